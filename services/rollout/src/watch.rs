//! What a rollout replica waits for, delivered to the trial waiting for it: the proxy's
//! `llm.call` records of its attempts and the grades (`reward.scored`, grading failures)
//! of its finished trials. One subscription per kind for the whole replica, instead of
//! each trial scanning the streams — which is quadratic in trials in flight. A trial
//! registers before it can cause an event; if a record never arrives through the
//! subscription (it is not a durable consumer), the caller falls back to reading the
//! stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_runtime::{Bus, Shutdown};
use arl_schemas::events::{FailureClass, LlmCallV1, RewardScoredV2, TrialFailedV1};
use arl_schemas::{Domain, Event, TrialId};
use futures::StreamExt;
use tokio::sync::Notify;

/// A finished trial's grade.
#[derive(Clone, Debug)]
pub enum Grade {
    Scored(RewardScoredV2),
    Failed(TrialFailedV1),
}

/// A trial attempt: (trial, attempt).
type Attempt = (TrialId, u32);

/// What one trial waits for, and its own wake-up (one waiter per entry: no herd).
#[derive(Default)]
struct Entry<T> {
    value: T,
    arrived: Arc<Notify>,
}

#[derive(Default)]
struct Inner {
    calls: Mutex<HashMap<TrialId, Entry<Vec<LlmCallV1>>>>,
    grades: Mutex<HashMap<Attempt, Entry<Option<Grade>>>>,
}

#[derive(Clone, Default)]
pub struct Watch {
    inner: Arc<Inner>,
}

impl Watch {
    /// Subscribes to every run's calls and grades of the bus's namespace.
    pub async fn start(bus: &Bus, shutdown: &Shutdown) -> Result<Self, String> {
        let watch = Self::default();
        let ns = bus.namespace();
        let subscribe = |subject: String| {
            let client = bus.client().clone();
            async move { client.subscribe(subject).await.map_err(|e| e.to_string()) }
        };
        let mut calls = subscribe(ns.event_filter(Domain::Llm, "call")).await?;
        let mut scored = subscribe(ns.event_filter(Domain::Reward, "scored")).await?;
        let mut failed = subscribe(ns.event_filter(Domain::Trial, "failed")).await?;
        let w = watch.clone();
        let token = shutdown.token();
        shutdown.spawn(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => break,
                    Some(m) = calls.next() => {
                        if let Ok(call) = LlmCallV1::decode(&m.payload) { w.on_call(call) }
                    }
                    Some(m) = scored.next() => {
                        if let Ok(s) = RewardScoredV2::decode(&m.payload) {
                            w.on_grade(s.trial_id.clone(), s.slot.attempt, Grade::Scored(s));
                        }
                    }
                    Some(m) = failed.next() => {
                        if let Ok(f) = TrialFailedV1::decode(&m.payload)
                            && f.class == FailureClass::GradingError
                        {
                            w.on_grade(f.trial_id.clone(), f.slot.attempt, Grade::Failed(f));
                        }
                    }
                    else => break,
                }
            }
        });
        Ok(watch)
    }

    fn on_call(&self, call: LlmCallV1) {
        let mut calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = calls.get_mut(&call.trial_id) {
            if !entry.value.iter().any(|c| c.turn_index == call.turn_index) {
                entry.value.push(call);
            }
            entry.arrived.notify_one();
        }
    }

    fn on_grade(&self, trial: TrialId, attempt: u32, grade: Grade) {
        let mut grades = self.inner.grades.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = grades.get_mut(&(trial, attempt)) {
            entry.value.get_or_insert(grade);
            entry.arrived.notify_one();
        }
    }

    /// Starts collecting the calls recorded under `scope` (before its key is issued).
    pub fn expect_calls(&self, scope: &TrialId) {
        let mut calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.entry(scope.clone()).or_default();
    }

    /// The calls of `scope` once `count` are in, or `None` after `timeout`. Stops
    /// collecting either way.
    pub async fn take_calls(
        &self,
        scope: &TrialId,
        count: usize,
        timeout: Duration,
    ) -> Option<Vec<LlmCallV1>> {
        let arrived = {
            let calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
            calls.get(scope).map(|e| e.arrived.clone())
        };
        let got = match arrived {
            Some(arrived) => {
                wait(&arrived, timeout, || {
                    let calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
                    calls
                        .get(scope)
                        .filter(|e| e.value.len() >= count)
                        .map(|e| e.value.clone())
                })
                .await
            }
            None => None,
        };
        let mut calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.remove(scope);
        got
    }

    /// Starts waiting for the grade of `trial`'s `attempt` (before `trial.finished`).
    pub fn expect_grade(&self, trial: &TrialId, attempt: u32) {
        let mut grades = self.inner.grades.lock().unwrap_or_else(|e| e.into_inner());
        grades.entry((trial.clone(), attempt)).or_default();
    }

    /// The grade once it arrives, or `None` after `timeout` (the registration stays).
    pub async fn grade(&self, trial: &TrialId, attempt: u32, timeout: Duration) -> Option<Grade> {
        let key = (trial.clone(), attempt);
        let arrived = {
            let grades = self.inner.grades.lock().unwrap_or_else(|e| e.into_inner());
            grades.get(&key).map(|e| e.arrived.clone())
        }?;
        wait(&arrived, timeout, || {
            let grades = self.inner.grades.lock().unwrap_or_else(|e| e.into_inner());
            grades.get(&key).and_then(|e| e.value.clone())
        })
        .await
    }

    /// Stops waiting for a grade.
    pub fn forget_grade(&self, trial: &TrialId, attempt: u32) {
        let mut grades = self.inner.grades.lock().unwrap_or_else(|e| e.into_inner());
        grades.remove(&(trial.clone(), attempt));
    }
}

/// Waits until `ready` gives a value; `arrived` is signalled after every change.
async fn wait<T>(arrived: &Notify, timeout: Duration, ready: impl Fn() -> Option<T>) -> Option<T> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = ready() {
            return Some(value);
        }
        // `notify_one` stores a permit when no one waits yet, so an arrival between the
        // check and this wait is not missed.
        if tokio::time::timeout_at(deadline, arrived.notified())
            .await
            .is_err()
        {
            return ready();
        }
    }
}
