//! Which nats-server ARL can use: the oldest version it speaks to, and where `arl up` finds
//! the program it starts.
//!
//! ARL's streams use JetStream features of 2.10 (subject transforms in stream configs,
//! `max_msg_size` on object stores, consumer filters by several subjects); against an
//! older server — Debian bookworm's 2.9.10 is the common one — JetStream answers in shapes
//! the client cannot read, and every service would retry provisioning forever. So the
//! version is checked once connected, and an older server is refused with what to do.

use std::path::{Path, PathBuf};

/// The oldest nats-server ARL runs on.
pub const MIN_VERSION: Version = Version {
    major: 2,
    minor: 10,
    patch: 0,
};

/// A nats-server release, as it reports itself (`2.10.24`, `v2.9.10`, `2.11.0-RC.1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    /// Reads `major.minor[.patch]` with an optional leading `v` and any suffix after the
    /// patch (`-RC.1`, `-beta`) ignored; None when it is not a version.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts = text.splitn(3, '.');
        let number = |part: &str| -> Option<u32> {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        };
        let major = number(parts.next()?)?;
        let minor = number(parts.next()?)?;
        let patch = parts.next().map_or(Some(0), number)?;
        Some(Self {
            major,
            minor,
            patch,
        })
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why a server that reports `reported` (its INFO `version`) cannot be used; None when it
/// can.
pub fn problem(reported: &str) -> Option<String> {
    match Version::parse(reported) {
        Some(version) if version >= MIN_VERSION => None,
        Some(version) => Some(format!(
            "nats-server {version} is too old: ARL needs {MIN_VERSION} or newer"
        )),
        None => Some(format!(
            "the server reports version {reported:?}, which is not a nats-server version: \
             ARL needs nats-server {MIN_VERSION} or newer"
        )),
    }
}

/// The program `arl up` (and `arl dataset validate`'s private server) starts:
/// `ARL_NATS_SERVER` when set (whatever it names: a wrong one then fails with its own
/// error), else the copy `make deps` installs (`~/.cache/arl/tools/bin/nats-server`), else
/// `nats-server` on PATH. The version is checked once the server runs ([`problem`]).
pub fn find() -> PathBuf {
    if let Some(path) = std::env::var_os("ARL_NATS_SERVER").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    std::env::var_os("HOME")
        .map(|home| installed(Path::new(&home)))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// Where `make deps` puts nats-server under `home`.
fn installed(home: &Path) -> PathBuf {
    home.join(".cache/arl/tools/bin/nats-server")
}

/// What `program --version` reports (`nats-server: v2.10.24` → 2.10.24); None when it
/// cannot be run or says something else.
pub fn version_of(program: &Path) -> Option<Version> {
    let output = std::process::Command::new(program)
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    Version::parse(text.trim().rsplit(' ').next()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_as_servers_report_them() {
        let v = |major, minor, patch| Version {
            major,
            minor,
            patch,
        };
        assert_eq!(Version::parse("2.10.24"), Some(v(2, 10, 24)));
        assert_eq!(Version::parse("v2.9.10"), Some(v(2, 9, 10)));
        assert_eq!(Version::parse("2.11.0-RC.1"), Some(v(2, 11, 0)));
        assert_eq!(Version::parse("2.12"), Some(v(2, 12, 0)));
        assert_eq!(Version::parse(""), None);
        assert_eq!(Version::parse("latest"), None);
        // Numeric order, not text order: 2.9 is older than 2.10.
        assert!(v(2, 9, 10) < MIN_VERSION && MIN_VERSION < v(2, 10, 1));
    }

    #[test]
    fn old_and_unreadable_servers_are_refused_with_the_minimum() {
        assert_eq!(problem("2.10.0"), None);
        assert_eq!(problem("2.12.1"), None);
        let old = problem("2.9.10").unwrap();
        assert!(
            old.contains("2.9.10 is too old") && old.contains("2.10.0 or newer"),
            "{old}"
        );
        let odd = problem("").unwrap();
        assert!(odd.contains("not a nats-server version"), "{odd}");
    }

    #[test]
    fn the_installed_server_lies_under_the_cache() {
        assert_eq!(
            installed(Path::new("/home/u")),
            Path::new("/home/u/.cache/arl/tools/bin/nats-server")
        );
    }
}
