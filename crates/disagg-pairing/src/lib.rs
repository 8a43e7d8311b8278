//! P/D pairing facts: what an endpoint declares about its KV transfer, and whether one
//! prefill/decode pair can hand KV over.
//!
//! The orchestrator never reads these facts: they are declared by whoever makes the
//! endpoints (`disagg-discovery`, the proxy's flags, a connector's helper), checked by
//! [`check_pair`] against the connector's rule for TP sizes ([`KvConnector::bridges_tp`])
//! and enforced, optionally, by `disagg-resilience`, which also compares the engines'
//! versions for the connectors whose [`KvConnector::equal_versions`] asks.
//!
//! An endpoint may declare, in a [`KvProfile`] kept in its
//! [`Endpoint::ext`](disagg_core::Endpoint::ext), the KV connector its engine runs
//! (vLLM's `kv_connector`, or `sglang`), its `kv_role` and its tensor-parallel size.
//! [`check_pair`] checks one pair of profiles against the orchestrator's connector and
//! names the [`Mismatch`] (the first three below; the fourth, [`Mismatch::Versions`], is
//! named by `disagg_resilience::pairing::check_versions`, not by [`check_pair`]):
//!
//! - a declared connector that differs from the other engine's or from the proxy's
//!   (engines of different connectors never meet: a NIXL decode cannot read from a
//!   Mooncake prefill);
//! - roles that cannot hand over: the prefill must be `kv_producer` or `kv_both`, the
//!   decode `kv_consumer` or `kv_both`;
//! - tensor-parallel sizes the connector cannot bridge
//!   ([`KvConnector::bridges_tp`]);
//! - engine versions that differ, for the connectors whose handshake compares them
//!   ([`KvConnector::equal_versions`]; read and compared by
//!   `disagg_resilience::pairing::{read_version, check_versions}`): vLLM's NIXL connector refuses a
//!   peer whose compatibility hash differs, and the hash covers the vLLM version
//!   (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py`); with the default
//!   `kv_load_failure_policy` of `fail` (`vllm/config/kv_transfer.py`) every request of
//!   such a pair errors. Mooncake pairs are held to one build likewise. The version is
//!   not declared but read from the engine: vLLM answers `GET /version` with
//!   `{"version": "0.33.0"}`.
//!
//! The profile is the one place a size is declared. Where a connector's own endpoint
//! configuration already fixes the size, the connector's helper writes it into the
//! profile when it installs that configuration (`disagg_connectors::lmcache::LmcacheReceiver::insert_into`:
//! a decode's receiver port count is its TP size), so the check needs no
//! connector-specific hook. What an endpoint does not declare is not checked; likewise a
//! version an engine does not tell (no answer to `GET /version`, another status, a body
//! without a version) is not checked: the pair is taken as one with an undeclared TP
//! size is.
//!
//! These are the facts connectors share. Enforcing them over a whole endpoint set is
//! optional and lives in `disagg-resilience` (`disagg_resilience::pairing`: `check_pairs`
//! refuses every pair that cannot hand over, naming both endpoints, and
//! `ValidatedSource` applies it at start-up and to every set a source publishes later).

use std::fmt;
use std::str::FromStr;

use disagg_core::KvConnector;
use disagg_core::endpoint::EndpointId;

/// An engine's `kv_role` (vLLM `kv_transfer_config.kv_role`; SGLang's
/// `--disaggregation-mode prefill|decode` maps to producer and consumer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    /// `kv_producer`: computes KV for others.
    Producer,
    /// `kv_consumer`: receives KV from others.
    Consumer,
    /// `kv_both`: either.
    Both,
}

impl KvRole {
    /// The role as vLLM writes it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

impl fmt::Display for KvRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text is not a `kv_role`.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a kv_role (kv_producer, kv_consumer, kv_both; or prefill, decode)")]
pub struct KvRoleError(String);

impl FromStr for KvRole {
    type Err = KvRoleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "kv_producer" | "producer" | "prefill" => Ok(KvRole::Producer),
            "kv_consumer" | "consumer" | "decode" => Ok(KvRole::Consumer),
            "kv_both" | "both" => Ok(KvRole::Both),
            _ => Err(KvRoleError(s.to_owned())),
        }
    }
}

