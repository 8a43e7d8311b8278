//! Where an engine listens (its data-parallel ranks' side channels) and the host it
//! advertises for them.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::net::TcpListener;

use crate::config::{KvMode, SimConfig};

/// How many side channels an engine has: one per data-parallel rank for a vLLM NIXL
/// engine (each rank's engine core has its own), else one.
pub(crate) fn side_channel_ranks(config: &SimConfig) -> usize {
    match config.kv_mode {
        KvMode::Nixl | KvMode::NixlPush => usize::try_from(config.dp_size.max(1)).unwrap_or(1),
        _ => 1,
    }
}

/// The side channels of every rank, rank 0's being `first` and rank `r`'s the port `r`
/// after it on the same address.
pub(crate) async fn rank_side_channels(
    config: &SimConfig,
    first: TcpListener,
) -> std::io::Result<Vec<TcpListener>> {
    let base = first.local_addr()?;
    let mut listeners = vec![first];
    for r in 1..side_channel_ranks(config) {
        let port = u16::try_from(r)
            .ok()
            .and_then(|r| base.port().checked_add(r))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::AddrNotAvailable,
                    "the data-parallel ranks' side-channel ports pass 65535",
                )
            })?;
        listeners.push(TcpListener::bind((base.ip(), port)).await?);
    }
    Ok(listeners)
}

/// The host an engine advertises: [`SimConfig::advertised_host`], else the address its
/// side channel listens on (127.0.0.1 when that is unspecified).
pub(crate) fn advertised_host(config: &SimConfig, side_channel: SocketAddr) -> String {
    if !config.advertised_host.is_empty() {
        return config.advertised_host.clone();
    }
    match side_channel.ip() {
        ip if ip.is_unspecified() => Ipv4Addr::LOCALHOST.to_string(),
        ip => ip.to_string(),
    }
}
