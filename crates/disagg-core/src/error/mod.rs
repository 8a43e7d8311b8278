//! Errors, one enum per concern, and the opaque edge error [`PdError`].
//!
//! Each layer of the request path has its own error: [`BodyError`] for the client's
//! JSON, [`RouteError`] for routing, [`ConnectorError`] for the KV handoff and
//! [`TransportError`] for the wire. [`PdError`] wraps them at the edge and tells a
//! server what it needs to answer: the HTTP status and a stable code
//! ([`http`](PdError::http)), the [`side`](PdError::side) that failed, and whether a
//! retry on another pair could help.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | the errors of each concern, and [`error_chain`], the one rendering of an error with its causes |
//! | `pd.rs` | [`PdError`] and its [`Side`]: the classification a server answers by |

use std::fmt;

use disagg_json::{BodyError, InvalidParam};

use crate::endpoint::EndpointId;

mod pd;

pub(crate) use pd::Phase;
pub use pd::{HttpFacts, Overload, PdError, Side};

/// A boxed error, the currency of transports and bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// No route could be chosen for a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The endpoint set has no prefill endpoint.
    #[error("no prefill endpoint is available")]
    NoPrefill,
    /// The endpoint set has no decode endpoint.
    #[error("no decode endpoint is available")]
    NoDecode,
    /// No decode endpoint serves the requested model (404 `model_not_found`).
    #[error(
        "the model `{model}` does not exist; served models: {}",
        Served(served)
    )]
    UnknownModel {
        /// The model the client asked for.
        model: String,
        /// The models some decode endpoint serves, sorted.
        served: std::sync::Arc<[std::sync::Arc<str>]>,
    },
    /// The request names no model, and the endpoints serve several (400
    /// `model_required`).
    #[error("the request must name a `model`; served models: {}", Served(served))]
    ModelRequired {
        /// The models some decode endpoint serves, sorted.
        served: std::sync::Arc<[std::sync::Arc<str>]>,
    },
}

/// A model list, as error messages print it.
struct Served<'a>(&'a [std::sync::Arc<str>]);

/// The most served names an error message lists: the list comes from the engines'
/// answers and discovery (an engine's `/v1/models` may name thousands), and every
/// client asking for an unknown model would get all of them.
const MAX_LISTED: usize = 32;

