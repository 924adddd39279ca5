//! Cluster images: `{registry}/{namespace}/{instance_id}:latest`, checked through the OCI
//! distribution API — `HEAD /v2/<name>/manifests/<tag>` — with the registry's auth: HTTP
//! Basic, or the Bearer token flow its `WWW-Authenticate` challenge names (realm, service,
//! scope), credentials sent to the token realm.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Manifest types a registry may hold for an image.
const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry {registry}: {reason}")]
    Unreachable { registry: String, reason: String },
    #[error("registry {registry} refused the credentials for {repository} (HTTP {status})")]
    Unauthorized {
        registry: String,
        repository: String,
        status: u16,
    },
    #[error("registry {registry} answered HTTP {status} for {repository}")]
    Unexpected {
        registry: String,
        repository: String,
        status: u16,
    },
}

#[derive(Clone, Debug)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

/// One registry (`http://host:port` or `https://…` behind a terminating proxy).
#[derive(Clone, Debug)]
pub struct Registry {
    pub base: String,
    pub namespace: String,
    pub credentials: Option<Credentials>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl Registry {
    pub fn new(base: &str, namespace: &str, credentials: Option<Credentials>) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            namespace: namespace.trim_matches('/').to_owned(),
            credentials,
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// `{registry}/{namespace}/{instance_id}:latest` without the scheme.
    pub fn reference(&self, instance_id: &str) -> String {
        let host = self
            .base
            .split_once("://")
            .map_or(self.base.as_str(), |(_, h)| h);
        format!("{host}/{}:latest", self.repository(instance_id))
    }

    fn repository(&self, instance_id: &str) -> String {
        format!("{}/{}", self.namespace, instance_id.to_ascii_lowercase())
    }

    /// The image's manifest digest, or None when the registry does not have it.
    pub async fn manifest_digest(
        &self,
        instance_id: &str,
    ) -> Result<Option<String>, RegistryError> {
        let repository = self.repository(instance_id);
        let url = format!("{}/v2/{repository}/manifests/latest", self.base);
        let (status, headers) = self.send("HEAD", &url, None).await?;
        let (status, headers) = if status == 401 {
            let authorization = self.authorize(&headers, &repository).await?;
            self.send("HEAD", &url, Some(&authorization)).await?
        } else {
            (status, headers)
        };
        match status {
            200 => Ok(headers
                .get("docker-content-digest")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .or(Some(String::new()))),
            404 => Ok(None),
            401 | 403 => Err(RegistryError::Unauthorized {
                registry: self.base.clone(),
                repository,
                status,
            }),
            status => Err(RegistryError::Unexpected {
                registry: self.base.clone(),
                repository,
                status,
            }),
        }
    }

    /// The `Authorization` value the challenge asks for.
    async fn authorize(
        &self,
        challenge: &hyper::HeaderMap,
        repository: &str,
    ) -> Result<String, RegistryError> {
        let unauthorized = || RegistryError::Unauthorized {
            registry: self.base.clone(),
            repository: repository.to_owned(),
            status: 401,
        };
        let credentials = self.credentials.as_ref().ok_or_else(unauthorized)?;
        let basic = format!(
            "Basic {}",
            base64(format!("{}:{}", credentials.username, credentials.password).as_bytes())
        );
        let header = challenge
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("Basic");
        let Some(params) = header.strip_prefix("Bearer ") else {
            return Ok(basic);
        };
        let param = |key: &str| {
            params.split(',').find_map(|p| {
                let (k, v) = p.trim().split_once('=')?;
                (k == key).then(|| v.trim_matches('"').to_owned())
            })
        };
        let realm = param("realm").ok_or_else(unauthorized)?;
        let service = param("service").unwrap_or_default();
        let scope = param("scope").unwrap_or(format!("repository:{repository}:pull"));
        let url = format!("{realm}?service={service}&scope={scope}");
        let (status, body) = self.get_body(&url, &basic).await?;
        if status != 200 {
            return Err(unauthorized());
        }
        let token: serde_json::Value = serde_json::from_slice(&body).map_err(|_| unauthorized())?;
        let token = token["token"]
            .as_str()
            .or(token["access_token"].as_str())
            .ok_or_else(unauthorized)?;
        Ok(format!("Bearer {token}"))
    }

    async fn send(
        &self,
        method: &str,
        url: &str,
        authorization: Option<&str>,
    ) -> Result<(u16, hyper::HeaderMap), RegistryError> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("accept", ACCEPT);
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        let request = request
            .body(Empty::new())
            .map_err(|e| self.unreachable(e))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| self.unreachable(e))?;
        Ok((response.status().as_u16(), response.headers().clone()))
    }

    async fn get_body(
        &self,
        url: &str,
        authorization: &str,
    ) -> Result<(u16, Bytes), RegistryError> {
        let request = hyper::Request::get(url)
            .header("authorization", authorization)
            .body(Empty::new())
            .map_err(|e| self.unreachable(e))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| self.unreachable(e))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| self.unreachable(e))?
            .to_bytes();
        Ok((status, body))
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> RegistryError {
        RegistryError::Unreachable {
            registry: self.base.clone(),
            reason: e.to_string(),
        }
    }
}

/// Standard base64 with padding (for HTTP Basic).
fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[((n >> (18 - 6 * i)) & 63) as usize] as char);
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
    fn base64_matches_rfc_4648_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
    }

    #[test]
    fn references_follow_the_naming_rule() {
        let r = Registry::new("http://127.0.0.1:5000/", "swebench/", None);
        assert_eq!(
            r.reference("django__django-11880"),
            "127.0.0.1:5000/swebench/django__django-11880:latest"
        );
    }
}
