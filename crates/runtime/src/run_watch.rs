//! One watch of `ARL_RUN_STATE` per process, shared by everything in it that waits for a
//! run's state to change ([`crate::Bus::await_run_state`]).
//!
//! Why shared: a KV watch is a JetStream consumer, and nats-server 2.15 caps each stream at
//! 1,000 consumers by default. A rollout replica holds one waiting trial per in-flight
//! trial of a run ahead of its weights; with a watch each, the cap (not the machine) was
//! the limit on trials in flight. Now a process holds one consumer on the bucket however
//! many trials wait, and each waiter holds a `tokio::sync::watch` receiver for its run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_schemas::state::RunStateV1;
use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio::sync::watch;

/// What the process last saw of one run's key: its revision (so a late read never
/// overwrites a newer update) and its state (None: deleted, purged or unreadable).
#[derive(Clone, Debug, Default)]
pub(crate) struct Seen {
    revision: u64,
    pub(crate) state: Option<RunStateV1>,
}

/// The runs some task in this process waits on, each with the latest state seen.
#[derive(Debug, Default)]
pub(crate) struct RunWatch {
    runs: Mutex<HashMap<String, watch::Sender<Seen>>>,
}

/// A waiter's hold on one run's updates; dropping it forgets the run once nobody else in
/// the process waits on it (so a finished run's entry does not stay for the process's life).
pub(crate) struct Subscription {
    watch: Arc<RunWatch>,
    run: String,
    pub(crate) updates: watch::Receiver<Seen>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut runs = self.watch.lock();
        if let Some(sender) = runs.get(&self.run) {
            // This receiver still counts until `self.updates` drops, after this body.
            if sender.receiver_count() <= 1 {
                runs.remove(&self.run);
            }
        }
    }
}

impl RunWatch {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Seen>>> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts following every run's key in `store` for the process's life; re-opens the
    /// watch (and re-reads every awaited run) if the server drops it.
    pub(crate) fn start(store: kv::Store) -> Arc<Self> {
        let this = Arc::new(Self::default());
        let weak = Arc::downgrade(&this);
        tokio::spawn(async move {
            loop {
                let watch = store.watch_all().await;
                // Updates between a watch ending and the new one starting are caught by
                // reading each awaited run again, after the new watch is open.
                let Some(this) = weak.upgrade() else { return };
                for run in this.awaited() {
                    if let Ok(Some(entry)) = store.entry(run.as_str()).await {
                        this.apply(&entry);
                    }
                }
                drop(this);
                match watch {
                    Ok(mut updates) => {
                        while let Some(update) = updates.next().await {
                            let Some(this) = weak.upgrade() else { return };
                            match update {
                                Ok(entry) => this.apply(&entry),
                                Err(err) => {
                                    tracing::warn!(%err, "run-state watch interrupted; reopening");
                                    break;
                                }
                            }
                        }
                    }
                    Err(err) => tracing::warn!(%err, "cannot watch run states; retrying"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        this
    }

    /// Follows one run: the receiver sees every later update of its key. The caller reads
    /// the key once after subscribing ([`RunWatch::apply`]) for the state before it.
    pub(crate) fn subscribe(self: &Arc<Self>, run: &str) -> Subscription {
        let updates = {
            let mut runs = self.lock();
            runs.entry(run.to_owned())
                .or_insert_with(|| watch::channel(Seen::default()).0)
                .subscribe()
        };
        Subscription {
            watch: self.clone(),
            run: run.to_owned(),
            updates,
        }
    }

    /// Records an entry of the bucket if someone waits on its run and it is newer than
    /// what was seen.
    pub(crate) fn apply(&self, entry: &kv::Entry) {
        let runs = self.lock();
        let Some(sender) = runs.get(&entry.key) else {
            return;
        };
        let state = match entry.operation {
            kv::Operation::Put => match RunStateV1::decode(&entry.value) {
                Ok(state) => Some(state),
                Err(err) => {
                    tracing::warn!(run = %entry.key, %err, "unreadable run state");
                    None
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => None,
        };
        sender.send_if_modified(|seen| {
            if entry.revision <= seen.revision {
                return false;
            }
            *seen = Seen {
                revision: entry.revision,
                state,
            };
            true
        });
    }

    fn awaited(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// How many runs some task waits on (for tests of the clean-up).
    pub(crate) fn awaited_count(&self) -> usize {
        self.lock().len()
    }
}
