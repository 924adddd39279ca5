//! Files in the object stores against a real `nats-server -js`: streamed up and down in
//! chunks (a file past the 1 MiB event limit included), checked by digest and size, and
//! deleted; least privilege on the weights store; and `weights.published` read in either
//! version.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use arl_runtime::auth::Secret;
use arl_runtime::bus::{BusConfig, MAX_EVENT_BYTES};
use arl_runtime::digest::sha256_file;
use arl_runtime::objects::{ObjectError, StoredFile};
use arl_runtime::{Bus, Delivery, Metrics, headers};
use arl_schemas::events::{Example, WeightsLocation, WeightsPublishedV1, WeightsPublishedV2};
use arl_schemas::permissions::Role;
use arl_schemas::{Event, Namespace, ObjectStore, RunId};
use arl_testkit::{NatsServer, test_namespace};

async fn connect(server: &NatsServer, namespace: &Namespace) -> Bus {
    let bus = Bus::connect(
        BusConfig::new(server.url(), namespace.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    bus
}

/// A file of `size` bytes that no two offsets repeat in a short period.
fn write_file(path: &Path, size: usize, seed: u64) {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005) | 1;
    let bytes: Vec<u8> = (0..size)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_larger_than_an_event_goes_up_and_comes_down_whole() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let source = tmp.path().join("model.safetensors");
    // Three event limits and a bit: many chunks, the last one short.
    write_file(&source, 3 * MAX_EVENT_BYTES + 12_345, 7);
    let (sha256, size_bytes) = sha256_file(&source).unwrap();

    let stored = bus
        .put_file(ObjectStore::Weights, "run-1/1/model.safetensors", &source)
        .await
        .unwrap();
    assert_eq!(
        stored,
        StoredFile {
            sha256: sha256.clone(),
            size_bytes
        }
    );
    let copy = tmp.path().join("copy");
    bus.get_file(
        ObjectStore::Weights,
        "run-1/1/model.safetensors",
        &copy,
        &stored,
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        std::fs::read(&source).unwrap()
    );

    // A digest or size other than the one expected is refused, and says which object.
    let wrong_digest = StoredFile {
        sha256: "0".repeat(64),
        ..stored.clone()
    };
    let error = bus
        .get_file(
            ObjectStore::Weights,
            "run-1/1/model.safetensors",
            &copy,
            &wrong_digest,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(error, ObjectError::WrongDigest { .. }) && error.is_permanent(),
        "{error}"
    );
    assert!(
        error.to_string().contains("run-1/1/model.safetensors"),
        "{error}"
    );
    let wrong_size = StoredFile {
        size_bytes: stored.size_bytes - 1,
        ..stored.clone()
    };
    let error = bus
        .get_file(
            ObjectStore::Weights,
            "run-1/1/model.safetensors",
            &copy,
            &wrong_size,
        )
        .await
        .unwrap_err();
    assert!(matches!(error, ObjectError::WrongSize { .. }), "{error}");

    // Deleted: gone for readers, and a second delete finds nothing.
    assert!(
        bus.delete_object(ObjectStore::Weights, "run-1/1/model.safetensors")
            .await
            .unwrap()
    );
    let error = bus
        .get_file(
            ObjectStore::Weights,
            "run-1/1/model.safetensors",
            &copy,
            &stored,
        )
        .await
        .unwrap_err();
    assert!(matches!(error, ObjectError::Missing { .. }), "{error}");
    assert!(
        !bus.delete_object(ObjectStore::Weights, "run-1/1/model.safetensors")
            .await
            .unwrap()
    );
    // The datasets store is another store.
    let error = bus
        .get_file(
            ObjectStore::Datasets,
            "run-1/1/model.safetensors",
            &copy,
            &stored,
        )
        .await
        .unwrap_err();
    assert!(matches!(error, ObjectError::Missing { .. }), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_folder_is_put_and_deleted_by_name() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let tmp = tempfile::tempdir().unwrap();
    let files = ["config.json", "model.safetensors", "tokenizer.json"];
    for (i, file) in files.iter().enumerate() {
        write_file(&tmp.path().join(file), 1000 * (i + 1), i as u64);
    }
    let files: Vec<String> = files.iter().map(|f| f.to_string()).collect();
    let run = RunId::new("run-folder").unwrap();
    let location = bus.put_weights(&run, 3, tmp.path(), &files).await.unwrap();
    let WeightsLocation::ObjectStore {
        bucket,
        files: objects,
    } = &location
    else {
        panic!("{location:?}")
    };
    assert_eq!(bucket, &ns.object_store(ObjectStore::Weights));
    let names: Vec<&str> = objects.iter().map(|o| o.object.as_str()).collect();
    assert_eq!(
        names,
        [
            "run-folder/3/config.json",
            "run-folder/3/model.safetensors",
            "run-folder/3/tokenizer.json"
        ]
    );
    for object in objects {
        let (sha256, size) = sha256_file(&tmp.path().join(&object.file)).unwrap();
        assert_eq!((&object.sha256, object.size_bytes), (&sha256, size));
    }
    // A file that is not there fails the whole version.
    let mut missing = files.clone();
    missing.push("tokenizer_config.json".into());
    let error = bus
        .put_weights(&run, 4, tmp.path(), &missing)
        .await
        .unwrap_err();
    assert!(matches!(error, ObjectError::File { .. }), "{error}");

    assert_eq!(bus.delete_weights(&run, 3, &files).await.unwrap(), 3);
    assert_eq!(bus.delete_weights(&run, 3, &files).await.unwrap(), 0);
}

/// A delivery of `event` as the bus publishes it, with or without its type headers.
fn delivery<E: Event>(event: &E, with_headers: bool) -> Delivery {
    let headers = with_headers.then(|| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::EVENT_TYPE, E::TYPE);
        headers.insert(headers::EVENT_VERSION, E::VERSION.to_string().as_str());
        headers
    });
    Delivery {
        subject: event.subject(&Namespace::default()),
        headers,
        payload: event.encode().unwrap().into(),
        attempt: 1,
        stream_sequence: 1,
        published: std::time::SystemTime::now(),
    }
}

