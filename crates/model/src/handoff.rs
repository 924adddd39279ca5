//! Policy versions handed from a trainer to an engine hosted in the same process
//! (`arl serve trainer + inference`, the colocated layout): the engine takes a version's
//! weights from memory — on a GPU, device to device — instead of reading the safetensors
//! file the trainer wrote. Engines in other processes read the file as before; the trainer
//! writes it either way (it is the checkpoint, and what every other engine loads).
//!
//! A handed version is keyed by (run, policy version, sha256 of the published weights
//! file): an engine takes it only for the `weights.published` event naming exactly that
//! file, so two runs never share weights, and a version whose event differs (a re-trained
//! step, a newer one) is loaded from its file. Its weights are the published values: the
//! trainer rounds them to the dtype it stored, so what an engine serves is bit for bit
//! what loading the file gives.
//!
//! Memory: the shelf holds the newest handed version of each run until an engine takes it
//! (or the run ends; at most [`RUNS_HELD`] runs' versions at once, the oldest offered
//! dropped first — an engine that follows one run must not make another run's versions
//! pile up) — on the host, one copy of the weights as f32; from a GPU trainer to a
//! GPU engine, also one f32 copy in device memory, freed once the engine has copied it into
//! its own. A trainer hands versions over only while an engine of this process listens
//! ([`listen`]), so a trainer alone keeps nothing.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::cuda::GpuBuf;
use crate::load::LoadedModel;
use crate::weights::Weights;

/// Which published version a hand-off is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionKey {
    pub run_id: String,
    pub policy_version: u64,
    /// The published weights file's sha256, as the `weights.published` event gives it.
    pub sha256: String,
}

/// One version's weights as the trainer published them.
#[derive(Debug)]
pub struct HandedVersion {
    pub key: VersionKey,
    /// Configuration, tokenizer, chat template, and the weights rounded as stored.
    pub model: LoadedModel,
    /// The same weights (f32 holding the stored values) in a GPU's memory, when the trainer
    /// trained there and the listening engine runs on the same GPU.
    pub device: Option<DeviceWeights>,
}

/// Weights in device memory, and the GPU they are on.
#[derive(Debug)]
pub struct DeviceWeights {
    pub ordinal: usize,
    pub weights: Weights<GpuBuf>,
}

/// The engine listening in this process: where it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    Cpu,
    /// A GPU, by ordinal.
    Gpu(usize),
}

/// Runs whose newest version the shelf holds at once.
pub const RUNS_HELD: usize = 2;

/// The newest handed version of each run, and the engines listening. Generic over what a
/// version holds so that its rules are tested without a model.
struct Shelf<V> {
    listeners: Vec<(u64, Listener)>,
    next_id: u64,
    /// By run: the version, and when it was offered (the shelf's own count).
    newest: HashMap<String, (VersionKey, V, u64)>,
    offers: u64,
}

impl<V> Default for Shelf<V> {
    fn default() -> Self {
        Self {
            listeners: Vec::new(),
            next_id: 0,
            newest: HashMap::new(),
            offers: 0,
        }
    }
}

impl<V> Shelf<V> {
    fn listen(&mut self, listener: Listener) -> u64 {
        self.next_id += 1;
        self.listeners.push((self.next_id, listener));
        self.next_id
    }

    fn unlisten(&mut self, id: u64) {
        self.listeners.retain(|(held, _)| *held != id);
        if self.listeners.is_empty() {
            self.newest.clear();
        }
    }

    fn offer(&mut self, key: VersionKey, version: V) {
        if self.listeners.is_empty() {
            return;
        }
        let newer = self
            .newest
            .get(&key.run_id)
            .is_none_or(|(held, _, _)| held.policy_version <= key.policy_version);
        if !newer {
            return;
        }
        self.offers += 1;
        self.newest
            .insert(key.run_id.clone(), (key, version, self.offers));
        // One offer adds one run at most: dropping one makes room.
        if self.newest.len() > RUNS_HELD
            && let Some(oldest) = self
                .newest
                .iter()
                .min_by_key(|(_, (_, _, offered))| *offered)
                .map(|(run, _)| run.clone())
        {
            self.newest.remove(&oldest);
        }
    }

