//! The OCI existence check against a real registry (Debian `docker-registry`, distribution
//! 2.8) with htpasswd auth on 127.0.0.1: an image pushed through the API is found with its
//! digest, a missing one is not, and bad or absent credentials are refused clearly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use std::path::Path;
use std::sync::Arc;

use arl_imagebuilder::buildkit::BuildKit;
use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::load_instances;
use arl_imagebuilder::registry::{Credentials, Registry, RegistryError};
use arl_imagebuilder::service::{Cluster, ImageBuilder, Recipes};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    EnvironmentLocation, EnvironmentRef, ImageFailedV1, ImageFailureReason, ImageReadyV1, Split,
    TaskBatchV1, TaskKind, TaskRef,
};
use arl_schemas::{Domain, Event, RunId, TaskId};
use arl_testkit::{Children, NatsServer, free_port, http, test_namespace, wait_for};

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", arl_runtime::digest::sha256_hex(bytes))
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
    let port = free_port().unwrap();
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
    let _registry = Children(vec![
        Command::new(&binary)
            .arg("serve")
            .arg(dir.path().join("config.yml"))
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

    // The service in cluster mode: the pushed image is ready (pinned by digest, nothing
    // built); a missing one goes to BuildKit, which is not installed here: a clear failure.
    let server = NatsServer::start().unwrap();
    let bus = Bus::connect(
        BusConfig::new(server.url(), test_namespace(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let swebench = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/swebench");
    let mut recipes = Recipes {
        swebench_dir: swebench.clone(),
        pyenv_root: "/root/.pyenv".into(),
        ..Recipes::default()
    };
    for instance in load_instances(&swebench.join("instances.json")).unwrap() {
        recipes
            .swebench
            .insert(instance.instance_id.clone(), instance);
    }
    let local = Arc::new(LocalBuilder::new(LocalConfig {
        root: dir.path().join("environments"),
        pyenv_root: "/root/.pyenv".into(),
        pip_cache: dir.path().join("pip"),
        timeout: Duration::from_secs(60),
    }));
    let cluster = Cluster {
        registry: registry.clone(),
        buildkit: BuildKit {
            addr: "tcp://127.0.0.1:1".into(),
            buildctl: "/nonexistent/buildctl".into(),
        },
        contexts: dir.path().join("contexts"),
    };
    let shutdown = Shutdown::new();
    ImageBuilder::new(bus.clone(), local, recipes)
        .with_cluster(cluster)
        .start(&shutdown);
    let run = RunId::new("run-cluster").unwrap();
    let task = |id: &str| TaskRef {
        task_id: TaskId::new(id).unwrap(),
        kind: TaskKind::Swebench,
        dataset_digest: "sha256:test".into(),
        environment: EnvironmentRef {
            name: format!("swebench/{id}"),
            digest: None,
        },
    };
    bus.publish(&TaskBatchV1 {
        run_id: run.clone(),
        step: 1,
        split: Split::Train,
        samples_per_task: 2,
        tasks: vec![task("django__django-11880"), task("django__django-9296")],
    })
    .await
    .unwrap();
    let last = |domain: Domain, event: &'static str| {
        let bus = bus.clone();
        let run = run.clone();
        async move {
            let stream = bus
                .jetstream()
                .get_stream(bus.namespace().stream(domain))
                .await
                .ok()?;
            let message = stream
                .get_last_raw_message_by_subject(
                    &bus.namespace().event_subject(domain, &run, event),
                )
                .await
                .ok()?;
            Some(message.payload)
        }
    };
    let ready = wait_for("image.ready", Duration::from_secs(30), || {
        last(Domain::Image, "ready")
    })
    .await;
    let ready = ImageReadyV1::decode(&ready).unwrap();
    assert!(ready.cached);
    assert_eq!(
        ready.location,
        EnvironmentLocation::OciImage {
            reference: format!(
                "127.0.0.1:{port}/{repository}:latest@{}",
                sha256(manifest.as_bytes())
            )
        }
    );
    let failed = wait_for("image.failed", Duration::from_secs(30), || {
        last(Domain::Image, "failed")
    })
    .await;
    let failed = ImageFailedV1::decode(&failed).unwrap();
    assert_eq!(failed.task_id.as_str(), "django__django-9296");
    assert_eq!(failed.reason, ImageFailureReason::BuildError);
    assert!(
        failed.message.contains("install BuildKit"),
        "{}",
        failed.message
    );
    assert!(
        dir.path()
            .join("contexts/swebench_django__django-9296/Dockerfile")
            .is_file()
    );
    shutdown.trigger();
    shutdown.wait().await;
}
