//! The HTTP/1.1 client to the backends (hyper, pooled keep-alive connections).

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing accepted the connection: another backend may.
    #[error("connection refused: {0}")]
    Connect(String),
    #[error("{0}")]
    Other(String),
}

#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1024)
                .build(connector),
        }
    }

    /// GET: the status and the body.
    pub async fn get(&self, url: &str) -> Result<(u16, Bytes), ClientError> {
        use http_body_util::BodyExt;
        let request = hyper::Request::get(url)
            .body(Full::new(Bytes::new()))
            .map_err(|e| ClientError::Other(e.to_string()))?;
        let response = self.send(request).await?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Other(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    }

    /// POST a JSON body: the status and the whole answer.
    pub async fn post_collected(
        &self,
        url: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), ClientError> {
        use http_body_util::BodyExt;
        let response = self.post_json(url, body).await?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Other(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    }

    pub async fn post_json(
        &self,
        url: &str,
        body: Bytes,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        self.post_json_with(url, body, None).await
    }

    /// [`Self::post_json`] with one more header (`(name, value)`).
    pub async fn post_json_with(
        &self,
        url: &str,
        body: Bytes,
        header: Option<(&'static str, &str)>,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        let mut builder =
            hyper::Request::post(url).header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some((name, value)) = header {
            builder = builder.header(name, value);
        }
        let mut request = builder
            .body(Full::new(body))
            .map_err(|e| ClientError::Other(e.to_string()))?;
        // The engine continues the caller's trace.
        arl_runtime::telemetry::inject_http(request.headers_mut());
        self.send(request).await
    }

    async fn send(
        &self,
        request: hyper::Request<Full<Bytes>>,
    ) -> Result<hyper::Response<Incoming>, ClientError> {
        self.inner.request(request).await.map_err(|e| {
            if e.is_connect() {
                ClientError::Connect(e.to_string())
            } else {
                ClientError::Other(e.to_string())
            }
        })
    }
}
