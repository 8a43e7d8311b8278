//! vLLM's NIXL connector in pull mode: the handoff comes back in the prefill's answer.
//!
//! Protocol (vLLM `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py` and
//! its successors under `…/v1/nixl/`; the reference proxy is
//! `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):
//!
//! 1. the prefill gets the [rewritten](crate::rewrite) body plus
//!    `kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
//!    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
//!    "remote_port": null}`;
//! 2. its non-streaming answer carries a top-level `kv_transfer_params` naming its engine
//!    id, the KV block ids, its side-channel host and port (and, by version,
//!    `remote_request_id`, `tp_size`, `remote_num_tokens`);
//! 3. the decode gets the client's body plus that dict **verbatim**: its shape changes
//!    between vLLM versions, so it is copied as raw bytes, never interpreted;
//! 4. when the route names data-parallel ranks (endpoints written `URL@RANK`), each leg
//!    carries its rank in `X-data-parallel-rank`, the header by which the vLLM API
//!    server lets a request pick its rank.
//!
//! When the answer's `kv_transfer_params` is missing, `null` or `{}` (the prefill ended
//! "stopped" on older vLLM, or the engine runs no KV connector), `complete` reports
//! [`KvOutcome::Missing`].

use async_trait::async_trait;
use bytes::Bytes;

use crate::connector::mooncake::set_rank;
use crate::connector::{Dispatch, Handoff, KvConnector, KvOutcome, Leg, PrefillAnswer};
use crate::disaggregate::Decision;
use crate::error::{ConnectorError, InvalidParam};
use crate::request::PdRequest;
use crate::rewrite::PrefillRewriter;
use crate::router::Route;

/// The field that carries the handoff, on requests and on the prefill's answer.
pub(crate) const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The prefill leg's `kv_transfer_params`: only `do_remote_decode` matters to the engine;
/// the `null` keys are the convention every reference proxy follows.
const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The vLLM NIXL (pull) connector: sequential, handoff in the prefill's answer.
///
/// # Examples
///
/// ```
/// use disagg_core::VllmNixl;
/// use disagg_core::connector::{Dispatch, KvConnector};
/// use disagg_core::endpoint::{Endpoint, Role};
/// use disagg_core::request::{Api, PdRequest};
/// use disagg_core::router::Route;
/// use std::sync::Arc;
///
/// let route = Route::new(
///     Some(Arc::new(Endpoint::new("http://p:8100", Role::Prefill)?)),
///     Arc::new(Endpoint::new("http://d:8200", Role::Decode)?),
/// );
/// let req = PdRequest::new(
///     Api::Completions,
///     Default::default(),
///     &r#"{"prompt":"hi","max_tokens":8}"#.into(),
/// )?;
/// let handoff = VllmNixl::new().prepare(&route, &req)?;
/// assert_eq!(handoff.dispatch, Dispatch::AfterPrefill);
/// assert_eq!(handoff.prefill.body.get("max_tokens"), Some(&b"1"[..]));
/// assert_eq!(handoff.decode.body.get("max_tokens"), Some(&b"8"[..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct VllmNixl {
    rewriter: PrefillRewriter,
}

impl VllmNixl {
    /// The connector with the default [`PrefillRewriter`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The connector with a custom rewriter.
    pub fn with_rewriter(rewriter: PrefillRewriter) -> Self {
        VllmNixl { rewriter }
    }
}

#[async_trait]
impl KvConnector for VllmNixl {
    fn name(&self) -> &'static str {
        "vllm-nixl"
    }

    /// [`check_request`](crate::rewrite::check::check_request) with the rewriter's
    /// limits: what vLLM refuses in the fields the prefill leg changes, and beam search
    /// served direct.
    fn check(&self, req: &PdRequest) -> Result<Decision, InvalidParam> {
        crate::rewrite::check::check_request(req, self.rewriter.limits())
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        super::openai_only(self.name(), req.api())?;
        let prefill_ep = route.prefill.clone().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        let mut prefill = self.rewriter.rewrite(req.api(), req.body());
        prefill.set_raw(KV_TRANSFER_PARAMS, Bytes::from_static(PREFILL_PARAMS));
        let mut prefill = Leg::new(prefill_ep, prefill);
        set_rank(&mut prefill, route.prefill_rank);
        let mut decode = Leg::new(route.decode.clone(), req.body().clone());
        set_rank(&mut decode, route.decode_rank);
        Ok(Handoff::new(Dispatch::AfterPrefill, prefill, decode))
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<KvOutcome, ConnectorError> {
        let params =
            answer
                .field(KV_TRANSFER_PARAMS)
                .map_err(|source| ConnectorError::InvalidAnswer {
                    endpoint: handoff.prefill.endpoint.id().clone(),
                    source,
                })?;
        let Some(params) = params else {
            return Ok(KvOutcome::Missing);
        };
        match params.first() {
            Some(b'{') => {}
            _ if &params[..] == b"null" => return Ok(KvOutcome::Missing),
            _ => {
                return Err(ConnectorError::InvalidHandoff {
                    endpoint: handoff.prefill.endpoint.id().clone(),
                    field: KV_TRANSFER_PARAMS,
                });
            }
        }
        if is_empty_object(&params) {
            return Ok(KvOutcome::Missing);
        }
        handoff.decode.body.set_raw(KV_TRANSFER_PARAMS, params);
        Ok(KvOutcome::Handed)
    }

    /// NIXL maps ranks by the ratio of the sizes (a decode rank reads from prefill rank
    /// `tp_rank / (decode_tp / prefill_tp)`; vLLM's compatibility matrix lists
    /// heterogeneous TP as supported), so one size must divide the other.
    fn bridges_tp(&self, prefill_tp: u32, decode_tp: u32) -> bool {
        let (lo, hi) = (prefill_tp.min(decode_tp), prefill_tp.max(decode_tp));
        lo > 0 && hi % lo == 0
    }
}

