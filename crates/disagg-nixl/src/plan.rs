//! The planner: from a node plan (hosts and their deployments) to every engine's
//! side-channel host, listener ports, engine id and launch environment.
//!
//! A [`Plan`] is usually read from TOML with [`Plan::from_toml`]; [`Plan::plan`] checks it
//! and returns a [`NodePlan`] or the first [`PlanError`] found.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::error::{ParseError, PlanError};
use crate::port::{self, NixlRole, Offset, PortScheme};

/// A deployment plan: the port layout of the engines deployed, the OS ephemeral range to
/// avoid, and the hosts with their deployments.
///
/// # Examples
///
/// ```
/// use disagg_nixl::{Plan, PortScheme};
/// let plan = Plan::from_toml(r#"
/// scheme = "per-tp-worker"
///
/// [[host]]
/// address = "10.0.0.5"
///
/// [[host.deployment]]
/// name = "prefill"
/// role = "prefill"
/// tp = 2
/// "#)?;
/// assert_eq!(plan.scheme, PortScheme::PerTpWorker);
/// assert_eq!(plan.hosts[0].deployments[0].tp, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Plan {
    /// The listener layout of the vLLM engines deployed (`scheme = "per-engine"` or
    /// `"per-tp-worker"`; default per-engine, the newer vLLM layout).
    #[serde(default)]
    pub scheme: PortScheme,
    /// The OS ephemeral port range to stay out of (Linux
    /// `/proc/sys/net/ipv4/ip_local_port_range`, typically 32768-60999), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_ports: Option<PortRange>,
    /// The hosts (`[[host]]` tables).
    #[serde(default, rename = "host")]
    pub hosts: Vec<Host>,
}

/// An inclusive range of ports (`{ first = 32768, last = 60999 }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRange {
    /// The first port of the range.
    pub first: u16,
    /// The last port of the range, included.
    pub last: u16,
}

/// One machine and the deployments it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Host {
    /// The host's address as peers reach it (IP or DNS name). It is the default
    /// side-channel host and part of every engine id.
    pub address: String,
    /// The deployments on this host (`[[host.deployment]]` tables).
    #[serde(default, rename = "deployment")]
    pub deployments: Vec<Deployment>,
}

/// A group of identical engines of one role on one host.
///
/// Each of the `replicas` engines is one vLLM server with `dp` data-parallel ranks of
/// `tp` × `pp` devices. Replica `r` gets `VLLM_NIXL_SIDE_CHANNEL_PORT = port` if `port`
/// is set, else `base (or the role default) + r × tp × pp`, as Ray Serve LLM computes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Deployment {
    /// The deployment's name, unique on its host; the prefix of its engine ids.
    pub name: String,
    /// Prefill or decode.
    pub role: NixlRole,
    /// How many engines (default 1).
    #[serde(default = "one")]
    pub replicas: u32,
    /// Data-parallel size of each engine (default 1).
    #[serde(default = "one")]
    pub dp: u32,
    /// Tensor-parallel size (default 1).
    #[serde(default = "one")]
    pub tp: u32,
    /// Pipeline-parallel size (default 1).
    #[serde(default = "one")]
    pub pp: u32,
    /// `NIXL_SIDE_CHANNEL_PORT_BASE`: replaces the role's default base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u16>,
    /// An explicit `VLLM_NIXL_SIDE_CHANNEL_PORT`, used as is by every replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST`; the host's address when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_channel_host: Option<String>,
}

fn one() -> u32 {
    1
}

/// The planner's answer: every engine of the plan, in plan order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct NodePlan {
    /// The listener layout the ports were computed for.
    pub scheme: PortScheme,
    /// The engines, host by host, deployment by deployment, replica by replica.
    pub engines: Vec<EnginePlan>,
}