#[test]
fn weights_published_is_read_in_either_version() {
    let v1 = WeightsPublishedV1::example();
    let v2 = WeightsPublishedV2::example();
    for with_headers in [true, false] {
        let read = delivery(&v1, with_headers)
            .decode_weights_published()
            .unwrap();
        assert_eq!(read.uri(), v1.uri, "headers: {with_headers}");
        assert!(matches!(read.location, WeightsLocation::Folder { .. }));
        let read = delivery(&v2, with_headers)
            .decode_weights_published()
            .unwrap();
        assert_eq!(read, v2, "headers: {with_headers}");
    }
    // Another event type is refused.
    let other = arl_schemas::events::RunFailedV1::example();
    let error = delivery(&other, true)
        .decode_weights_published()
        .unwrap_err();
    assert!(
        error.to_string().contains("expected weights.published v2"),
        "{error}"
    );
}

/// A server whose users are `roles`, each held to its least-privilege permissions
/// (`arl_schemas::permissions`), with password `pw-<role>`.
fn least_privilege(ns: &Namespace, roles: &[Role]) -> NatsServer {
    let quoted = |subjects: &[String]| {
        subjects
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let users: String = roles
        .iter()
        .map(|role| {
            let p = ns.permissions(*role);
            format!(
                "{{ user: \"{name}\", password: \"pw-{name}\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }} }}\n",
                quoted(&p.publish),
                quoted(&p.subscribe),
                name = role.name(),
            )
        })
        .collect();
    NatsServer::start_with_config(&format!("authorization {{ users: [\n{users}] }}\n")).unwrap()
}

async fn connect_as(server: &NatsServer, ns: &Namespace, role: Role) -> Bus {
    let mut config = BusConfig::new(server.url(), ns.clone(), role.name());
    config.auth.nats_user = Some(role.name().into());
    config.auth.nats_password = Some(Secret::new(format!("pw-{}", role.name())));
    config.auth.nats_inbox_prefix = Some(role.inbox_prefix());
    config.publish_timeout = Duration::from_secs(5);
    let bus = Bus::connect(config, Metrics::new()).await.unwrap();
    bus.provision().await.unwrap();
    bus
}

/// On least privilege the trainer writes weights objects and the engine reads them; the
/// engine cannot write them, and another service can neither read nor write them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_trainer_writes_weights_and_only_engines_read_them() {
    let ns = test_namespace();
    let server = least_privilege(&ns, &[Role::Trainer, Role::Inference, Role::Rollout]);
    let trainer = connect_as(&server, &ns, Role::Trainer).await;
    let engine = connect_as(&server, &ns, Role::Inference).await;
    let rollout = connect_as(&server, &ns, Role::Rollout).await;
    let tmp = tempfile::tempdir().unwrap();
    let source = tmp.path().join("model.safetensors");
    write_file(&source, 300_000, 3);
    let name = "run-lp/1/model.safetensors";

    let stored = trainer
        .put_file(ObjectStore::Weights, name, &source)
        .await
        .unwrap();
    engine
        .get_file(
            ObjectStore::Weights,
            name,
            &tmp.path().join("engine"),
            &stored,
        )
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(tmp.path().join("engine")).unwrap(),
        std::fs::read(&source).unwrap()
    );
    let refused = engine.put_file(ObjectStore::Weights, name, &source).await;
    assert!(refused.is_err(), "the engine wrote a weights object");
    let refused = rollout
        .get_file(
            ObjectStore::Weights,
            name,
            &tmp.path().join("rollout"),
            &stored,
        )
        .await;
    assert!(
        refused.is_err(),
        "the rollout service read a weights object"
    );
    let refused = rollout.put_file(ObjectStore::Weights, name, &source).await;
    assert!(
        refused.is_err(),
        "the rollout service wrote a weights object"
    );
    let refused = engine.delete_object(ObjectStore::Weights, name).await;
    assert!(refused.is_err(), "the engine deleted a weights object");
    // What the trainer stored is untouched by the refused attempts.
    engine
        .get_file(
            ObjectStore::Weights,
            name,
            &tmp.path().join("again"),
            &stored,
        )
        .await
        .unwrap();
    assert!(
        trainer
            .delete_object(ObjectStore::Weights, name)
            .await
            .unwrap()
    );
}
