//! Warm pools: per environment, a deadpool of prepared sandboxes, so a lease usually takes
//! a ready one instead of waiting while a snapshot is copied or a Pod starts.
//!
//! A sandbox handed to a lease is detached from its pool (it becomes the lease's, and is
//! deleted with it), and the pool is refilled in the background to `min_idle`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use deadpool::managed::{self, Manager, Object, Pool, RecycleResult};

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
    pools: Mutex<HashMap<String, Pool<SandboxMaker<B>>>>,
    shutdown: arl_runtime::Shutdown,
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

    fn pool(
        &self,
        name: &str,
        environment: &B::Environment,
    ) -> Result<Pool<SandboxMaker<B>>, BackendError> {
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
        let pool = self.pool(name, environment)?;
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
    /// background.
    pub fn refill(&self, name: &str, environment: &B::Environment) {
        if self.min_idle == 0 {
            return;
        }
        let Ok(pool) = self.pool(name, environment) else {
            return;
        };
        let want = self.min_idle.min(self.max_size);
        let name = name.to_owned();
        self.shutdown.spawn(async move {
            let status = pool.status();
            if status.available >= want {
                return;
            }
            // Holding `want` objects at once forces the pool to make the missing ones;
            // dropping them returns all of them as idle.
            let mut held = Vec::with_capacity(want);
            for _ in 0..want {
                match pool.get().await {
                    Ok(object) => held.push(object),
                    Err(err) => {
                        tracing::warn!(environment = %name, %err, "cannot pre-warm a sandbox");
                        break;
                    }
                }
            }
            drop(held);
        });
    }

    /// Prepared sandboxes waiting, per environment.
    pub fn idle(&self) -> HashMap<String, usize> {
        let pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools
            .iter()
            .map(|(name, pool)| (name.clone(), pool.status().available))
            .collect()
    }
}
