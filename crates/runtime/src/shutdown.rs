//! Graceful shutdown, in the tokio mini-redis manner: one token that every task watches,
//! and a tracker that `wait` blocks on until every spawned task has finished.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    token: CancellationToken,
    tasks: TaskTracker,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks every task to stop.
    pub fn trigger(&self) {
        self.token.cancel();
    }

    pub fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once shutdown has been asked for.
    pub async fn triggered(&self) {
        self.token.cancelled().await;
    }

    /// A token for code that wants to select on shutdown directly.
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Spawns a task that shutdown waits for. Services never use a bare `tokio::spawn`.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// Triggers shutdown when SIGINT or SIGTERM arrives.
    pub fn trigger_on_signals(&self) {
        let token = self.token.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = wait_for_signal() => {
                    tracing::info!("signal received, shutting down");
                    token.cancel();
                }
                () = token.cancelled() => {}
            }
        });
    }

    /// Waits until every spawned task has finished. Call after `trigger`.
    pub async fn wait(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}

async fn wait_for_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!(%err, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::error!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