/// One engine's side-channel assignment and the environment to launch it with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct EnginePlan {
    /// `<deployment>/<replica>`, the name errors and tables use.
    pub engine: String,
    /// The deployment's name.
    pub deployment: String,
    /// The replica's rank in its deployment.
    pub replica: u32,
    /// Prefill or decode.
    pub role: NixlRole,
    /// The host's address.
    pub host: String,
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST`: the interface bound and advertised as `remote_host`.
    pub side_channel_host: String,
    /// `VLLM_NIXL_SIDE_CHANNEL_PORT`: the first listener.
    pub port: u16,
    /// Every listener the engine opens under the plan's scheme, in rank order.
    pub listeners: Vec<u16>,
    /// The unique engine id, `<deployment>-<host>-<port>`.
    pub engine_id: String,
    /// The environment variables to set, by name.
    pub env: BTreeMap<String, String>,
    /// The `--kv-transfer-config` JSON.
    pub kv_transfer_config: String,
}

// === impl Plan ===

impl Plan {
    /// An empty plan with the given listener layout.
    pub fn new(scheme: PortScheme) -> Self {
        Self {
            scheme,
            ..Self::default()
        }
    }

    /// Sets the OS ephemeral range the plan must avoid.
    pub fn with_ephemeral_ports(mut self, first: u16, last: u16) -> Self {
        self.ephemeral_ports = Some(PortRange { first, last });
        self
    }

    /// Adds a host.
    pub fn with_host(mut self, host: Host) -> Self {
        self.hosts.push(host);
        self
    }

    /// Reads a plan from TOML.
    ///
    /// # Errors
    ///
    /// [`ParseError`] on invalid TOML, a missing field or an unknown one.
    pub fn from_toml(text: &str) -> Result<Self, ParseError> {
        toml::from_str(text).map_err(ParseError::new)
    }

    /// Computes every engine's side-channel ports, host, id and environment.
    ///
    /// # Errors
    ///
    /// The first [`PlanError`] found: a zero size, a port outside 1024-65535, listeners
    /// in the ephemeral range, two engines on one host sharing a port (naming both and
    /// the port), a loopback side-channel host while prefill and decode are on different
    /// hosts, or a repeated engine id or deployment name.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::{Deployment, Host, Plan, PortScheme, NixlRole};
    /// let plan = Plan::new(PortScheme::PerEngine).with_host(
    ///     Host::new("10.0.0.5")
    ///         .with_deployment(Deployment::new("p", NixlRole::Prefill))
    ///         .with_deployment(Deployment::new("d", NixlRole::Decode)),
    /// );
    /// let out = plan.plan()?;
    /// assert_eq!(out.engines[0].engine_id, "p-10.0.0.5-20000");
    /// assert_eq!(out.engines[1].listeners, [22000]);
    ///
    /// // The same base twice: "address already in use" caught before launch.
    /// let clash = Plan::new(PortScheme::PerEngine).with_host(
    ///     Host::new("10.0.0.5")
    ///         .with_deployment(Deployment::new("a", NixlRole::Prefill))
    ///         .with_deployment(Deployment::new("b", NixlRole::Prefill)),
    /// );
    /// let err = clash.plan().unwrap_err().to_string();
    /// assert_eq!(err, "engines a/0 and b/0 both listen on 10.0.0.5:20000");
    /// # Ok::<(), disagg_nixl::PlanError>(())
    /// ```
    pub fn plan(&self) -> Result<NodePlan, PlanError> {
        if let Some(range) = self.ephemeral_ports
            && range.first > range.last
        {
            return Err(PlanError::EmptyEphemeralRange {
                first: range.first,
                last: range.last,
            });
        }
        let mut engines = Vec::new();
        // (host, port) → engine, and engine id → engine: the uniqueness checks.
        let mut bound: HashMap<(&str, u16), String> = HashMap::new();
        let mut ids: HashMap<String, String> = HashMap::new();
        for host in &self.hosts {
            let mut names = BTreeSet::new();
            for deployment in &host.deployments {
                if !names.insert(deployment.name.as_str()) {
                    return Err(PlanError::DuplicateDeployment {
                        host: host.address.clone(),
                        deployment: deployment.name.clone(),
                    });
                }
                deployment.check_sizes(&host.address)?;
                for replica in 0..deployment.replicas {
                    let engine = self.engine(host, deployment, replica)?;
                    for &port in &engine.listeners {
                        if let Some(first) =
                            bound.insert((&host.address, port), engine.engine.clone())
                        {
                            return Err(PlanError::PortCollision {
                                first,
                                second: engine.engine,
                                host: host.address.clone(),
                                port,
                            });
                        }
                    }
                    if let Some(first) = ids.insert(engine.engine_id.clone(), engine.engine.clone())
                    {
                        return Err(PlanError::DuplicateEngineId {
                            first,
                            second: engine.engine,
                            engine_id: engine.engine_id,
                        });
                    }
                    engines.push(engine);
                }
            }
        }
        check_loopback(&engines)?;
        Ok(NodePlan {
            scheme: self.scheme,
            engines,
        })
    }

    /// Plans one engine, checking its ports against the usable and ephemeral ranges.
    fn engine(
        &self,
        host: &Host,
        deployment: &Deployment,
        replica: u32,
    ) -> Result<EnginePlan, PlanError> {
        let engine = format!("{}/{replica}", deployment.name);
        let out_of_range = |e: crate::PortError| {
            let crate::PortError::OutOfRange { port } = e;
            PlanError::PortOutOfRange {
                engine: engine.clone(),
                host: host.address.clone(),
                port,
            }
        };
        let port = port::side_channel_port(
            deployment.role,
            deployment.port,
            deployment.base,
            Offset::Replica {
                rank: replica,
                tp: deployment.tp,
                pp: deployment.pp,
            },
        )
        .map_err(out_of_range)?;
        let listeners = self
            .scheme
            .listeners(port, deployment.dp, deployment.tp)
            .map_err(out_of_range)?;
        let last = listeners.last().copied().unwrap_or(port);
        if let Some(range) = self.ephemeral_ports
            && port <= range.last
            && last >= range.first
        {
            return Err(PlanError::EphemeralOverlap {
                engine,
                host: host.address.clone(),
                first: port,
                last,
                ephemeral_first: range.first,
                ephemeral_last: range.last,
            });
        }
        let side_channel_host = deployment
            .side_channel_host
            .clone()
            .unwrap_or_else(|| host.address.clone());
        let engine_id = format!("{}-{}-{port}", deployment.name, host.address);
        let kv_transfer_config = kv_transfer_config(&engine_id);
        let env = BTreeMap::from([
            (port::HOST_ENV.to_owned(), side_channel_host.clone()),
            (port::PORT_ENV.to_owned(), port.to_string()),
        ]);
        Ok(EnginePlan {
            engine,
            deployment: deployment.name.clone(),
            replica,
            role: deployment.role,
            host: host.address.clone(),
            side_channel_host,
            port,
            listeners,
            engine_id,
            env,
            kv_transfer_config,
        })
    }
}

