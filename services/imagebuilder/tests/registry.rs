//! The OCI existence check against a real registry (Debian `docker-registry`, distribution
//! 2.8) with htpasswd auth on 127.0.0.1: an image pushed through the API is found with its
//! digest, a missing one is not, and bad or absent credentials are refused clearly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use arl_imagebuilder::buildkit::BuildKit;
use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::load_instances;
use arl_imagebuilder::registry::{Credentials, Registry, RegistryError};
use arl_imagebuilder::service::{Builds, Cluster, ImageBuilder, Recipes};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    EnvironmentLocation, EnvironmentRef, ImageFailedV1, ImageFailureReason, ImageReadyV1, Split,
    TaskBatchV1, TaskKind, TaskRef,
};
use arl_schemas::{Domain, Event, RunId, TaskId};
use arl_testkit::{NatsServer, test_namespace, wait_for};

mod common;
use common::LocalRegistry;

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
    let dir = tempfile::tempdir().unwrap();
    let local_registry =
        LocalRegistry::start(dir.path(), Some(&format!("arl:{}\n", bcrypt("s3cret")))).await;
    let (base, port) = (local_registry.base.clone(), local_registry.port);
    let repository = "swebench/django__django-11880";
    let digest_pushed = local_registry
        .push_image(repository, Some("Basic YXJsOnMzY3JldA==")) // arl:s3cret
        .await;

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
    assert_eq!(digest, Some(digest_pushed.clone()));
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
        builds: Builds::Buildctl(BuildKit {
            addr: "tcp://127.0.0.1:1".into(),
            buildctl: "/nonexistent/buildctl".into(),
        }),
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
            reference: format!("127.0.0.1:{port}/{repository}:latest@{digest_pushed}")
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
