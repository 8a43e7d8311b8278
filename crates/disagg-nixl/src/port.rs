//! The side-channel port arithmetic: what a launcher sets `VLLM_NIXL_SIDE_CHANNEL_PORT`
//! to, and which ports a vLLM engine then listens on.
//!
//! Two steps, kept apart because different software owns each:
//!
//! 1. **The launcher** (Ray Serve LLM, a Helm chart, a shell script) picks the value of
//!    `VLLM_NIXL_SIDE_CHANNEL_PORT` for each engine: [`side_channel_port`].
//! 2. **The engine** (vLLM's NIXL connector) opens one or more listeners from that value,
//!    in a layout that depends on the vLLM generation: [`PortScheme::listeners`].

use serde::{Deserialize, Serialize};

use crate::error::PortError;

/// The lowest port the planner hands out: below it are the privileged ports.
pub const MIN_PORT: u16 = 1024;

/// The environment variable that fixes an engine's side-channel port.
///
/// Source: `vllm-project/vllm vllm/envs.py` (default `5557` in older versions, `5600` in
/// newer ones).
pub const PORT_ENV: &str = "VLLM_NIXL_SIDE_CHANNEL_PORT";

/// The environment variable naming the interface the side channel binds to, and the host
/// the prefill advertises to the decode as `remote_host`.
///
/// Source: `vllm-project/vllm vllm/envs.py` (default `"localhost"` in every version read).
pub const HOST_ENV: &str = "VLLM_NIXL_SIDE_CHANNEL_HOST";

/// Which side of the disaggregated pair an engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum NixlRole {
    /// Computes the prompt's KV cache and keeps it until the decode pulls it.
    Prefill,
    /// Pulls the KV cache over NIXL and generates the tokens.
    Decode,
}

// === impl NixlRole ===

impl NixlRole {
    /// The default side-channel port base for this role.
    ///
    /// Prefill `20000` (`experimental_configs["NIXL_SIDE_CHANNEL_PORT_BASE"]`'s default in
    /// `ray-project/ray python/ray/llm/_internal/serve/engines/vllm/kv_transfer/nixl.py`),
    /// decode `22000` (`_default_decode_nixl_port_base` in
    /// `…/serving_patterns/prefill_decode/builder.py`). The bases are 2000 apart so that a
    /// prefill and a decode on one node never share a port.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::NixlRole;
    /// assert_eq!(NixlRole::Prefill.default_base(), 20000);
    /// assert_eq!(NixlRole::Decode.default_base(), 22000);
    /// ```
    pub const fn default_base(self) -> u16 {
        match self {
            Self::Prefill => 20000,
            Self::Decode => 22000,
        }
    }

    /// The role's lowercase name (`"prefill"`, `"decode"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl std::fmt::Display for NixlRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The offset a launcher adds to the base port.
///
/// Source: `_compute_port_offset` in `ray-project/ray
/// python/ray/llm/_internal/serve/engines/vllm/kv_transfer/base.py` (newest version read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Offset {
    /// The engine's data-parallel rank, used as is when set: vLLM itself spaces the TP
    /// workers of older layouts.
    DataParallelRank(u32),
    /// No data-parallel rank: the replica's rank times the devices one replica uses
    /// (tensor-parallel × pipeline-parallel size), so replicas land on disjoint ports.
    Replica {
        /// The replica's rank within its deployment, from 0.
        rank: u32,
        /// Tensor-parallel size.
        tp: u32,
        /// Pipeline-parallel size.
        pp: u32,
    },
}

// === impl Offset ===

impl Offset {
    /// The offset's value, computed without overflow.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::Offset;
    /// assert_eq!(Offset::DataParallelRank(3).value(), 3);
    /// assert_eq!(Offset::Replica { rank: 3, tp: 2, pp: 2 }.value(), 12);
    /// ```
    pub fn value(self) -> u64 {
        match self {
            Self::DataParallelRank(rank) => u64::from(rank),
            Self::Replica { rank, tp, pp } => u64::from(rank) * u64::from(tp) * u64::from(pp),
        }
    }
}

/// The value a launcher gives `VLLM_NIXL_SIDE_CHANNEL_PORT` for one engine.
///
/// - `explicit` (the variable already set by the operator) is used as is;
/// - otherwise `base` (`NIXL_SIDE_CHANNEL_PORT_BASE`), or the role's
///   [default base](NixlRole::default_base), plus the [`Offset`].
///
/// Source: `ray-project/ray python/ray/llm/_internal/serve/engines/vllm/kv_transfer/nixl.py`
/// and `…/base.py` (`_compute_port_offset`), with the decode's default base from
/// `python/ray/llm/_internal/serve/serving_patterns/prefill_decode/builder.py`.
///
/// # Errors
///
/// [`PortError::OutOfRange`] when the sum is above 65535 or below [`MIN_PORT`].
///
/// # Examples
///
/// ```
/// use disagg_nixl::{Offset, NixlRole, side_channel_port};
/// // The second replica of a TP 2 prefill, default base.
/// let port = side_channel_port(NixlRole::Prefill, None, None, Offset::Replica { rank: 1, tp: 2, pp: 1 })?;
/// assert_eq!(port, 20002);
/// // An explicit port wins over everything.
/// assert_eq!(side_channel_port(NixlRole::Decode, Some(5600), Some(30000), Offset::DataParallelRank(7))?, 5600);
/// # Ok::<(), disagg_nixl::PortError>(())
/// ```
pub fn side_channel_port(
    role: NixlRole,
    explicit: Option<u16>,
    base: Option<u16>,
    offset: Offset,
) -> Result<u16, PortError> {
    let port = match explicit {
        Some(port) => u64::from(port),
        None => u64::from(base.unwrap_or(role.default_base())) + offset.value(),
    };
    checked_port(port)
}