/// Refuses loopback and unspecified side-channel hosts when prefill and decode are on
/// different hosts.
///
/// Every engine is checked, not only prefills: the engines run as `kv_both`, and the
/// prefill's `remote_host` is literally its `VLLM_NIXL_SIDE_CHANNEL_HOST` (vllm-project/vllm
/// `vllm/envs.py` and `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`, e.g.
/// commit 002a105; `docs/features/nixl_connector_usage.md`).
fn check_loopback(engines: &[EnginePlan]) -> Result<(), PlanError> {
    let roles: BTreeSet<NixlRole> = engines.iter().map(|e| e.role).collect();
    let hosts: BTreeSet<&str> = engines.iter().map(|e| e.host.as_str()).collect();
    if roles.len() < 2 || hosts.len() < 2 {
        return Ok(());
    }
    match engines.iter().find(|e| is_loopback(&e.side_channel_host)) {
        Some(e) => Err(PlanError::LoopbackAcrossHosts {
            engine: e.engine.clone(),
            host: e.host.clone(),
            side_channel_host: e.side_channel_host.clone(),
        }),
        None => Ok(()),
    }
}

/// A host no other machine reaches this engine at: `localhost` (any case, with or
/// without a trailing dot), 127.0.0.0/8, `::1`, an unspecified address (`0.0.0.0`,
/// `::`: fine to bind, but vLLM advertises the host literally as `remote_host`, and a
/// peer connecting to it connects to itself), and those written as IPv4-mapped IPv6
/// (`::ffff:127.0.0.1`, `::ffff:0.0.0.0`).
fn is_loopback(host: &str) -> bool {
    let host = host.trim_end_matches('.');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .map(|ip| ip.to_canonical())
        .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

/// The `--kv-transfer-config` JSON for a NIXL engine with this id.
///
/// `kv_role` is `kv_both`: the NIXL connector ignores it and the proxy decides each
/// request's role (`vllm-project/vllm docs/features/nixl_connector_usage.md`).
///
/// # Examples
///
/// ```
/// assert_eq!(
///     disagg_nixl::kv_transfer_config("p-10.0.0.5-20000"),
///     r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"p-10.0.0.5-20000"}"#,
/// );
/// ```
pub fn kv_transfer_config(engine_id: &str) -> String {
    // Serialized by hand in field order; the id goes through serde_json for escaping.
    let id = serde_json::Value::String(engine_id.to_owned());
    format!(r#"{{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":{id}}}"#)
}

// === impl Host ===

impl Host {
    /// A host without deployments.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            deployments: Vec::new(),
        }
    }

    /// Adds a deployment.
    pub fn with_deployment(mut self, deployment: Deployment) -> Self {
        self.deployments.push(deployment);
        self
    }
}

