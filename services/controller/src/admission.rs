//! Admission of run requests: accept, reject with every field error, or refuse to route.

use std::path::Path;

use arl_schemas::events::RunRequestedV1;
use arl_schemas::spec::ResolvedResources;
use arl_schemas::{FieldError, RunId};

/// What the controller decided about one run request.
#[derive(Debug)]
pub enum Admission {
    Accept {
        request: Box<RunRequestedV1>,
        resources: ResolvedResources,
    },
    /// The request names a run (in its subject) but is invalid.
    Reject {
        run_id: RunId,
        request: Option<Box<RunRequestedV1>>,
        errors: Vec<FieldError>,
    },
}

/// Why a message could not even be tied to a run.
#[derive(Debug, thiserror::Error)]
#[error("subject {subject:?} does not name a valid run: {reason}")]
pub struct Unroutable {
    pub subject: String,
    pub reason: String,
}

/// Decides on a run request. `run_token` is the run id from the subject: it is the
/// authority for which run the answer belongs to, even when the body is garbage.
pub fn admit(
    subject: &str,
    run_token: Option<&str>,
    body: &[u8],
    model_dir: &Path,
) -> Result<Admission, Unroutable> {
    let token = run_token.ok_or_else(|| Unroutable {
        subject: subject.to_owned(),
        reason: "not a run event subject of this namespace".into(),
    })?;
    let run_id = RunId::new(token).map_err(|err| Unroutable {
        subject: subject.to_owned(),
        reason: err.to_string(),
    })?;

    let request = match arl_schemas::catalog::decode_run_request(body) {
        Ok(request) => request,
        Err(errors) => {
            return Ok(Admission::Reject {
                run_id,
                request: None,
                errors,
            });
        }
    };
    if request.run_id != run_id {
        let errors = vec![FieldError::new(
            "run_id",
            format!(
                "is {} but the message was published for run {run_id}",
                request.run_id
            ),
        )];
        return Ok(Admission::Reject {
            run_id,
            request: Some(Box::new(request)),
            errors,
        });
    }
    match request.spec.check_resources(model_dir) {
        Ok(resources) => Ok(Admission::Accept {
            request: Box::new(request),
            resources,
        }),
        Err(errors) => {
            let errors = errors
                .into_iter()
                .map(|e| FieldError::new(format!("spec.{}", e.path), e.reason))
                .collect();
            Ok(Admission::Reject {
                run_id,
                request: Some(Box::new(request)),
                errors,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_rejected_for_the_run_in_the_subject() {
        let dir = std::env::temp_dir();
        let admission = admit("arl.run.r1.requested", Some("r1"), b"\x00\x01", &dir).unwrap();
        match admission {
            Admission::Reject { run_id, errors, .. } => {
                assert_eq!(run_id.as_str(), "r1");
                assert!(errors[0].reason.contains("not valid JSON"), "{errors:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_subject_without_a_valid_run_is_unroutable() {
        let dir = std::env::temp_dir();
        assert!(admit("x", None, b"{}", &dir).is_err());
        assert!(admit("arl.run.a=b.requested", Some("a=b"), b"{}", &dir).is_err());
    }
}
