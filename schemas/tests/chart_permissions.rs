//! The Helm chart's NATS users (`deploy/helm/arl/files/permissions.json`, rendered into
//! its nats.conf) hold exactly what `arl_schemas::permissions` grants each role in the
//! default namespace. Regenerate the file after changing the permissions:
//! `ARL_REGENERATE=1 cargo test -p arl-schemas --test chart_permissions`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use arl_schemas::Namespace;
use arl_schemas::permissions::Role;
use serde_json::{Value, json};

fn rendered() -> Value {
    let ns = Namespace::default();
    let roles: serde_json::Map<String, Value> = Role::ALL
        .into_iter()
        .map(|role| {
            let p = ns.permissions(role);
            let entry = json!({
                "inbox_prefix": role.inbox_prefix(),
                "publish": p.publish,
                "subscribe": p.subscribe,
                "allow_responses": p.answers_requests,
            });
            (role.name().to_owned(), entry)
        })
        .collect();
    json!({
        "generated_by": "schemas/tests/chart_permissions.rs from arl_schemas::permissions; do not edit",
        "roles": roles,
    })
}

#[test]
fn chart_permissions_match_the_roles() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/arl/files/permissions.json");
    let expected = rendered();
    if std::env::var_os("ARL_REGENERATE").is_some() {
        let mut text = serde_json::to_string_pretty(&expected).unwrap();
        text.push('\n');
        std::fs::write(&path, text).unwrap();
        return;
    }
    let on_disk: Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    assert!(
        on_disk == expected,
        "{} does not match arl_schemas::permissions: regenerate it with \
         `ARL_REGENERATE=1 cargo test -p arl-schemas --test chart_permissions` (then `make chart`)",
        path.display()
    );
}