// === impl Deployment ===

impl Deployment {
    /// One engine of the role, DP 1 × TP 1 × PP 1, default base, side channel on the
    /// host's address.
    pub fn new(name: impl Into<String>, role: NixlRole) -> Self {
        Self {
            name: name.into(),
            role,
            replicas: 1,
            dp: 1,
            tp: 1,
            pp: 1,
            base: None,
            port: None,
            side_channel_host: None,
        }
    }

    /// Sets the number of engines.
    pub fn with_replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// Sets the data-parallel, tensor-parallel and pipeline-parallel sizes.
    pub fn with_parallelism(mut self, dp: u32, tp: u32, pp: u32) -> Self {
        self.dp = dp;
        self.tp = tp;
        self.pp = pp;
        self
    }

    /// Sets `NIXL_SIDE_CHANNEL_PORT_BASE`.
    pub fn with_base(mut self, base: u16) -> Self {
        self.base = Some(base);
        self
    }

    /// Sets an explicit `VLLM_NIXL_SIDE_CHANNEL_PORT`.
    pub fn with_port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Sets `VLLM_NIXL_SIDE_CHANNEL_HOST`.
    pub fn with_side_channel_host(mut self, host: impl Into<String>) -> Self {
        self.side_channel_host = Some(host.into());
        self
    }

    fn check_sizes(&self, host: &str) -> Result<(), PlanError> {
        for (field, value) in [
            ("replicas", self.replicas),
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
        ] {
            if value == 0 {
                return Err(PlanError::ZeroSize {
                    deployment: self.name.clone(),
                    host: host.to_owned(),
                    field,
                });
            }
        }
        Ok(())
    }
}

// === impl EnginePlan ===

