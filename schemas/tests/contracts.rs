//! The checked-in JSON Schemas match the types, and every golden file still decodes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn pretty(value: &impl serde::Serialize) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap();
    text.push('\n');
    text
}

#[test]
fn checked_in_schemas_are_current() {
    let mut stale = Vec::new();
    for entry in arl_schemas::catalog::all_events() {
        let path = root()
            .join("json")
            .join(format!("{}.json", entry.file_stem()));
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        if on_disk != pretty(&(entry.schema)()) {
            stale.push(path.display().to_string());
        }
    }
    for (name, schema) in arl_schemas::catalog::other_schemas() {
        let path = root().join("json").join(format!("{name}.json"));
        if std::fs::read_to_string(&path).unwrap_or_default() != pretty(&schema) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "stale or missing schema files (run `make gen`): {stale:#?}"
    );
}

#[test]
fn every_golden_file_still_decodes() {
    for entry in arl_schemas::catalog::all_events() {
        let path = root()
            .join("golden")
            .join(format!("{}.json", entry.file_stem()));
        let body = std::fs::read(&path)
            .unwrap_or_else(|err| panic!("{}: {err} (run `make gen` once)", path.display()));
        (entry.decode)(&body).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    }
}

#[test]
fn no_schema_or_golden_file_is_orphaned() {
    let known: std::collections::HashSet<String> = arl_schemas::catalog::all_events()
        .iter()
        .map(|e| format!("{}.json", e.file_stem()))
        .collect();
    for entry in std::fs::read_dir(root().join("golden")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            known.contains(&name),
            "golden/{name} matches no event in the catalog"
        );
    }
}

/// A `weights.published` as version 1 went on the wire reads as version 2: its uri is
/// the folder location, everything else carried over.
#[test]
fn golden_weights_published_v1_upgrades_to_v2() {
    use arl_schemas::events::{WeightsLocation, WeightsPublishedV2};
    let v1 = std::fs::read(root().join("golden/weights.published.v1.json")).unwrap();
    let upgraded = WeightsPublishedV2::read(1, &v1).unwrap();
    assert_eq!(
        upgraded.location,
        WeightsLocation::Folder {
            path: "/home/ada/.cache/arl/runs/run-0193a1b2c3d4/step-1".into()
        }
    );
    assert_eq!(
        upgraded.uri(),
        "file:///home/ada/.cache/arl/runs/run-0193a1b2c3d4/step-1"
    );
    assert_eq!(
        (upgraded.policy_version, upgraded.step, upgraded.size_bytes),
        (1, 1, 538_090_408)
    );
    let v2 = std::fs::read(root().join("golden/weights.published.v2.json")).unwrap();
    let read = WeightsPublishedV2::read(2, &v2).unwrap();
    assert!(matches!(read.location, WeightsLocation::ObjectStore { .. }));
    assert_eq!(
        (read.run_id, read.sha256),
        (upgraded.run_id, upgraded.sha256)
    );
}