/// What an endpoint declares about its KV transfer; every part optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvProfile {
    /// The engine's KV connector: vLLM's `kv_connector` (`NixlConnector`,
    /// `MooncakeConnector`, ...), or a disagg connector name (`nixl`, `vllm-mooncake`,
    /// `sglang`). Compared by the protocol the name stands for, so that vLLM's and
    /// disagg's spellings match (`NixlConnector` and `vllm-nixl` are both NIXL,
    /// `LMCacheConnectorV1` and `lmcache` both LMCache).
    pub connector: Option<String>,
    /// The engine's `kv_role`.
    pub role: Option<KvRole>,
    /// The engine's tensor-parallel size.
    pub tp_size: Option<u32>,
}

/// The protocol a connector name stands for, so that the engines' and disagg's
/// spellings compare equal: lowercase, without the engine family before a `-` (disagg
/// names its connectors `FAMILY-PROTOCOL` or `PROTOCOL`), without `connector` and
/// without a trailing interface version (`NixlConnector` and `vllm-nixl` are both
/// `nixl`; `LMCacheConnectorV1` and `lmcache` are both `lmcache`).
pub(crate) fn connector_kind(name: &str) -> String {
    let lower = name.trim().to_ascii_lowercase();
    let lower = match lower.split_once('-') {
        Some((_, protocol)) if !protocol.is_empty() => protocol,
        _ => &lower,
    };
    let kind = lower.replace("connector", "").replace(['-', '_'], "");
    // vLLM names some connectors after the version of its connector interface
    // (`LMCacheConnectorV1` implements `KVConnectorBase_V1`): the version says nothing
    // of the wire protocol, so `lmcachev1` is `lmcache`.
    let unnumbered = kind.trim_end_matches(|c: char| c.is_ascii_digit());
    if unnumbered.len() < kind.len()
        && let Some(base) = unnumbered.strip_suffix('v')
        && !base.is_empty()
    {
        return base.to_owned();
    }
    kind
}

/// Why one pair cannot hand over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// The two engines declare different connectors.
    #[error("the prefill runs connector `{prefill}` and the decode `{decode}`")]
    Connectors {
        /// The prefill's connector.
        prefill: String,
        /// The decode's connector.
        decode: String,
    },
    /// An engine declares a connector other than the proxy's.
    #[error("the {leg} runs connector `{declared}` but the proxy speaks `{proxy}`")]
    NotTheProxys {
        /// `prefill` or `decode`.
        leg: &'static str,
        /// The engine's connector.
        declared: String,
        /// The proxy's connector.
        proxy: &'static str,
    },
    /// The prefill is declared a pure consumer.
    #[error("the prefill is declared {0}, which cannot produce KV")]
    PrefillRole(KvRole),
    /// The decode is declared a pure producer.
    #[error("the decode is declared {0}, which cannot consume KV")]
    DecodeRole(KvRole),
    /// The connector cannot bridge the two tensor-parallel sizes.
    #[error(
        "connector `{connector}` cannot hand KV from tensor-parallel size {prefill} to {decode}"
    )]
    TpSize {
        /// The proxy's connector.
        connector: &'static str,
        /// The prefill's TP size.
        prefill: u32,
        /// The decode's TP size.
        decode: u32,
    },
    /// The engines run different versions and the connector needs one build on both
    /// sides ([`KvConnector::equal_versions`]).
    #[error(
        "the prefill runs version {prefill} and the decode version {decode}, and connector `{connector}` needs one engine build on both sides (its handshake compares them)"
    )]
    Versions {
        /// The proxy's connector.
        connector: &'static str,
        /// The prefill's `GET /version`.
        prefill: String,
        /// The decode's `GET /version`.
        decode: String,
    },
}

