//! The sandbox service: lease, renew and release over NATS; expiry; reaping what an
//! earlier instance left; lifecycle events.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::rpc::serve;
use arl_runtime::{Bus, Shutdown};
use arl_schemas::events::{
    EnvironmentRef, LeaseEnd, SandboxFailedV1, SandboxLeasedV1, SandboxReleasedV2,
};
use arl_schemas::rpc::{
    LeaseGrantV1, LeaseRequestV1, ReleaseRequest, ReleasedV1, RenewRequest, RenewedV1, RpcError,
    RpcErrorCode, SandboxOp,
};
use arl_schemas::{Event, LeaseId};
use chrono::Utc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::backend::{Activation, Backend, ExecOutput, ExecSpec};
use crate::bwrap::Bubblewrap;
use crate::config::SandboxConfig;
use crate::environment::EnvironmentError;
use crate::lease::{Lease, LeaseParts, LeaseRecord, LeaseTable};
use crate::pool::WarmPools;

pub(crate) struct Inner<B: Backend> {
    pub(crate) bus: Bus,
    pub(crate) config: SandboxConfig,
    pub(crate) backend: Arc<B>,
    pub(crate) pools: WarmPools<B>,
    pub(crate) leases: LeaseTable<B::Sandbox>,
    capacity: Arc<Semaphore>,
    shutdown: Shutdown,
}

/// A running sandbox service. Cheap to clone.
pub struct SandboxService<B: Backend = Bubblewrap> {
    pub(crate) inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for SandboxService<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("cannot prepare {path}: {source}")]
    StateDir {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot serve the exec API on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot answer lease requests: {0}")]
    Rpc(String),
}

