//! Trial keys over NATS request/reply: `arl.rpc.proxy.any.issue` (queue group `proxy`) and
//! `arl.rpc.proxy.<instance>.revoke`.

use std::sync::Arc;

use arl_runtime::rpc::serve;
use arl_runtime::{Bus, Shutdown};
use arl_schemas::rpc::{
    ProxyOp, RpcError, RpcErrorCode, TrialKeyGrantV1, TrialKeyRequestV1, TrialKeyRevokeV1,
    TrialKeyRevokedV1,
};

use crate::keys::Keys;
use crate::mcp::Mcp;

/// Serves key issue and revoke until shutdown.
pub async fn serve_keys(
    bus: &Bus,
    keys: Arc<Keys>,
    mcp: Arc<Mcp>,
    instance: &str,
    public_url: &str,
    shutdown: &Shutdown,
) -> Result<(), arl_runtime::rpc::RequestError> {
    let ns = bus.namespace();
    let (issue_keys, base, name) = (keys.clone(), public_url.to_owned(), instance.to_owned());
    let issue = serve(
        bus.clone(),
        ns.proxy_rpc("any", ProxyOp::Issue),
        Some("proxy".into()),
        64,
        move |request: TrialKeyRequestV1| {
            let (keys, base, name) = (issue_keys.clone(), base.clone(), name.clone());
            async move {
                let trial_key = keys.issue(&request);
                tracing::debug!(run = %request.run_id, trial = %request.trial_id, "trial key issued");
                Ok::<_, RpcError>(TrialKeyGrantV1 {
                    base_url: format!("{base}/{trial_key}/v1"),
                    mcp_url: Some(format!("{base}/{trial_key}/mcp")),
                    trial_key,
                    instance: name,
                })
            }
        },
        shutdown.clone(),
    )
    .await?;
    shutdown.spawn(issue);
    let revoke = serve(
        bus.clone(),
        ns.proxy_rpc(instance, ProxyOp::Revoke),
        None,
        64,
        move |request: TrialKeyRevokeV1| {
            let (keys, mcp) = (keys.clone(), mcp.clone());
            async move {
                // The trial is over: so are its MCP sessions, and their sandboxes.
                mcp.end_trial(&request.trial_key).await;
                match keys.revoke(&request.trial_key) {
                    Some(sequences) => Ok(TrialKeyRevokedV1 {
                        calls: sequences.len() as u32,
                        call_sequences: sequences,
                    }),
                    None => Err(RpcError::new(
                        RpcErrorCode::NotFound,
                        "no live trial has this key (already revoked, or issued by another proxy instance)",
                    )),
                }
            }
        },
        shutdown.clone(),
    )
    .await?;
    shutdown.spawn(revoke);
    Ok(())
}
