//! Engines on loopback addresses of their own ([`SimConfig::bind_host`]): a handoff
//! that names the other engine's host fails, as it would between machines, and the
//! right host succeeds. Linux routes all of 127.0.0.0/8 to the loopback interface, so
//! there the addresses must bind (a failure to is a failure of the test); elsewhere,
//! where an address other than 127.0.0.1 cannot be bound, there is nothing to check.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
/// The bootstrap timeout: the wrong-host legs wait it out, the right-host ones must meet
/// within it (on a loaded machine too).
const WAIT: Duration = Duration::from_secs(2);
const PROMPT: &str = "a prompt long enough to fill more than one block of sixteen tokens with words \
    that keep on coming until the end of the line";

/// The prefill's and the decode's own loopback addresses, if this machine lets a
/// socket bind them.
fn hosts() -> Option<(IpAddr, IpAddr)> {
    let p = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let d = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
    for ip in [p, d] {
        if let Err(e) = std::net::TcpListener::bind((ip, 0)) {
            // Linux routes the whole of 127.0.0.0/8 to loopback: never a skip there.
            if cfg!(target_os = "linux") {
                panic!("{ip} cannot be bound: {e}");
            }
            eprintln!("{ip} cannot be bound here: nothing to check");
            return None;
        }
    }
    Some((p, d))
}

async fn engine(kv_mode: KvMode, bind_host: IpAddr, id: &str) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        bind_host,
        bootstrap_timeout: WAIT,
        engine_id: Some(id.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens})
}

fn with_params(mut body: Value, params: Value) -> Value {
    body["kv_transfer_params"] = params;
    body
}

#[tokio::test]
async fn every_listener_is_on_the_bind_host_and_it_is_advertised() {
    let Some((ph, _)) = hosts() else { return };
    for mode in [
        KvMode::Nixl,
        KvMode::Sglang(SimRole::Prefill),
        KvMode::Mooncake(SimRole::Prefill),
    ] {
        let p = engine(mode, ph, "pf").await;
        assert_eq!(p.addr().ip(), ph, "{mode:?}");
        assert_eq!(p.side_channel_addr().ip(), ph, "{mode:?}");
        assert_eq!(p.advertised_host(), "127.0.0.2", "{mode:?}");
        assert_eq!(p.url(), format!("http://127.0.0.2:{}", p.addr().port()));
        if mode != KvMode::Nixl {
            assert_eq!(p.bootstrap_addr().unwrap().ip(), ph, "{mode:?}");
        }
    }
    // An explicit advertised host wins (an engine behind an address of its own).
    let p = SimEngine::start(SimConfig {
        bind_host: ph,
        advertised_host: "prefill.example".into(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(p.advertised_host(), "prefill.example");
    // By default, 127.0.0.1.
    let e = SimEngine::start(SimConfig::default()).await.unwrap();
    assert_eq!(e.addr().ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_eq!(e.advertised_host(), "127.0.0.1");
}

#[tokio::test]
async fn nixl_remote_host_of_the_decode_fails_and_the_prefills_succeeds() {
    let Some((ph, dh)) = hosts() else { return };
    let p = engine(KvMode::Nixl, ph, "pf").await;
    let d = engine(KvMode::Nixl, dh, "dc").await;
    let body = with_params(
        chat(1),
        json!({"do_remote_decode": true, "do_remote_prefill": false}),
    );
    let reply = post(p.addr(), CHAT, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let params = reply.json()["kv_transfer_params"].clone();

    // A proxy that put the decode's own host (or any other) where the prefill's goes.
    let mut swapped = params.clone();
    swapped["remote_host"] = json!(d.addr().ip().to_string());
    let r = post(d.addr(), CHAT, &with_params(chat(4), swapped)).await;
    assert_transfer_failed(&r, "cannot connect to 127.0.0.3:");
    assert_eq!(p.stats().side_channel_connections, 0);

    assert_eq!(params["remote_host"], "127.0.0.2");
    let r = post(d.addr(), CHAT, &with_params(chat(4), params)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(p.stats().blocks_held, 0);
}

#[tokio::test]
async fn sglang_bootstrap_host_of_the_decode_fails_and_the_prefills_succeeds() {
    let Some((ph, dh)) = hosts() else { return };
    let p = engine(KvMode::Sglang(SimRole::Prefill), ph, "pf").await;
    let d = engine(KvMode::Sglang(SimRole::Decode), dh, "dc").await;
    let legs = |host: IpAddr, room: u64| {
        let mut body = chat(4);
        body["bootstrap_host"] = json!(host.to_string());
        body["bootstrap_port"] = json!(p.bootstrap_addr().unwrap().port());
        body["bootstrap_room"] = json!(room);
        body
    };
    // Both legs name the decode's host: the decode finds no bootstrap server there and
    // the prefill waits in vain for its room to be taken.
    let wrong = legs(d.addr().ip(), 1);
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &wrong), post(d.addr(), CHAT, &wrong));
    assert_sglang_transfer_failed(&dr, "127.0.0.3");
    assert_sglang_transfer_failed(&pr, "no decode took room 1");

    let right = legs(p.addr().ip(), 2);
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &right), post(d.addr(), CHAT, &right));
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(d.stats().remote_decodes, 1);
}

#[tokio::test]
async fn mooncake_bootstrap_addr_of_the_decode_fails_and_the_prefills_succeeds() {
    let Some((ph, dh)) = hosts() else { return };
    let p = engine(KvMode::Mooncake(SimRole::Prefill), ph, "pf").await;
    let d = engine(KvMode::Mooncake(SimRole::Decode), dh, "dc").await;
    let legs = |host: IpAddr, transfer: &str| {
        let prefill = with_params(
            chat(1),
            json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer}),
        );
        let port = p.bootstrap_addr().unwrap().port();
        let decode = with_params(
            chat(4),
            json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_bootstrap_addr": format!("http://{host}:{port}"),
                "remote_engine_id": p.engine_id(),
                "transfer_id": transfer,
            }),
        );
        (prefill, decode)
    };
    let (pb, db) = legs(d.addr().ip(), "t1");
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db));
    assert_eq!(pr.status, 200, "{}", pr.text());
    assert_transfer_failed(&dr, "127.0.0.3");

    let (pb, db) = legs(p.addr().ip(), "t2");
    let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &pb), post(d.addr(), CHAT, &db));
    assert_eq!((pr.status, dr.status), (200, 200), "{}", dr.text());
    assert_eq!(d.stats().remote_decodes, 1);
}