impl SandboxService<Bubblewrap> {
    /// Starts the service with the bubblewrap backend: reaps leftovers, serves the exec
    /// API on `http_addr`, and answers lease requests until `shutdown`.
    pub async fn start_local(
        bus: Bus,
        config: SandboxConfig,
        http_addr: SocketAddr,
        shutdown: &Shutdown,
    ) -> Result<Self, StartError> {
        for dir in [
            config.state_dir.join("leases"),
            config.state_dir.join("warm"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| StartError::StateDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let backend = Arc::new(Bubblewrap::new(&config)?);
        Self::start_with(bus, config, backend, http_addr, shutdown).await
    }
}

impl<B: Backend> SandboxService<B> {
    /// Starts the service on `backend`: reaps what an earlier instance left, serves the
    /// exec API on `http_addr`, and answers lease requests until `shutdown`.
    pub async fn start_with(
        bus: Bus,
        mut config: SandboxConfig,
        backend: Arc<B>,
        http_addr: SocketAddr,
        shutdown: &Shutdown,
    ) -> Result<Self, StartError> {
        let listener = tokio::net::TcpListener::bind(http_addr)
            .await
            .map_err(|source| StartError::Http {
                addr: http_addr,
                source,
            })?;
        let bound = listener.local_addr().map_err(|source| StartError::Http {
            addr: http_addr,
            source,
        })?;
        if config.public_url.is_empty() {
            config.public_url = format!("http://{bound}");
        }
        let service = Self::assemble(bus, config, backend, shutdown);
        service.start(listener, bound).await?;
        Ok(service)
    }

    fn assemble(bus: Bus, config: SandboxConfig, backend: Arc<B>, shutdown: &Shutdown) -> Self {
        let pools = WarmPools::new(
            backend.clone(),
            config.pool_min_idle,
            config.pool_max_size,
            shutdown.clone(),
        );
        let capacity = Arc::new(Semaphore::new(config.max_leases));
        Self {
            inner: Arc::new(Inner {
                bus,
                config,
                backend,
                pools,
                leases: LeaseTable::default(),
                capacity,
                shutdown: shutdown.clone(),
            }),
        }
    }

    pub fn public_url(&self) -> &str {
        &self.inner.config.public_url
    }

    pub fn instance(&self) -> &str {
        &self.inner.config.instance
    }

    pub fn active_leases(&self) -> usize {
        self.inner.leases.len()
    }

    /// Prepared sandboxes waiting per environment.
    pub fn idle_sandboxes(&self) -> std::collections::HashMap<String, usize> {
        self.inner.pools.idle()
    }

    /// Starts pre-warming an environment's pool (e.g. when a run's tasks are known).
    pub fn prewarm(&self, environment: &EnvironmentRef) -> Result<(), EnvironmentError> {
        let resolved = self.inner.backend.resolve(environment)?;
        self.inner.pools.refill(&environment.name, &resolved);
        Ok(())
    }

    async fn start(
        &self,
        listener: tokio::net::TcpListener,
        addr: SocketAddr,
    ) -> Result<(), StartError> {
        self.reap_leftovers().await;
        let shutdown = self.inner.shutdown.clone();

        let router = crate::api::router(self.clone()).merge(arl_runtime::http::ops_router(
            "sandbox",
            self.inner.bus.clone(),
            self.inner.bus.metrics().clone(),
            arl_runtime::http::Readiness::always(),
        ));
        arl_runtime::http::serve_listener(listener, router, &shutdown)
            .map_err(|source| StartError::Http { addr, source })?;

        let ns = self.inner.bus.namespace().clone();
        let instance = self.inner.config.instance.clone();
        let service = self.clone();
        self.answer(
            ns.sandbox_rpc("any", SandboxOp::Lease),
            Some("sandbox".into()),
            move |req: LeaseRequestV1| {
                let service = service.clone();
                async move { service.lease(req).await }
            },
        )
        .await?;
        let service = self.clone();
        self.answer(
            ns.sandbox_rpc(&instance, SandboxOp::Renew),
            None,
            move |req: RenewRequest| {
                let service = service.clone();
                async move { service.renew(req) }
            },
        )
        .await?;
        let service = self.clone();
        self.answer(
            ns.sandbox_rpc(&instance, SandboxOp::Release),
            None,
            move |req: ReleaseRequest| {
                let service = service.clone();
                async move { service.release_on_request(req).await }
            },
        )
        .await?;

        let service = self.clone();
        shutdown.spawn(async move { service.expire_leases().await });
        tracing::info!(instance = %self.inner.config.instance, url = %self.inner.config.public_url, "sandbox service ready");
        Ok(())
    }

    /// Subscribes (before returning) and answers requests on a task.
    async fn answer<Req, Rep, H, Fut>(
        &self,
        subject: String,
        group: Option<String>,
        handler: H,
    ) -> Result<(), StartError>
    where
        Req: serde::de::DeserializeOwned + Send + 'static,
        Rep: serde::Serialize + Send + 'static,
        H: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Rep, RpcError>> + Send + 'static,
    {
        let (bus, shutdown) = (self.inner.bus.clone(), self.inner.shutdown.clone());
        let answering = serve(bus, subject, group, 64, handler, shutdown)
            .await
            .map_err(|e| StartError::Rpc(e.to_string()))?;
        self.inner.shutdown.spawn(answering);
        Ok(())
    }

    /// Grants a lease: a work tree (warm if possible), limits, a token.
    pub async fn lease(&self, request: LeaseRequestV1) -> Result<LeaseGrantV1, RpcError> {
        let config = &self.inner.config;
        if request.ttl_s == 0 || request.ttl_s > config.max_ttl.as_secs() {
            return Err(RpcError::new(
                RpcErrorCode::BadRequest,
                format!(
                    "ttl_s must be between 1 and {}, got {}",
                    config.max_ttl.as_secs(),
                    request.ttl_s
                ),
            ));
        }
        let environment = self
            .inner
            .backend
            .resolve(&request.environment)
            .map_err(|err| {
                let code = match err {
                    EnvironmentError::Missing { .. } | EnvironmentError::NoImage { .. } => {
                        RpcErrorCode::NotFound
                    }
                    _ => RpcErrorCode::BadRequest,
                };
                RpcError::new(code, err.to_string())
            })?;
        let permit = self
            .inner
            .capacity
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                RpcError::new(
                    RpcErrorCode::Busy,
                    format!(
                        "all {} leases of instance {} are in use; retry later",
                        config.max_leases, config.instance
                    ),
                )
            })?;
        let lease_id = LeaseId::generate();
        let limits = config.default_limits.merge(&request.limits);
        let failed = |message: String| {
            let event = SandboxFailedV1 {
                run_id: request.run_id.clone(),
                lease_id: Some(lease_id.clone()),
                trial_id: request.trial_id.clone(),
                environment: request.environment.clone(),
                message: message.clone(),
                at: Utc::now(),
            };
            (event, RpcError::new(RpcErrorCode::Internal, message))
        };

        let name = request.environment.name.as_str();
        let (prepared, warm) = match self.inner.pools.take(name, &environment).await {
            Ok(taken) => taken,
            Err(err) => {
                let (event, error) = failed(err.to_string());
                self.announce(&event).await;
                return Err(error);
            }
        };
        let record = LeaseRecord {
            lease_id: lease_id.clone(),
            run_id: request.run_id.clone(),
            instance: config.instance.clone(),
            environment: name.to_owned(),
            created_at: Utc::now(),
        };
        let (base, workdir) = (prepared.base.clone(), prepared.workdir.clone());
        let ended = CancellationToken::new();
        let activation = Activation {
            record: &record,
            limits: &limits,
            ended: ended.clone(),
        };
        let sandbox = match self.inner.backend.activate(prepared, activation).await {
            Ok(sandbox) => sandbox,
            Err(err) => {
                let (event, error) = failed(err.to_string());
                self.announce(&event).await;
                return Err(error);
            }
        };
        let expires_at = Utc::now() + chrono::Duration::seconds(request.ttl_s as i64);
        let parts = LeaseParts {
            record,
            trial_id: request.trial_id.clone(),
            base,
            workdir,
            sandbox,
            ended,
        };
        let lease = Arc::new(Lease::new(parts, expires_at, permit));
        self.inner.leases.insert(lease.clone());
        let (service, watched) = (self.clone(), lease.clone());
        self.inner
            .shutdown
            .spawn(async move { service.watch(watched).await });
        let endpoint = format!("{}/leases/{lease_id}", config.public_url);
        self.announce(&SandboxLeasedV1 {
            run_id: request.run_id.clone(),
            lease_id: lease_id.clone(),
            trial_id: request.trial_id.clone(),
            environment: request.environment.clone(),
            backend: self.inner.backend.kind(),
            endpoint: endpoint.clone(),
            expires_at,
            warm,
        })
        .await;
        Ok(LeaseGrantV1 {
            lease_id,
            instance: config.instance.clone(),
            endpoint,
            token: lease.token.clone(),
            workdir: lease.workdir.clone(),
            proxy_url: config.proxy_url(),
            expires_at,
            warm,
        })
    }

