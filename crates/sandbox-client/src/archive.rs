//! A POSIX ustar archive of text files, so that several files reach a sandbox in one
//! upload (`PUT /leases/{id}/tar`): each write is a process started in the sandbox, and a
//! grading that stages a verifier's tests and a patch one file at a time paid for each.

const BLOCK: usize = 512;

/// Why a file cannot go in an archive.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum ArchiveError {
    #[error(
        "{0:?}: a path in an archive must be relative, without `..`, and fit ustar's 255 bytes (at most 100 after its last usable `/`)"
    )]
    Path(String),
}

/// The archive of `files` (path relative to where it is unpacked, content), each a regular
/// file of mode 0644 owned by root, its folders created by `tar -x` as it unpacks.
pub fn ustar(files: &[(String, String)]) -> Result<Vec<u8>, ArchiveError> {
    let mut out = Vec::new();
    for (path, content) in files {
        let (prefix, name) = split_path(path).ok_or_else(|| ArchiveError::Path(path.clone()))?;
        out.extend_from_slice(&header(prefix, name, content.len()));
        out.extend_from_slice(content.as_bytes());
        out.resize(out.len().next_multiple_of(BLOCK), 0);
    }
    // The end of an archive: two zero blocks.
    out.resize(out.len() + 2 * BLOCK, 0);
    Ok(out)
}

/// ustar keeps a path as a prefix (≤ 155 bytes) and a name (≤ 100 bytes) joined by `/`.
fn split_path(path: &str) -> Option<(&str, &str)> {
    let usable = !path.is_empty()
        && !path.starts_with('/')
        && !path.contains('\0')
        && path.split('/').all(|part| part != "..")
        && !path.ends_with('/');
    if !usable {
        return None;
    }
    if path.len() <= 100 {
        return Some(("", path));
    }
    path.match_indices('/')
        .map(|(i, _)| (&path[..i], &path[i + 1..]))
        .find(|(prefix, name)| prefix.len() <= 155 && name.len() <= 100)
}

fn header(prefix: &str, name: &str, size: usize) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    put(&mut h, 0, name.as_bytes());
    put(&mut h, 100, b"0000644\0");
    put(&mut h, 108, b"0000000\0");
    put(&mut h, 116, b"0000000\0");
    put(&mut h, 124, format!("{size:011o}\0").as_bytes());
    put(&mut h, 136, b"00000000000\0");
    h[156] = b'0';
    put(&mut h, 257, b"ustar\0");
    put(&mut h, 263, b"00");
    put(&mut h, 345, prefix.as_bytes());
    // The checksum is summed with its own field read as spaces.
    put(&mut h, 148, b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    put(&mut h, 148, format!("{sum:06o}\0 ").as_bytes());
    h
}

fn put(block: &mut [u8; BLOCK], at: usize, bytes: &[u8]) {
    block[at..at + bytes.len()].copy_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn files(paths: &[&str]) -> Vec<(String, String)> {
        paths
            .iter()
            .enumerate()
            .map(|(i, p)| (p.to_string(), format!("file {i}\n").repeat(i * 70 + 1)))
            .collect()
    }

    #[test]
    fn gnu_tar_unpacks_every_file_with_its_content() {
        let long = format!("{}/{}", "d".repeat(150), "n".repeat(99));
        let files = files(&[
            ".arl-eval/x/tests/test.sh",
            "a/b/c/d.txt",
            "top.diff",
            &long,
            "empty",
        ]);
        let dir = std::env::temp_dir().join(format!("arl-ustar-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let archive = dir.join("a.tar");
        std::fs::write(&archive, ustar(&files).unwrap()).unwrap();
        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        let status = Command::new("tar")
            .arg("-C")
            .arg(&out)
            .arg("-xf")
            .arg(&archive)
            .arg("--no-same-owner")
            .status()
            .unwrap();
        assert!(status.success());
        for (path, content) in &files {
            assert_eq!(&std::fs::read_to_string(out.join(path)).unwrap(), content);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn paths_that_cannot_be_archived_are_refused_by_name() {
        for bad in ["", "/etc/passwd", "a/../b", "dir/", &"x".repeat(101)] {
            assert_eq!(
                ustar(&files(&[bad])),
                Err(ArchiveError::Path(bad.to_owned())),
                "{bad}"
            );
        }
        let too_long = format!("{}/{}", "d".repeat(156), "n".repeat(10));
        assert!(ustar(&files(&[&too_long])).is_err());
    }
}
