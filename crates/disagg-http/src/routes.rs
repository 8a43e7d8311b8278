//! [`RouteTable`]: which of an engine's routes the [`PdService`](crate::PdService)
//! orchestrates, answers itself, forwards, refuses or fans out.
//!
//! A P/D deployment should look to its clients like one engine, so every route the
//! proxy does not orchestrate reaches an engine unchanged. Routes that change an
//! engine's state (LoRA adapters, caches, sleep, profiling, weights) are the exception:
//! they are closed by default, because the proxy is the public face of the fleet and
//! the engines open them only to their operators (vLLM behind `VLLM_SERVER_DEV_MODE`,
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING` or `VLLM_TORCH_PROFILER_DIR`, in
//! `vllm/entrypoints/openai/api_server.py`). Opened ([`RouteTable::admin_routes`]), each
//! goes to every engine of the model, prefill and decode: a pair whose two sides
//! disagree about a LoRA adapter cannot hand KV over.
//!
//! The default table:
//!
//! | route | action |
//! |---|---|
//! | `POST /v1/chat/completions`, `/v1/completions`, `/generate`, `/inference/v1/generate`, `/v1/messages`, `/v1/responses`, `/cohere/v2/chat` | [`Orchestrated`](RouteAction::Orchestrated) |
//! | `GET /v1/models`, `/v1/models/{id}`, `/health`, `/metrics` | [`Proxy`](RouteAction::Proxy) |
//! | the paths below `/v1/responses` (retrieve, cancel), `/v1/audio/transcriptions`, `/v1/audio/translations`, `/invocations` | [`Direct`](RouteAction::Direct) |
//! | [`ADMIN_ROUTES`] | [`Refused`](RouteAction::Refused), [`FannedOut`](RouteAction::FannedOut) once opened |
//! | every other path that starts with `/metrics` (the engines' Prometheus mount answers them all) | [`Refused`](RouteAction::Refused) |
//! | anything else (`/tokenize`, `/detokenize`, `/version`, `/v1/embeddings`, `/pooling`, `/score`, `/rerank`, ...) | [`Forwarded`](RouteAction::Forwarded) |

use std::borrow::Cow;

/// What the service does with a request on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RouteAction {
    /// Served disaggregated: the prefill leg, the KV handoff, the decode leg (`POST`
    /// only; another method is 405).
    Orchestrated,
    /// Answered by the proxy itself: the model list and cards built from the engines'
    /// own, the fleet's health, the proxy's metrics.
    Proxy,
    /// Forwarded unchanged to one engine serving the request's model (a decode engine
    /// when one does, the least loaded), bodies streamed both ways.
    Forwarded,
    /// Generation that P/D does not orchestrate: forwarded to one decode engine alone,
    /// which computes the prompt itself; the answer says `x-disagg-handoff: direct`.
    Direct,
    /// Closed: 403 `admin_route_closed` in OpenAI's format, nothing sent to an engine.
    Refused,
    /// Sent to every engine (prefill and decode) serving the request's `model`, or
    /// every engine when it names none; the answer lists each engine's result.
    FannedOut,
}

impl RouteAction {
    /// The action's name as the docs and logs spell it.
    pub fn name(self) -> &'static str {
        match self {
            RouteAction::Orchestrated => "orchestrated",
            RouteAction::Proxy => "proxy",
            RouteAction::Forwarded => "forwarded",
            RouteAction::Direct => "direct",
            RouteAction::Refused => "refused",
            RouteAction::FannedOut => "fanned out",
        }
    }
}

/// The routes that change an engine's state (or expose its internals), closed by
/// default. Checked against vLLM 0.33 (`vllm/entrypoints/openai/api_server.py` and the
/// routers under `vllm/entrypoints/serve/`) and SGLang 0.5.23
/// (`sglang/srt/entrypoints/http_server.py`).
pub const ADMIN_ROUTES: &[&str] = &[
    // vLLM: runtime LoRA, cache resets, sleep and pause, the profiler, dev mode's RPC
    // and introspection, elastic EP, weight transfer and updates, fault tolerance.
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/release_kv_cache_memory",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/collective_rpc",
    "/server_info",
    // SGLang's older spellings of its `/server_info` (the engine's whole configuration)
    // and of `/hicache/storage-backend/clear`, and its remote-instance weight loading's
    // transfer-engine session (both spellings).
    "/get_server_info",
    "/clear_hicache_storage_backend",
    "/remote_instance_transfer_engine_info",
    "/get_remote_instance_transfer_engine_info",
    "/get_world_size",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/update_weights",
    "/update_weight_version",
    "/weight_checker",
    "/weight_info",
    "/fault_tolerance/*",
    // SGLang: cache flush, LoRA, weight updates and transfer groups, memory release,
    // logging and tracing, request abort and pausing, sessions (engine-local state a
    // P/D pair would not share), expert-distribution recording, the dumper, HiCache's
    // storage backend, corpora, role switching, GC.
    "/flush_cache",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/begin_weight_update",
    "/end_weight_update",
    "/get_weights_by_name",
    "/weights_checker",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/configure_logging",
    "/set_trace_level",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/slow_down",
    "/set_internal_state",
    "/open_session",
    "/close_session",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/dumper/*",
    "/hicache/storage-backend",
    "/hicache/storage-backend/*",
    "/add_external_corpus",
    "/remove_external_corpus",
    "/pd_role_switch",
    "/freeze_gc",
];

/// Generation routes that P/D does not orchestrate, served by one decode engine.
const DIRECT_ROUTES: &[&str] = &[
    // vLLM's Responses API's retrieve and cancel routes: the response lives on the
    // engine that made it.
    "/v1/responses/*",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    // SageMaker's entry point, which vLLM routes to chat, completions or pooling by
    // the body's shape.
    "/invocations",
];

/// One rule of a [`RouteTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRule {
    /// The path; one ending in `/*` also matches every path below it, one ending in
    /// another `*` every longer path that starts with what comes before the `*`.
    pub path: Cow<'static, str>,
    /// What is done with requests on it.
    pub action: RouteAction,
}

