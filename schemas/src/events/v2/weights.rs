//! A new policy version, ready for engines to load, version 2: where its files are is a
//! typed location — a folder the trainer and the engine share (one machine, or a volume
//! mounted on both), or a JetStream object store any engine on the bus can read, each file
//! with its own digest. Version 1 carried a `file://` uri only; readers upgrade it on read
//! ([`WeightsPublishedV2::read`]).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::v1::{WeightsFormat, WeightsPublishedV1, example_run, example_time};
use crate::events::{Example, event};
use crate::namespace::ObjectStore;
use crate::{DecodeError, Event, FieldError, RunId};

/// The weights file of a version folder, the one [`WeightsPublishedV2::sha256`] names.
pub const WEIGHTS_FILE: &str = "model.safetensors";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WeightsPublishedV2 {
    pub run_id: RunId,
    pub policy_version: u64,
    pub step: u32,
    pub format: WeightsFormat,
    /// SHA-256 of the weights file (`model.safetensors`), hex: an engine checks it before
    /// it loads the version, wherever the files came from.
    pub sha256: String,
    /// Size of the weights file in bytes.
    pub size_bytes: u64,
    pub location: WeightsLocation,
    pub at: DateTime<Utc>,
}
event!(WeightsPublishedV2, weights, "published", 2, |e| format!(
    "weights.published:{}:{}",
    e.run_id, e.policy_version
));

/// Where a version's files are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WeightsLocation {
    /// A Hugging Face folder on a filesystem the engine reads too (what version 1's
    /// `file://` uri meant). Engines load only folders under their own weights folder.
    Folder {
        /// Absolute path of the version folder.
        path: String,
    },
    /// One object per file of the version folder in a JetStream object store
    /// (`ARL_WEIGHTS`); an engine downloads them into its own weights folder, checks each
    /// digest, and loads the copy.
    ObjectStore {
        /// The object store (bucket) name, `{PREFIX_}ARL_WEIGHTS`.
        bucket: String,
        /// Every file the engine needs, `model.safetensors` among them.
        files: Vec<WeightsObject>,
    },
}

/// One file of a version in the object store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WeightsObject {
    /// The file's name in the version folder (`config.json`): one path component.
    pub file: String,
    /// The object's name in the bucket, `<run_id>/<policy_version>/<file>`
    /// ([`ObjectStore::weights_object`]).
    pub object: String,
    /// SHA-256 of the file, hex.
    pub sha256: String,
    pub size_bytes: u64,
}

impl WeightsLocation {
    /// A uri for people and run status: `file:///…` for a folder,
    /// `nats-object-store://<bucket>/<run_id>/<version>/` for the object store.
    pub fn uri(&self, run_id: &RunId, policy_version: u64) -> String {
        match self {
            WeightsLocation::Folder { path } => format!("file://{path}"),
            WeightsLocation::ObjectStore { bucket, .. } => format!(
                "nats-object-store://{bucket}/{}",
                ObjectStore::weights_prefix(run_id, policy_version)
            ),
        }
    }
}

impl WeightsPublishedV2 {
    /// Decodes a `weights.published` body of `version` (from the `Arl-Version` header),
    /// upgrading version 1 to this one.
    pub fn read(version: u32, body: &[u8]) -> Result<Self, DecodeError> {
        match version {
            1 => Self::upgrade(WeightsPublishedV1::decode(body)?),
            2 => Self::decode(body),
            other => Err(DecodeError::UnknownVersion {
                event_type: Self::TYPE,
                version: other,
            }),
        }
    }

    /// Version 1 as version 2: its `file://` uri (or plain absolute path) is a folder.
    /// Version 1 never carried anything else; another scheme is refused.
    pub fn upgrade(v1: WeightsPublishedV1) -> Result<Self, DecodeError> {
        let path = match v1.uri.strip_prefix("file://") {
            Some(path) => path.to_owned(),
            None if v1.uri.starts_with('/') => v1.uri.clone(),
            None => {
                return Err(DecodeError::Invalid {
                    event: WeightsPublishedV1::TYPE,
                    version: WeightsPublishedV1::VERSION,
                    errors: vec![FieldError::new(
                        "uri",
                        format!(
                            "{:?} is not a file:// location, the only kind version 1 carries",
                            v1.uri
                        ),
                    )],
                });
            }
        };
        Ok(Self {
            run_id: v1.run_id,
            policy_version: v1.policy_version,
            step: v1.step,
            format: v1.format,
            sha256: v1.sha256,
            size_bytes: v1.size_bytes,
            location: WeightsLocation::Folder { path },
            at: v1.at,
        })
    }