impl Mismatch {
    /// A short name of the kind of mismatch, for a metric's label: `connector`,
    /// `role`, `tp_size` or `version`.
    pub fn kind(&self) -> &'static str {
        match self {
            Mismatch::Connectors { .. } | Mismatch::NotTheProxys { .. } => "connector",
            Mismatch::PrefillRole(_) | Mismatch::DecodeRole(_) => "role",
            Mismatch::TpSize { .. } => "tp_size",
            Mismatch::Versions { .. } => "version",
        }
    }
}

/// One prefill/decode pair that cannot hand KV over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("prefill endpoint {prefill} and decode endpoint {decode} cannot be paired: {mismatch}")]
pub struct PairError {
    /// The prefill endpoint.
    pub prefill: EndpointId,
    /// The decode endpoint.
    pub decode: EndpointId,
    /// Why.
    pub mismatch: Mismatch,
}

/// Check one pair of declared profiles against `connector`.
///
/// # Errors
///
/// The first [`Mismatch`] found.
pub fn check_pair(
    prefill: &KvProfile,
    decode: &KvProfile,
    connector: &dyn KvConnector,
) -> Result<(), Mismatch> {
    let proxy = connector.name();
    let proxy_kind = connector_kind(proxy);
    if let (Some(p), Some(d)) = (&prefill.connector, &decode.connector)
        && connector_kind(p) != connector_kind(d)
    {
        return Err(Mismatch::Connectors {
            prefill: p.clone(),
            decode: d.clone(),
        });
    }
    for (leg, declared) in [
        ("prefill", &prefill.connector),
        ("decode", &decode.connector),
    ] {
        if let Some(c) = declared
            && connector_kind(c) != proxy_kind
        {
            return Err(Mismatch::NotTheProxys {
                leg,
                declared: c.clone(),
                proxy,
            });
        }
    }
    if let Some(r @ KvRole::Consumer) = prefill.role {
        return Err(Mismatch::PrefillRole(r));
    }
    if let Some(r @ KvRole::Producer) = decode.role {
        return Err(Mismatch::DecodeRole(r));
    }
    if let (Some(p), Some(d)) = (prefill.tp_size, decode.tp_size)
        && !connector.bridges_tp(p, d)
    {
        return Err(Mismatch::TpSize {
            connector: proxy,
            prefill: p,
            decode: d,
        });
    }
    Ok(())
}

// === encoder (EC) profiles ===

/// An engine's `ec_role` (vLLM `--ec-transfer-config`'s `ec_role`,
/// `vllm/config/ec_transfer.py`): whether it produces encoder outputs (an encoder-only
/// instance), consumes them (the prefill, or the prefill-decode engine, of E/P/D), or
/// both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcRole {
    /// `ec_producer`: encodes media items for others.
    Producer,
    /// `ec_consumer`: loads the encoders' outputs.
    Consumer,
    /// `ec_both`: either.
    Both,
}

impl EcRole {
    /// The role as vLLM writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            EcRole::Producer => "ec_producer",
            EcRole::Consumer => "ec_consumer",
            EcRole::Both => "ec_both",
        }
    }
}

impl fmt::Display for EcRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EcRole {
    type Err = EcProfileError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ec_producer" | "producer" => Ok(EcRole::Producer),
            "ec_consumer" | "consumer" => Ok(EcRole::Consumer),
            "ec_both" | "both" => Ok(EcRole::Both),
            _ => Err(EcProfileError(format!(
                "`{}` is not an ec_role (ec_producer, ec_consumer, ec_both)",
                s.trim()
            ))),
        }
    }
}

