//! Errors of the port arithmetic, the planner and the plan file.

/// A port computation left the usable range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PortError {
    /// The port is above 65535 or below 1024 (the privileged ports).
    #[error("port {port} is outside 1024-65535")]
    OutOfRange {
        /// The computed port, unbounded.
        port: u64,
    },
}

/// Why the planner refused a plan.
///
/// Every variant names the engine(s) concerned as `<deployment>/<replica>` on a host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A size (`replicas`, `dp`, `tp`, `pp`) is zero.
    #[error("deployment {deployment} on {host}: `{field}` must be at least 1")]
    ZeroSize {
        /// The deployment's name.
        deployment: String,
        /// The host it is on.
        host: String,
        /// The field that is zero.
        field: &'static str,
    },
    /// An engine's listeners would fall outside 1024-65535.
    #[error("engine {engine} on {host}: side-channel port {port} is outside 1024-65535")]
    PortOutOfRange {
        /// The engine.
        engine: String,
        /// Its host.
        host: String,
        /// The offending port, unbounded.
        port: u64,
    },
    /// An engine's listeners overlap the operating system's ephemeral port range, from
    /// which any outgoing connection may take a port first.
    #[error(
        "engine {engine} on {host}: side-channel ports {first}-{last} overlap the ephemeral range {ephemeral_first}-{ephemeral_last}"
    )]
    EphemeralOverlap {
        /// The engine.
        engine: String,
        /// Its host.
        host: String,
        /// The engine's first listener.
        first: u16,
        /// The engine's last listener.
        last: u16,
        /// The ephemeral range's first port.
        ephemeral_first: u16,
        /// The ephemeral range's last port.
        ephemeral_last: u16,
    },
    /// Two engines on one host would listen on the same port ("address already in use").
    #[error("engines {first} and {second} both listen on {host}:{port}")]
    PortCollision {
        /// The engine planned first.
        first: String,
        /// The engine planned second.
        second: String,
        /// The host both are on.
        host: String,
        /// The port both would bind.
        port: u16,
    },
    /// Prefill and decode are on different hosts, yet an engine advertises a loopback
    /// or unspecified side-channel host (`localhost`, `127.x`, `::1`, `0.0.0.0`, `::`,
    /// or one of those as IPv4-mapped IPv6) that a peer on another machine cannot reach.
    #[error(
        "engine {engine} on {host}: side-channel host {side_channel_host} is loopback or unspecified, but prefill and decode run on different hosts"
    )]
    LoopbackAcrossHosts {
        /// The engine.
        engine: String,
        /// Its host.
        host: String,
        /// The loopback or unspecified side-channel host it would advertise.
        side_channel_host: String,
    },
    /// Two engines would get the same engine id.
    #[error("engines {first} and {second} would share the engine id {engine_id}")]
    DuplicateEngineId {
        /// The engine planned first.
        first: String,
        /// The engine planned second.
        second: String,
        /// The repeated id.
        engine_id: String,
    },
    /// Two deployments on one host share a name, so their engines cannot be told apart.
    #[error("host {host} has two deployments named {deployment}")]
    DuplicateDeployment {
        /// The host.
        host: String,
        /// The repeated name.
        deployment: String,
    },
    /// The ephemeral range given is empty (`first > last`).
    #[error("ephemeral port range {first}-{last} is empty")]
    EmptyEphemeralRange {
        /// The range's first port.
        first: u16,
        /// The range's last port.
        last: u16,
    },
}

/// A plan file could not be read as TOML.
#[derive(Debug, thiserror::Error)]
#[error("invalid plan file")]
pub struct ParseError {
    #[source]
    source: toml::de::Error,
}

// === impl ParseError ===

impl ParseError {
    pub(crate) fn new(source: toml::de::Error) -> Self {
        Self { source }
    }
}
