//! How a service (or the CLI) proves who it is to NATS and checks the server: one of
//! user and password, a token, an NKey seed or a `.creds` file (a user JWT and its NKey
//! seed, as `nsc` writes it); TLS with a CA and optionally a client certificate. The
//! settings come from flags or the environment variables the `nats` CLI uses (`NATS_USER`,
//! `NATS_PASSWORD`, `NATS_TOKEN`, `NATS_NKEY`, `NATS_CREDS`, `NATS_CA`, `NATS_CERT`,
//! `NATS_KEY`). Secrets are never printed: [`Secret`]'s `Debug` and `Display` redact them,
//! and [`redact_url`] hides a password written into a URL.

use std::path::PathBuf;

/// A secret string: kept, used, never shown.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

/// NATS credentials and TLS settings, as flags (`--nats-…`) or environment variables.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct NatsAuth {
    /// NATS user name (with --nats-password).
    #[arg(long, global = true, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password of --nats-user.
    #[arg(long, global = true, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<Secret>,
    /// NATS authentication token.
    #[arg(long, global = true, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<Secret>,
    /// File holding an NKey seed (`SU…`).
    #[arg(long, global = true, env = "NATS_NKEY")]
    pub nats_nkey: Option<PathBuf>,
    /// A `.creds` file: a user JWT and its NKey seed (decentralized auth, `nsc`).
    #[arg(long, global = true, env = "NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// PEM file of the CA that signed the server's certificate; TLS is then required.
    #[arg(long, global = true, env = "NATS_CA")]
    pub nats_ca: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with --nats-key).
    #[arg(long, global = true, env = "NATS_CERT")]
    pub nats_cert: Option<PathBuf>,
    /// PEM private key of --nats-cert.
    #[arg(long, global = true, env = "NATS_KEY")]
    pub nats_key: Option<PathBuf>,
    /// Replies arrive on `<prefix>.…` instead of `_INBOX.…`: a server that gives each user
    /// its own inbox prefix (least privilege) keeps users from reading others' replies.
    #[arg(long, global = true, env = "NATS_INBOX_PREFIX")]
    pub nats_inbox_prefix: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{0}")]
    Conflict(String),
    #[error("cannot read {what} {path}: {reason}")]
    Unreadable {
        what: &'static str,
        path: String,
        reason: String,
    },
}

impl NatsAuth {
    /// The connect options with these credentials and TLS settings.
    pub async fn apply(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, AuthError> {
        let methods = [
            self.nats_user.is_some() || self.nats_password.is_some(),
            self.nats_token.is_some(),
            self.nats_nkey.is_some(),
            self.nats_creds.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err(AuthError::Conflict(
                "give one NATS credential: a user and password, a token, an NKey seed or a .creds file"
                    .into(),
            ));
        }
        match (&self.nats_user, &self.nats_password) {
            (Some(user), Some(password)) => {
                options = options.user_and_password(user.clone(), password.expose().to_owned());
            }
            (Some(_), None) => {
                return Err(AuthError::Conflict(
                    "--nats-user needs --nats-password (NATS_PASSWORD)".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(AuthError::Conflict(
                    "--nats-password needs --nats-user (NATS_USER)".into(),
                ));
            }
            (None, None) => {}
        }
        if let Some(token) = &self.nats_token {
            options = options.token(token.expose().to_owned());
        }
        if let Some(path) = &self.nats_nkey {
            let seed = read("NKey seed", path)?;
            options = options.nkey(seed.trim().to_owned());
        }
        if let Some(path) = &self.nats_creds {
            let creds = read("credentials file", path)?;
            options = options
                .credentials(&creds)
                .map_err(|err| AuthError::Unreadable {
                    what: "credentials file",
                    path: path.display().to_string(),
                    reason: err.to_string(),
                })?;
        }
        if let Some(prefix) = &self.nats_inbox_prefix {
            options = options.custom_inbox_prefix(prefix.clone());
        }
        if let Some(ca) = &self.nats_ca {
            read("CA certificate", ca)?;
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&self.nats_cert, &self.nats_key) {
            (Some(cert), Some(key)) => {
                read("client certificate", cert)?;
                read("client key", key)?;
                options = options
                    .add_client_certificate(cert.clone(), key.clone())
                    .require_tls(true);
            }
            (None, None) => {}
            _ => {
                return Err(AuthError::Conflict(
                    "a client certificate needs both --nats-cert and --nats-key".into(),
                ));
            }
        }
        Ok(options)
    }
}

fn read(what: &'static str, path: &std::path::Path) -> Result<String, AuthError> {
    std::fs::read_to_string(path).map_err(|err| AuthError::Unreadable {
        what,
        path: path.display().to_string(),
        reason: err.to_string(),
    })
}

/// `url` with any password (or token) in its user part replaced: safe to print.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or_default();
            if userinfo.contains(':') {
                format!("{scheme}://{user}:<redacted>@{host}")
            } else {
                format!("{scheme}://<redacted>@{host}")
            }
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_and_passwords_in_urls_are_never_shown() {
        let auth = NatsAuth {
            nats_user: Some("rollout".into()),
            nats_password: Some(Secret::new("hunter2")),
            ..NatsAuth::default()
        };
        let shown = format!("{auth:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("rollout"));
        assert_eq!(
            redact_url("nats://ada:hunter2@nats:4222"),
            "nats://ada:<redacted>@nats:4222"
        );
        assert_eq!(
            redact_url("tls://s3cret@nats:4222"),
            "tls://<redacted>@nats:4222"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }

    #[tokio::test]
    async fn conflicting_or_incomplete_settings_are_refused() {
        let options = || async_nats::ConnectOptions::new();
        let two = NatsAuth {
            nats_token: Some(Secret::new("t")),
            nats_creds: Some("/x.creds".into()),
            ..NatsAuth::default()
        };
        assert!(matches!(
            two.apply(options()).await,
            Err(AuthError::Conflict(_))
        ));
        let no_password = NatsAuth {
            nats_user: Some("u".into()),
            ..NatsAuth::default()
        };
        assert!(no_password.apply(options()).await.is_err());
        let half_cert = NatsAuth {
            nats_cert: Some("/c.pem".into()),
            ..NatsAuth::default()
        };
        assert!(half_cert.apply(options()).await.is_err());
        let missing = NatsAuth {
            nats_creds: Some("/no/such.creds".into()),
            ..NatsAuth::default()
        };
        let err = missing.apply(options()).await.unwrap_err().to_string();
        assert!(err.contains("/no/such.creds"), "{err}");
    }
}
