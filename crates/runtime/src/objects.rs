//! Files in JetStream object stores, and the policy versions kept in `ARL_WEIGHTS`.
//!
//! A file goes up and comes down as a stream of chunks (128 KiB each, well under the
//! server's `max_payload`; the object store's stream has no message-size limit of its
//! own), never whole in memory, so a version of hundreds of megabytes costs a buffer.
//! Every transfer is checked against SHA-256 and size: an upload against the object the
//! server then records, a download against the digest the publisher announced — an object
//! that does not hold what was published is refused, and says so
//! ([`ObjectError::is_permanent`]).

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use arl_schemas::events::{WeightsLocation, WeightsObject};
use arl_schemas::{ObjectStore, RunId};
use async_nats::jetstream::object_store;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};

use crate::Bus;
use crate::digest::Sha256Stream;

/// What a stored file holds: its digest and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredFile {
    /// SHA-256, lowercase hex.
    pub sha256: String,
    pub size_bytes: u64,
}

/// Why a file could not be stored in or fetched from an object store.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object {name} is not in {store} (deleted, or never stored)")]
    Missing { store: String, name: String },
    #[error(
        "object {name} of {store} holds {found} bytes, not {expected}: it is not the file that was published (tampered with, or replaced)"
    )]
    WrongSize {
        store: String,
        name: String,
        /// What was found (at least; a download stops once it is too long).
        found: u64,
        expected: u64,
    },
    #[error(
        "object {name} of {store} has sha256 {found}, not {expected}: it is not the file that was published (tampered with, or replaced)"
    )]
    WrongDigest {
        store: String,
        name: String,
        found: String,
        expected: String,
    },
    #[error(
        "object {name} of {store} is corrupt: its chunks do not match the digest it was stored with"
    )]
    Corrupt { store: String, name: String },
    #[error("object {name} of {store}: {reason}")]
    Bus {
        store: String,
        name: String,
        reason: String,
    },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ObjectError {
    /// True when trying again cannot help: the object is gone, or is not what was
    /// published. Bus and disk trouble are transient.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            ObjectError::Missing { .. }
                | ObjectError::WrongSize { .. }
                | ObjectError::WrongDigest { .. }
                | ObjectError::Corrupt { .. }
        )
    }
}

/// Which object an error is about.
struct ObjectAt {
    store: String,
    name: String,
}

impl ObjectAt {
    fn bus(&self, reason: String) -> ObjectError {
        ObjectError::Bus {
            store: self.store.clone(),
            name: self.name.clone(),
            reason,
        }
    }
}

impl Bus {
    /// The object store `store`, and the object `name` for the errors of what follows.
    async fn open_objects(
        &self,
        store: ObjectStore,
        name: &str,
    ) -> Result<(object_store::ObjectStore, ObjectAt), ObjectError> {
        let at = ObjectAt {
            store: self.namespace().object_store(store),
            name: name.to_owned(),
        };
        match self.object_store(store).await {
            Ok(objects) => Ok((objects, at)),
            Err(err) => Err(at.bus(err.to_string())),
        }
    }

