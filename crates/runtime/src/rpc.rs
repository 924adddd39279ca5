//! Request/reply over NATS core: typed requests with a deadline, and a serving loop with
//! bounded concurrency. Replies are [`arl_schemas::rpc::Reply`]: a malformed request gets
//! a `bad_request` answer, never silence.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arl_schemas::rpc::{Reply, RpcError, RpcErrorCode};
use async_nats::HeaderMap;
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tracing::Instrument;

use crate::{Bus, Shutdown};

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("nobody answers on {subject}; is the service running?")]
    NoResponders { subject: String },
    #[error("no answer on {subject} within {timeout:?}")]
    TimedOut { subject: String, timeout: Duration },
    #[error("request on {subject} failed: {reason}")]
    Transport { subject: String, reason: String },
    #[error("the answer on {subject} is not understood: {reason}")]
    BadReply { subject: String, reason: String },
    #[error(transparent)]
    Refused(#[from] RpcError),
}

impl Bus {
    /// Sends `request` and waits for the typed answer.
    pub async fn request<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        request: &Req,
        timeout: Duration,
    ) -> Result<Rep, RequestError> {
        let body = serde_json::to_vec(request).map_err(|err| RequestError::Transport {
            subject: subject.clone(),
            reason: err.to_string(),
        })?;
        let mut headers = HeaderMap::new();
        crate::telemetry::inject_context(&mut headers);
        // The client's own request timeout (10 s by default) must not cut this one short.
        let sent = self.client().send_request(
            subject.clone(),
            async_nats::Request::new()
                .headers(headers)
                .payload(body.into())
                .timeout(Some(timeout)),
        );
        let message = match tokio::time::timeout(timeout, sent).await {
            Err(_) => return Err(RequestError::TimedOut { subject, timeout }),
            Ok(Err(err)) => {
                return Err(match err.kind() {
                    async_nats::RequestErrorKind::NoResponders => {
                        RequestError::NoResponders { subject }
                    }
                    async_nats::RequestErrorKind::TimedOut => {
                        RequestError::TimedOut { subject, timeout }
                    }
                    _ => RequestError::Transport {
                        subject,
                        reason: err.to_string(),
                    },
                });
            }
            Ok(Ok(message)) => message,
        };
        match serde_json::from_slice::<Reply<Rep>>(&message.payload) {
            Ok(Reply::Ok(reply)) => Ok(reply),
            Ok(Reply::Error(err)) => Err(RequestError::Refused(err)),
            Err(err) => Err(RequestError::BadReply {
                subject,
                reason: err.to_string(),
            }),
        }
    }
}

/// Subscribes to `subject` and returns the loop that answers its requests until shutdown
/// (spawn it). The subscription exists when this returns, so no request sent afterwards
/// is missed. With a `queue_group`, replicas share the requests. At most `concurrency`
/// handlers run at once.
pub async fn serve<Req, Rep, H, Fut>(
    bus: Bus,
    subject: String,
    queue_group: Option<String>,
    concurrency: usize,
    handler: H,
    shutdown: Shutdown,
) -> Result<impl Future<Output = ()> + Send + 'static, RequestError>
where
    Req: DeserializeOwned + Send + 'static,
    Rep: Serialize + Send + 'static,
    H: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Rep, RpcError>> + Send + 'static,
{
    let transport = |err: async_nats::SubscribeError| RequestError::Transport {
        subject: subject.clone(),
        reason: err.to_string(),
    };
    let mut requests = match &queue_group {
        Some(group) => bus
            .client()
            .queue_subscribe(subject.clone(), group.clone())
            .await
            .map_err(transport)?,
        None => bus
            .client()
            .subscribe(subject.clone())
            .await
            .map_err(transport)?,
    };
    bus.client()
        .flush()
        .await
        .map_err(|err| RequestError::Transport {
            subject: subject.clone(),
            reason: err.to_string(),
        })?;
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    Ok(async move {
        loop {
            let message = tokio::select! {
                () = shutdown.triggered() => break,
                message = requests.next() => match message {
                    Some(message) => message,
                    None => break,
                },
            };
            let Some(reply_to) = message.reply.clone() else {
                tracing::warn!(subject = %message.subject, "request without a reply subject; ignored");
                continue;
            };
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let (bus, handler) = (bus.clone(), handler.clone());
            let span = tracing::info_span!("rpc", subject = %message.subject, otel.kind = "server");
            if let Some(headers) = message.headers.as_ref() {
                crate::telemetry::set_parent_from_headers(&span, headers);
            }
            shutdown.spawn(
                async move {
                    let reply = match serde_json::from_slice::<Req>(&message.payload) {
                        Ok(request) => match handler(request).await {
                            Ok(answer) => Reply::Ok(answer),
                            Err(err) => Reply::Error(err),
                        },
                        Err(err) => Reply::Error(RpcError::new(
                            RpcErrorCode::BadRequest,
                            format!("cannot decode the request: {err}"),
                        )),
                    };
                    match serde_json::to_vec(&reply) {
                        Ok(body) => {
                            if let Err(err) = bus.client().publish(reply_to, body.into()).await {
                                tracing::warn!(%err, "cannot send the reply");
                            }
                        }
                        Err(err) => tracing::error!(%err, "cannot encode the reply"),
                    }
                    drop(permit);
                }
                .instrument(span),
            );
        }
        let _ = requests.unsubscribe().await;
    })
}
