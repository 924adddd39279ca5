//! Identifiers of the domain. Run ids appear as a token of NATS subjects, so they are
//! restricted to characters that are safe there (no `.`, `*`, `>` or whitespace).

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} is {len} characters long; at most {max} are allowed")]
    TooLong {
        kind: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "{kind} {value:?} contains {bad:?}; only ASCII letters, digits, '-' and '_' are allowed"
    )]
    BadCharacter {
        kind: &'static str,
        value: String,
        bad: char,
    },
}

fn check_token(kind: &'static str, value: &str, max: usize) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > max {
        return Err(IdError::TooLong {
            kind,
            len: value.len(),
            max,
        });
    }
    if let Some(bad) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(IdError::BadCharacter {
            kind,
            value: value.to_owned(),
            bad,
        });
    }
    Ok(())
}

macro_rules! token_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                check_token($kind, &value, $max)?;
                Ok(Self(value))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// For ids written in this crate's examples, known to be valid.
            pub(crate) fn known(value: &str) -> Self {
                Self(value.to_owned())
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }
    };
}

token_id!(
    /// One training run, from `arl run submit` to completion. A token of NATS subjects.
    RunId, "run id", 64
);
token_id!(
    /// One attempt of an agent at one task: `n` trials of a task form a group.
    TrialId, "trial id", 128
);
token_id!(
    /// A sandbox lease handed out by the sandbox service.
    LeaseId, "lease id", 128
);

impl RunId {
    /// A fresh, time-ordered run id (`run-` + UUIDv7 without dashes).
    pub fn generate() -> Self {
        Self(format!("run-{}", uuid::Uuid::now_v7().simple()))
    }
}

impl LeaseId {
    pub fn generate() -> Self {
        Self(format!("lease-{}", uuid::Uuid::now_v7().simple()))
    }
}

/// A task of a dataset, e.g. a SWE-bench `instance_id` (`django__django-11880`). Task ids
/// never appear in subjects, so any non-empty string up to 256 characters is allowed.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
pub struct TaskId(String);

impl TaskId {
    pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
        let value = value.into();
        if value.is_empty() {
            return Err(IdError::Empty { kind: "task id" });
        }
        if value.len() > 256 {
            return Err(IdError::TooLong {
                kind: "task id",
                len: value.len(),
                max: 256,
            });
        }
        Ok(Self(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn known(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl TryFrom<String> for TaskId {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, IdError> {
        Self::new(value)
    }
}

impl From<TaskId> for String {
    fn from(id: TaskId) -> String {
        id.0
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_subject_safe() {
        assert!(RunId::new("run-1_a").is_ok());
        assert!(matches!(
            RunId::new("a.b"),
            Err(IdError::BadCharacter { bad: '.', .. })
        ));
        assert!(matches!(
            RunId::new("a*"),
            Err(IdError::BadCharacter { bad: '*', .. })
        ));
        assert!(matches!(RunId::new(""), Err(IdError::Empty { .. })));
        assert!(matches!(
            RunId::new("x".repeat(65)),
            Err(IdError::TooLong { .. })
        ));
        let generated = RunId::generate();
        assert!(RunId::new(generated.as_str()).is_ok());
    }

    #[test]
    fn ids_validate_when_decoded() {
        let err = serde_json::from_str::<RunId>("\"bad id\"").unwrap_err();
        assert!(err.to_string().contains("only ASCII letters"), "{err}");
    }
}