impl RouteRule {
    fn matches(&self, path: &str) -> bool {
        if let Some(prefix) = self.path.strip_suffix("/*") {
            return path
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.len() > 1 && rest.starts_with('/'));
        }
        match self.path.strip_suffix('*') {
            Some(prefix) => path.len() > prefix.len() && path.starts_with(prefix),
            None => self.path == path,
        }
    }
}

/// A rule's `path` in its normal form (borrowed as it came when it is normal already):
/// of a pattern ending in `*`, the part before it (`*` alone covers every path).
fn normal_rule_path(path: Cow<'static, str>) -> Result<Cow<'static, str>, crate::path::PathError> {
    let prefix = path.strip_suffix('*').unwrap_or(&path);
    if prefix.is_empty() {
        return Ok(path);
    }
    match crate::path::normalize(prefix)? {
        Cow::Borrowed(_) => Ok(path),
        Cow::Owned(mut normal) => {
            if path.ends_with('*') {
                normal.push('*');
            }
            Ok(Cow::Owned(normal))
        }
    }
}

/// The route table of a [`PdService`](crate::PdService): an action per path, and
/// [`Forwarded`](RouteAction::Forwarded) for every path it does not name. See the
/// [module docs](self) for the default table.
///
/// # Examples
///
/// ```
/// use disagg_http::routes::{RouteAction, RouteTable};
///
/// let closed = RouteTable::default();
/// assert_eq!(closed.action("/v1/load_lora_adapter"), RouteAction::Refused);
/// assert_eq!(closed.action("/tokenize"), RouteAction::Forwarded);
///
/// let open = RouteTable::default().admin_routes(true).set("/tokenize", RouteAction::Refused);
/// assert_eq!(open.action("/v1/load_lora_adapter"), RouteAction::FannedOut);
/// assert_eq!(open.action("/tokenize"), RouteAction::Refused);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    rules: Vec<RouteRule>,
}

impl Default for RouteTable {
    fn default() -> Self {
        let rule = |path: &'static str, action| RouteRule {
            path: Cow::Borrowed(path),
            action,
        };
        let mut rules = vec![
            rule("/v1/chat/completions", RouteAction::Orchestrated),
            rule("/v1/completions", RouteAction::Orchestrated),
            rule("/generate", RouteAction::Orchestrated),
            // vLLM's token-in, token-out route (`vllm/entrypoints/scale_out/`).
            rule("/inference/v1/generate", RouteAction::Orchestrated),
            // vLLM's Anthropic Messages API (`vllm/entrypoints/anthropic/`).
            rule("/v1/messages", RouteAction::Orchestrated),
            // vLLM's Responses API (`vllm/entrypoints/openai/responses/`); a request
            // that keeps or continues state goes to one engine (the connector says).
            rule("/v1/responses", RouteAction::Orchestrated),
            // vLLM's Cohere chat API (`vllm/entrypoints/cohere/`).
            rule("/cohere/v2/chat", RouteAction::Orchestrated),
            rule("/v1/models", RouteAction::Proxy),
            rule("/v1/models/*", RouteAction::Proxy),
            rule("/health", RouteAction::Proxy),
            rule("/metrics", RouteAction::Proxy),
            // The engines' Prometheus app answers every path that starts with
            // `/metrics` (vLLM mounts it with the pattern `^/metrics(?P<path>.*)$`),
            // so `/metrics/` or `/metricsx` forwarded would be an engine's metrics,
            // past the scraper's key.
            rule("/metrics*", RouteAction::Refused),
        ];
        rules.extend(DIRECT_ROUTES.iter().map(|p| rule(p, RouteAction::Direct)));
        rules.extend(ADMIN_ROUTES.iter().map(|p| rule(p, RouteAction::Refused)));
        RouteTable { rules }
    }
}

