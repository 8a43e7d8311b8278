//! The KV-event sockets' ports are free again once `shutdown` returns, as a restarted
//! engine process needs them (the listeners were closed by a task that ran later).

use std::net::TcpListener;

use disagg_sim::{KvEventsConfig, SimConfig, SimEngine};

fn port_of(endpoint: &str) -> u16 {
    endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("endpoint ends in a port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_event_ports_are_free_once_shutdown_returns() {
    // The race lost in one of a few runs: repeat it so a listener closed late shows.
    for round in 0..100 {
        let engine = SimEngine::start(SimConfig {
            prefix_cache_blocks: 64,
            kv_events: Some(KvEventsConfig {
                replay_port: Some(0),
                load_port: Some(0),
                ..KvEventsConfig::default()
            }),
            record_requests: 0,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let events = port_of(&engine.kv_events_endpoint().unwrap());
        let replay = port_of(&engine.kv_events_replay_endpoint().unwrap());
        let load = port_of(&engine.load_endpoint().unwrap());
        engine.shutdown().await;
        for (what, port) in [("events", events), ("replay", replay), ("load", load)] {
            if let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
                panic!("round {round}: the {what} port {port} is still taken: {e}");
            }
        }
    }
}
