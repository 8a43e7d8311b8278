//! The bench's flags, through its binary: loads the bench could not honour are refused
//! or cut, not run under a label they do not match.

use std::process::{Command, Output};

fn bench(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_disagg-bench"))
        .args(args)
        .output()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn max_requests_below_the_largest_concurrency_is_refused() -> std::io::Result<()> {
    // Fewer requests than the c=64 phase's clients would run fewer clients than its
    // label says.
    let out = bench(&[
        "--duration",
        "0.01",
        "--warmup",
        "0",
        "--max-requests",
        "10",
        "--streams",
        "4",
        "--stream-delay-ms",
        "1",
    ])?;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--max-requests") && err.contains("64"),
        "{err}"
    );
    Ok(())
}

#[test]
fn hold_refuses_fewer_requests_than_clients() -> std::io::Result<()> {
    let out = bench(&["hold", "--clients", "4", "--requests", "2"])?;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--requests"), "{err}");
    Ok(())
}

#[test]
fn hold_gives_up_at_its_timeout() -> std::io::Result<()> {
    // 8 requests of 16 tokens 20 ms apart on 2 clients take about 1.3 s: not 50 ms.
    let out = bench(&[
        "hold",
        "--clients",
        "2",
        "--requests",
        "8",
        "--kv-lease",
        "0.2",
        "--timeout",
        "0.05",
    ])?;
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("did not finish within"), "{err}");
    Ok(())
}

/// The load tests address 127.0.0.1 only: `--proxy-args` that would make the proxy (or
/// an engine, told by the proxy) listen on or connect to another host, or find engines
/// at run time wherever a discovery source says, are refused before anything starts,
/// naming the flag.
#[test]
fn proxy_args_addressing_other_hosts_are_refused() -> std::io::Result<()> {
    let run = [
        "--duration",
        "0.01",
        "--warmup",
        "0",
        "--max-requests",
        "64",
        "--streams",
        "4",
        "--stream-delay-ms",
        "1",
    ];
    let hold = ["hold", "--clients", "1", "--requests", "1", "--tokens", "1"];
    for (base, extra, says) in [
        (
            &run[..],
            "--otlp-endpoint http://10.255.255.1:4318",
            "--otlp-endpoint",
        ),
        (
            &run[..],
            "--policy kv_events --kv-events-endpoint http://127.0.0.1:1=tcp://10.255.255.1:5557",
            "--kv-events-endpoint",
        ),
        (
            &run[..],
            "--lmcache-notify tcp://*:7500",
            "--lmcache-notify",
        ),
        (
            &run[..],
            "--prefill-dns engines.example:8000",
            "--prefill-dns",
        ),
        (
            &run[..],
            "--endpoints-file /nonexistent.toml",
            "--endpoints-file",
        ),
        (
            &hold[..],
            "--otlp-endpoint http://collector:4318",
            "--otlp-endpoint",
        ),
        (
            &hold[..],
            "--decode http://10.255.255.1:8000",
            "http://10.255.255.1:8000",
        ),
    ] {
        let out = bench(&[base, &["--proxy-args", extra]].concat())?;
        let err = stderr(&out);
        assert!(!out.status.success(), "{extra}: {err}");
        assert!(
            err.contains(says) && err.contains("127.0.0.1"),
            "{extra}: {err}"
        );
        // Refused before any engine or proxy started.
        assert!(
            out.stdout.is_empty(),
            "{extra}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(!err.contains("proxy pid"), "{extra}: {err}");
    }
    Ok(())
}
