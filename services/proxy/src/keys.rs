//! Trial keys: issued for one trial over NATS request/reply, revoked when it ends. A key
//! names exactly one trial, so a caller can only ever add to its own trial's record.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use arl_runtime::telemetry::TraceContext;
use arl_schemas::rpc::TrialKeyRequestV1;
use arl_schemas::{RunId, TrialId};

#[derive(Debug)]
pub struct Trial {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub policy_version: u64,
    pub max_staleness: Option<u64>,
    /// Calls so far: the next call's turn index.
    pub turns: AtomicU32,
    /// Where each stored `llm.call` record of the trial is in the LLM stream, in the
    /// order stored (refused calls have a turn index but no record): what the trial's
    /// trajectory will be built from.
    recorded: Mutex<Vec<u64>>,
    /// Where in its trial's trace the key was issued: the parent of calls that bring no
    /// `traceparent` of their own.
    pub trace: TraceContext,
    /// The backend that answered the trial last ([`NO_BACKEND`]: none yet): its next call
    /// goes there first, so that the engine's prefix cache keeps serving the trial.
    backend: AtomicUsize,
}

const NO_BACKEND: usize = usize::MAX;

impl Trial {
    /// The backend that answered the trial last.
    pub fn backend(&self) -> Option<usize> {
        Some(self.backend.load(Ordering::Relaxed)).filter(|&i| i != NO_BACKEND)
    }

    /// Sends the trial's next calls to `backend` first.
    pub fn stick_to(&self, backend: usize) {
        self.backend.store(backend, Ordering::Relaxed);
    }

    /// Notes a call's record as stored at `sequence` of the LLM stream.
    pub fn record(&self, sequence: u64) {
        self.recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sequence);
    }

    /// The stream sequences of the calls recorded so far.
    pub fn recorded_calls(&self) -> Vec<u64> {
        self.recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[derive(Debug, Default)]
pub struct Keys {
    trials: RwLock<HashMap<String, Arc<Trial>>>,
}

impl Keys {
    pub fn issue(&self, request: &TrialKeyRequestV1) -> String {
        let key = format!("tk-{}", uuid::Uuid::new_v4().simple());
        let trial = Arc::new(Trial {
            run_id: request.run_id.clone(),
            trial_id: request.trial_id.clone(),
            policy_version: request.policy_version,
            max_staleness: request.max_staleness,
            turns: AtomicU32::new(0),
            recorded: Mutex::new(Vec::new()),
            trace: TraceContext::current(),
            backend: AtomicUsize::new(NO_BACKEND),
        });
        self.trials
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), trial);
        key
    }

    /// The live trial of a key.
    pub fn get(&self, key: &str) -> Option<Arc<Trial>> {
        self.trials
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned()
    }

    /// Ends a key; returns the stream sequences of the calls it recorded, None if it was
    /// not live.
    pub fn revoke(&self, key: &str) -> Option<Vec<u64>> {
        self.trials
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key)
            .map(|t| t.recorded_calls())
    }
}