    /// Extends a lease, for whoever holds its token.
    pub fn renew(&self, request: RenewRequest) -> Result<RenewedV1, RpcError> {
        let request = match request {
            RenewRequest::V2(request) => request,
            RenewRequest::V1(_) => return Err(token_required("renew", "RenewRequestV2")),
        };
        let max = self.inner.config.max_ttl.as_secs();
        if request.ttl_s == 0 || request.ttl_s > max {
            return Err(RpcError::new(
                RpcErrorCode::BadRequest,
                format!("ttl_s must be between 1 and {max}"),
            ));
        }
        let lease = self.holder_of(&request.lease_id, &request.token)?;
        let expires_at = Utc::now() + chrono::Duration::seconds(request.ttl_s as i64);
        lease.extend_to(expires_at);
        Ok(RenewedV1 {
            lease_id: request.lease_id,
            expires_at,
        })
    }

    /// Ends a lease for whoever holds its token.
    async fn release_on_request(&self, request: ReleaseRequest) -> Result<ReleasedV1, RpcError> {
        let request = match request {
            ReleaseRequest::V2(request) => request,
            ReleaseRequest::V1(_) => return Err(token_required("release", "ReleaseRequestV2")),
        };
        self.holder_of(&request.lease_id, &request.token)?;
        self.release(request.lease_id.clone(), LeaseEnd::Released, None)
            .await?;
        Ok(ReleasedV1 {
            lease_id: request.lease_id,
        })
    }

    /// The lease, when `token` is its own.
    fn holder_of(
        &self,
        lease_id: &LeaseId,
        token: &str,
    ) -> Result<Arc<Lease<B::Sandbox>>, RpcError> {
        let lease = self
            .inner
            .leases
            .get(lease_id)
            .ok_or_else(|| not_found(lease_id))?;
        if !lease.token_is(token) {
            return Err(RpcError::new(
                RpcErrorCode::Unauthorized,
                format!("wrong token for lease {lease_id}; use the token of its lease grant"),
            ));
        }
        Ok(lease)
    }

