//! NIXL side-channel port and engine-id planning for vLLM prefill/decode deployments.
//!
//! Every vLLM engine running the NIXL connector opens a side-channel listener; the peer
//! finds it through `remote_host`/`remote_port` in the prefill's `kv_transfer_params`,
//! so the port must be predictable and must not collide with any other engine's on the
//! same host. This crate is that arithmetic, once, tested:
//!
//! - [`side_channel_port`]: the value of `VLLM_NIXL_SIDE_CHANNEL_PORT` a launcher sets
//!   (explicit, or base + offset, with disjoint per-role default bases, as Ray Serve LLM
//!   computes it);
//! - [`PortScheme`]: which listeners vLLM then opens from it, per vLLM generation;
//! - [`Plan::plan`]: a whole node plan checked for collisions, out-of-range and ephemeral
//!   ports and loopback hosts, with each engine's id, environment and
//!   `--kv-transfer-config`.
//!
//! It does no I/O. `disagg-proxy nixl-ports PLAN.toml` prints a plan file's result; the
//! [`guide`] explains the arithmetic and the failures it prevents.
//!
//! # Examples
//!
//! ```
//! use disagg_nixl::Plan;
//!
//! let plan = Plan::from_toml(r#"
//! scheme = "per-engine"
//! ephemeral_ports = { first = 32768, last = 60999 }
//!
//! [[host]]
//! address = "10.0.0.5"
//!
//! [[host.deployment]]
//! name = "prefill"
//! role = "prefill"
//! replicas = 2
//! tp = 2
//!
//! [[host.deployment]]
//! name = "decode"
//! role = "decode"
//! tp = 2
//! "#)?;
//! let out = plan.plan()?;
//! let ports: Vec<u16> = out.engines.iter().map(|e| e.port).collect();
//! assert_eq!(ports, [20000, 20002, 22000]);
//! assert_eq!(out.engines[1].engine_id, "prefill-10.0.0.5-20002");
//! assert_eq!(out.engines[1].env["VLLM_NIXL_SIDE_CHANNEL_PORT"], "20002");
//! assert_eq!(out.engines[1].env["VLLM_NIXL_SIDE_CHANNEL_HOST"], "10.0.0.5");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod error;
pub mod plan;
pub mod port;

pub use error::{ParseError, PlanError, PortError};
pub use plan::{Deployment, EnginePlan, Host, NodePlan, Plan, PortRange, kv_transfer_config};
pub use port::{NixlRole, Offset, PortScheme, side_channel_port};

/// The guide: the port arithmetic with a worked example, the listener layouts per vLLM
/// generation, and the common failures the planner catches (`docs/nixl.md`).
#[doc = include_str!("../docs/nixl.md")]
pub mod guide {}