fn is_empty_object(raw: &[u8]) -> bool {
    raw.iter()
        .filter(|b| !b.is_ascii_whitespace())
        .eq(b"{}".iter())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::body::JsonBody;
    use crate::endpoint::{Endpoint, Role};
    use crate::request::Api;

    fn route() -> Route {
        Route::new(
            Some(Arc::new(
                Endpoint::new("http://p:1", Role::Prefill).unwrap(),
            )),
            Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap()),
        )
    }

    fn req(api: Api, body: &str) -> PdRequest {
        PdRequest::new(api, HeaderMap::new(), &Bytes::from(body.to_owned())).unwrap()
    }

    fn answer(body: &str) -> PrefillAnswer {
        PrefillAnswer {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from(body.to_owned()),
        }
    }

    fn text(b: &JsonBody) -> String {
        String::from_utf8(b.to_bytes().to_vec()).unwrap()
    }

    #[test]
    fn golden_chat_stream() {
        let r = req(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":32,"kv_transfer_params":{"remote_host":"evil"}}"#,
        );
        let h = VllmNixl::new().prepare(&route(), &r).unwrap();
        assert_eq!(
            text(&h.prefill.body),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":1,"max_completion_tokens":1,"ignore_eos":true,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#
        );
        assert_eq!(
            text(&h.decode.body),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":32}"#
        );
        assert_eq!(h.prefill.endpoint.id().as_str(), "http://p:1");
        assert_eq!(h.decode.endpoint.id().as_str(), "http://d:1");
    }

    #[tokio::test]
    async fn complete_copies_params_verbatim() {
        let c = VllmNixl::new();
        let mut h = c
            .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p","n":2}"#))
            .unwrap();
        let params = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1, 2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.5","remote_port":5600,"tp_size":8,"future_key":{"x":1.0}}"#;
        let a = answer(&format!(
            r#"{{"id":"x","choices":[],"kv_transfer_params":{params}}}"#
        ));
        assert_eq!(c.complete(&mut h, &a).await.unwrap(), KvOutcome::Handed);
        assert_eq!(
            text(&h.decode.body),
            format!(r#"{{"prompt":"p","n":2,"kv_transfer_params":{params}}}"#)
        );
    }

    #[tokio::test]
    async fn complete_reports_missing_params() {
        let c = VllmNixl::new();
        for body in [
            r#"{"choices":[]}"#,
            r#"{"kv_transfer_params":null}"#,
            r#"{"kv_transfer_params": { } }"#,
        ] {
            let mut h = c
                .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
                .unwrap();
            assert_eq!(
                c.complete(&mut h, &answer(body)).await.unwrap(),
                KvOutcome::Missing
            );
            assert!(h.decode.body.get(KV_TRANSFER_PARAMS).is_none());
        }
        let mut h = c
            .prepare(&route(), &req(Api::Completions, r#"{"prompt":"p"}"#))
            .unwrap();
        assert!(matches!(
            c.complete(&mut h, &answer(r#"{"kv_transfer_params":"x"}"#))
                .await,
            Err(ConnectorError::InvalidHandoff { .. })
        ));
        assert!(matches!(
            c.complete(&mut h, &answer(r#"{"choices":[}"#)).await,
            Err(ConnectorError::InvalidAnswer { .. })
        ));
    }

    #[test]
    fn needs_a_prefill_endpoint() {
        let mut r = route();
        r.prefill = None;
        assert!(matches!(
            VllmNixl::new().prepare(&r, &req(Api::Completions, "{}")),
            Err(ConnectorError::NeedsPrefill { .. })
        ));
    }

    #[test]
    fn sglang_generate_is_not_carried() {
        let err = VllmNixl::new()
            .prepare(&route(), &req(Api::Generate, r#"{"text":"hi"}"#))
            .unwrap_err();
        assert!(matches!(err, ConnectorError::Unsupported { .. }), "{err}");
        let pd = crate::error::PdError::connector(crate::error::Side::Prefill, err);
        assert_eq!(
            (pd.status().as_u16(), pd.code()),
            (400, "unsupported_by_connector")
        );
    }
}
