//! The lease table: who holds which sandbox until when.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use arl_schemas::{LeaseId, RunId, TrialId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// Whose a lease is: kept with the sandbox (beside a work tree, on a Pod's annotations),
/// so that a restarted service can reap it and say whose it was.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub lease_id: LeaseId,
    pub run_id: RunId,
    pub instance: String,
    pub environment: String,
    pub created_at: DateTime<Utc>,
}

impl LeaseRecord {
    pub const FILE: &'static str = "lease.json";

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let body = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(Self::FILE), body)
    }

    pub fn read(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(Self::FILE)).ok()?).ok()
    }
}

#[derive(Debug)]
pub struct Lease<S> {
    pub record: LeaseRecord,
    pub trial_id: Option<TrialId>,
    /// Bearer token of the exec and file API.
    pub token: String,
    /// The commit diffs are taken against.
    pub base: String,
    /// Absolute path of the work tree inside the sandbox.
    pub workdir: String,
    /// The backend's sandbox.
    pub sandbox: S,
    /// Cancelled when the lease ends: running commands are killed.
    pub ended: CancellationToken,
    expires_at: Mutex<DateTime<Utc>>,
    /// Held for the lease's life: bounds leases per instance.
    _capacity: OwnedSemaphorePermit,
}

/// What a lease is made of, besides its token and expiry.
pub struct LeaseParts<S> {
    pub record: LeaseRecord,
    pub trial_id: Option<TrialId>,
    pub base: String,
    pub workdir: String,
    pub sandbox: S,
    pub ended: CancellationToken,
}

impl<S> Lease<S> {
    pub fn new(
        parts: LeaseParts<S>,
        expires_at: DateTime<Utc>,
        capacity: OwnedSemaphorePermit,
    ) -> Self {
        let LeaseParts {
            record,
            trial_id,
            base,
            workdir,
            sandbox,
            ended,
        } = parts;
        Self {
            record,
            trial_id,
            token: uuid::Uuid::new_v4().simple().to_string(),
            base,
            workdir,
            sandbox,
            ended,
            expires_at: Mutex::new(expires_at),
            _capacity: capacity,
        }
    }

    pub fn id(&self) -> &LeaseId {
        &self.record.lease_id
    }

    /// Whether `presented` is this lease's token (compared in constant time).
    pub fn token_is(&self, presented: &str) -> bool {
        arl_runtime::secret::same_secret(presented.as_bytes(), self.token.as_bytes())
    }

    pub fn expires_at(&self) -> DateTime<Utc> {
        *self
            .expires_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub fn extend_to(&self, at: DateTime<Utc>) {
        *self
            .expires_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = at;
    }
}

#[derive(Debug)]
pub struct LeaseTable<S> {
    leases: RwLock<HashMap<LeaseId, Arc<Lease<S>>>>,
    /// Why the service itself ended recent leases, for holders who call again.
    ended_by_service: Mutex<VecDeque<(LeaseId, String)>>,
}

/// Ended leases whose reason is kept for their holders.
const ENDS_KEPT: usize = 1024;

impl<S> Default for LeaseTable<S> {
    fn default() -> Self {
        Self {
            leases: RwLock::default(),
            ended_by_service: Mutex::default(),
        }
    }
}

impl<S> LeaseTable<S> {
    pub fn insert(&self, lease: Arc<Lease<S>>) {
        self.write().insert(lease.id().clone(), lease);
    }

    pub fn get(&self, id: &LeaseId) -> Option<Arc<Lease<S>>> {
        self.leases
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// Removes a lease; only one caller gets it (release and expiry may race).
    pub fn remove(&self, id: &LeaseId) -> Option<Arc<Lease<S>>> {
        self.write().remove(id)
    }

    /// Keeps why the service ended a lease (its holder's next call is told).
    pub fn remember_end(&self, id: LeaseId, why: String) {
        let mut ended = self
            .ended_by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if ended.len() == ENDS_KEPT {
            ended.pop_front();
        }
        ended.push_back((id, why));
    }

    /// Why the service ended `id`, when it did so recently.
    pub fn end_of(&self, id: &LeaseId) -> Option<String> {
        self.ended_by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .rev()
            .find(|(ended, _)| ended == id)
            .map(|(_, why)| why.clone())
    }

    pub fn expired(&self, now: DateTime<Utc>) -> Vec<LeaseId> {
        let leases = self.leases.read().unwrap_or_else(PoisonError::into_inner);
        leases
            .values()
            .filter(|l| l.expires_at() <= now)
            .map(|l| l.id().clone())
            .collect()
    }

    pub fn ids(&self) -> Vec<LeaseId> {
        self.leases
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.leases
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<LeaseId, Arc<Lease<S>>>> {
        self.leases.write().unwrap_or_else(PoisonError::into_inner)
    }
}