impl EnginePlan {
    /// The last listener's port.
    pub fn last_port(&self) -> u16 {
        self.listeners.last().copied().unwrap_or(self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ports(plan: &NodePlan) -> Vec<(&str, Vec<u16>)> {
        plan.engines
            .iter()
            .map(|e| (e.engine.as_str(), e.listeners.clone()))
            .collect()
    }

    /// Prefill and decode on one node with the default bases.
    #[test]
    fn one_node_default_bases() {
        let plan = Plan::new(PortScheme::PerEngine)
            .with_ephemeral_ports(32768, 60999)
            .with_host(
                Host::new("10.0.0.5")
                    .with_deployment(Deployment::new("prefill", NixlRole::Prefill).with_replicas(2))
                    .with_deployment(Deployment::new("decode", NixlRole::Decode).with_replicas(2)),
            );
        let out = plan.plan().expect("valid plan");
        assert_eq!(
            ports(&out),
            [
                ("prefill/0", vec![20000]),
                ("prefill/1", vec![20001]),
                ("decode/0", vec![22000]),
                ("decode/1", vec![22001]),
            ]
        );
        let e = &out.engines[3];
        assert_eq!(e.engine_id, "decode-10.0.0.5-22001");
        assert_eq!(
            e.env,
            BTreeMap::from([
                (
                    "VLLM_NIXL_SIDE_CHANNEL_HOST".to_owned(),
                    "10.0.0.5".to_owned()
                ),
                ("VLLM_NIXL_SIDE_CHANNEL_PORT".to_owned(), "22001".to_owned()),
            ])
        );
        assert_eq!(
            e.kv_transfer_config,
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"decode-10.0.0.5-22001"}"#
        );
    }

    /// Replicas of TP 2 step by 2, so the older per-TP-worker layout fits too.
    #[test]
    fn replicas_step_by_devices() {
        for scheme in [PortScheme::PerEngine, PortScheme::PerTpWorker] {
            let plan = Plan::new(scheme).with_host(
                Host::new("h").with_deployment(
                    Deployment::new("p", NixlRole::Prefill)
                        .with_replicas(3)
                        .with_parallelism(1, 2, 1),
                ),
            );
            let out = plan.plan().expect("valid plan");
            let firsts: Vec<u16> = out.engines.iter().map(|e| e.port).collect();
            assert_eq!(firsts, [20000, 20002, 20004], "{scheme:?}");
        }
    }

    /// DP 4 × TP 2, one engine, in both layouts.
    #[test]
    fn dp4_tp2_both_layouts() {
        let host = Host::new("h")
            .with_deployment(Deployment::new("p", NixlRole::Prefill).with_parallelism(4, 2, 1));
        let newer = Plan::new(PortScheme::PerEngine).with_host(host.clone());
        assert_eq!(
            ports(&newer.plan().expect("valid")),
            [("p/0", vec![20000, 20001, 20002, 20003])]
        );
        let older = Plan::new(PortScheme::PerTpWorker).with_host(host);
        assert_eq!(
            ports(&older.plan().expect("valid")),
            [("p/0", (20000..=20007).collect())]
        );
    }

    /// Two DP 4 replicas: Ray's `rank × tp × pp` stride (2) is shorter than the engine's
    /// span (4 or 8), and the planner says where they meet.
    #[test]
    fn dp_replicas_overlap_is_refused() {
        let plan = Plan::new(PortScheme::PerEngine).with_host(
            Host::new("h").with_deployment(
                Deployment::new("p", NixlRole::Prefill)
                    .with_replicas(2)
                    .with_parallelism(4, 2, 1),
            ),
        );
        assert_eq!(
            plan.plan(),
            Err(PlanError::PortCollision {
                first: "p/0".into(),
                second: "p/1".into(),
                host: "h".into(),
                port: 20002,
            })
        );
    }

    #[test]
    fn explicit_port_wins() {
        let plan = Plan::new(PortScheme::PerEngine).with_host(
            Host::new("h").with_deployment(
                Deployment::new("p", NixlRole::Prefill)
                    .with_base(30000)
                    .with_port(5600),
            ),
        );
        let out = plan.plan().expect("valid");
        assert_eq!(out.engines[0].port, 5600);
        assert_eq!(out.engines[0].engine_id, "p-h-5600");
    }

    /// Bases one apart: rank 1 of `a` is rank 0 of `b`.
    #[test]
    fn bases_one_apart_collide() {
        let plan = Plan::new(PortScheme::PerTpWorker).with_host(
            Host::new("h")
                .with_deployment(
                    Deployment::new("a", NixlRole::Prefill)
                        .with_parallelism(1, 2, 1)
                        .with_base(20000),
                )
                .with_deployment(
                    Deployment::new("b", NixlRole::Decode)
                        .with_parallelism(1, 2, 1)
                        .with_base(20001),
                ),
        );
        let err = plan.plan().expect_err("collision");
        assert_eq!(
            err.to_string(),
            "engines a/0 and b/0 both listen on h:20001"
        );
    }

    #[test]
    fn same_ports_on_different_hosts_are_fine() {
        let plan = Plan::new(PortScheme::PerEngine)
            .with_host(
                Host::new("10.0.0.5").with_deployment(Deployment::new("p", NixlRole::Prefill)),
            )
            .with_host(
                Host::new("10.0.0.6").with_deployment(Deployment::new("p", NixlRole::Prefill)),
            );
        let out = plan.plan().expect("valid");
        assert_eq!(out.engines[0].engine_id, "p-10.0.0.5-20000");
        assert_eq!(out.engines[1].engine_id, "p-10.0.0.6-20000");
    }

    #[test]
    fn ephemeral_overlap_is_refused() {
        let plan = Plan::new(PortScheme::PerEngine)
            .with_ephemeral_ports(32768, 60999)
            .with_host(
                Host::new("h").with_deployment(
                    Deployment::new("p", NixlRole::Prefill)
                        .with_base(32766)
                        .with_parallelism(4, 1, 1),
                ),
            );
        assert_eq!(
            plan.plan(),
            Err(PlanError::EphemeralOverlap {
                engine: "p/0".into(),
                host: "h".into(),
                first: 32766,
                last: 32769,
                ephemeral_first: 32768,
                ephemeral_last: 60999,
            })
        );
    }

    #[test]
    fn out_of_range_ports_are_refused() {
        let low = Plan::new(PortScheme::PerEngine).with_host(
            Host::new("h").with_deployment(Deployment::new("p", NixlRole::Prefill).with_port(80)),
        );
        assert!(matches!(
            low.plan(),
            Err(PlanError::PortOutOfRange { port: 80, .. })
        ));
        let high = Plan::new(PortScheme::PerTpWorker).with_host(
            Host::new("h").with_deployment(
                Deployment::new("p", NixlRole::Prefill)
                    .with_base(65534)
                    .with_parallelism(1, 4, 1),
            ),
        );
        assert!(matches!(
            high.plan(),
            Err(PlanError::PortOutOfRange { port: 65537, .. })
        ));
    }

    #[test]
    fn loopback_across_hosts_is_refused() {
        let plan = Plan::new(PortScheme::PerEngine)
            .with_host(Host::new("10.0.0.5").with_deployment(
                Deployment::new("p", NixlRole::Prefill).with_side_channel_host("localhost"),
            ))
            .with_host(
                Host::new("10.0.0.6").with_deployment(Deployment::new("d", NixlRole::Decode)),
            );
        assert_eq!(
            plan.plan().expect_err("loopback").to_string(),
            "engine p/0 on 10.0.0.5: side-channel host localhost is loopback or unspecified, but prefill and decode run on different hosts"
        );
        for host in ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "LOCALHOST."] {
            assert!(is_loopback(host), "{host}");
        }
        // Unspecified addresses, and IPv4 ones written as IPv6, reach no other host.
        for host in [
            "0.0.0.0",
            "::",
            "[::]",
            "::ffff:127.0.0.1",
            "[::ffff:127.0.0.1]",
            "::ffff:0.0.0.0",
        ] {
            assert!(is_loopback(host), "{host}");
            let plan = Plan::new(PortScheme::PerEngine)
                .with_host(Host::new("10.0.0.5").with_deployment(
                    Deployment::new("p", NixlRole::Prefill).with_side_channel_host(host),
                ))
                .with_host(
                    Host::new("10.0.0.6").with_deployment(Deployment::new("d", NixlRole::Decode)),
                );
            assert!(
                matches!(plan.plan(), Err(PlanError::LoopbackAcrossHosts { .. })),
                "{host}"
            );
        }
        assert!(!is_loopback("10.0.0.5"));
        assert!(!is_loopback("::ffff:10.0.0.5"));
        // On one host, loopback is fine.
        let single = Plan::new(PortScheme::PerEngine).with_host(
            Host::new("127.0.0.1")
                .with_deployment(Deployment::new("p", NixlRole::Prefill))
                .with_deployment(Deployment::new("d", NixlRole::Decode)),
        );
        assert!(single.plan().is_ok());
    }

