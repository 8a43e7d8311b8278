//! E/P/D with vLLM's Mooncake EC connector (push, issue #34), with the real
//! `disagg-proxy serve --ec-connector mooncake` in front of simulated vLLM engines over
//! loopback: the consumers listen on an EC port and take a request's media items only
//! from what the encoders pushed there under the transfer ids the request names, so
//! a consumer that was not the one named to the encoders, a wrong address or a wrong
//! transfer id really fails.

#![allow(missing_docs)] // a test binary

use std::time::Duration;

use disagg_sim::{EcConfig, EcRole, Faults, SimConfig, SimEngine};
use serde_json::{Value, json};

mod common;
use common::certs::TempDir;
use common::{Proxy, post};

async fn engine(role: Option<EcRole>, store: &TempDir) -> SimEngine {
    SimEngine::start(SimConfig {
        ec: role.map(|role| EcConfig {
            role,
            store: store.0.clone(),
        }),
        ec_push: true,
        ec_push_wait: Duration::from_secs(2),
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

fn chat(images: usize, stream: bool) -> String {
    let mut content = vec![json!({"type": "text", "text": "what is in these pictures?"})];
    content.extend((0..images).map(|n| {
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,AAAA{n}")}})
    }));
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "stream": stream,
    })
    .to_string()
}

async fn reference(body: &str) -> String {
    let store = TempDir::new();
    let plain = engine(None, &store).await;
    let a = post(&plain.url(), "/v1/chat/completions", body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a.chat_content()
}

/// Two push encoders and `consumers` prefill-decode engines (E → PD), the proxy in
/// Mooncake EC mode told each consumer's EC port (or `wrong_port` for all).
struct Epd {
    _store: TempDir,
    encoders: Vec<SimEngine>,
    consumers: Vec<SimEngine>,
    proxy: Proxy,
}

impl Epd {
    async fn start(consumers: usize, wrong_port: Option<u16>) -> Epd {
        let store = TempDir::new();
        let encoders = vec![
            engine(Some(EcRole::Producer), &store).await,
            engine(Some(EcRole::Producer), &store).await,
        ];
        let mut pds = Vec::new();
        for _ in 0..consumers {
            pds.push(engine(Some(EcRole::Consumer), &store).await);
        }
        let mut args = vec!["--ec-connector".to_owned(), "mooncake".to_owned()];
        for d in &pds {
            let port = wrong_port.unwrap_or_else(|| d.ec_push_port().expect("an EC port"));
            args.extend([
                "--decode".to_owned(),
                d.url(),
                "--ec-address".to_owned(),
                format!("{}=127.0.0.1:{port}", d.url()),
            ]);
        }
        for e in &encoders {
            args.extend(["--encode".to_owned(), e.url()]);
        }
        let proxy = Proxy::start_args(&args).await;
        Epd {
            _store: store,
            encoders,
            consumers: pds,
            proxy,
        }
    }

    fn encoder_legs(&self) -> Vec<disagg_sim::RecordedRequest> {
        self.encoders.iter().flat_map(SimEngine::requests).collect()
    }

    fn loaded(&self) -> u64 {
        self.consumers
            .iter()
            .map(|c| c.stats().ec_items_loaded)
            .sum()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_pd_with_mooncake_push_serves_one_and_two_images_streamed_and_not() {
    let epd = Epd::start(1, None).await;
    let consumer = &epd.consumers[0];
    let zmq = format!("tcp://127.0.0.1:{}", consumer.ec_push_port().unwrap());
    let mut loaded = 0;
    for (images, stream) in [(1, false), (2, false), (1, true), (2, true)] {
        let body = chat(images, stream);
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.chat_content(), reference(&body).await);
        loaded += images as u64;
        // Every item reached the consumer by push, under the transfer ids its leg named.
        assert_eq!(consumer.stats().ec_items_loaded, loaded);
        assert!(!a.text().contains("ec_transfer_params"), "{}", a.text());
    }
    // The encoder legs named the consumer's address and one transfer id per item.
    let legs = epd.encoder_legs();
    assert!(!legs.is_empty());
    let mut ids = Vec::new();
    for leg in &legs {
        let params = &leg.body["ec_transfer_params"];
        assert_eq!(params["consumer_zmq"], zmq.as_str(), "{params}");
        let items = params["ec_items"].as_array().expect("ec_items");
        let parts = leg.body["messages"][0]["content"].as_array().unwrap().len();
        assert_eq!(items.len(), parts);
        ids.extend(
            items
                .iter()
                .map(|i| i["transfer_id"].as_str().unwrap().to_owned()),
        );
    }
    // Transfer ids are unique per request and item.
    let n = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n);
    assert_eq!(n as u64, loaded);
    // The consumer leg named each item's hash (its uuid) and transfer id.
    let last = consumer.requests().pop().expect("a recorded request");
    let ec_items = last.body["ec_transfer_params"]["ec_items"]
        .as_array()
        .expect("ec_items on the consumer leg")
        .clone();
    let uuids: Vec<&str> = last.body["messages"][0]["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["uuid"].as_str())
        .collect();
    assert_eq!(ec_items.len(), 2);
    for item in &ec_items {
        assert!(uuids.contains(&item["mm_hash"].as_str().unwrap()), "{item}");
        assert!(ids.contains(&item["transfer_id"].as_str().unwrap().to_owned()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_is_chosen_first_and_its_leg_goes_to_it() {
    let epd = Epd::start(2, None).await;
    // Round robin over two consumers: each request's items are pushed to the one it
    // is then served by, or its consumer would wait for them in vain.
    for stream in [false, true, false, true] {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    for c in &epd.consumers {
        assert_eq!(c.stats().ec_items_loaded, 2);
        let zmq = format!("tcp://127.0.0.1:{}", c.ec_push_port().unwrap());
        // The transfers its requests named are those of the legs that named it.
        let named: Vec<String> = epd
            .encoder_legs()
            .iter()
            .filter(|l| l.body["ec_transfer_params"]["consumer_zmq"] == zmq.as_str())
            .map(|l| l.body["ec_transfer_params"]["ec_items"][0]["transfer_id"].to_string())
            .collect();
        assert_eq!(named.len(), 2);
        for r in c.requests() {
            let id = r.body["ec_transfer_params"]["ec_items"][0]["transfer_id"].to_string();
            assert!(named.contains(&id), "{id} not in {named:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_consumer_address_fails_visibly() {
    // A port nothing listens on, held (bound, never listening) so that no engine
    // started meanwhile takes it.
    let (_, held) = common::held_dead_url();
    let port = held.local_addr().unwrap().port();
    let epd = Epd::start(1, Some(port)).await;
    let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(1, false)).await;
    a.assert_error(502, "encode_failed");
    assert_eq!(epd.loaded(), 0);
    assert_eq!(epd.consumers[0].stats().requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_fails_a_transfer_that_never_came() {
    // Straight to the consumer, naming a transfer no encoder pushed: vLLM's consumer
    // waits push_wait_timeout_s, then fails the request.
    let store = TempDir::new();
    let consumer = engine(Some(EcRole::Consumer), &store).await;
    let mut body: Value = serde_json::from_str(&chat(1, false)).unwrap();
    body["messages"][0]["content"][1]["uuid"] = json!("item-a");
    body["ec_transfer_params"] =
        json!({"ec_items": [{"mm_hash": "item-a", "transfer_id": "nope"}]});
    let a = post(&consumer.url(), "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(a.status, 500, "{}", a.text());
    assert!(a.text().contains("never arrived"), "{}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_request_is_untouched_by_the_push_mode() {
    let epd = Epd::start(1, None).await;
    for stream in [false, true] {
        let a = post(&epd.proxy.url(), "/v1/chat/completions", &chat(0, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert!(epd.encoder_legs().is_empty());
    for r in epd.consumers[0].requests() {
        assert!(r.body.get("ec_transfer_params").is_none(), "{}", r.body);
    }
}

/// A push consumer with `dp` data-parallel ranks, an EC port each.
async fn consumer_dp(store: &TempDir, dp: u32) -> SimEngine {
    SimEngine::start(SimConfig {
        ec: Some(EcConfig {
            role: EcRole::Consumer,
            store: store.0.clone(),
        }),
        ec_push: true,
        ec_push_wait: Duration::from_secs(2),
        dp_size: dp,
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

/// Two consumers of two data-parallel ranks each, given to the proxy as whole engines
/// (`ranked` false: vLLM balances its ranks itself unless pinned) or as `URL@0-1`, and
/// `--ec-dp-size 2`; with `pd`, they are decodes serving alone (E → PD), else prefills
/// in front of one plain decode (E → P → D). Every request of `requests`, one or two
/// images each, must have been read on the very rank that served it, and every rank of
/// every consumer must have served some.
async fn dp_consumers_get_their_items_on_the_rank_that_serves(pd: bool, ranked: bool) {
    let store = TempDir::new();
    let encoders = vec![
        engine(Some(EcRole::Producer), &store).await,
        engine(Some(EcRole::Producer), &store).await,
    ];
    let consumers = vec![consumer_dp(&store, 2).await, consumer_dp(&store, 2).await];
    let decode = engine(None, &store).await;
    let role = if pd { "--decode" } else { "--prefill" };
    let mut args: Vec<String> = ["--ec-connector", "mooncake", "--ec-dp-size", "2"]
        .map(str::to_owned)
        .to_vec();
    for c in &consumers {
        let ports = c.ec_push_ports();
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[1], ports[0] + 1, "rank d listens at ec_port + d");
        let url = if ranked {
            format!("{}@0-1", c.url())
        } else {
            c.url()
        };
        args.extend([
            role.to_owned(),
            url,
            "--ec-address".to_owned(),
            format!("{}=127.0.0.1:{}", c.url(), ports[0]),
        ]);
    }
    if !pd {
        args.extend(["--decode".to_owned(), decode.url()]);
    }
    for e in &encoders {
        args.extend(["--encode".to_owned(), e.url()]);
    }
    let proxy = Proxy::start_args(&args).await;
    let mut items = 0;
    for n in 0..12 {
        let images = 1 + n % 2;
        let body = chat(images, n % 3 == 0);
        let a = post(&proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "request {n}: {}", a.text());
        assert_eq!(a.chat_content(), reference(&body).await);
        items += images as u64;
    }
    let mut loaded = 0;
    for (i, c) in consumers.iter().enumerate() {
        let s = c.stats();
        loaded += s.ec_items_loaded;
        // Each of its requests read its items on the rank it was placed on, from that
        // rank's EC port: a request is counted on a rank only once its items arrived
        // there, and the media requests are all the consumer served.
        assert_eq!(
            s.ec_items_loaded_per_dp_rank.iter().sum::<u64>(),
            s.ec_items_loaded,
            "consumer {i}: {s:?}"
        );
        for rank in 0..2 {
            assert!(
                s.requests_per_dp_rank[rank] > 0 && s.ec_items_loaded_per_dp_rank[rank] > 0,
                "consumer {i} rank {rank} served nothing: {:?} {:?}",
                s.requests_per_dp_rank,
                s.ec_items_loaded_per_dp_rank
            );
        }
        // Every consumer leg named the rank it was pushed to.
        for r in c.requests() {
            assert!(
                r.header("x-data-parallel-rank").is_some(),
                "an unpinned consumer leg: {:?}",
                r.headers
            );
        }
    }
    assert_eq!(loaded, items);
    // The decode behind the prefills read nothing: the prefills consumed every item.
    if !pd {
        assert_eq!(decode.stats().ec_items_loaded, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_p_d_push_to_dp_prefills_given_without_a_rank() {
    dp_consumers_get_their_items_on_the_rank_that_serves(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_p_d_push_to_dp_prefills_given_with_their_ranks() {
    dp_consumers_get_their_items_on_the_rank_that_serves(false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_pd_push_to_dp_decodes_given_without_a_rank() {
    dp_consumers_get_their_items_on_the_rank_that_serves(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_pd_push_to_dp_decodes_given_with_their_ranks() {
    dp_consumers_get_their_items_on_the_rank_that_serves(true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_consumer_without_ec_dp_size_is_pinned_to_rank_0() {
    // The size not declared (1): vLLM would balance an unpinned request onto rank 1,
    // where rank 0's items never arrive; the proxy pins rank 0 instead.
    let store = TempDir::new();
    let encoder = engine(Some(EcRole::Producer), &store).await;
    let consumer = consumer_dp(&store, 2).await;
    let port = consumer.ec_push_port().expect("an EC port");
    let args = [
        "--ec-connector".to_owned(),
        "mooncake".to_owned(),
        "--decode".to_owned(),
        consumer.url(),
        "--ec-address".to_owned(),
        format!("{}=127.0.0.1:{port}", consumer.url()),
        "--encode".to_owned(),
        encoder.url(),
    ];
    let proxy = Proxy::start_args(&args).await;
    for stream in [false, true, false, true] {
        let a = post(&proxy.url(), "/v1/chat/completions", &chat(1, stream)).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let s = consumer.stats();
    assert_eq!(s.ec_items_loaded_per_dp_rank, vec![4, 0]);
    assert_eq!(s.requests_per_dp_rank, vec![4, 0]);
}

/// E → P → D in push mode with `--prefill-failure decode-only` and decodes that consume
/// (`--ec-profile ...,ec_consumer`): the items were pushed to the prefill, which then
/// fails; the decode that serves alone never got them, so the encoder stage runs again
/// with that decode as the consumer, and the request is served (not a 500 after the
/// decode waited `push_wait_timeout_s` for transfers pushed elsewhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_only_fallback_to_a_consuming_decode_has_the_items_pushed_to_it() {
    let store = TempDir::new();
    let encoder = engine(Some(EcRole::Producer), &store).await;
    let prefill = engine(Some(EcRole::Consumer), &store).await;
    let decode = engine(Some(EcRole::Consumer), &store).await;
    prefill.set_faults(Faults {
        status: Some(503),
        ..Faults::default()
    });
    let zmq = |e: &SimEngine| format!("127.0.0.1:{}", e.ec_push_port().expect("an EC port"));
    let args = [
        "--ec-connector".to_owned(),
        "mooncake".to_owned(),
        "--prefill".to_owned(),
        prefill.url(),
        "--ec-address".to_owned(),
        format!("{}={}", prefill.url(), zmq(&prefill)),
        "--decode".to_owned(),
        decode.url(),
        "--ec-address".to_owned(),
        format!("{}={}", decode.url(), zmq(&decode)),
        "--ec-profile".to_owned(),
        format!("{}=mooncake,ec_consumer", decode.url()),
        "--encode".to_owned(),
        encoder.url(),
        "--prefill-failure".to_owned(),
        "decode-only".to_owned(),
    ];
    let proxy = Proxy::start_args(&args).await;
    for stream in [false, true] {
        let body = chat(2, stream);
        let a = post(&proxy.url(), "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
        assert_eq!(a.chat_content(), reference(&body).await);
    }
    // Each request's prefill failed; its decode read both items, pushed to it.
    assert_eq!(prefill.stats().requests, 2);
    assert_eq!(prefill.stats().ec_items_loaded, 0);
    assert_eq!(decode.stats().ec_items_loaded, 4);
    // The encoder legs named the prefill first, then the decode, once per request.
    let named = |e: &SimEngine| {
        let zmq = format!("tcp://{}", zmq(e));
        encoder
            .requests()
            .iter()
            .filter(|l| l.body["ec_transfer_params"]["consumer_zmq"] == zmq.as_str())
            .count()
    };
    assert_eq!((named(&prefill), named(&decode)), (2, 2));
    // Counted once per request, and not as failures.
    assert_eq!(proxy.metric("disagg_encode_requests_total").await, 2);
    assert_eq!(proxy.metric("disagg_encode_failures_total").await, 0);
    assert_eq!(proxy.metric("disagg_prefill_fallbacks_total").await, 2);
}