/// What an endpoint declares about its encoder-output (EC) transfer, E/P/D; every part
/// optional. Written `CONNECTOR,ROLE` (`ECExampleConnector,ec_producer`, `cpu,ec_consumer`,
/// `,ec_both`) on the command line (`--ec-profile URL=…`), in the Kubernetes annotation
/// `disagg.io/ec-profile` and in an endpoints file's `ec_profile`.
///
/// # Examples
///
/// ```
/// use disagg_pairing::{EcProfile, EcRole, check_ec_pair};
/// let encoder: EcProfile = "ECExampleConnector,ec_producer".parse()?;
/// let prefill: EcProfile = "example,ec_consumer".parse()?;
/// assert_eq!(encoder.role, Some(EcRole::Producer));
/// assert!(check_ec_pair(&encoder, &prefill).is_ok());
/// let other: EcProfile = "ECMooncakeConnector,ec_consumer".parse()?;
/// assert!(check_ec_pair(&encoder, &other).is_err());
/// # Ok::<(), disagg_pairing::EcProfileError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EcProfile {
    /// The engine's EC connector: vLLM's `ec_connector` (`ECExampleConnector`,
    /// `ECCPUConnector`, `ECMooncakeConnector`) or its short form (`example`, `cpu`,
    /// `mooncake`), compared by the connector it names.
    pub connector: Option<String>,
    /// The engine's `ec_role`.
    pub role: Option<EcRole>,
}

/// An EC profile that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ec profile: {0}")]
pub struct EcProfileError(String);

impl FromStr for EcProfile {
    type Err = EcProfileError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',').map(str::trim);
        let connector = parts.next().filter(|c| !c.is_empty()).map(str::to_owned);
        let role = parts
            .next()
            .filter(|r| !r.is_empty())
            .map(str::parse::<EcRole>)
            .transpose()?;
        if parts.next().is_some() {
            return Err(EcProfileError(format!(
                "`{s}` has more than CONNECTOR,ROLE"
            )));
        }
        if let Some(c) = &connector
            && !c
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return Err(EcProfileError(format!("`{c}` is not a connector name")));
        }
        Ok(EcProfile { connector, role })
    }
}

/// The EC connector a name stands for, so that vLLM's class names and their short forms
/// compare equal: lowercase, without a leading `ec` and without `connector`
/// (`ECExampleConnector` and `example` are both `example`, `ECCPUConnector` and `cpu`
/// both `cpu`, `ECMooncakeConnector` and `mooncake` both `mooncake`).
pub fn ec_connector_kind(name: &str) -> String {
    let lower = name.trim().to_ascii_lowercase().replace(['-', '_'], "");
    let lower = lower.replace("connector", "");
    match lower.strip_prefix("ec") {
        Some(rest) if !rest.is_empty() => rest.to_owned(),
        _ => lower,
    }
}

/// Why an encoder cannot hand its outputs to a consumer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EcMismatch {
    /// The two engines declare different EC connectors.
    #[error("the encoder runs EC connector `{encoder}` and the consumer `{consumer}`")]
    Connectors {
        /// The encoder's connector.
        encoder: String,
        /// The consumer's connector.
        consumer: String,
    },
    /// The encoder is declared a pure consumer.
    #[error("the encoder is declared {0}, which cannot produce encoder outputs")]
    EncoderRole(EcRole),
    /// The consumer is declared a pure producer.
    #[error("the consumer is declared {0}, which cannot consume encoder outputs")]
    ConsumerRole(EcRole),
}

impl EcMismatch {
    /// A short name of the kind of mismatch, for a metric's label: `connector` or
    /// `role` (as [`Mismatch::kind`]).
    pub fn kind(&self) -> &'static str {
        match self {
            EcMismatch::Connectors { .. } => "connector",
            EcMismatch::EncoderRole(_) | EcMismatch::ConsumerRole(_) => "role",
        }
    }
}

/// One encoder and consumer (the prefill, or the prefill-decode engine of E → PD) that
/// cannot hand encoder outputs over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "encoder endpoint {encoder} and {consumer_role} endpoint {consumer} cannot be paired: {mismatch}"
)]
pub struct EcPairError {
    /// The encoder endpoint.
    pub encoder: EndpointId,
    /// The consumer endpoint.
    pub consumer: EndpointId,
    /// The consumer's role: `prefill`, or `decode` for a prefill-decode engine.
    pub consumer_role: &'static str,
    /// Why.
    pub mismatch: EcMismatch,
}

