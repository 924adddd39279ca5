//! `arl-sandbox-init`: the first process inside a sandbox.
//!
//! `arl-sandbox-init [--relay 127.0.0.1:PORT=/run/arl/proxy.sock] -- COMMAND…`
//!
//! It relays TCP connections on the sandbox's own loopback to the token proxy's Unix
//! socket (the sandbox has no other network), runs COMMAND, and exits with its status.
//! When it exits, bubblewrap tears down the pid namespace, which kills every process the
//! command left behind.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitCode};
use std::thread;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(split) = args.iter().position(|a| a == "--") else {
        eprintln!("usage: arl-sandbox-init [--relay ADDR=SOCKET] -- COMMAND…");
        return ExitCode::from(125);
    };
    let (options, command) = (&args[..split], &args[split + 1..]);
    let mut options = options.iter();
    while let Some(option) = options.next() {
        match (option.as_str(), options.next()) {
            ("--relay", Some(spec)) => {
                if let Err(err) = start_relay(spec) {
                    eprintln!("arl-sandbox-init: cannot start the proxy relay {spec}: {err}");
                    return ExitCode::from(125);
                }
            }
            (other, _) => {
                eprintln!("arl-sandbox-init: unknown option {other}");
                return ExitCode::from(125);
            }
        }
    }
    let Some((program, rest)) = command.split_first() else {
        eprintln!("arl-sandbox-init: no command given");
        return ExitCode::from(125);
    };
    match Command::new(program).args(rest).status() {
        Ok(status) => {
            let code = status
                .code()
                .or_else(|| status.signal().map(|s| 128 + s))
                .unwrap_or(255);
            ExitCode::from(u8::try_from(code).unwrap_or(255))
        }
        Err(err) => {
            eprintln!("arl-sandbox-init: cannot run {program}: {err}");
            ExitCode::from(127)
        }
    }
}

fn start_relay(spec: &str) -> std::io::Result<()> {
    let (addr, socket) = spec
        .split_once('=')
        .ok_or_else(|| std::io::Error::other("expected ADDR=SOCKET"))?;
    let listener = TcpListener::bind(addr)?;
    let socket = socket.to_owned();
    thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let socket = socket.clone();
            thread::spawn(move || {
                if let Ok(upstream) = UnixStream::connect(&socket) {
                    relay(client, upstream);
                }
            });
        }
    });
    Ok(())
}

/// Copies bytes both ways until either side closes.
fn relay(client: TcpStream, upstream: UnixStream) {
    let (Ok(mut client_read), Ok(mut upstream_write)) = (client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    let forward = thread::spawn(move || {
        copy(&mut client_read, &mut upstream_write);
        let _ = upstream_write.shutdown(Shutdown::Write);
    });
    let (mut upstream_read, mut client_write) = (upstream, client);
    copy(&mut upstream_read, &mut client_write);
    let _ = client_write.shutdown(Shutdown::Write);
    let _ = forward.join();
}

fn copy(from: &mut impl Read, to: &mut impl Write) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    return;
                }
            }
        }
    }
}
