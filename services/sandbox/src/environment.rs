//! Environment snapshots: `<environments_dir>/<name>/tree/` is the work tree a sandbox
//! starts from; `<name>/environment.json` may say where it is mounted (`{"workdir":
//! "/testbed"}`, default `/app`), which read-only folders of the environments root appear
//! where inside (`"mounts": [{"source": "python/3.6.15", "target": "/opt/python"}]`: an
//! interpreter, a virtual environment), and extra environment variables (`"env"`). The
//! image builder writes them; the sandbox only reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arl_schemas::events::EnvironmentRef;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum EnvironmentError {
    #[error(
        "environment name {0:?} is invalid: use letters, digits, '.', '_', '-' and '/' separators, no '..'"
    )]
    BadName(String),
    #[error("environment {name} does not exist (no {path}); build it with the image builder first")]
    Missing { name: String, path: String },
    #[error(
        "environment {name} has no image here: start the sandbox service with --kube-registry \
         (images <registry>/<environment>:latest) or --kube-image {name}=IMAGE"
    )]
    NoImage { name: String },
    #[error("environment {name}: {path} is unreadable: {reason}")]
    BadMetadata {
        name: String,
        path: String,
        reason: String,
    },
}

/// A resolved environment snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Environment {
    pub name: String,
    pub tree: PathBuf,
    /// Absolute path of the work tree inside the sandbox.
    pub workdir: String,
    /// Read-only folders of the environments root and where they appear inside.
    pub mounts: Vec<(PathBuf, String)>,
    /// Variables every command of the environment gets (its `PATH`, `VIRTUAL_ENV`, …).
    pub env: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(default = "default_workdir")]
    workdir: String,
    #[serde(default)]
    mounts: Vec<MountSpec>,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct MountSpec {
    /// Relative to the environments root.
    source: String,
    /// Absolute path inside the sandbox.
    target: String,
}

fn default_workdir() -> String {
    "/app".into()
}

/// Checks an environment's name: letters, digits, `.`, `_`, `-` between `/` separators.
pub fn check_name(name: &str) -> Result<(), EnvironmentError> {
    let valid = !name.is_empty()
        && !name.starts_with('/')
        && name.split('/').all(|part| {
            !part.is_empty()
                && part != "."
                && part != ".."
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        });
    if valid {
        Ok(())
    } else {
        Err(EnvironmentError::BadName(name.to_owned()))
    }
}

/// The environment that is always there: an empty work folder with the machine's own
/// tools (`python3`, a shell) — what the MCP sandbox tools of a math trial run in.
pub const SCRATCH: &str = "scratch";

pub fn resolve(root: &Path, env: &EnvironmentRef) -> Result<Environment, EnvironmentError> {
    let name = env.name.as_str();
    check_name(name)?;
    let dir = root.join(name);
    let tree = dir.join("tree");
    if name == SCRATCH && !tree.is_dir() {
        std::fs::create_dir_all(&tree).map_err(|e| EnvironmentError::BadMetadata {
            name: name.to_owned(),
            path: tree.display().to_string(),
            reason: format!("cannot create the scratch environment: {e}"),
        })?;
    }
    if !tree.is_dir() {
        return Err(EnvironmentError::Missing {
            name: name.to_owned(),
            path: tree.display().to_string(),
        });
    }
    let metadata_path = dir.join("environment.json");
    let bad = |reason: String| EnvironmentError::BadMetadata {
        name: name.to_owned(),
        path: metadata_path.display().to_string(),
        reason,
    };
    let metadata = match std::fs::read(&metadata_path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|err| bad(err.to_string()))?,
        Err(_) => Metadata {
            workdir: default_workdir(),
            mounts: Vec::new(),
            env: BTreeMap::new(),
        },
    };
    let workdir = metadata.workdir;
    if !sane_target(&workdir) {
        return Err(bad(format!(
            "workdir {workdir:?} must be an absolute path outside system folders"
        )));
    }
    let mut mounts = Vec::with_capacity(metadata.mounts.len());
    for mount in metadata.mounts {
        let source = root.join(&mount.source);
        let inside_root = !mount.source.starts_with('/')
            && !mount.source.split('/').any(|p| p == "..")
            && source.is_dir();
        if !inside_root {
            return Err(bad(format!(
                "mount source {:?} must be an existing folder inside the environments root",
                mount.source
            )));
        }
        if !sane_target(&mount.target) || mount.target == workdir {
            return Err(bad(format!(
                "mount target {:?} must be an absolute path outside system folders and the work tree",
                mount.target
            )));
        }
        mounts.push((source, mount.target));
    }
    Ok(Environment {
        name: name.to_owned(),
        tree,
        workdir,
        mounts,
        env: metadata.env,
    })
}

/// An absolute path inside the sandbox that does not shadow a system folder.
fn sane_target(path: &str) -> bool {
    path.starts_with('/')
        && !path.split('/').any(|p| p == "..")
        && ![
            "/", "/proc", "/dev", "/usr", "/etc", "/run", "/tmp", "/bin", "/lib", "/lib64", "/sbin",
        ]
        .contains(&path.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> EnvironmentRef {
        EnvironmentRef {
            name: name.into(),
            digest: None,
        }
    }

    #[test]
    fn names_cannot_escape_the_root() {
        let root = std::env::temp_dir();
        for bad in ["", "/abs", "../x", "a/../b", "a//b", "a b"] {
            assert!(
                matches!(resolve(&root, &env(bad)), Err(EnvironmentError::BadName(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn workdir_defaults_and_is_checked() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("harbor/t1/tree")).unwrap();
        assert_eq!(
            resolve(root.path(), &env("harbor/t1")).unwrap().workdir,
            "/app"
        );
        std::fs::write(
            root.path().join("harbor/t1/environment.json"),
            r#"{"workdir":"/etc"}"#,
        )
        .unwrap();
        assert!(resolve(root.path(), &env("harbor/t1")).is_err());
        std::fs::write(
            root.path().join("harbor/t1/environment.json"),
            r#"{"workdir":"/testbed"}"#,
        )
        .unwrap();
        assert_eq!(
            resolve(root.path(), &env("harbor/t1")).unwrap().workdir,
            "/testbed"
        );
        assert!(matches!(
            resolve(root.path(), &env("nope")),
            Err(EnvironmentError::Missing { .. })
        ));
    }

    #[test]
    fn the_scratch_environment_is_always_there() {
        let root = tempfile::tempdir().unwrap();
        let scratch = resolve(root.path(), &env(SCRATCH)).unwrap();
        assert!(scratch.tree.is_dir());
        assert_eq!(scratch.workdir, "/app");
    }
}
