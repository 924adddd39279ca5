//! The list of every event type and version, for schema generation, golden files and
//! decoding by header.

use schemars::Schema;
use serde_json::Value;

use crate::events::{self, Example};
use crate::{DecodeError, Event, FieldError};

/// What tooling needs to know about one event version.
pub struct EventEntry {
    pub event_type: &'static str,
    pub version: u32,
    pub schema: fn() -> Schema,
    pub example: fn() -> Value,
    pub decode: fn(&[u8]) -> Result<(), DecodeError>,
}

impl EventEntry {
    /// `run.requested.v1`: the stem of the schema and golden file names.
    pub fn file_stem(&self) -> String {
        format!("{}.v{}", self.event_type, self.version)
    }
}

fn entry<E: Event + Example>() -> EventEntry {
    EventEntry {
        event_type: E::TYPE,
        version: E::VERSION,
        schema: || schemars::schema_for!(E),
        example: || serde_json::to_value(E::example()).unwrap_or(Value::Null),
        decode: |body| E::decode(body).map(|_| ()),
    }
}

/// Every event of the pipeline, every version.
pub fn all_events() -> Vec<EventEntry> {
    vec![
        entry::<events::RunRequestedV1>(),
        entry::<events::RunAcceptedV1>(),
        entry::<events::RunRejectedV1>(),
        entry::<events::RunProgressV1>(),
        entry::<events::RunCompletedV1>(),
        entry::<events::RunFailedV1>(),
        entry::<events::RunCancelRequestedV1>(),
        entry::<events::RunCancelledV1>(),
        entry::<events::TaskBatchV1>(),
        entry::<events::DatasetRegisteredV1>(),
        entry::<events::ImageReadyV1>(),
        entry::<events::ImageFailedV1>(),
        entry::<events::SandboxLeasedV1>(),
        entry::<events::SandboxReleasedV1>(),
        entry::<events::SandboxReleasedV2>(),
        entry::<events::SandboxFailedV1>(),
        entry::<events::TrialRequestedV1>(),
        entry::<events::TrialStartedV1>(),
        entry::<events::TrialFinishedV1>(),
        entry::<events::TrialFailedV1>(),
        entry::<events::LlmCallV1>(),
        entry::<events::LlmCallV2>(),
        entry::<events::TrajectoryV1>(),
        entry::<events::RewardScoredV1>(),
        entry::<events::RewardScoredV2>(),
        entry::<events::TrainStepV1>(),
        entry::<events::TrainStepV2>(),
        entry::<events::WeightsPublishedV1>(),
        entry::<events::WeightsPublishedV2>(),
        entry::<events::EvaluationCompletedV1>(),
    ]
}

/// Other generated schemas: documents that are not events.
pub fn other_schemas() -> Vec<(&'static str, Schema)> {
    vec![
        ("run-spec", schemars::schema_for!(crate::spec::RunSpec)),
        (
            "dataset-manifest.v1",
            schemars::schema_for!(crate::dataset::DatasetManifestV1),
        ),
        (
            "run-state.v1",
            schemars::schema_for!(crate::state::RunStateV1),
        ),
        (
            "trial-record.v1",
            schemars::schema_for!(crate::state::TrialRecordV1),
        ),
        (
            "trial-record.v2",
            schemars::schema_for!(crate::state::TrialRecordV2),
        ),
        (
            "trainer-announcement.v1",
            schemars::schema_for!(crate::state::TrainerAnnouncementV1),
        ),
        (
            "rpc.sandbox.lease-request.v1",
            schemars::schema_for!(crate::rpc::LeaseRequestV1),
        ),
        (
            "rpc.sandbox.lease-grant.v1",
            schemars::schema_for!(crate::rpc::LeaseGrantV1),
        ),
        (
            "rpc.sandbox.renew-request.v1",
            schemars::schema_for!(crate::rpc::RenewRequestV1),
        ),
        (
            "rpc.sandbox.renew-request.v2",
            schemars::schema_for!(crate::rpc::RenewRequestV2),
        ),
        (
            "rpc.sandbox.release-request.v1",
            schemars::schema_for!(crate::rpc::ReleaseRequestV1),
        ),
        (
            "rpc.sandbox.release-request.v2",
            schemars::schema_for!(crate::rpc::ReleaseRequestV2),
        ),
        (
            "rpc.sandbox.exec-request",
            schemars::schema_for!(crate::rpc::ExecRequest),
        ),
        (
            "rpc.sandbox.exec-result",
            schemars::schema_for!(crate::rpc::ExecResult),
        ),
        (
            "rpc.proxy.key-request.v1",
            schemars::schema_for!(crate::rpc::TrialKeyRequestV1),
        ),
        (
            "rpc.proxy.key-grant.v1",
            schemars::schema_for!(crate::rpc::TrialKeyGrantV1),
        ),
        (
            "rpc.proxy.revoke.v1",
            schemars::schema_for!(crate::rpc::TrialKeyRevokeV1),
        ),
    ]
}