/// `port` as a `u16` if it is in `MIN_PORT..=65535`.
pub(crate) fn checked_port(port: u64) -> Result<u16, PortError> {
    match u16::try_from(port) {
        Ok(p) if p >= MIN_PORT => Ok(p),
        _ => Err(PortError::OutOfRange { port }),
    }
}

/// Which listeners a vLLM engine opens from `VLLM_NIXL_SIDE_CHANNEL_PORT`, by vLLM
/// generation (each variant names the vLLM sources and versions it matches).
///
/// Both layouts are contiguous from the variable's value; they differ in how many ports
/// an engine takes. Pick the one matching the engines actually deployed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum PortScheme {
    /// One listener per engine (per data-parallel rank) at `PORT + dp_index`.
    ///
    /// Matches vLLM from the single-file NIXL connector whose scheduler owns one ZMQ
    /// `ROUTER` (`vllm-project/vllm
    /// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`, e.g. commit
    /// 002a105, late 2025) through the newest split connector
    /// (`…/v1/nixl/base_scheduler.py`, `PORT + parallel_config.data_parallel_index`);
    /// documented as "base_port + dp_rank" in `docs/features/nixl_connector_usage.md`.
    #[default]
    PerEngine,
    /// One listener per tensor-parallel worker at `PORT + dp_rank × tp_size + tp_rank`.
    ///
    /// Matches the early vLLM NIXL connector (mid-2025, the layout documented by
    /// vllm-project/vllm PR #24249: "base_port + dp_rank * tp_size + tp_rank"), where the
    /// prefill advertises `remote_port = PORT + dp_rank × tp_size` and the decode dials
    /// `remote_port + p_remote_rank`.
    PerTpWorker,
}

// === impl PortScheme ===

impl PortScheme {
    /// How many consecutive ports an engine process with `dp` data-parallel ranks of `tp`
    /// tensor-parallel workers takes.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::PortScheme;
    /// assert_eq!(PortScheme::PerEngine.span(4, 2), 4);
    /// assert_eq!(PortScheme::PerTpWorker.span(4, 2), 8);
    /// ```
    pub fn span(self, dp: u32, tp: u32) -> u64 {
        match self {
            Self::PerEngine => u64::from(dp),
            Self::PerTpWorker => u64::from(dp) * u64::from(tp),
        }
    }

    /// The port one listener uses, given the engine's `VLLM_NIXL_SIDE_CHANNEL_PORT`, its
    /// data-parallel rank and tensor-parallel rank (ignored by [`PortScheme::PerEngine`]).
    ///
    /// # Errors
    ///
    /// [`PortError::OutOfRange`] when the port is above 65535.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::PortScheme;
    /// assert_eq!(PortScheme::PerEngine.listener(20000, 3, 1, 2)?, 20003);
    /// assert_eq!(PortScheme::PerTpWorker.listener(20000, 3, 1, 2)?, 20007);
    /// # Ok::<(), disagg_nixl::PortError>(())
    /// ```
    pub fn listener(
        self,
        port: u16,
        dp_rank: u32,
        tp_rank: u32,
        tp: u32,
    ) -> Result<u16, PortError> {
        let offset = match self {
            Self::PerEngine => u64::from(dp_rank),
            Self::PerTpWorker => u64::from(dp_rank) * u64::from(tp) + u64::from(tp_rank),
        };
        checked_port(u64::from(port) + offset)
    }

    /// Every listener an engine process opens, in rank order (DP rank major, TP rank
    /// minor), given its `VLLM_NIXL_SIDE_CHANNEL_PORT`.
    ///
    /// # Errors
    ///
    /// [`PortError::OutOfRange`] when the last port is above 65535.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_nixl::PortScheme;
    /// assert_eq!(PortScheme::PerEngine.listeners(20000, 2, 2)?, [20000, 20001]);
    /// assert_eq!(PortScheme::PerTpWorker.listeners(20000, 2, 2)?, [20000, 20001, 20002, 20003]);
    /// # Ok::<(), disagg_nixl::PortError>(())
    /// ```
    pub fn listeners(self, port: u16, dp: u32, tp: u32) -> Result<Vec<u16>, PortError> {
        let span = self.span(dp, tp);
        if span > 0 {
            checked_port(u64::from(port) + span - 1)?;
        }
        let tp_ranks = match self {
            Self::PerEngine => 1,
            Self::PerTpWorker => tp,
        };
        let mut ports = Vec::with_capacity(usize::try_from(span).unwrap_or(0));
        for dp_rank in 0..dp {
            for tp_rank in 0..tp_ranks {
                ports.push(self.listener(port, dp_rank, tp_rank, tp)?);
            }
        }
        Ok(ports)
    }

