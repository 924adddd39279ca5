//! Warm pools: per environment, a deadpool of prepared sandboxes, so a lease usually takes
//! a ready one instead of waiting while a snapshot is copied or a Pod starts.
//!
//! A sandbox handed to a lease is detached from its pool (it becomes the lease's, and is
//! deleted with it), and the pool is refilled in the background to `min_idle`: by one
//! refill at a time per pool, which never waits for a slot. (A refill per lease, each
//! holding part of `min_idle` and waiting for the rest, filled the pool with half-done
//! refills under a burst of leases; every lease then waited on them forever.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool::managed::{self, Manager, Object, Pool, RecycleResult, Timeouts};

use crate::backend::{Backend, BackendError, Prepared};

pub struct SandboxMaker<B: Backend> {
    backend: Arc<B>,
    environment: B::Environment,
}

impl<B: Backend> Manager for SandboxMaker<B> {
    type Type = Prepared<B::Idle>;
    type Error = BackendError;

    async fn create(&self) -> Result<Prepared<B::Idle>, BackendError> {
        self.backend.prepare(&self.environment).await
    }

    async fn recycle(
        &self,
        _sandbox: &mut Prepared<B::Idle>,
        _: &managed::Metrics,
    ) -> RecycleResult<BackendError> {
        // An idle sandbox has never been leased: it is as fresh as when it was made.
        Ok(())
    }
}

/// All warm pools of one service instance.
pub struct WarmPools<B: Backend> {
    backend: Arc<B>,
    min_idle: usize,
    max_size: usize,
    pools: Mutex<HashMap<String, WarmPool<B>>>,
    shutdown: arl_runtime::Shutdown,
}

/// One environment's pool, and whether a refill of it is under way.
struct WarmPool<B: Backend> {
    pool: Pool<SandboxMaker<B>>,
    refilling: Arc<AtomicBool>,
}

impl<B: Backend> Clone for WarmPool<B> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            refilling: self.refilling.clone(),
        }
    }
}

impl<B: Backend> WarmPools<B> {
    pub fn new(
        backend: Arc<B>,
        min_idle: usize,
        max_size: usize,
        shutdown: arl_runtime::Shutdown,
    ) -> Self {
        Self {
            backend,
            min_idle,
            max_size: max_size.max(1),
            pools: Mutex::default(),
            shutdown,
        }
    }

    fn pool(&self, name: &str, environment: &B::Environment) -> Result<WarmPool<B>, BackendError> {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pool) = pools.get(name) {
            return Ok(pool.clone());
        }
        let manager = SandboxMaker {
            backend: self.backend.clone(),
            environment: environment.clone(),
        };
        let pool = Pool::builder(manager)
            .max_size(self.max_size)
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .map_err(|e| BackendError::Prepare {
                environment: name.to_owned(),
                reason: e.to_string(),
            })?;
        let pool = WarmPool {
            pool,
            refilling: Arc::default(),
        };
        pools.insert(name.to_owned(), pool.clone());
        Ok(pool)
    }

    /// A prepared sandbox of `environment` (named `name`), and whether it came ready from
    /// the pool.
    pub async fn take(
        &self,
        name: &str,
        environment: &B::Environment,
    ) -> Result<(Prepared<B::Idle>, bool), BackendError> {
        let pool = self.pool(name, environment)?.pool;
        let warm = pool.status().available > 0;
        let object = pool.get().await.map_err(|err| match err {
            managed::PoolError::Backend(err) => err,
            other => BackendError::Prepare {
                environment: name.to_owned(),
                reason: other.to_string(),
            },
        })?;
        let prepared = Object::take(object);
        self.refill(name, environment);
        Ok((prepared, warm))
    }

    /// Brings the pool of `environment` up to `min_idle` prepared sandboxes, in the
    /// background, unless a refill of it is under way already.
    pub fn refill(&self, name: &str, environment: &B::Environment) {
        if self.min_idle == 0 {
            return;
        }
        let Ok(WarmPool { pool, refilling }) = self.pool(name, environment) else {
            return;
        };
        if refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let want = self.min_idle.min(self.max_size);
        let name = name.to_owned();
        self.shutdown.spawn(async move {
            // Holding `want` objects at once makes the pool create the missing ones;
            // dropping them returns all of them as idle. A slot not free at once (leases
            // are taking them) ends the refill: it must never wait on a slot, or it holds
            // what it has while the leases wait on it.
            let now = Timeouts {
                wait: Some(Duration::ZERO),
                ..Timeouts::new()
            };
            let mut held = Vec::with_capacity(want);
            while held.len() < want && pool.status().available < want {
                match pool.timeout_get(&now).await {
                    Ok(object) => held.push(object),
                    Err(managed::PoolError::Timeout(_)) => break,
                    Err(err) => {
                        tracing::warn!(environment = %name, %err, "cannot pre-warm a sandbox");
                        break;
                    }
                }
            }
            drop(held);
            refilling.store(false, Ordering::Release);
        });
    }

    /// Prepared sandboxes waiting, per environment.
    pub fn idle(&self) -> HashMap<String, usize> {
        let pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools
            .iter()
            .map(|(name, warm)| (name.clone(), warm.pool.status().available))
            .collect()
    }
}