    fn take(&mut self, key: &VersionKey) -> Option<V> {
        let (held, _, _) = self.newest.get(&key.run_id)?;
        if held != key {
            return None;
        }
        self.newest
            .remove(&key.run_id)
            .map(|(_, version, _)| version)
    }
}

static SHELF: Mutex<Option<Shelf<HandedVersion>>> = Mutex::new(None);

fn with_shelf<T>(f: impl FnOnce(&mut Shelf<HandedVersion>) -> T) -> T {
    let mut shelf = SHELF.lock().unwrap_or_else(PoisonError::into_inner);
    f(shelf.get_or_insert_with(Shelf::default))
}

/// An engine's registration; versions are handed over while it lives.
#[derive(Debug)]
pub struct Listening {
    id: u64,
}

impl Drop for Listening {
    fn drop(&mut self) {
        with_shelf(|s| s.unlisten(self.id));
    }
}

/// Registers an engine of this process, running on `listener`, to be handed versions.
pub fn listen(listener: Listener) -> Listening {
    Listening {
        id: with_shelf(|s| s.listen(listener)),
    }
}

/// Where the engines listening in this process run (empty: hand nothing over).
pub fn listeners() -> Vec<Listener> {
    with_shelf(|s| s.listeners.iter().map(|(_, l)| *l).collect())
}

/// Puts `version` on the shelf in place of any older version of its run; ignored when no
/// engine listens.
pub fn offer(version: HandedVersion) {
    with_shelf(|s| s.offer(version.key.clone(), version));
}

/// Takes the handed version `key` names exactly (None: load it from its file).
pub fn take(key: &VersionKey) -> Option<HandedVersion> {
    with_shelf(|s| s.take(key))
}

/// Drops whatever `run_id` left on the shelf (its run ended).
pub fn forget(run_id: &str) {
    with_shelf(|s| {
        s.newest.remove(run_id);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(run: &str, version: u64, sha: &str) -> VersionKey {
        VersionKey {
            run_id: run.into(),
            policy_version: version,
            sha256: sha.into(),
        }
    }

    #[test]
    fn a_version_is_handed_only_to_a_listener_and_only_as_published() {
        let mut shelf = Shelf::<u64>::default();
        shelf.offer(key("run-a", 1, "aa"), 1);
        let listening = shelf.listen(Listener::Cpu);
        assert!(
            shelf.take(&key("run-a", 1, "aa")).is_none(),
            "nothing is kept while no engine listens"
        );

        shelf.offer(key("run-a", 1, "aa"), 1);
        assert!(
            shelf.take(&key("run-a", 1, "other")).is_none(),
            "another file"
        );
        assert!(shelf.take(&key("run-b", 1, "aa")).is_none(), "another run");
        assert_eq!(shelf.take(&key("run-a", 1, "aa")), Some(1));
        assert!(shelf.take(&key("run-a", 1, "aa")).is_none(), "taken once");

        shelf.offer(key("run-a", 2, "bb"), 2);
        shelf.offer(key("run-a", 1, "aa"), 1);
        assert!(
            shelf.take(&key("run-a", 1, "aa")).is_none(),
            "an older version never replaces a newer"
        );
        shelf.offer(key("run-a", 3, "cc"), 3);
        assert!(
            shelf.take(&key("run-a", 2, "bb")).is_none(),
            "replaced by the newer"
        );
        shelf.offer(key("run-b", 3, "cc"), 30);
        assert_eq!(shelf.take(&key("run-a", 3, "cc")), Some(3));
        assert_eq!(shelf.take(&key("run-b", 3, "cc")), Some(30), "runs apart");

        for (run, version) in [("run-a", 5), ("run-b", 5), ("run-c", 5)] {
            shelf.offer(key(run, version, "ee"), version);
        }
        assert!(
            shelf.take(&key("run-a", 5, "ee")).is_none(),
            "the oldest offered run's version makes room for a third run's"
        );
        assert!(shelf.take(&key("run-b", 5, "ee")).is_some());
        assert!(shelf.take(&key("run-c", 5, "ee")).is_some());

        shelf.offer(key("run-a", 4, "dd"), 4);
        shelf.unlisten(listening);
        let _again = shelf.listen(Listener::Gpu(0));
        assert!(
            shelf.take(&key("run-a", 4, "dd")).is_none(),
            "dropped with the last listener"
        );
    }
}