    /// Ends a lease: kills what runs in it, deletes its files, and says so. `detail` says
    /// why when the service ends it itself; the holder's next call is told.
    pub async fn release(
        &self,
        lease_id: LeaseId,
        reason: LeaseEnd,
        detail: Option<String>,
    ) -> Result<(), RpcError> {
        let lease = self
            .inner
            .leases
            .remove(&lease_id)
            .ok_or_else(|| not_found(&lease_id))?;
        if let Some(why) = &detail {
            self.inner
                .leases
                .remember_end(lease_id.clone(), why.clone());
        }
        lease.ended.cancel();
        self.inner.backend.destroy(&lease.sandbox).await;
        self.announce(&SandboxReleasedV2 {
            run_id: lease.record.run_id.clone(),
            lease_id,
            trial_id: lease.trial_id.clone(),
            reason,
            detail,
            at: Utc::now(),
        })
        .await;
        Ok(())
    }

    /// Ends the lease early when its backend says it must (a work tree past its disk
    /// limit).
    async fn watch(&self, lease: Arc<Lease<B::Sandbox>>) {
        let shutdown = self.inner.shutdown.clone();
        let (reason, why) = tokio::select! {
            () = lease.ended.cancelled() => return,
            () = shutdown.triggered() => return,
            ended = self.inner.backend.watch(&lease.sandbox) => ended,
        };
        let lease_id = lease.id().clone();
        drop(lease);
        tracing::warn!(lease = %lease_id, %why, "ending a lease early");
        let _ = self.release(lease_id, reason, Some(why)).await;
    }

    /// Runs a command in a lease's sandbox.
    pub async fn exec(
        &self,
        lease: &Lease<B::Sandbox>,
        spec: ExecSpec,
    ) -> Result<ExecOutput, RpcError> {
        self.inner
            .backend
            .exec(&lease.sandbox, spec)
            .await
            .map_err(|err| RpcError::new(RpcErrorCode::Internal, err.to_string()))
    }

    async fn expire_leases(&self) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            tokio::select! {
                () = shutdown.triggered() => break,
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
            for lease_id in self.inner.leases.expired(Utc::now()) {
                tracing::info!(lease = %lease_id, "lease expired");
                let _ = self.release(lease_id, LeaseEnd::Expired, None).await;
            }
        }
        // Leases die with the service; a restarted one would reap them anyway.
        for lease_id in self.inner.leases.ids() {
            let _ = self.release(lease_id, LeaseEnd::Reaped, None).await;
        }
        self.inner.backend.wind_down().await;
    }

    /// Destroys the leases and prepared sandboxes an earlier instance left, and says so.
    async fn reap_leftovers(&self) {
        let records = self.inner.backend.reap_leftovers().await;
        if !records.is_empty() {
            tracing::warn!(
                reaped = records.len(),
                "reaped leases left by an earlier instance"
            );
        }
        for record in records {
            self.announce(&SandboxReleasedV2 {
                run_id: record.run_id,
                lease_id: record.lease_id,
                trial_id: None,
                reason: LeaseEnd::Reaped,
                detail: None,
                at: Utc::now(),
            })
            .await;
        }
    }

    async fn announce<E: Event>(&self, event: &E) {
        // Lifecycle events are for observers; a lease does not fail because one is late.
        if let Err(err) = self.inner.bus.publish(event).await {
            tracing::warn!(event = E::TYPE, %err, "cannot publish a sandbox event");
        }
    }
}

/// The refusal of a request version that carries no lease token.
fn token_required(op: &str, version: &str) -> RpcError {
    RpcError::new(
        RpcErrorCode::BadRequest,
        format!(
            "{op} needs the lease's token: send a {version} with the `token` of the lease grant"
        ),
    )
}

fn not_found(lease_id: &LeaseId) -> RpcError {
    RpcError::new(
        RpcErrorCode::NotFound,
        format!("no lease {lease_id} on this instance (expired or released?)"),
    )
}