impl RouteTable {
    /// Open (`true`: [`FannedOut`](RouteAction::FannedOut)) or close (`false`:
    /// [`Refused`](RouteAction::Refused)) every route of [`ADMIN_ROUTES`].
    #[must_use]
    pub fn admin_routes(mut self, open: bool) -> Self {
        let action = if open {
            RouteAction::FannedOut
        } else {
            RouteAction::Refused
        };
        for rule in &mut self.rules {
            if ADMIN_ROUTES.contains(&&*rule.path) {
                rule.action = action;
            }
        }
        self
    }

    /// Give `path` the `action` (a path ending in `/*` covers the paths below it, one
    /// ending in another `*` every longer path that starts with what precedes it),
    /// replacing its rule if it had one. An exact path's rule wins over the others, and
    /// among those the longest that matches.
    ///
    /// The rule is set on the path's normal form ([`crate::path::normalize`]), the one
    /// requests are routed on: `//tokenize` and `/%74okenize` set `/tokenize`'s rule. A
    /// path with no normal form (`/a%2Fb`, `/../x`, one without a leading `/`) sets no
    /// rule and is logged at `warn`: no request is routed on such a path (the service
    /// answers it 400 `invalid_path`; a model card's id with an encoded `/` takes the
    /// rule of its plain spelling, `/v1/models/org/model`). [`try_set`](Self::try_set)
    /// says so as an error instead.
    #[must_use]
    pub fn set(mut self, path: impl Into<Cow<'static, str>>, action: RouteAction) -> Self {
        let path = path.into();
        if let Err(err) = self.try_set(path.clone(), action) {
            tracing::warn!(
                path = %path,
                error = %err,
                "route rule not set: its path has no normal form, so no request is routed on it"
            );
        }
        self
    }

    /// Give `path` the `action` in place, as [`set`](Self::set) does, or say why it
    /// cannot have a rule (the table is then unchanged).
    ///
    /// # Errors
    ///
    /// [`PathError`](crate::path::PathError) when `path` has no normal form.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_http::path::PathError;
    /// use disagg_http::routes::{RouteAction, RouteTable};
    ///
    /// let mut t = RouteTable::default();
    /// t.try_set("//tokenize", RouteAction::Refused)?;
    /// assert_eq!(t.action("/tokenize"), RouteAction::Refused);
    /// assert_eq!(t.try_set("/a%2Fb", RouteAction::Refused), Err(PathError::Separator));
    /// # Ok::<(), PathError>(())
    /// ```
    pub fn try_set(
        &mut self,
        path: impl Into<Cow<'static, str>>,
        action: RouteAction,
    ) -> Result<(), crate::path::PathError> {
        self.put(normal_rule_path(path.into())?, action);
        Ok(())
    }

    /// Give the normal `path` the `action`, replacing its rule if it had one.
    fn put(&mut self, path: Cow<'static, str>, action: RouteAction) {
        match self.rules.iter_mut().find(|r| r.path == path) {
            Some(rule) => rule.action = action,
            None => self.rules.push(RouteRule { path, action }),
        }
    }

    /// The action for a request on `path`, compared as given: give it the path's normal
    /// form ([`crate::path::normalize`]), as [`PdService`](crate::PdService) does, or
    /// `/%72eset_prefix_cache` is not `/reset_prefix_cache`.
    pub fn action(&self, path: &str) -> RouteAction {
        self.rule(path).map_or(RouteAction::Forwarded, |r| r.action)
    }

    /// The rule that gives `path` its action, as [`action`](Self::action) picks it;
    /// `None` when no rule matches (the path is forwarded).
    pub(crate) fn rule(&self, path: &str) -> Option<&RouteRule> {
        let exact = self.rules.iter().find(|r| r.path == path);
        exact.or_else(|| {
            self.rules
                .iter()
                .filter(|r| r.matches(path))
                .max_by_key(|r| r.path.len())
        })
    }

