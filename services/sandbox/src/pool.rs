//! Warm pools: per environment, a deadpool of prepared work trees, so a lease usually
//! takes a ready tree instead of copying a snapshot while its caller waits.
//!
//! A tree handed to a lease is detached from its pool (it becomes the lease's, and is
//! deleted with it), and the pool is refilled in the background to `min_idle`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use deadpool::managed::{self, Manager, Object, Pool, RecycleResult};

use crate::backend::{Backend, BackendError, PreparedTree};
use crate::environment::Environment;

pub struct TreeManager<B> {
    backend: Arc<B>,
    environment: Environment,
    warm_dir: PathBuf,
}

impl<B: Backend> Manager for TreeManager<B> {
    type Type = PreparedTree;
    type Error = BackendError;

    async fn create(&self) -> Result<PreparedTree, BackendError> {
        let dir = self
            .warm_dir
            .join(uuid::Uuid::new_v4().simple().to_string());
        let prepared = match self.backend.prepare(&self.environment, &dir).await {
            Ok(base) => crate::disk::measure(&dir.join("tree"))
                .await
                .map(|(bytes, _)| (base, bytes))
                .map_err(|err| BackendError::Prepare {
                    environment: self.environment.name.clone(),
                    reason: format!("cannot measure the prepared tree: {err}"),
                }),
            Err(err) => Err(err),
        };
        match prepared {
            Ok((base, bytes)) => Ok(PreparedTree {
                dir,
                base,
                bytes,
                environment: self.environment.clone(),
            }),
            Err(err) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                Err(err)
            }
        }
    }

    async fn recycle(
        &self,
        _tree: &mut PreparedTree,
        _: &managed::Metrics,
    ) -> RecycleResult<BackendError> {
        // An idle tree has never been leased: it is as fresh as when it was made.
        Ok(())
    }
}

/// All warm pools of one service instance.
pub struct WarmPools<B: Backend> {
    backend: Arc<B>,
    warm_root: PathBuf,
    min_idle: usize,
    max_size: usize,
    pools: Mutex<HashMap<String, Pool<TreeManager<B>>>>,
    shutdown: arl_runtime::Shutdown,
}

impl<B: Backend> WarmPools<B> {
    pub fn new(
        backend: Arc<B>,
        warm_root: PathBuf,
        min_idle: usize,
        max_size: usize,
        shutdown: arl_runtime::Shutdown,
    ) -> Self {
        Self {
            backend,
            warm_root,
            min_idle,
            max_size: max_size.max(1),
            pools: Mutex::default(),
            shutdown,
        }
    }

    fn pool(&self, environment: &Environment) -> Result<Pool<TreeManager<B>>, BackendError> {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pool) = pools.get(&environment.name) {
            return Ok(pool.clone());
        }
        let slot = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, environment.name.as_bytes());
        let manager = TreeManager {
            backend: self.backend.clone(),
            environment: environment.clone(),
            warm_dir: self.warm_root.join(slot.simple().to_string()),
        };
        let pool = Pool::builder(manager)
            .max_size(self.max_size)
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .map_err(|e| BackendError::Prepare {
                environment: environment.name.clone(),
                reason: e.to_string(),
            })?;
        pools.insert(environment.name.clone(), pool.clone());
        Ok(pool)
    }

    /// A prepared tree of `environment`, and whether it came ready from the pool.
    pub async fn take(
        &self,
        environment: &Environment,
    ) -> Result<(PreparedTree, bool), BackendError> {
        let pool = self.pool(environment)?;
        let warm = pool.status().available > 0;
        let object = pool.get().await.map_err(|err| match err {
            managed::PoolError::Backend(err) => err,
            other => BackendError::Prepare {
                environment: environment.name.clone(),
                reason: other.to_string(),
            },
        })?;
        let tree = Object::take(object);
        self.refill(environment);
        Ok((tree, warm))
    }

    /// Brings the pool of `environment` up to `min_idle` prepared trees, in the background.
    pub fn refill(&self, environment: &Environment) {
        if self.min_idle == 0 {
            return;
        }
        let Ok(pool) = self.pool(environment) else {
            return;
        };
        let want = self.min_idle.min(self.max_size);
        let name = environment.name.clone();
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
                        tracing::warn!(environment = %name, %err, "cannot pre-warm a tree");
                        break;
                    }
                }
            }
            drop(held);
        });
    }

    /// Prepared trees waiting, per environment.
    pub fn idle(&self) -> HashMap<String, usize> {
        let pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools
            .iter()
            .map(|(name, pool)| (name.clone(), pool.status().available))
            .collect()
    }
}