    #[test]
    fn zero_sizes_and_duplicates_are_refused() {
        let zero = Plan::new(PortScheme::PerEngine)
            .with_host(Host::new("h").with_deployment(
                Deployment::new("p", NixlRole::Prefill).with_parallelism(1, 0, 1),
            ));
        assert!(matches!(
            zero.plan(),
            Err(PlanError::ZeroSize { field: "tp", .. })
        ));
        let dup = Plan::new(PortScheme::PerEngine).with_host(
            Host::new("h")
                .with_deployment(Deployment::new("p", NixlRole::Prefill))
                .with_deployment(Deployment::new("p", NixlRole::Decode)),
        );
        assert!(matches!(
            dup.plan(),
            Err(PlanError::DuplicateDeployment { .. })
        ));
        let empty = Plan::new(PortScheme::PerEngine).with_ephemeral_ports(2, 1);
        assert!(matches!(
            empty.plan(),
            Err(PlanError::EmptyEphemeralRange { .. })
        ));
    }

    #[test]
    fn toml_round_trip_and_typos() {
        let text = r#"
            scheme = "per-tp-worker"
            ephemeral_ports = { first = 32768, last = 60999 }

            [[host]]
            address = "10.0.0.5"

            [[host.deployment]]
            name = "prefill"
            role = "prefill"
            replicas = 2
            tp = 2

            [[host.deployment]]
            name = "decode"
            role = "decode"
            dp = 2
            base = 24000
            side_channel_host = "10.0.1.5"
        "#;
        let plan = Plan::from_toml(text).expect("parses");
        let want = Plan::new(PortScheme::PerTpWorker)
            .with_ephemeral_ports(32768, 60999)
            .with_host(
                Host::new("10.0.0.5")
                    .with_deployment(
                        Deployment::new("prefill", NixlRole::Prefill)
                            .with_replicas(2)
                            .with_parallelism(1, 2, 1),
                    )
                    .with_deployment(
                        Deployment::new("decode", NixlRole::Decode)
                            .with_parallelism(2, 1, 1)
                            .with_base(24000)
                            .with_side_channel_host("10.0.1.5"),
                    ),
            );
        assert_eq!(plan, want);
        assert!(Plan::from_toml("[[host]]\naddress = \"h\"\nport = 1\n").is_err());
        assert!(Plan::from_toml("scheme = \"per-worker\"\n").is_err());
    }