    /// The scheme's name in plan files (`"per-engine"`, `"per-tp-worker"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PerEngine => "per-engine",
            Self::PerTpWorker => "per-tp-worker",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row of the launcher table: role, explicit port, base, offset → port.
    type LauncherRow = (NixlRole, Option<u16>, Option<u16>, Offset, u16);

    /// The launcher's arithmetic, pinned: (role, explicit, base, offset) → port.
    #[test]
    fn launcher_port_table() {
        let replica = |rank, tp, pp| Offset::Replica { rank, tp, pp };
        let table: &[LauncherRow] = &[
            // Prefill and decode on one node, default bases, one replica each.
            (NixlRole::Prefill, None, None, replica(0, 1, 1), 20000),
            (NixlRole::Decode, None, None, replica(0, 1, 1), 22000),
            // Replicas step by TP × PP.
            (NixlRole::Prefill, None, None, replica(1, 1, 1), 20001),
            (NixlRole::Prefill, None, None, replica(1, 2, 1), 20002),
            (NixlRole::Prefill, None, None, replica(3, 2, 2), 20012),
            (NixlRole::Decode, None, None, replica(2, 4, 1), 22008),
            // A data-parallel rank is used as is, without a TP multiplier.
            (
                NixlRole::Prefill,
                None,
                None,
                Offset::DataParallelRank(3),
                20003,
            ),
            (
                NixlRole::Decode,
                None,
                None,
                Offset::DataParallelRank(1),
                22001,
            ),
            // NIXL_SIDE_CHANNEL_PORT_BASE replaces the role default.
            (
                NixlRole::Prefill,
                None,
                Some(30000),
                replica(2, 2, 1),
                30004,
            ),
            (
                NixlRole::Decode,
                None,
                Some(31000),
                Offset::DataParallelRank(2),
                31002,
            ),
            // An explicit VLLM_NIXL_SIDE_CHANNEL_PORT wins over base and offset.
            (NixlRole::Prefill, Some(5600), None, replica(5, 8, 1), 5600),
            (
                NixlRole::Decode,
                Some(5557),
                Some(40000),
                Offset::DataParallelRank(9),
                5557,
            ),
        ];
        for &(role, explicit, base, offset, want) in table {
            assert_eq!(
                side_channel_port(role, explicit, base, offset),
                Ok(want),
                "{role} explicit={explicit:?} base={base:?} {offset:?}"
            );
        }
    }

    #[test]
    fn launcher_port_out_of_range() {
        assert_eq!(
            side_channel_port(
                NixlRole::Decode,
                None,
                Some(65535),
                Offset::DataParallelRank(1)
            ),
            Err(PortError::OutOfRange { port: 65536 })
        );
        assert_eq!(
            side_channel_port(
                NixlRole::Decode,
                Some(80),
                None,
                Offset::DataParallelRank(0)
            ),
            Err(PortError::OutOfRange { port: 80 })
        );
    }

    /// DP 4 × TP 2 from base 20000 in both layouts: (dp_rank, tp_rank) → port.
    #[test]
    fn dp4_tp2_layouts() {
        let per_engine = [
            ((0, 0), 20000),
            ((0, 1), 20000),
            ((1, 0), 20001),
            ((1, 1), 20001),
            ((2, 0), 20002),
            ((3, 1), 20003),
        ];
        for ((dp_rank, tp_rank), want) in per_engine {
            assert_eq!(
                PortScheme::PerEngine.listener(20000, dp_rank, tp_rank, 2),
                Ok(want)
            );
        }
        let per_tp_worker = [
            ((0, 0), 20000),
            ((0, 1), 20001),
            ((1, 0), 20002),
            ((1, 1), 20003),
            ((2, 0), 20004),
            ((2, 1), 20005),
            ((3, 0), 20006),
            ((3, 1), 20007),
        ];
        for ((dp_rank, tp_rank), want) in per_tp_worker {
            assert_eq!(
                PortScheme::PerTpWorker.listener(20000, dp_rank, tp_rank, 2),
                Ok(want)
            );
        }
        assert_eq!(
            PortScheme::PerEngine.listeners(20000, 4, 2),
            Ok(vec![20000, 20001, 20002, 20003])
        );
        assert_eq!(
            PortScheme::PerTpWorker.listeners(20000, 4, 2),
            Ok((20000..=20007).collect())
        );
    }

    #[test]
    fn listeners_past_65535_are_refused() {
        assert_eq!(
            PortScheme::PerTpWorker.listeners(65530, 4, 2),
            Err(PortError::OutOfRange { port: 65537 })
        );
    }

    #[test]
    fn scheme_names_round_trip() {
        for scheme in [PortScheme::PerEngine, PortScheme::PerTpWorker] {
            let json = serde_json::to_string(&scheme).unwrap_or_default();
            assert_eq!(json, format!("\"{}\"", scheme.as_str()));
        }
    }
}
