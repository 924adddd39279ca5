//! What the image builder's integration tests share: a real registry (Debian
//! `docker-registry`, distribution 2.8) on a free port of 127.0.0.1, and an image pushed
//! into it through the OCI distribution API, as BuildKit's push would leave it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use arl_testkit::{Children, free_port, http, wait_for};

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", arl_runtime::digest::sha256_hex(bytes))
}

/// A running registry; stopped when dropped.
pub struct LocalRegistry {
    pub base: String,
    pub port: u16,
    _process: Children,
}

impl LocalRegistry {
    /// A registry storing under `dir`, with HTTP Basic auth when `htpasswd` (a file's
    /// contents) is given.
    pub async fn start(dir: &Path, htpasswd: Option<&str>) -> Self {
        let binary = std::env::var_os("ARL_REGISTRY_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/docker-registry"));
        assert!(
            binary.exists(),
            "{} is missing: apt-get install docker-registry (`make deps` does)",
            binary.display()
        );
        let port = free_port().unwrap();
        let auth = match htpasswd {
            Some(entries) => {
                std::fs::write(dir.join("htpasswd"), entries).unwrap();
                format!(
                    "auth:\n  htpasswd:\n    realm: arl\n    path: {}\n",
                    dir.join("htpasswd").display()
                )
            }
            None => String::new(),
        };
        std::fs::write(
            dir.join("config.yml"),
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}",
                dir.join("data").display(),
            ),
        )
        .unwrap();
        let process = Children(vec![
            Command::new(&binary)
                .arg("serve")
                .arg(dir.join("config.yml"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        ]);
        let base = format!("http://127.0.0.1:{port}");
        wait_for("the registry", Duration::from_secs(20), || async {
            http(&format!("{base}/v2/"), "GET", &[], b"")
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        Self {
            base,
            port,
            _process: process,
        }
    }

    /// Pushes a minimal OCI image (config blob + manifest) as `repository:latest`; returns
    /// the manifest's digest.
    pub async fn push_image(&self, repository: &str, authorization: Option<&str>) -> String {
        let base = &self.base;
        let mut auth = Vec::new();
        if let Some(value) = authorization {
            auth.push(("authorization", value));
        }
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut headers = auth.clone();
            headers.extend_from_slice(extra);
            headers
        };
        let config = b"{\"architecture\":\"amd64\",\"os\":\"linux\",\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[]}}";
        let config_digest = sha256(config);
        // Start an upload session, then finish it with the blob (monolithic PUT).
        let session = http(
            &format!("{base}/v2/{repository}/blobs/uploads/"),
            "POST",
            &with(&[]),
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
            &with(&[("content-type", "application/octet-stream")]),
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
            &with(&[("content-type", "application/vnd.oci.image.manifest.v1+json")]),
            manifest.as_bytes(),
        )
        .await
        .unwrap();
        assert_eq!(put.status, 201, "{}", put.text());
        sha256(manifest.as_bytes())
    }
}