    /// The rules, in the order they were added.
    pub fn rules(&self) -> &[RouteRule] {
        &self.rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_cover_only_paths_below_them() {
        let t = RouteTable::default();
        assert_eq!(t.action("/v1/models"), RouteAction::Proxy);
        assert_eq!(t.action("/v1/models/org/model"), RouteAction::Proxy);
        assert_eq!(t.action("/v1/models/"), RouteAction::Forwarded);
        assert_eq!(t.action("/v1/responses/resp_1/cancel"), RouteAction::Direct);
        assert_eq!(t.action("/v1/responsesX"), RouteAction::Forwarded);
        // The engines' metrics mount answers every path that starts with `/metrics`.
        assert_eq!(t.action("/metrics"), RouteAction::Proxy);
        for path in ["/metrics/", "/metricsx", "/metrics/metrics"] {
            assert_eq!(t.action(path), RouteAction::Refused, "{path}");
        }
        assert_eq!(t.action("/metric"), RouteAction::Forwarded);
        assert_eq!(
            t.admin_routes(true).action("/metrics/"),
            RouteAction::Refused
        );
    }

    #[test]
    fn admin_routes_open_and_close_together() {
        let open = RouteTable::default().admin_routes(true);
        for path in ADMIN_ROUTES {
            assert_eq!(open.action(path), RouteAction::FannedOut, "{path}");
        }
        let closed = open.admin_routes(false);
        for path in ADMIN_ROUTES {
            assert_eq!(closed.action(path), RouteAction::Refused, "{path}");
        }
        assert_eq!(closed.action("/v1/completions"), RouteAction::Orchestrated);
        // Admin prefixes close the paths below them, not their neighbours.
        assert_eq!(
            closed.action("/fault_tolerance/apply"),
            RouteAction::Refused
        );
        assert_eq!(
            closed.action("/hicache/storage-backend/clear"),
            RouteAction::Refused
        );
        assert_eq!(closed.action("/dumper/start"), RouteAction::Refused);
        assert_eq!(closed.action("/tokenizer_info"), RouteAction::Forwarded);
    }

    #[test]
    fn the_longest_prefix_wins() {
        let t = RouteTable::default().set("/metrics/engine/*", RouteAction::Forwarded);
        assert_eq!(t.action("/metrics/engine/0"), RouteAction::Forwarded);
        assert_eq!(t.action("/metrics/other"), RouteAction::Refused);
    }

    #[test]
    fn an_exact_rule_wins_over_a_prefix() {
        let t = RouteTable::default().set("/v1/responses/keep", RouteAction::Refused);
        assert_eq!(t.action("/v1/responses/keep"), RouteAction::Refused);
        assert_eq!(t.action("/v1/responses/other"), RouteAction::Direct);
    }

    #[test]
    fn a_rule_is_set_on_the_paths_normal_form() {
        for spelling in [
            "//tokenize",
            "/%74okenize",
            "/./tokenize",
            "/v1/../tokenize",
        ] {
            let t = RouteTable::default().set(spelling, RouteAction::Refused);
            assert_eq!(t.action("/tokenize"), RouteAction::Refused, "{spelling}");
            let mut t = RouteTable::default();
            t.try_set(spelling, RouteAction::Refused).unwrap();
            assert_eq!(t.action("/tokenize"), RouteAction::Refused, "{spelling}");
        }
        // One rule per normal form: a second spelling replaces the first's action.
        let t = RouteTable::default()
            .set("//score", RouteAction::Refused)
            .set("/score", RouteAction::Direct);
        assert_eq!(t.action("/score"), RouteAction::Direct);
        assert_eq!(t.rules().iter().filter(|r| r.path == "/score").count(), 1);
        // Prefixes too.
        let t = RouteTable::default().set("//metrics/engine//*", RouteAction::Forwarded);
        assert_eq!(t.action("/metrics/engine/0"), RouteAction::Forwarded);
        // `*` alone covers every path without a rule of its own (a deny-all), and a
        // prefix pattern's part before its `*` is normalized alone.
        let t = RouteTable::default().set("*", RouteAction::Refused);
        assert_eq!(t.action("/anything/at/all"), RouteAction::Refused);
        assert_eq!(t.action("/v1/chat/completions"), RouteAction::Orchestrated);
        let t = RouteTable::default().set("//x%79*", RouteAction::Refused);
        assert_eq!(t.rules().iter().filter(|r| r.path == "/xy*").count(), 1);
        assert_eq!(t.action("/xyz"), RouteAction::Refused);
    }

    #[test]
    fn a_path_with_no_normal_form_is_refused_as_a_rule() {
        for (path, err) in [
            ("/a%2Fb", crate::path::PathError::Separator),
            ("/../tokenize", crate::path::PathError::AboveRoot),
            ("tokenize", crate::path::PathError::NotAbsolute),
        ] {
            let mut t = RouteTable::default();
            assert_eq!(t.try_set(path, RouteAction::Refused), Err(err), "{path}");
            assert_eq!(t, RouteTable::default(), "{path}");
            // `set` adds no rule that no request could match, and does not panic.
            let t = RouteTable::default().set(path, RouteAction::Refused);
            assert_eq!(t, RouteTable::default(), "{path}");
        }
    }
}