impl fmt::Display for Served<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, m) in self.0.iter().take(MAX_LISTED).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(m)?;
        }
        if self.0.len() > MAX_LISTED {
            write!(f, " and {} more", self.0.len() - MAX_LISTED)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod served_tests {
    use super::*;

    #[test]
    fn an_error_lists_at_most_32_served_models() {
        let names: std::sync::Arc<[std::sync::Arc<str>]> = (0..1000)
            .map(|i| std::sync::Arc::from(format!("m{i}")))
            .collect();
        let err = RouteError::UnknownModel {
            model: "x".into(),
            served: names,
        };
        let text = err.to_string();
        assert!(text.ends_with("m30, m31 and 968 more"), "{text}");
        assert!(!text.contains("m32"), "{text}");
        let few: std::sync::Arc<[std::sync::Arc<str>]> =
            ["a", "b"].map(std::sync::Arc::from).into();
        let err = RouteError::ModelRequired { served: few };
        assert!(err.to_string().ends_with("served models: a, b"), "{err}");
    }
}

/// A connector could not build or complete a handoff.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    /// The connector needs a prefill endpoint, and the route has none.
    #[error("the {connector} connector needs a prefill endpoint")]
    NeedsPrefill {
        /// The connector's name.
        connector: &'static str,
    },
    /// The prefill's answer carried no usable handoff.
    #[error("prefill endpoint {endpoint} returned no `{field}`")]
    MissingHandoff {
        /// The prefill endpoint.
        endpoint: EndpointId,
        /// The field that was missing.
        field: &'static str,
    },
    /// The prefill's answer carried a handoff the decode cannot use
    /// ([`HandoffFound::Incomplete`](crate::connector::HandoffFound::Incomplete)), and the
    /// configuration fails such requests.
    #[error("prefill endpoint {endpoint} returned an incomplete `{field}`: {problem}")]
    IncompleteHandoff {
        /// The prefill endpoint.
        endpoint: EndpointId,
        /// The handoff field.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// An engine's answer named a sequence the request does not have (an `index` past
    /// its prompts times `n`): nothing is allocated for it, and the request fails.
    #[error(
        "prefill endpoint {endpoint} answered {what} {found}, beyond the request's {sequences} sequences"
    )]
    OutOfRange {
        /// The endpoint.
        endpoint: EndpointId,
        /// What was out of range (`index`, `list length`).
        what: &'static str,
        /// The value the engine wrote.
        found: String,
        /// How many sequences the request has.
        sequences: usize,
    },
    /// The prefill's answer carried the handoff field in an unusable shape.
    #[error("prefill endpoint {endpoint} returned a malformed `{field}`")]
    InvalidHandoff {
        /// The prefill endpoint.
        endpoint: EndpointId,
        /// The field.
        field: &'static str,
    },
    /// The prefill's 2xx answer is not a JSON object.
    #[error("prefill endpoint {endpoint} answered something that is not a JSON object")]
    InvalidAnswer {
        /// The prefill endpoint.
        endpoint: EndpointId,
        /// Why it did not parse.
        #[source]
        source: BodyError,
    },
    /// The prefill's bootstrap server could not tell what the handoff needs (vLLM
    /// Mooncake's engine id).
    #[error("bootstrap server {addr} of prefill endpoint {endpoint} gave no usable answer")]
    Bootstrap {
        /// The prefill endpoint.
        endpoint: EndpointId,
        /// The bootstrap server's address.
        addr: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The client's request asks for something the connector cannot carry (LMCache: more
    /// than one choice). Answered 400 `unsupported_by_connector`.
    #[error("the {connector} connector cannot serve {what}")]
    Unsupported {
        /// The connector's name.
        connector: &'static str,
        /// What it cannot serve.
        what: String,
    },
    /// The client's request has a parameter its engines would refuse, which the
    /// connector could tell only from what an engine told it (LMCache: a token limit
    /// above the room the prefill's context leaves, its length learned from the
    /// prefill's `/tokenize`). Answered as the proxy answers such a parameter found
    /// before routing: 400 `invalid_parameter`, the parameter as `param`, the engine's
    /// own words as the message, nothing in front of them.
    #[error(transparent)]
    Invalid(#[from] InvalidParam),
    /// An endpoint of the route lacks the configuration the connector needs (an LMCache
    /// decode without receiver ports).
    #[error("endpoint {endpoint} has no {what}")]
    NotConfigured {
        /// The endpoint.
        endpoint: EndpointId,
        /// What it lacks.
        what: &'static str,
    },
    /// A call the handoff needs on an engine failed (LMCache's `/tokenize`).
    #[error("{what} on endpoint {endpoint} failed")]
    Engine {
        /// The endpoint.
        endpoint: EndpointId,
        /// The call.
        what: &'static str,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The KV never became ready for the decode leg ([`KvGate`](crate::connector::KvGate)).
    #[error("KV for the decode leg will not be ready: {reason}")]
    NotReady {
        /// Why.
        reason: String,
    },
    /// An encoder's 2xx answer could not be used (E/P/D, [`encode`](crate::encode)).
    #[error("an encoder answered unusably: {problem}")]
    InvalidEncoderAnswer {
        /// What is wrong, in words.
        problem: &'static str,
        /// Why it did not parse, when it did not.
        #[source]
        source: Option<BodyError>,
    },
    /// A value the connector had to serialize could not be.
    #[error("could not encode `{field}`")]
    Encode {
        /// The field.
        field: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

impl ConnectorError {
    /// Whether this failure is the fault of the engine at `engine`: an answer of its
    /// that carried no usable handoff (missing, incomplete, malformed, naming a sequence
    /// the request does not have, not a JSON object), its bootstrap server that gave no
    /// usable answer, or a call on it that failed. The variants that name an engine
    /// blame it only when it is `engine` (a failure of the other leg's engine is not
    /// this one's), or a data-parallel rank of the same engine (a connector that picks
    /// the rank after routing sends the leg to a rank endpoint,
    /// [`proto::dp_rank`](crate::proto::dp_rank), and its errors name that). The
    /// others blame no engine: a route without a prefill, a client's request the
    /// connector cannot carry or a parameter of it the engines would refuse, an
    /// endpoint without the configuration the connector needs (the operator's), KV
    /// that will not be ready (the LMCache
    /// connector's declared-TP mismatch, its notification registry full or closed, a
    /// registration past its time to live: the proxy's side or its configuration; a
    /// gate that waits out the handoff budget is a timeout, not this), an encoder's
    /// answer, or a value the connector could not encode.
    pub(crate) fn blames(&self, engine: &EndpointId) -> bool {
        match self {
            ConnectorError::MissingHandoff { endpoint, .. }
            | ConnectorError::IncompleteHandoff { endpoint, .. }
            | ConnectorError::OutOfRange { endpoint, .. }
            | ConnectorError::InvalidHandoff { endpoint, .. }
            | ConnectorError::InvalidAnswer { endpoint, .. }
            | ConnectorError::Bootstrap { endpoint, .. }
            | ConnectorError::Engine { endpoint, .. } => endpoint.same_engine(engine),
            ConnectorError::NeedsPrefill { .. }
            | ConnectorError::Unsupported { .. }
            | ConnectorError::Invalid(_)
            | ConnectorError::NotConfigured { .. }
            | ConnectorError::NotReady { .. }
            | ConnectorError::InvalidEncoderAnswer { .. }
            | ConnectorError::Encode { .. } => false,
        }
    }
}

/// The transport could not complete an exchange with an endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// No connection could be made (refused, unreachable, DNS).
    #[error("connection failed")]
    Connect(#[source] BoxError),
    /// The exchange did not finish in time.
    #[error("timed out")]
    Timeout,
    /// The connection broke while sending or receiving.
    #[error("connection broke")]
    Io(#[source] BoxError),
}

impl TransportError {
    /// Whether the request certainly never reached the endpoint.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, TransportError::Connect(_))
    }
}

/// The message of an error and of each of its causes, joined with `": "`.
///
/// `Display` of disagg's errors describes one level only; this is what a client or a log
/// line should see.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_connection_certainly_never_reached_the_endpoint() {
        assert!(TransportError::Connect("refused".into()).is_connect());
        assert!(!TransportError::Timeout.is_connect());
        assert!(!TransportError::Io("reset".into()).is_connect());
    }

    #[test]
    fn a_connector_error_blames_only_the_engine_whose_fault_it_is() {
        let p = EndpointId::from("http://p:1");
        let d = EndpointId::from("http://d:1");
        let named = |endpoint: &EndpointId| {
            let endpoint = endpoint.clone();
            [
                ConnectorError::MissingHandoff {
                    endpoint: endpoint.clone(),
                    field: "kv handoff",
                },
                ConnectorError::IncompleteHandoff {
                    endpoint: endpoint.clone(),
                    field: "kv_transfer_params",
                    problem: "no remote_block_ids",
                },
                ConnectorError::OutOfRange {
                    endpoint: endpoint.clone(),
                    what: "index",
                    found: "9".into(),
                    sequences: 1,
                },
                ConnectorError::InvalidHandoff {
                    endpoint: endpoint.clone(),
                    field: "kv_transfer_params",
                },
                ConnectorError::InvalidAnswer {
                    endpoint: endpoint.clone(),
                    source: BodyError::NotAnObject,
                },
                ConnectorError::Bootstrap {
                    endpoint: endpoint.clone(),
                    addr: "p:8998".into(),
                    source: "refused".into(),
                },
                ConnectorError::Engine {
                    endpoint,
                    what: "/tokenize",
                    source: "refused".into(),
                },
            ]
        };
        for e in named(&p) {
            assert!(e.blames(&p), "{e:?}");
            assert!(!e.blames(&d), "another engine's: {e:?}");
        }
        // A data-parallel rank of the engine (a connector that picked the rank after
        // routing names it) is the same engine, whichever rank the route named; an
        // engine whose URL merely starts the same is not.
        let rank = EndpointId::from("http://p:1@1");
        for e in named(&rank) {
            assert!(e.blames(&p), "the routed engine: {e:?}");
            assert!(e.blames(&EndpointId::from("http://p:1@0")), "{e:?}");
            assert!(!e.blames(&EndpointId::from("http://p:10")), "{e:?}");
            assert!(!e.blames(&EndpointId::from("http://d:1@1")), "{e:?}");
        }
        for e in named(&p) {
            assert!(e.blames(&EndpointId::from("http://p:1@2")), "{e:?}");
        }
        let blameless = [
            ConnectorError::NeedsPrefill { connector: "nixl" },
            ConnectorError::Unsupported {
                connector: "lmcache",
                what: "n > 1".into(),
            },
            ConnectorError::Invalid(InvalidParam::new("max_tokens", "too large")),
            ConnectorError::NotConfigured {
                endpoint: p.clone(),
                what: "receiver ports",
            },
            ConnectorError::NotReady {
                reason: "notification listener closed".into(),
            },
            ConnectorError::InvalidEncoderAnswer {
                problem: "no items",
                source: None,
            },
            ConnectorError::Encode {
                field: "bootstrap_host",
                source: serde_json::from_str::<u8>("x").unwrap_err(),
            },
        ];
        for e in blameless {
            assert!(!e.blames(&p) && !e.blames(&d), "{e:?}");
        }
    }
}