    /// Stores the file at `path` as object `name` (replacing an object of that name), read
    /// as a stream; then checks that the object the server records has the digest and size
    /// of the bytes read.
    pub async fn put_file(
        &self,
        store: ObjectStore,
        name: &str,
        path: &Path,
    ) -> Result<StoredFile, ObjectError> {
        let (objects, at) = self.open_objects(store, name).await?;
        let (store_name, bus_error) = (at.store.clone(), |reason| at.bus(reason));
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|source| ObjectError::File {
                path: path.to_path_buf(),
                source,
            })?;
        let mut reader = Hashing {
            inner: file,
            digest: Sha256Stream::default(),
        };
        let put = objects
            .put(name, &mut reader)
            .await
            .map_err(|e| bus_error(format!("upload failed: {e}")))?;
        let sent = reader.digest.finish();
        // What the server now serves under the name: this upload, whole.
        let stored = objects
            .info(name)
            .await
            .map_err(|e| bus_error(format!("reading back its info: {e}")))?;
        if stored.nuid != put.nuid || stored.deleted {
            return Err(bus_error(
                "another upload replaced it while it was being stored".into(),
            ));
        }
        if stored.size as u64 != sent.size {
            return Err(ObjectError::WrongSize {
                store: store_name,
                name: name.to_owned(),
                found: stored.size as u64,
                expected: sent.size,
            });
        }
        if stored.digest.as_deref() != Some(sent.object_store.as_str()) {
            return Err(ObjectError::WrongDigest {
                store: store_name,
                name: name.to_owned(),
                found: stored.digest.unwrap_or_default(),
                expected: sent.object_store,
            });
        }
        Ok(StoredFile {
            sha256: sent.sha256,
            size_bytes: sent.size,
        })
    }

    /// Writes object `name` to `dest` as it arrives, and checks it is `expected`: a wrong
    /// size is refused before (or as soon as) it shows, a wrong digest at the end. `dest`
    /// may be left part-written on error; the caller writes into a folder of its own.
    pub async fn get_file(
        &self,
        store: ObjectStore,
        name: &str,
        dest: &Path,
        expected: &StoredFile,
    ) -> Result<(), ObjectError> {
        let (objects, at) = self.open_objects(store, name).await?;
        let (store_name, bus_error) = (at.store.clone(), |reason| at.bus(reason));
        let wrong_size = |found: u64| ObjectError::WrongSize {
            store: store_name.clone(),
            name: name.to_owned(),
            found,
            expected: expected.size_bytes,
        };
        let mut object = match objects.get(name).await {
            Ok(object) => object,
            Err(err) if err.kind() == object_store::GetErrorKind::NotFound => {
                return Err(ObjectError::Missing {
                    store: store_name,
                    name: name.to_owned(),
                });
            }
            Err(err) => return Err(bus_error(err.to_string())),
        };
        if object.info().size as u64 != expected.size_bytes {
            return Err(wrong_size(object.info().size as u64));
        }
        let file_error = |source| ObjectError::File {
            path: dest.to_path_buf(),
            source,
        };
        let mut file = tokio::fs::File::create(dest).await.map_err(file_error)?;
        let mut digest = Sha256Stream::default();
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            let read = object.read(&mut buffer).await.map_err(|e| {
                // The client checks the chunks against the digest the object was stored
                // with, and fails the last read when they differ.
                if e.kind() == std::io::ErrorKind::InvalidData {
                    ObjectError::Corrupt {
                        store: store_name.clone(),
                        name: name.to_owned(),
                    }
                } else {
                    bus_error(format!("download failed: {e}"))
                }
            })?;
            if read == 0 {
                break;
            }
            let bytes = &buffer[..read];
            digest.update(bytes);
            if digest.size() > expected.size_bytes {
                return Err(wrong_size(digest.size()));
            }
            file.write_all(bytes).await.map_err(file_error)?;
        }
        file.sync_all().await.map_err(file_error)?;
        let found = digest.finish();
        if found.size != expected.size_bytes {
            return Err(wrong_size(found.size));
        }
        if found.sha256 != expected.sha256 {
            return Err(ObjectError::WrongDigest {
                store: store_name,
                name: name.to_owned(),
                found: found.sha256,
                expected: expected.sha256.clone(),
            });
        }
        Ok(())
    }

    /// Deletes object `name`; false when there was none.
    pub async fn delete_object(&self, store: ObjectStore, name: &str) -> Result<bool, ObjectError> {
        let (objects, at) = self.open_objects(store, name).await?;
        let bus_error = |reason| at.bus(reason);
        match objects.info(name).await {
            Ok(info) if info.deleted => return Ok(false),
            Ok(_) => {}
            Err(err) if err.kind() == object_store::InfoErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(bus_error(err.to_string())),
        }
        objects
            .delete(name)
            .await
            .map_err(|e| bus_error(format!("delete failed: {e}")))?;
        Ok(true)
    }

    /// Uploads `files` of the version folder `dir` to `ARL_WEIGHTS` as
    /// `<run_id>/<policy_version>/<file>`, each checked; returns the location a
    /// `weights.published` names. Any failure fails the whole version: no location is
    /// returned for files an engine could not fetch.
    pub async fn put_weights(
        &self,
        run_id: &RunId,
        policy_version: u64,
        dir: &Path,
        files: &[String],
    ) -> Result<WeightsLocation, ObjectError> {
        let mut objects = Vec::with_capacity(files.len());
        for file in files {
            let object = ObjectStore::weights_object(run_id, policy_version, file);
            let stored = self
                .put_file(ObjectStore::Weights, &object, &dir.join(file))
                .await?;
            objects.push(WeightsObject {
                file: file.clone(),
                object,
                sha256: stored.sha256,
                size_bytes: stored.size_bytes,
            });
        }
        Ok(WeightsLocation::ObjectStore {
            bucket: self.namespace().object_store(ObjectStore::Weights),
            files: objects,
        })
    }

    /// Deletes the objects of `files` of a policy version from `ARL_WEIGHTS` (those that
    /// are there); returns how many were deleted.
    pub async fn delete_weights(
        &self,
        run_id: &RunId,
        policy_version: u64,
        files: &[String],
    ) -> Result<usize, ObjectError> {
        let mut deleted = 0;
        for file in files {
            let object = ObjectStore::weights_object(run_id, policy_version, file);
            if self.delete_object(ObjectStore::Weights, &object).await? {
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

/// A reader that hashes what passes through it.
struct Hashing<R> {
    inner: R,
    digest: Sha256Stream,
}

impl<R: AsyncRead + Unpin> AsyncRead for Hashing<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &polled {
            this.digest.update(&buf.filled()[before..]);
        }
        polled
    }
}
