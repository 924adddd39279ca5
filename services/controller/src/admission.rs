//! Admission of run requests: accept, reject with every field error, or refuse to route.

use std::path::Path;

use arl_schemas::events::RunRequestedV1;
use arl_schemas::spec::Device;

use crate::resources::{self, ResolvedResources};
use arl_schemas::state::TrainerAnnouncementV1;
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
/// `trainers` are the live trainers' announcements: a `cuda` run needs one with a GPU.
pub fn admit(
    subject: &str,
    run_token: Option<&str>,
    body: &[u8],
    model_dir: &Path,
    trainers: &[TrainerAnnouncementV1],
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
    let refusal =
        gpu_trainer_missing(&request, trainers).or_else(|| held_capacity_short(&request, trainers));
    if let Some(error) = refusal {
        return Ok(Admission::Reject {
            run_id,
            request: Some(Box::new(request)),
            errors: vec![error],
        });
    }
    match resources::check(&request.spec, model_dir) {
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

/// A `cuda` run with no live trainer that has a GPU would spend its first step's rollouts
/// and then fail: it is refused here, with what the trainers said about their GPUs.
fn gpu_trainer_missing(
    request: &RunRequestedV1,
    trainers: &[TrainerAnnouncementV1],
) -> Option<FieldError> {
    if request.spec.trainer.device != Device::Cuda || trainers.iter().any(|t| !t.devices.is_empty())
    {
        return None;
    }
    let why = if trainers.is_empty() {
        "no trainer is running".to_owned()
    } else {
        let reasons: Vec<String> = trainers
            .iter()
            .map(|t| {
                format!(
                    "{} on {}: {}",
                    t.instance,
                    t.host,
                    t.gpu_unavailable.as_deref().unwrap_or("no GPU")
                )
            })
            .collect();
        format!(
            "{} live trainer(s), none with a GPU ({})",
            trainers.len(),
            reasons.join("; ")
        )
    };
    Some(FieldError::new(
        "spec.trainer.device",
        format!(
            "is \"cuda\" but {why}; start arl-trainer on a machine with an NVIDIA GPU (compute capability 8.0+), or use \"cpu\""
        ),
    ))
}

/// A trainer acknowledges a trajectory only once a checkpoint covers its step, so it holds
/// `train_batch_size × n × (save_every + max_staleness)` of a run at the peak (the steps
/// since the last checkpoint, and those rollouts ran ahead on). A run needing more than
/// the roomiest live trainer holds would stall forever once JetStream stops delivering:
/// it is refused here. Trainers that do not announce a capacity are not judged.
fn held_capacity_short(
    request: &RunRequestedV1,
    trainers: &[TrainerAnnouncementV1],
) -> Option<FieldError> {
    let roomiest = trainers.iter().filter_map(|t| t.held_capacity).max()?;
    let spec = &request.spec;
    let needed = u64::from(spec.data.train_batch_size)
        * u64::from(spec.rollout.n)
        * (u64::from(spec.trainer.save_every) + u64::from(spec.algorithm.max_staleness));
    (needed > roomiest).then(|| {
        FieldError::new(
            "spec.trainer.save_every",
            format!(
                "is {} but data.train_batch_size × rollout.n × (trainer.save_every + \
                 algorithm.max_staleness) = {} × {} × ({} + {}) = {needed} trajectories would \
                 be held awaiting a checkpoint, and the roomiest live trainer holds {roomiest}; \
                 lower trainer.save_every (or the batch), or start arl-trainer with --capacity \
                 {needed} or more",
                spec.trainer.save_every,
                spec.data.train_batch_size,
                spec.rollout.n,
                spec.trainer.save_every,
                spec.algorithm.max_staleness
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arl_schemas::state::GpuDeviceV1;

    fn trainer(devices: Vec<GpuDeviceV1>) -> TrainerAnnouncementV1 {
        TrainerAnnouncementV1 {
            instance: "t1".into(),
            host: "node-a".into(),
            gpu_unavailable: devices
                .is_empty()
                .then(|| "no CUDA driver: libcuda.so could not be loaded".into()),
            devices,
            runs: Vec::new(),
            held_capacity: None,
            at: chrono::Utc::now(),
        }
    }

    fn cuda_request() -> Vec<u8> {
        let mut request = <RunRequestedV1 as arl_schemas::events::Example>::example();
        request.spec.trainer.device = Device::Cuda;
        serde_json::to_vec(&request).unwrap()
    }

    #[test]
    fn a_cuda_run_without_a_gpu_trainer_is_rejected_with_the_cause() {
        let dir = std::env::temp_dir();
        let body = cuda_request();
        let run = <RunRequestedV1 as arl_schemas::events::Example>::example().run_id;
        let subject = format!("arl.run.{run}.requested");
        for trainers in [vec![], vec![trainer(vec![])]] {
            match admit(&subject, Some(run.as_str()), &body, &dir, &trainers).unwrap() {
                Admission::Reject { errors, .. } => {
                    assert_eq!(errors[0].path, "spec.trainer.device");
                    assert!(errors[0].reason.contains("\"cpu\""), "{errors:?}");
                    if !trainers.is_empty() {
                        assert!(errors[0].reason.contains("libcuda.so"), "{errors:?}");
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        let gpu = trainer(vec![GpuDeviceV1 {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            memory_bytes: 150_000_000_000,
            compute_capability: "9.0".into(),
        }]);
        let request: RunRequestedV1 = serde_json::from_slice(&body).unwrap();
        assert_eq!(gpu_trainer_missing(&request, &[trainer(vec![]), gpu]), None);
    }

    #[test]
    fn a_run_that_would_hold_more_than_any_trainer_can_is_refused() {
        let mut request = <RunRequestedV1 as arl_schemas::events::Example>::example();
        request.spec.data.train_batch_size = 8;
        request.spec.rollout.n = 16;
        request.spec.trainer.save_every = 10;
        request.spec.algorithm.max_staleness = 2;
        let roomy = |capacity| TrainerAnnouncementV1 {
            held_capacity: Some(capacity),
            ..trainer(vec![])
        };
        // 8 × 16 × (10 + 2) = 1536.
        let error = held_capacity_short(&request, &[roomy(1000), roomy(1535)]).unwrap();
        assert_eq!(error.path, "spec.trainer.save_every");
        assert!(error.reason.contains("= 1536 trajectories"), "{error:?}");
        assert!(error.reason.contains("holds 1535"), "{error:?}");
        assert_eq!(
            held_capacity_short(&request, &[roomy(1000), roomy(1536)]),
            None
        );
        // Trainers that say nothing are not judged.
        assert_eq!(held_capacity_short(&request, &[trainer(vec![])]), None);
        assert_eq!(held_capacity_short(&request, &[]), None);
    }

    #[test]
    fn garbage_is_rejected_for_the_run_in_the_subject() {
        let dir = std::env::temp_dir();
        let admission = admit("arl.run.r1.requested", Some("r1"), b"\x00\x01", &dir, &[]).unwrap();
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
        assert!(admit("x", None, b"{}", &dir, &[]).is_err());
        assert!(admit("arl.run.a=b.requested", Some("a=b"), b"{}", &dir, &[]).is_err());
    }
}
