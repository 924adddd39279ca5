//! A nats-server configuration of least privilege: one NKey user per service (and one for
//! the CLI) with the permissions `arl_schemas::permissions` gives its role. The seeds go
//! to `<dir>/<role>.nk` (mode 0600); the configuration holds only public keys.

use std::path::{Path, PathBuf};

use arl_schemas::Namespace;
use arl_schemas::permissions::Role;

/// What was written: the configuration file and each role's seed file.
pub struct Written {
    pub config: PathBuf,
    pub dir: PathBuf,
}

impl Written {
    pub fn seed(&self, role: Role) -> PathBuf {
        self.dir.join(format!("{}.nk", role.name()))
    }
}

fn quoted(subjects: &[String]) -> String {
    subjects
        .iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes the configuration and fresh seeds into `dir`.
pub fn write(dir: &Path, ns: &Namespace) -> std::io::Result<Written> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let mut users = String::new();
    for role in Role::ALL {
        let key = nkeys::KeyPair::new_user();
        let seed = key
            .seed()
            .map_err(|e| std::io::Error::other(format!("an NKey seed: {e}")))?;
        let file = dir.join(format!("{}.nk", role.name()));
        std::fs::write(&file, seed)?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
        let permissions = ns.permissions(role);
        users.push_str(&format!(
            "    # {role}\n    {{ nkey: \"{key}\", permissions: {{\n      publish: {{ allow: [{publish}] }}\n      subscribe: {{ allow: [{subscribe}] }}\n{responses}    }} }}\n",
            role = role.name(),
            key = key.public_key(),
            publish = quoted(&permissions.publish),
            subscribe = quoted(&permissions.subscribe),
            responses = if permissions.answers_requests {
                "      allow_responses: true\n"
            } else {
                ""
            },
        ));
    }
    let config = dir.join("nats.conf");
    std::fs::write(
        &config,
        format!(
            "# ARL on least privilege (written by arl; see arl_schemas::permissions).\n\
             # Each client connects with NATS_NKEY=<role>.nk and NATS_INBOX_PREFIX=_INBOX_<role>.\n\
             authorization {{\n  users: [\n{users}  ]\n}}\n"
        ),
    )?;
    Ok(Written {
        config,
        dir: dir.to_path_buf(),
    })
}