    /// A uri for people and run status ([`WeightsLocation::uri`]).
    pub fn uri(&self) -> String {
        self.location.uri(&self.run_id, self.policy_version)
    }
}

impl Example for WeightsPublishedV2 {
    fn example() -> Self {
        let run_id = example_run();
        let file = |name: &str, sha256: &str, size_bytes: u64| WeightsObject {
            file: name.into(),
            object: ObjectStore::weights_object(&run_id, 1, name),
            sha256: sha256.into(),
            size_bytes,
        };
        let weights_sha = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";
        Self {
            run_id: run_id.clone(),
            policy_version: 1,
            step: 1,
            format: WeightsFormat::HfSafetensors,
            sha256: weights_sha.into(),
            size_bytes: 538_090_408,
            location: WeightsLocation::ObjectStore {
                bucket: "ARL_WEIGHTS".into(),
                files: vec![
                    file(
                        "config.json",
                        "b5bb9d8014a0f9b1d61e21e796d78dccdf1352f23cd32812f4850b878ae4944c",
                        861,
                    ),
                    file(
                        "generation_config.json",
                        "7d865e959b2466918c9863afca942d0fb89d7c9ac0c99bafc3749504ded97730",
                        20,
                    ),
                    file(WEIGHTS_FILE, weights_sha, 538_090_408),
                    file(
                        "tokenizer.json",
                        "bf07a7fbb825fc0aae7bf4a1177b2b31fcf8a3feeaf7092761e18c859ee52a9c",
                        2_104_556,
                    ),
                    file(
                        "tokenizer_config.json",
                        "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03",
                        1_203,
                    ),
                ],
            },
            at: example_time(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_1_upgrades_to_a_folder() {
        let v1 = WeightsPublishedV1::example();
        let body = serde_json::to_vec(&v1).unwrap();
        let v2 = WeightsPublishedV2::read(1, &body).unwrap();
        assert_eq!(
            v2.location,
            WeightsLocation::Folder {
                path: "/home/ada/.cache/arl/runs/run-0193a1b2c3d4/step-1".into()
            }
        );
        assert_eq!(
            (
                v2.run_id,
                v2.policy_version,
                v2.step,
                v2.sha256,
                v2.size_bytes,
                v2.at
            ),
            (
                v1.run_id,
                v1.policy_version,
                v1.step,
                v1.sha256,
                v1.size_bytes,
                v1.at
            )
        );
        // The uri reads back as version 1 wrote it.
        let again = WeightsPublishedV2::upgrade(WeightsPublishedV1::example()).unwrap();
        assert_eq!(again.uri(), WeightsPublishedV1::example().uri);
    }

    #[test]
    fn version_1_with_a_plain_path_upgrades_and_another_scheme_is_refused() {
        let mut v1 = WeightsPublishedV1::example();
        v1.uri = "/srv/runs/run-1/step-000002".into();
        let upgraded = WeightsPublishedV2::upgrade(v1.clone()).unwrap();
        assert_eq!(
            upgraded.location,
            WeightsLocation::Folder {
                path: "/srv/runs/run-1/step-000002".into()
            }
        );
        v1.uri = "s3://bucket/run-1/step-000002".into();
        let error = WeightsPublishedV2::upgrade(v1).unwrap_err();
        assert_eq!(error.field_errors()[0].path, "uri");
        assert!(error.to_string().contains("s3://bucket"), "{error}");
    }

    #[test]
    fn an_unknown_version_is_named() {
        let error = WeightsPublishedV2::read(3, b"{}").map(|_| ());
        assert!(
            matches!(error, Err(DecodeError::UnknownVersion { version: 3, .. })),
            "{error:?}"
        );
    }

    #[test]
    fn object_store_uri_names_the_bucket_and_the_version() {
        let event = WeightsPublishedV2::example();
        assert_eq!(
            event.uri(),
            "nats-object-store://ARL_WEIGHTS/run-0193a1b2c3d4/1/"
        );
        let WeightsLocation::ObjectStore { files, .. } = &event.location else {
            panic!("the example is in the object store")
        };
        assert!(
            files
                .iter()
                .any(|f| f.file == WEIGHTS_FILE && f.sha256 == event.sha256)
        );
    }
}