    #[test]
    fn engine_ids_are_json_escaped() {
        assert_eq!(
            kv_transfer_config("a\"b"),
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"a\"b"}"#
        );
    }

    // === properties ===

    fn deployment() -> impl Strategy<Value = Deployment> {
        (
            prop_oneof![Just(NixlRole::Prefill), Just(NixlRole::Decode)],
            1u32..4,
            // Mostly DP 1: replicas of a DP engine overlap (stride tp × pp < span).
            prop_oneof![3 => Just(1u32), 1 => 2u32..5],
            1u32..5,
            1u32..3,
            // Bases: a narrow window where collisions are common, spaced ones where they
            // are not, and the top of the port space.
            proptest::option::weighted(
                0.5,
                prop_oneof![
                    20000u16..20016,
                    (0u16..8).prop_map(|k| 23000 + k * 100),
                    65520u16..=65535
                ],
            ),
            proptest::option::weighted(0.1, prop_oneof![1000u16..1030, 20000u16..20016]),
        )
            .prop_map(|(role, replicas, dp, tp, pp, base, port)| Deployment {
                name: String::new(),
                role,
                replicas,
                dp,
                tp,
                pp,
                base,
                port,
                side_channel_host: None,
            })
    }

    fn plan() -> impl Strategy<Value = Plan> {
        (
            prop_oneof![Just(PortScheme::PerEngine), Just(PortScheme::PerTpWorker)],
            proptest::option::of(Just(PortRange {
                first: 23300,
                last: 24000,
            })),
            proptest::collection::vec(proptest::collection::vec(deployment(), 1..4), 1..3),
        )
            .prop_map(|(scheme, ephemeral_ports, hosts)| Plan {
                scheme,
                ephemeral_ports,
                hosts: hosts
                    .into_iter()
                    .enumerate()
                    .map(|(h, deployments)| Host {
                        address: format!("10.0.0.{h}"),
                        deployments: deployments
                            .into_iter()
                            .enumerate()
                            .map(|(i, d)| Deployment {
                                name: format!("d{i}"),
                                ..d
                            })
                            .collect(),
                    })
                    .collect(),
            })
    }

    proptest! {
        /// Whatever the planner accepts binds each (host, port) once, inside 1024-65535
        /// and outside the ephemeral range, with unique engine ids.
        #[test]
        fn accepted_plans_are_collision_free(plan in plan()) {
            if let Ok(out) = plan.plan() {
                let mut seen = BTreeSet::new();
                let mut ids = BTreeSet::new();
                for e in &out.engines {
                    prop_assert!(ids.insert(e.engine_id.clone()));
                    let d = plan.hosts.iter()
                        .filter(|h| h.address == e.host)
                        .flat_map(|h| &h.deployments)
                        .find(|d| d.name == e.deployment);
                    prop_assert!(d.is_some());
                    if let Some(d) = d {
                        prop_assert_eq!(e.listeners.len() as u64, plan.scheme.span(d.dp, d.tp));
                    }
                    for &p in &e.listeners {
                        prop_assert!(p >= port::MIN_PORT);
                        prop_assert!(seen.insert((e.host.clone(), p)), "{}:{} bound twice", e.host, p);
                        if let Some(r) = plan.ephemeral_ports {
                            prop_assert!(p < r.first || p > r.last);
                        }
                    }
                }
            }
        }

        /// Any plan in which two engines would share a (host, port), computed here
        /// independently, is refused; a collision error names two engines that do share
        /// the port it gives.
        #[test]
        fn shared_ports_are_always_refused(plan in plan()) {
            let mut owners: BTreeMap<(String, u16), BTreeSet<String>> = BTreeMap::new();
            for h in &plan.hosts {
                for d in &h.deployments {
                    for r in 0..d.replicas {
                        let offset = Offset::Replica { rank: r, tp: d.tp, pp: d.pp };
                        let Ok(port) = port::side_channel_port(d.role, d.port, d.base, offset) else { continue };
                        let Ok(listeners) = plan.scheme.listeners(port, d.dp, d.tp) else { continue };
                        for p in listeners {
                            owners.entry((h.address.clone(), p)).or_default().insert(format!("{}/{r}", d.name));
                        }
                    }
                }
            }
            let shared = owners.values().any(|o| o.len() > 1);
            let result = plan.plan();
            if shared {
                prop_assert!(result.is_err());
            }
            if let Err(PlanError::PortCollision { first, second, host, port }) = result {
                let o = owners.get(&(host, port));
                prop_assert!(o.is_some_and(|o| o.contains(&first) && o.contains(&second)));
            }
        }

        /// Two deployments on one host whose ranges overlap are refused, naming both
        /// engines and a port both would bind.
        #[test]
        fn overlapping_ranges_are_refused(
            scheme in prop_oneof![Just(PortScheme::PerEngine), Just(PortScheme::PerTpWorker)],
            dp in 1u32..5,
            tp in 1u32..5,
            base in 1024u16..60000,
            gap_seed in 0u64..1000,
            role_a in prop_oneof![Just(NixlRole::Prefill), Just(NixlRole::Decode)],
            role_b in prop_oneof![Just(NixlRole::Prefill), Just(NixlRole::Decode)],
        ) {
            let span = scheme.span(dp, tp);
            let gap = u16::try_from(gap_seed % span).unwrap_or(0);
            let plan = Plan::new(scheme).with_host(
                Host::new("h")
                    .with_deployment(Deployment::new("a", role_a).with_parallelism(dp, tp, 1).with_base(base))
                    .with_deployment(Deployment::new("b", role_b).with_parallelism(dp, tp, 1).with_base(base + gap)),
            );
            match plan.plan() {
                Err(PlanError::PortCollision { first, second, host, port }) => {
                    prop_assert_eq!(first, "a/0");
                    prop_assert_eq!(second, "b/0");
                    prop_assert_eq!(host, "h");
                    prop_assert_eq!(port, base + gap);
                }
                other => prop_assert!(false, "expected a collision, got {:?}", other),
            }
        }
    }
}
