//! The `Event` trait every wire message implements, and the errors of decoding one.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::namespace::Namespace;

/// A versioned message on the bus.
///
/// `TYPE` and `VERSION` travel in the NATS headers (`Arl-Type`, `Arl-Version`) so that a
/// reader knows what it holds before it parses the body. `message_id` becomes
/// `Nats-Msg-Id`: publishing the same logical event twice stores it once.
pub trait Event: Serialize + DeserializeOwned + JsonSchema + Send + Sync + 'static {
    /// Dotted name of the event, `domain.event`, e.g. `run.requested`.
    const TYPE: &'static str;
    const VERSION: u32;
    /// The domain, and so the stream, the event is stored in.
    const DOMAIN: crate::Domain;

    fn subject(&self, ns: &Namespace) -> String;

    /// The subject filter that takes this event of every run: what a consumer of it
    /// subscribes to.
    fn filter(ns: &Namespace) -> String;

    /// A deterministic id of this logical event, used for de-duplication.
    fn message_id(&self) -> String;

    /// Decodes a body that claims to be this event type and version.
    fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let mut de = serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(&mut de).map_err(|err| {
            let path = err.path().to_string();
            DecodeError::Invalid {
                event: Self::TYPE,
                version: Self::VERSION,
                errors: vec![FieldError::new(
                    if path == "." { String::new() } else { path },
                    err.into_inner().to_string(),
                )],
            }
        })
    }

    fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

/// One problem with one field of an input: `path` is dotted (`rollout.n`), empty for the
/// whole document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FieldError {
    pub path: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "message is a {found_type} v{found_version}, expected {expected_type} v{expected_version}"
    )]
    WrongType {
        expected_type: &'static str,
        expected_version: u32,
        found_type: String,
        found_version: u32,
    },
    #[error("invalid {event} v{version}: {}", join(errors))]
    Invalid {
        event: &'static str,
        version: u32,
        errors: Vec<FieldError>,
    },
    #[error("{event_type} v{version} is newer than this build reads: upgrade the consumer")]
    UnknownVersion {
        event_type: &'static str,
        version: u32,
    },
}

impl DecodeError {
    /// The field errors, for a rejection event.
    pub fn field_errors(&self) -> Vec<FieldError> {
        match self {
            DecodeError::WrongType { .. } | DecodeError::UnknownVersion { .. } => {
                vec![FieldError::new("", self.to_string())]
            }
            DecodeError::Invalid { errors, .. } => errors.clone(),
        }
    }
}

fn join(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
