//! Pointed at a nats-server older than 2.10 (Debian bookworm ships 2.9.10), every part of
//! ARL says so and stops, instead of retrying provisioning forever on answers it cannot
//! read (issue 27).
//!
//! The old server is a test double: a listener that speaks the start of the NATS protocol
//! (INFO with `"version":"2.9.10"`, PONG to PING) — enough for the client to connect and
//! read the version, which is all the check needs. A real 2.9 build is not installable from
//! the package registries this project uses beside Debian's, and Debian's would change
//! under the test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use arl_testkit::built_binary;

/// A listener answering as nats-server 2.9.10 until the test ends; its URL.
fn old_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut writer = stream.try_clone().unwrap();
                let info = r#"INFO {"server_id":"OLD","server_name":"old","version":"2.9.10","proto":1,"go":"go1.19","host":"127.0.0.1","port":4222,"headers":true,"max_payload":1048576,"jetstream":true}"#;
                if writer.write_all(format!("{info}\r\n").as_bytes()).is_err() {
                    return;
                }
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { return };
                    if line.starts_with("PING") && writer.write_all(b"PONG\r\n").is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// Runs `command` to its end, or fails after `limit` (a service that retried forever
/// would never end).
fn finish(mut command: Command, limit: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?} against a 2.9 server:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn says_too_old(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        stderr.contains("2.9.10 is too old") && stderr.contains("2.10.0 or newer"),
        "{stderr}"
    );
    stderr
}

#[test]
fn services_and_the_cli_refuse_a_nats_server_older_than_2_10() {
    let url = old_server();
    let arl = built_binary("arl");

    // A service stops with the reason and what to do.
    let mut service = Command::new(&arl);
    service
        .args(["serve", "controller", "--http-addr", "127.0.0.1:0"])
        .env("NATS_URL", &url);
    let output = finish(service, Duration::from_secs(60));
    assert!(!output.status.success());
    let stderr = says_too_old(&output);
    assert!(stderr.contains("make deps"), "{stderr}");

    // The CLI: exit 3 (the bus is unusable), with the same reason.
    let mut list = Command::new(&arl);
    list.args(["run", "list"]).env("NATS_URL", &url);
    let output = finish(list, Duration::from_secs(30));
    assert_eq!(output.status.code(), Some(3));
    says_too_old(&output);
}

#[test]
fn arl_up_refuses_to_start_an_old_nats_server() {
    // ARL_NATS_SERVER naming a program that reports 2.9.10: refused before it starts.
    let dir = tempfile::tempdir().unwrap();
    // arl up's state must be reachable by the sandbox user.
    set_executable(dir.path());
    let program = dir.path().join("nats-server");
    std::fs::write(&program, "#!/bin/sh\necho 'nats-server: v2.9.10'\n").unwrap();
    set_executable(&program);
    let mut up = Command::new(built_binary("arl"));
    up.args(["up", "--state-dir"])
        .arg(dir.path().join("state"))
        .env_remove("NATS_URL")
        .env("ARL_NATS_SERVER", &program);
    let output = finish(up, Duration::from_secs(60));
    assert_eq!(output.status.code(), Some(2));
    let stderr = says_too_old(&output);
    assert!(
        stderr.contains("ARL_NATS_SERVER") && stderr.contains(&program.display().to_string()),
        "{stderr}"
    );
}

fn set_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}
