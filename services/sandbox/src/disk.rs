//! The work tree's disk limit.
//!
//! A lease may grow its work tree by its `disk_mb` beyond the environment's own files (the
//! semantics of a container's writable layer). Work trees share the host's file system
//! with the warm pool (a lease's tree is a prepared tree renamed into place, in
//! milliseconds), so a per-lease file system image with its own hard limit would cost a
//! copy into a loop device per lease and a loop device per sandbox, which most container
//! hosts do not hand out. Instead a watchdog measures each tree, as often as a fraction
//! of one core allows, and ends the lease once the tree is past its limit; between two
//! measurements a write is bounded by the per-file limit (`RLIMIT_FSIZE`, set to the
//! same `disk_mb` on every command) and by how fast the disk is.

use std::path::Path;
use std::time::{Duration, Instant};

/// Bytes of disk a tree holds, and how long measuring took: the allocated blocks of
/// everything under `root`, hard links counted once, links not followed, other file
/// systems not entered (`du -sx`). GNU du walks trees of any depth (a sandbox can nest
/// folders past `PATH_MAX`, which a walk by path cannot enter) and skips what vanishes
/// while it walks.
pub async fn measure(root: &Path) -> std::io::Result<(u64, Duration)> {
    let started = Instant::now();
    let output = tokio::process::Command::new("du")
        .args(["-s", "-x", "-B1", "--"])
        .arg(root)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await?;
    // du exits 1 when an entry vanished under it; its total still counts the rest.
    let bytes = String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "du {}: {}",
                root.display(),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        })?;
    Ok((bytes, started.elapsed()))
}

/// The pause before the next measurement: at least a second, and long enough that
/// measuring takes at most a twentieth of one core (a tree of a million files takes
/// seconds to walk).
pub fn next_check_in(last_walk: Duration) -> Duration {
    (last_walk * 20).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Why a lease's tree is over its limit, for the lease's holder; `None` while it is not.
pub fn over_limit(grown_bytes: u64, limit_mb: u64) -> Option<String> {
    let limit = limit_mb.saturating_mul(1024 * 1024);
    (grown_bytes > limit).then(|| {
        format!(
            "its work tree grew by {} MB, past the lease's disk limit of {limit_mb} MB \
             (ask for more with `limits.disk_mb`, or keep large files out of the tree)",
            grown_bytes.div_ceil(1024 * 1024)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn usage(dir: &Path) -> std::io::Result<u64> {
        Ok(measure(dir).await?.0)
    }

    #[tokio::test]
    async fn usage_counts_allocated_blocks_and_hard_links_once() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let empty = usage(dir.path()).await?;
        std::fs::write(dir.path().join("a"), vec![1u8; 1 << 20])?;
        let one = usage(dir.path()).await?;
        assert!(one >= empty + (1 << 20), "{empty} -> {one}");
        std::fs::hard_link(dir.path().join("a"), dir.path().join("b"))?;
        std::os::unix::fs::symlink("/usr", dir.path().join("usr"))?;
        let linked = usage(dir.path()).await?;
        assert!(linked < one + 64 * 1024, "{one} -> {linked}");
        // A sparse file holds only the blocks written.
        let sparse = std::fs::File::create(dir.path().join("sparse"))?;
        sparse.set_len(1 << 30)?;
        assert!(usage(dir.path()).await? < linked + 64 * 1024);
        Ok(())
    }

    #[tokio::test]
    async fn a_missing_tree_is_an_error() {
        let err = usage(Path::new("/nonexistent/arl-tree")).await;
        assert!(err.is_err(), "{err:?}");
    }

    #[test]
    fn over_limit_says_by_how_much_and_what_to_do() {
        assert_eq!(over_limit(1024 * 1024, 1), None);
        let why = over_limit(3 * 1024 * 1024 + 1, 2).unwrap_or_default();
        assert!(why.contains("grew by 4 MB"), "{why}");
        assert!(why.contains("disk limit of 2 MB"), "{why}");
        assert!(why.contains("limits.disk_mb"), "{why}");
        assert_eq!(
            next_check_in(Duration::from_millis(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            next_check_in(Duration::from_millis(500)),
            Duration::from_secs(10)
        );
    }
}
