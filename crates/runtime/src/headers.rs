//! NATS header names and the W3C trace context carried in them.

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector};

/// JetStream's de-duplication header.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The event type, e.g. `run.requested`.
pub const EVENT_TYPE: &str = "Arl-Type";
/// The event version, e.g. `1`.
pub const EVENT_VERSION: &str = "Arl-Version";
/// On a dead-lettered message: why the consumer gave up.
pub const DEAD_LETTER_REASON: &str = "Arl-Dead-Letter-Reason";
/// On a dead-lettered message: where it was first published.
pub const ORIGINAL_SUBJECT: &str = "Arl-Original-Subject";

pub(crate) struct HeaderInjector<'a>(pub &'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

pub(crate) struct HeaderExtractor<'a>(pub &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// The `Arl-Type` and `Arl-Version` of a message, if it has them.
pub fn event_type(headers: Option<&HeaderMap>) -> Option<(String, u32)> {
    let headers = headers?;
    let kind = headers.get(EVENT_TYPE)?.as_str().to_owned();
    let version = headers.get(EVENT_VERSION)?.as_str().parse().ok()?;
    Some((kind, version))
}

/// `traceparent` into an HTTP request's headers.
pub(crate) struct HttpInjector<'a>(pub &'a mut axum::http::HeaderMap);

impl Injector for HttpInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(key.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// `traceparent` out of an HTTP request's headers.
pub(crate) struct HttpExtractor<'a>(pub &'a axum::http::HeaderMap);

impl Extractor for HttpExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}
