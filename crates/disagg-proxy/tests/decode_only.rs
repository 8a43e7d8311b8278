//! `--prefill-failure decode-only` with no prefill engine configured: the real binary
//! starts, and serves each request on a decode engine alone, marked as a fallback
//! for want of a prefill endpoint (docs/reliability.md, "Prefill failure policy").

#![allow(missing_docs)] // a test binary

use disagg_sim::{SimConfig, SimEngine};

mod common;
use common::{Proxy, completion, post};

#[tokio::test]
async fn decode_only_with_no_prefill_engine_serves_on_the_decode_alone() {
    let decode = SimEngine::start(SimConfig::default())
        .await
        .expect("start a simulated engine");
    let proxy = Proxy::start_args(&[
        "--decode".to_owned(),
        decode.url(),
        "--prefill-failure".to_owned(),
        "decode-only".to_owned(),
    ])
    .await;
    let expected = disagg_sim::generate("alone", 4, 0).concat();
    for stream in [false, true] {
        let a = post(
            &proxy.url(),
            "/v1/completions",
            &completion("alone", 4, stream),
        )
        .await;
        assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
        assert_eq!(a.header("x-disagg-handoff"), Some("decode-only"));
        assert_eq!(a.header("x-disagg-fallback"), Some("no_prefill_endpoint"));
        assert_eq!(a.content(), expected);
    }
    let d = decode.stats();
    assert_eq!((d.requests, d.remote_decodes), (2, 0), "{d:?}");
}