/// Decodes a run request field by field so that a bad spec yields every error with its
/// path (`spec.rollout.n`), and a bad envelope still yields a reason.
pub fn decode_run_request(body: &[u8]) -> Result<events::RunRequestedV1, Vec<FieldError>> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|err| vec![FieldError::new("", format!("not valid JSON: {err}"))])?;
    let spec_value = match value.as_object_mut().and_then(|o| o.remove("spec")) {
        Some(spec) => spec,
        None => return Err(vec![FieldError::new("spec", "missing field `spec`")]),
    };
    let spec = crate::spec::RunSpec::from_json_value(spec_value).map_err(|errors| {
        errors
            .into_iter()
            .map(|e| FieldError::new(join_path("spec", &e.path), e.reason))
            .collect::<Vec<_>>()
    });
    let envelope = RequestEnvelope::decode(&value);
    match (envelope, spec) {
        (Ok(envelope), Ok(spec)) => {
            let range_errors: Vec<_> = spec
                .check()
                .into_iter()
                .map(|e| FieldError::new(join_path("spec", &e.path), e.reason))
                .collect();
            if !range_errors.is_empty() {
                return Err(range_errors);
            }
            Ok(events::RunRequestedV1 {
                run_id: envelope.run_id,
                spec,
                submitted_at: envelope.submitted_at,
                submitted_by: envelope.submitted_by,
            })
        }
        (envelope, spec) => {
            let mut errors = envelope.err().unwrap_or_default();
            errors.extend(spec.err().unwrap_or_default());
            Err(errors)
        }
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestEnvelope {
    run_id: crate::RunId,
    submitted_at: chrono::DateTime<chrono::Utc>,
    submitted_by: String,
}

impl RequestEnvelope {
    fn decode(value: &Value) -> Result<Self, Vec<FieldError>> {
        serde_path_to_error::deserialize(value).map_err(|err| {
            let path = err.path().to_string();
            let path = if path == "." { String::new() } else { path };
            vec![FieldError::new(path, err.into_inner().to_string())]
        })
    }
}

fn join_path(root: &str, path: &str) -> String {
    if path.is_empty() {
        root.to_owned()
    } else {
        format!("{root}.{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_types_are_unique_and_match_subjects() {
        let mut seen = std::collections::HashSet::new();
        for entry in all_events() {
            assert!(
                seen.insert(entry.file_stem()),
                "duplicate {}",
                entry.file_stem()
            );
        }
    }

    #[test]
    fn examples_decode() {
        for entry in all_events() {
            let body = serde_json::to_vec(&(entry.example)()).unwrap();
            (entry.decode)(&body).unwrap_or_else(|err| panic!("{}: {err}", entry.file_stem()));
        }
    }

    #[test]
    fn a_run_request_reports_every_bad_field() {
        let body = serde_json::json!({
            "run_id": "run-1",
            "submitted_at": "2026-11-30T12:00:00Z",
            "submitted_by": "t",
            "spec": {"rollout": {"n": 0, "top_p": 3.0}}
        });
        let errors = decode_run_request(body.to_string().as_bytes()).unwrap_err();
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["spec.rollout.n", "spec.rollout.top_p"]);
    }

    #[test]
    fn a_bad_envelope_and_spec_are_both_reported() {
        let body = serde_json::json!({
            "run_id": "bad id",
            "submitted_at": "2026-11-30T12:00:00Z",
            "submitted_by": "t",
            "spec": {"optim": {"lr": "fast"}}
        });
        let errors = decode_run_request(body.to_string().as_bytes()).unwrap_err();
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["run_id", "spec.optim.lr"]);
        assert_eq!(decode_run_request(b"\xff\x00").unwrap_err()[0].path, "");
    }
}
