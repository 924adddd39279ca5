//! Run state in the key-value bucket, written with compare-and-set so that the
//! controller's consumers never overwrite each other's updates.

use arl_runtime::Bus;
use arl_schemas::state::RunStateV1;
use arl_schemas::{Bucket, RunId};
use async_nats::jetstream::kv;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("run state bucket: {0}")]
    Bus(#[from] arl_runtime::BusError),
    #[error("reading the state of {run_id}: {reason}")]
    Read { run_id: RunId, reason: String },
    #[error("the stored state of {run_id} is corrupt: {reason}")]
    Corrupt { run_id: RunId, reason: String },
    #[error("writing the state of {run_id}: {reason}")]
    Write { run_id: RunId, reason: String },
    #[error("the state of {run_id} kept changing under us")]
    Contended { run_id: RunId },
}

/// A run's state and the bucket revision it was read at.
#[derive(Debug, Clone)]
pub struct Versioned {
    pub state: RunStateV1,
    pub revision: u64,
}

#[derive(Clone, Debug)]
pub struct RunStore {
    kv: kv::Store,
}

impl RunStore {
    pub async fn open(bus: &Bus) -> Result<Self, StoreError> {
        Ok(Self {
            kv: bus.bucket(Bucket::RunState).await?,
        })
    }

    pub async fn get(&self, run_id: &RunId) -> Result<Option<Versioned>, StoreError> {
        let entry = self
            .kv
            .entry(run_id.as_str())
            .await
            .map_err(|err| StoreError::Read {
                run_id: run_id.clone(),
                reason: err.to_string(),
            })?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let state = RunStateV1::decode(&entry.value).map_err(|err| StoreError::Corrupt {
            run_id: run_id.clone(),
            reason: err.to_string(),
        })?;
        Ok(Some(Versioned {
            state,
            revision: entry.revision,
        }))
    }

    /// Stores the first state of a run. Returns `None` if the run already had one.
    pub async fn create(&self, state: &RunStateV1) -> Result<Option<u64>, StoreError> {
        let body = self.encode(state)?;
        match self.kv.create(state.run_id.as_str(), body.into()).await {
            Ok(revision) => Ok(Some(revision)),
            Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(err) => Err(StoreError::Write {
                run_id: state.run_id.clone(),
                reason: err.to_string(),
            }),
        }
    }

    /// Reads, changes and writes a run's state, retrying if another writer got there
    /// first. `change` returns false to leave the state as it is.
    pub async fn modify(
        &self,
        run_id: &RunId,
        mut change: impl FnMut(&mut RunStateV1) -> bool,
    ) -> Result<Option<RunStateV1>, StoreError> {
        for _ in 0..32 {
            let Some(Versioned {
                mut state,
                revision,
            }) = self.get(run_id).await?
            else {
                return Ok(None);
            };
            if !change(&mut state) {
                return Ok(Some(state));
            }
            state.updated_at = chrono::Utc::now();
            let body = self.encode(&state)?;
            match self.kv.update(run_id.as_str(), body.into(), revision).await {
                Ok(_) => return Ok(Some(state)),
                Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(err) => {
                    return Err(StoreError::Write {
                        run_id: run_id.clone(),
                        reason: err.to_string(),
                    });
                }
            }
        }
        Err(StoreError::Contended {
            run_id: run_id.clone(),
        })
    }

    fn encode(&self, state: &RunStateV1) -> Result<Vec<u8>, StoreError> {
        state.encode().map_err(|err| StoreError::Write {
            run_id: state.run_id.clone(),
            reason: err.to_string(),
        })
    }
}
