//! The bus against a real nats-server that requires TLS (verifying client certificates)
//! and credentials: the right user and password, or NKey, gets in and works with
//! JetStream; no credentials, a wrong password, an unknown NKey, no CA or no client
//! certificate are refused — and the refusal says so, without printing the secret.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use arl_runtime::auth::{NatsAuth, Secret};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{Example, RunRequestedV1};
use arl_schemas::{Domain, Event};
use arl_testkit::{NatsServer, test_namespace};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made by openssl.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
                .output()
                .expect("openssl is needed (apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        run(&[
            &[
                "req",
                "-x509",
                "-days",
                "2",
                "-subj",
                "/CN=arl-test-ca",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ][..],
            &ec[..],
        ]
        .concat());
        std::fs::write(
            dir.path().join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("client.ext"),
            "extendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        for who in ["server", "client"] {
            let (key, csr, pem, ext) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.pem"),
                format!("{who}.ext"),
            );
            run(&[
                &[
                    "req",
                    "-new",
                    "-subj",
                    &format!("/CN={who}"),
                    "-keyout",
                    &key,
                    "-out",
                    &csr,
                ][..],
                &ec[..],
            ]
            .concat());
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ]);
        }
        Self { dir }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }
}

fn quoted(path: &Path) -> String {
    format!("{:?}", path.display().to_string())
}

async fn connect(server: &NatsServer, auth: NatsAuth) -> Result<Bus, String> {
    let mut config = BusConfig::new(server.url(), test_namespace(), "auth-test");
    config.wait_for_server = false;
    config.auth = auth;
    Bus::connect(config, Metrics::new())
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_right_credentials_over_verified_tls_get_in() {
    let pki = Pki::new();
    let nkey = nkeys::KeyPair::new_user();
    let seed_file = pki.path("service.nk");
    std::fs::write(&seed_file, nkey.seed().unwrap()).unwrap();
    let server = NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: true\n  timeout: 5\n}}\n\
         authorization {{\n  users: [\n    {{ user: controller, password: \"s3cret-pw\" }}\n    {{ nkey: {} }}\n  ]\n}}\n",
        quoted(&pki.path("server.pem")),
        quoted(&pki.path("server.key")),
        quoted(&pki.path("ca.pem")),
        nkey.public_key()
    ))
    .unwrap();
    let tls = NatsAuth {
        nats_ca: Some(pki.path("ca.pem")),
        nats_cert: Some(pki.path("client.pem")),
        nats_key: Some(pki.path("client.key")),
        ..NatsAuth::default()
    };
    let password = NatsAuth {
        nats_user: Some("controller".into()),
        nats_password: Some(Secret::new("s3cret-pw")),
        ..tls.clone()
    };

    // The right password: JetStream works.
    let bus = connect(&server, password.clone()).await.unwrap();
    bus.provision().await.unwrap();
    let event = RunRequestedV1::example();
    bus.publish(&event).await.unwrap();
    let ns = bus.namespace().clone();
    let seen: Vec<RunRequestedV1> = bus.replay(Domain::Run, event.subject(&ns)).await.unwrap();
    assert_eq!(seen, vec![event]);

    // The NKey (its seed in a file): in.
    let with_nkey = NatsAuth {
        nats_nkey: Some(seed_file),
        ..tls.clone()
    };
    let other = connect(&server, with_nkey).await.unwrap();
    other.provision().await.unwrap();

    // Refused: no credentials, a wrong password, an NKey the server does not know.
    let refusal = |auth: NatsAuth| {
        let server = &server;
        async move {
            let result = tokio::time::timeout(Duration::from_secs(20), connect(server, auth)).await;
            match result {
                Ok(Err(message)) => message,
                Ok(Ok(_)) => panic!("connected"),
                Err(_) => panic!("no answer within 20 s"),
            }
        }
    };
    let none = refusal(tls.clone()).await;
    assert!(none.to_lowercase().contains("author"), "{none}");
    let wrong = refusal(NatsAuth {
        nats_password: Some(Secret::new("guess")),
        ..password.clone()
    })
    .await;
    assert!(
        !wrong.contains("guess"),
        "the password is never shown: {wrong}"
    );
    let stranger = pki.path("stranger.nk");
    std::fs::write(&stranger, nkeys::KeyPair::new_user().seed().unwrap()).unwrap();
    refusal(NatsAuth {
        nats_nkey: Some(stranger),
        ..tls.clone()
    })
    .await;
    // Refused: TLS without the CA (the server's certificate cannot be trusted), or
    // without a client certificate (the server verifies clients).
    refusal(NatsAuth {
        nats_ca: None,
        ..password.clone()
    })
    .await;
    refusal(NatsAuth {
        nats_cert: None,
        nats_key: None,
        ..password.clone()
    })
    .await;
    // A password in the URL is not printed either.
    let mut config = BusConfig::new(
        server.url().replace("nats://", "nats://controller:url-pw@"),
        test_namespace(),
        "auth-test",
    );
    config.wait_for_server = false;
    let err = Bus::connect(config, Metrics::new())
        .await
        .unwrap_err()
        .to_string();
    assert!(!err.contains("url-pw"), "{err}");
}