/// Check one encoder and consumer pair of declared EC profiles: the same connector when
/// both declare one, an encoder that can produce (`ec_producer` or `ec_both`) and a
/// consumer that can consume (`ec_consumer` or `ec_both`). What is not declared is not
/// checked.
///
/// # Errors
///
/// The first [`EcMismatch`] found.
pub fn check_ec_pair(encoder: &EcProfile, consumer: &EcProfile) -> Result<(), EcMismatch> {
    if let (Some(e), Some(c)) = (&encoder.connector, &consumer.connector)
        && ec_connector_kind(e) != ec_connector_kind(c)
    {
        return Err(EcMismatch::Connectors {
            encoder: e.clone(),
            consumer: c.clone(),
        });
    }
    if let Some(r @ EcRole::Consumer) = encoder.role {
        return Err(EcMismatch::EncoderRole(r));
    }
    if let Some(r @ EcRole::Producer) = consumer.role {
        return Err(EcMismatch::ConsumerRole(r));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_compare_vllm_and_disagg_spellings() {
        assert_eq!(connector_kind("NixlConnector"), "nixl");
        assert_eq!(connector_kind("vllm-nixl"), "nixl");
        assert_eq!(connector_kind("MooncakeConnector"), "mooncake");
        assert_eq!(connector_kind("vllm-mooncake"), "mooncake");
        assert_eq!(connector_kind("sglang"), "sglang");
        assert_eq!(connector_kind("LMCacheConnectorV1"), "lmcache");
        assert_eq!(connector_kind("lmcache"), "lmcache");
        // Only a `v` followed by digits is a version.
        assert_eq!(connector_kind("P2pNcclConnector"), "p2pnccl");
        assert_eq!(connector_kind("LMCacheMPConnector"), "lmcachemp");
        assert_eq!("kv_both".parse::<KvRole>().unwrap(), KvRole::Both);
        assert!("kv_nothing".parse::<KvRole>().is_err());
    }

    #[test]
    fn ec_kinds_compare_vllm_class_names_and_short_forms() {
        for (long, short) in [
            ("ECExampleConnector", "example"),
            ("ECCPUConnector", "cpu"),
            ("ECMooncakeConnector", "mooncake"),
        ] {
            assert_eq!(ec_connector_kind(long), short);
            assert_eq!(ec_connector_kind(short), short);
        }
        assert_ne!(
            ec_connector_kind("ECExampleConnector"),
            ec_connector_kind("ECMooncakeConnector")
        );
    }

    #[test]
    fn ec_pairs_need_one_connector_a_producer_and_a_consumer() {
        let p = |s: &str| s.parse::<EcProfile>().unwrap();
        assert!(
            check_ec_pair(
                &p("ECExampleConnector,ec_producer"),
                &p("example,ec_consumer")
            )
            .is_ok()
        );
        assert!(check_ec_pair(&p(",ec_both"), &p(",ec_both")).is_ok());
        assert!(check_ec_pair(&EcProfile::default(), &p("cpu,ec_consumer")).is_ok());
        assert!(matches!(
            check_ec_pair(&p("cpu,ec_producer"), &p("mooncake,ec_consumer")),
            Err(EcMismatch::Connectors { .. })
        ));
        assert_eq!(
            check_ec_pair(&p("cpu,ec_consumer"), &p("cpu,ec_consumer")),
            Err(EcMismatch::EncoderRole(EcRole::Consumer))
        );
        assert_eq!(
            check_ec_pair(&p("cpu,ec_producer"), &p("cpu,ec_producer")),
            Err(EcMismatch::ConsumerRole(EcRole::Producer))
        );
        assert!("cpu,ec_maybe".parse::<EcProfile>().is_err());
        assert!("cpu,ec_producer,1".parse::<EcProfile>().is_err());
    }
}
