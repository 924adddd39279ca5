//! The OCI existence check against a real registry (Debian `docker-registry`, distribution
//! 2.8) with htpasswd auth on 127.0.0.1: an image pushed through the API is found with its
//! digest, a missing one is not, and bad or absent credentials are refused clearly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use arl_imagebuilder::registry::{Credentials, Registry, RegistryError};
use arl_testkit::{http, wait_for};

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sha256(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    format!(
        "sha256:{}",
        digest
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

fn bcrypt(password: &str) -> String {
    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/arl/tools/bin/python")
        });
    let out = Command::new(python)
        .args([
            "-c",
            &format!(
                "import bcrypt; print(bcrypt.hashpw(b'{password}', bcrypt.gensalt(8)).decode())"
            ),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bcrypt (tools venv): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_found_by_manifest_with_registry_auth() {
    let binary = std::env::var_os("ARL_REGISTRY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/docker-registry"));
    assert!(
        binary.exists(),
        "{} is missing: apt-get install docker-registry (`make deps` does)",
        binary.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(
        dir.path().join("htpasswd"),
        format!("arl:{}\n", bcrypt("s3cret")),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("config.yml"),
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\nauth:\n  htpasswd:\n    realm: arl\n    path: {}\n",
            dir.path().join("data").display(),
            dir.path().join("htpasswd").display()
        ),
    )
    .unwrap();
    let _registry = Running(
        Command::new(&binary)
            .arg("serve")
            .arg(dir.path().join("config.yml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    wait_for("the registry", Duration::from_secs(20), || async {
        http(&format!("{base}/v2/"), "GET", &[], b"")
            .await
            .ok()
            .map(|_| ())
    })
    .await;

    // Push a minimal OCI image (config blob + manifest) through the API.
    let auth = ("authorization", "Basic YXJsOnMzY3JldA=="); // arl:s3cret
    let repository = "swebench/django__django-11880";
    let config = b"{\"architecture\":\"amd64\",\"os\":\"linux\",\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[]}}";
    let config_digest = sha256(config);
    // Start an upload session, then finish it with the blob (monolithic PUT).
    let session = http(
        &format!("{base}/v2/{repository}/blobs/uploads/"),
        "POST",
        &[auth],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(session.status, 202, "{}", session.text());
    let location = session
        .headers
        .iter()
        .find(|(k, _)| k == "location")
        .map(|(_, v)| v.clone())
        .unwrap();
    let location = if location.starts_with("http") {
        location
    } else {
        format!("{base}{location}")
    };
    let separator = if location.contains('?') { '&' } else { '?' };
    let upload = http(
        &format!("{location}{separator}digest={config_digest}"),
        "PUT",
        &[auth, ("content-type", "application/octet-stream")],
        config,
    )
    .await
    .unwrap();
    assert_eq!(upload.status, 201, "{}", upload.text());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
        "layers": []
    })
    .to_string();
    let put = http(
        &format!("{base}/v2/{repository}/manifests/latest"),
        "PUT",
        &[
            auth,
            ("content-type", "application/vnd.oci.image.manifest.v1+json"),
        ],
        manifest.as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(put.status, 201, "{}", put.text());

    let credentials = Some(Credentials {
        username: "arl".into(),
        password: "s3cret".into(),
    });
    let registry = Registry::new(&base, "swebench", credentials);
    assert_eq!(
        registry.reference("django__django-11880"),
        format!("127.0.0.1:{port}/{repository}:latest")
    );
    let digest = registry
        .manifest_digest("django__django-11880")
        .await
        .unwrap();
    assert_eq!(digest, Some(sha256(manifest.as_bytes())));
    assert_eq!(
        registry
            .manifest_digest("django__django-9296")
            .await
            .unwrap(),
        None
    );

    let wrong = Registry::new(
        &base,
        "swebench",
        Some(Credentials {
            username: "arl".into(),
            password: "nope".into(),
        }),
    );
    let error = wrong
        .manifest_digest("django__django-11880")
        .await
        .unwrap_err();
    assert!(
        matches!(error, RegistryError::Unauthorized { .. }),
        "{error}"
    );
    let anonymous = Registry::new(&base, "swebench", None);
    assert!(matches!(
        anonymous.manifest_digest("django__django-11880").await,
        Err(RegistryError::Unauthorized { .. })
    ));
    let down = Registry::new("http://127.0.0.1:1", "swebench", None);
    assert!(matches!(
        down.manifest_digest("x").await,
        Err(RegistryError::Unreachable { .. })
    ));
}
