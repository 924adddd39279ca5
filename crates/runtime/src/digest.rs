//! SHA-256 as the services exchange it (lowercase hex): the trainer names each published
//! weights file by it and the engine checks the file against it, so both use this one
//! definition; recipe and dataset digests use it too.

use std::io::Read;
use std::path::Path;

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

/// Hex SHA-256 and size of a file, read in 1 MiB blocks.
pub fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    let mut file = std::fs::File::open(path)?;
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buffer = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        context.update(&buffer[..read]);
        size += read as u64;
    }
    Ok((hex(context.finish().as_ref()), size))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of bytes as they go by (an upload read from disk, a download written to it),
/// with their count.
#[derive(Clone)]
pub struct Sha256Stream {
    context: ring::digest::Context,
    size: u64,
}

impl std::fmt::Debug for Sha256Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sha256Stream")
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Default for Sha256Stream {
    fn default() -> Self {
        Self {
            context: ring::digest::Context::new(&ring::digest::SHA256),
            size: 0,
        }
    }
}

/// A finished [`Sha256Stream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamDigest {
    /// Lowercase hex, as services exchange it.
    pub sha256: String,
    /// As a JetStream object store records an object's digest: `SHA-256=<base64url>`.
    pub object_store: String,
    pub size: u64,
}

impl Sha256Stream {
    pub fn update(&mut self, bytes: &[u8]) {
        self.context.update(bytes);
        self.size += bytes.len() as u64;
    }

    /// Bytes seen so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn finish(self) -> StreamDigest {
        let digest = self.context.finish();
        StreamDigest {
            sha256: hex(digest.as_ref()),
            object_store: format!("SHA-256={}", base64url(digest.as_ref())),
            size: self.size,
        }
    }
}

/// RFC 4648 base64 with the URL-safe alphabet and padding (Go's `URLEncoding`, which the
/// NATS object store writes digests in).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let group = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(
                    ALPHABET[((group >> (18 - 6 * i)) & 63) as usize],
                ));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_bytes_digests_agree_with_the_known_vector() {
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_hex(b"abc"), abc);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"abc").unwrap();
        assert_eq!(
            sha256_file(&dir.path().join("f")).unwrap(),
            (abc.to_owned(), 3)
        );
        let mut stream = Sha256Stream::default();
        stream.update(b"a");
        stream.update(b"bc");
        let digest = stream.finish();
        assert_eq!((digest.sha256.as_str(), digest.size), (abc, 3));
        // Python: base64.urlsafe_b64encode(hashlib.sha256(b"abc").digest())
        assert_eq!(
            digest.object_store,
            "SHA-256=ungWv48Bz-pBQUDeXa4iI7ADYaOWF3qctBD_YfIAFa0="
        );
    }

    #[test]
    fn base64url_pads_like_go() {
        for (bytes, expected) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"\xfb\xff", "-_8="),
        ] {
            assert_eq!(base64url(bytes), expected, "{bytes:?}");
        }
    }
}
