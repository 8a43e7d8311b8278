//! The endpoints file: edits, an invalid edit, deletion.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use disagg_core::endpoint::Facts;
use disagg_core::{EndpointSource, Role};
use disagg_discovery::MergedSource;
use disagg_discovery::file::{self, FileConfig, FileError};

use crate::support::{TempDir, eventually, ids, serves, wait_for};

/// The issue's bound: a change is in force within 2 s (the default poll is 1 s).
const RELOAD: Duration = Duration::from_secs(2);

/// The poll of the tests that are not about the default's bound: ten a second.
const FAST_POLL: Duration = Duration::from_millis(100);

/// The polls a claim that nothing more happens is held over: that polls of unchanged
/// content count and publish nothing.
const SEVERAL_POLLS: u64 = 5;

/// Replaces the file as editors and ConfigMap volumes do: a new file renamed over it.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

const FIRST: &str = r#"
[[prefill]]
url = "http://10.0.0.5:8100"
bootstrap_port = 8998

[[decode]]
url = "http://10.0.0.7:8200"
"#;

/// The file at [`FIRST`] and a merged source over it, polled every `poll` (`None`: the
/// default poll).
async fn start(dir: &TempDir, poll: Option<Duration>) -> (std::path::PathBuf, MergedSource) {
    let path = dir.path().join("endpoints.toml");
    replace(&path, FIRST);
    let mut config = FileConfig::new(&path);
    if let Some(poll) = poll {
        config.poll_interval = poll;
    }
    let source = file::spawn(config).await.unwrap();
    let merged = MergedSource::builder().source(source).build();
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(ids(&set, Role::Prefill), ["http://10.0.0.5:8100"]);
    assert_eq!(ids(&set, Role::Decode), ["http://10.0.0.7:8200"]);
    (path, merged)
}

fn errors(merged: &MergedSource) -> u64 {
    merged.sources().next().unwrap().1.errors()
}

fn polls(merged: &MergedSource) -> u64 {
    merged.sources().next().unwrap().1.polls()
}

/// Waits until `n` polls of the file have run, their outcomes taken, after the one
/// whose outcome was just seen (which may not be counted yet: one more is waited for).
async fn polls_run(merged: &MergedSource, n: u64) {
    let until = polls(merged) + n + 1;
    eventually(Duration::from_secs(10), "the polls", || {
        polls(merged) >= until
    })
    .await;
}

#[tokio::test]
async fn an_edit_is_in_force_within_two_seconds_and_unchanged_engines_stay() {
    let dir = TempDir::new("file-edit");
    // The default poll: the bound under test.
    let (path, merged) = start(&dir, None).await;
    let before = merged.snapshot();

    // A new decode, and the prefill's bootstrap port changes.
    replace(
        &path,
        r#"
        [[prefill]]
        url = "http://10.0.0.5:8100"
        bootstrap_port = 9000
        [[decode]]
        url = "http://10.0.0.7:8200"
        [[decode]]
        url = "http://10.0.0.8:8200"
        model = "llama"
        "#,
    );
    let after = wait_for(&merged, RELOAD, "the edit", |s| {
        s.by_role(Role::Decode).len() == 2
    })
    .await;
    assert_eq!(
        after.by_role(Role::Prefill)[0]
            .facts()
            .get(Facts::BOOTSTRAP_PORT),
        Some("9000")
    );
    assert!(!Arc::ptr_eq(
        &before.by_role(Role::Prefill)[0],
        &after.by_role(Role::Prefill)[0]
    ));
    let kept = after
        .by_role(Role::Decode)
        .iter()
        .find(|e| e.id().as_str() == "http://10.0.0.7:8200")
        .unwrap();
    assert!(Arc::ptr_eq(kept, &before.by_role(Role::Decode)[0]));
    let added = after
        .by_role(Role::Decode)
        .iter()
        .find(|e| e.id().as_str() == "http://10.0.0.8:8200")
        .unwrap();
    assert!(serves(added, "llama") && !serves(added, "qwen"));

    // An edit in place (no rename) is seen too.
    std::fs::write(&path, FIRST).unwrap();
    wait_for(&merged, RELOAD, "the edit in place", |s| {
        s.by_role(Role::Decode).len() == 1
    })
    .await;
    assert_eq!(errors(&merged), 0);
}

#[tokio::test]
async fn an_invalid_edit_keeps_the_last_good_engines_and_is_counted_once() {
    let dir = TempDir::new("file-invalid");
    let (path, merged) = start(&dir, Some(FAST_POLL)).await;
    let before = merged.snapshot();

    // A typo in a key: the whole edit is refused.
    replace(
        &path,
        "[[decode]]\nurl = \"http://10.0.0.9:8200\"\nbootstarp_port = 1\n",
    );
    eventually(Duration::from_secs(5), "the error counted", || {
        errors(&merged) == 1
    })
    .await;
    // Polls of the same invalid content count nothing more, and publish nothing.
    polls_run(&merged, SEVERAL_POLLS).await;
    assert_eq!(errors(&merged), 1);
    let now = merged.snapshot();
    assert!(Arc::ptr_eq(&now, &before), "the set was not republished");

    // Another invalid content counts again; then a valid edit is in force.
    replace(&path, "[[decode]\n");
    eventually(Duration::from_secs(5), "the second error", || {
        errors(&merged) == 2
    })
    .await;
    replace(&path, "[[decode]]\nurl = \"http://10.0.0.9:8200\"\n");
    let set = wait_for(&merged, RELOAD, "the valid edit", |s| {
        ids(s, Role::Decode) == ["http://10.0.0.9:8200"]
    })
    .await;
    assert!(set.by_role(Role::Prefill).is_empty());
}

#[tokio::test]
async fn a_deleted_file_keeps_the_last_good_engines_until_it_is_back() {
    let dir = TempDir::new("file-deleted");
    let (path, merged) = start(&dir, Some(FAST_POLL)).await;
    let before = merged.snapshot();

    std::fs::remove_file(&path).unwrap();
    eventually(Duration::from_secs(5), "the deletion counted", || {
        errors(&merged) == 1
    })
    .await;
    polls_run(&merged, SEVERAL_POLLS).await;
    assert_eq!(errors(&merged), 1, "a missing file is counted once");
    assert!(Arc::ptr_eq(&merged.snapshot(), &before));

    // Back, with other engines: in force. An empty file would empty the set.
    replace(&path, "[[decode]]\nurl = \"http://10.0.0.9:8200\"\n");
    wait_for(&merged, RELOAD, "the file back", |s| {
        ids(s, Role::Decode) == ["http://10.0.0.9:8200"]
    })
    .await;
    replace(&path, "");
    wait_for(&merged, RELOAD, "the empty file", |s| {
        s.by_role(Role::Decode).is_empty() && s.by_role(Role::Prefill).is_empty()
    })
    .await;
}

#[tokio::test]
async fn a_missing_or_invalid_file_at_start_is_an_error() {
    let dir = TempDir::new("file-start");
    let path = dir.path().join("endpoints.toml");
    let missing = file::spawn(FileConfig::new(&path)).await.unwrap_err();
    assert!(matches!(missing, FileError::Read { .. }), "{missing}");
    replace(
        &path,
        "[[prefill]]\nurl = \"http://10.0.0.5:8100\"\nranks = \"x\"\n",
    );
    let invalid = file::spawn(FileConfig::new(&path)).await.unwrap_err();
    assert!(matches!(invalid, FileError::Invalid(_)), "{invalid}");
    assert!(invalid.to_string().contains("[[prefill]] #1"), "{invalid}");
}

/// E/P/D: `[[encode]]` entries are encoder endpoints, their `ec_profile` in their
/// extensions for the pair check; an edit adds and removes them like the others.
#[tokio::test]
async fn encode_entries_are_encoder_endpoints_and_follow_edits() {
    let dir = TempDir::new("file-encode");
    let (path, merged) = start(&dir, Some(FAST_POLL)).await;
    assert!(merged.snapshot().by_role(Role::Encode).is_empty());
    replace(
        &path,
        &format!(
            "{FIRST}\n[[encode]]\nurl = \"http://10.0.0.9:8300\"\nec_profile = \"ECExampleConnector,ec_producer\"\n"
        ),
    );
    let set = wait_for(&merged, RELOAD, "the encoder", |s| {
        s.by_role(Role::Encode).len() == 1
    })
    .await;
    let encoder = &set.by_role(Role::Encode)[0];
    assert_eq!(encoder.id().as_str(), "http://10.0.0.9:8300");
    assert_eq!(encoder.role(), Role::Encode);
    let profile = encoder.ext().get::<disagg_pairing::EcProfile>().unwrap();
    assert_eq!(profile.role, Some(disagg_pairing::EcRole::Producer));
    // Neither a prefill nor a decode: routers never see it.
    assert_eq!(set.by_role(Role::Prefill).len(), 1);
    assert_eq!(set.by_role(Role::Decode).len(), 1);
    assert_eq!(merged.sources().next().unwrap().1.encode_endpoints(), 1);
    // Removed by the next edit.
    replace(&path, FIRST);
    wait_for(&merged, RELOAD, "the encoder gone", |s| {
        s.by_role(Role::Encode).is_empty()
    })
    .await;
    // A bootstrap port or a bad EC role on an encoder is refused with the entry named.
    let bad = "[[encode]]\nurl = \"http://10.0.0.9:8300\"\nbootstrap_port = 1\n";
    assert!(
        file::parse(bad)
            .unwrap_err()
            .to_string()
            .contains("[[encode]] #1")
    );
    let bad = "[[encode]]\nurl = \"http://10.0.0.9:8300\"\nec_profile = \"cpu,ec_maybe\"\n";
    assert!(file::parse(bad).is_err());
}

/// The ceiling on an endpoints file's size: what 4,096 engines written out in full take
/// (about 2.2 MB, [`fleet`]), with room to spare.
const CEILING: usize = 4 * 1024 * 1024;

/// `text` padded with a comment to `len` bytes.
fn padded(text: &str, len: usize) -> String {
    let mut padded = format!("{text}\n# ");
    padded.push_str(&"x".repeat(len - padded.len() - 1));
    padded.push('\n');
    assert_eq!(padded.len(), len);
    padded
}

/// A file past the ceiling on its size is refused with the error naming the ceiling, at
/// start and on reload (the last good engines stay); one at the ceiling is read.
#[tokio::test]
async fn a_file_past_the_size_ceiling_is_refused() {
    let dir = TempDir::new("file-size");
    let path = dir.path().join("endpoints.toml");
    replace(&path, &padded(FIRST, CEILING + 1));
    let err = file::spawn(FileConfig::new(&path)).await.unwrap_err();
    assert!(matches!(err, FileError::TooLarge { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("larger than {CEILING} bytes")),
        "{err}"
    );
    replace(&path, &padded(FIRST, CEILING));
    let source = file::spawn(FileConfig::new(&path)).await.unwrap();
    assert_eq!(source.watch().borrow().as_ref().map(|s| s.len()), Some(2));
    drop(source);

    let (path, merged) = start(&dir, Some(FAST_POLL)).await;
    let before = merged.snapshot();
    replace(&path, &padded(FIRST, CEILING + 1));
    eventually(RELOAD, "the oversized edit refused", || {
        errors(&merged) == 1
    })
    .await;
    assert!(Arc::ptr_eq(&merged.snapshot(), &before), "the set was kept");
    assert_eq!(file::MAX_FILE_BYTES, CEILING as u64);
}

/// The ceiling on a file's size follows the ceiling on its endpoints, 1 KiB for each
/// (about twice what an engine written out in full takes), 4 MiB at least: with
/// 8,192 endpoints allowed, a file of 6 MiB is read and one past 8 MiB refused, at start
/// and on reload.
#[tokio::test]
async fn the_size_ceiling_follows_the_endpoint_ceiling() {
    const RAISED: usize = 8 * 1024 * 1024;
    let dir = TempDir::new("file-size-raised");
    let path = dir.path().join("endpoints.toml");
    let config = || {
        let mut config = FileConfig::new(&path);
        config.bounds.max_endpoints = 8192;
        config.poll_interval = FAST_POLL;
        config
    };
    assert_eq!(config().max_file_bytes(), RAISED as u64);
    assert_eq!(
        FileConfig::new(&path).max_file_bytes(),
        file::MAX_FILE_BYTES
    );
    replace(&path, &padded(FIRST, RAISED + 1));
    let err = file::spawn(config()).await.unwrap_err();
    assert!(matches!(err, FileError::TooLarge { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("larger than {RAISED} bytes")),
        "{err}"
    );
    replace(&path, &padded(FIRST, 6 * 1024 * 1024));
    let source = file::spawn(config()).await.unwrap();
    let merged = MergedSource::builder().source(source).build();
    merged.synced().await;
    assert_eq!(merged.snapshot().iter().count(), 2);
    let before = merged.snapshot();
    replace(&path, &padded(FIRST, RAISED + 1));
    eventually(RELOAD, "the oversized edit refused", || {
        errors(&merged) == 1
    })
    .await;
    assert!(Arc::ptr_eq(&merged.snapshot(), &before), "the set was kept");
    replace(&path, &padded(&FIRST.replace("8200", "8201"), RAISED));
    wait_for(&merged, RELOAD, "the edit at the ceiling", |s| {
        ids(s, Role::Decode) == ["http://10.0.0.7:8201"]
    })
    .await;
}

/// 4,096 engines (the most one source may contribute by default) written out in full:
/// long host names, three models each, every optional key.
fn fleet() -> String {
    let mut text = String::from("# the production fleet\n");
    for (role, n) in [("prefill", 2048), ("decode", 2048)] {
        for i in 0..n {
            let host = format!(
                "vllm-{role}-{i:04}.vllm-{role}-headless.inference-production.svc.cluster.local"
            );
            text.push_str(&format!("[[{role}]]\nurl = \"http://{host}:8000\"\n"));
            if role == "prefill" {
                text.push_str("bootstrap_port = 8998\n");
            }
            text.push_str(
                "model = [\"meta-llama/Llama-3.1-70B-Instruct\", \"meta-llama/Llama-3.1-70B-Instruct-FP8\", \"customer-a/llama-3.1-70b-lora-support-v2\"]\n\
                 weight = 1.5\n\
                 kv_profile = { connector = \"NixlConnector\", role = \"kv_both\", tp = 4 }\n",
            );
            text.push_str(&format!("kv_events = \"tcp://{host}:5557\"\n"));
            if role == "decode" {
                text.push_str(&format!(
                    "lmcache_receiver = \"10.{}.{}.7:7300,7301,7302,7303:7400,7401,7402,7403\"\n",
                    i / 256,
                    i % 256
                ));
            }
            text.push_str(&format!(
                "facts = {{ my_engine_id = \"{role}-{i:04}\", zone = \"us-east-1a\" }}\n\n"
            ));
        }
    }
    text
}

/// A file of 4,096 engines written out in full is well within the ceiling and read.
#[tokio::test]
async fn a_file_of_the_most_engines_written_out_in_full_is_read() {
    let text = fleet();
    assert!(text.len() < CEILING * 2 / 3, "{} bytes", text.len());
    let dir = TempDir::new("file-fleet");
    let path = dir.path().join("endpoints.toml");
    replace(&path, &text);
    let source = file::spawn(FileConfig::new(&path)).await.unwrap();
    let merged = MergedSource::builder().source(source).build();
    merged.synced().await;
    let set = merged.snapshot();
    assert_eq!(
        (
            set.by_role(Role::Prefill).len(),
            set.by_role(Role::Decode).len()
        ),
        (2048, 2048)
    );
}

/// A file caught while it is rewritten in place (`>` redirection, `kubectl cp`:
/// truncated, then written) is not published: neither the empty file nor its first
/// entries alone. A change is in force once the file reads the same twice, the settle
/// delay apart; here the writer pauses for 300 ms (several polls) at each step, within
/// the settle delay of a second.
#[tokio::test]
async fn a_file_caught_mid_write_is_not_published() {
    use std::io::Write;
    let dir = TempDir::new("file-mid-write");
    let path = dir.path().join("endpoints.toml");
    replace(&path, FIRST);
    let mut config = FileConfig::new(&path);
    config.poll_interval = Duration::from_millis(20);
    config.settle = Duration::from_secs(1);
    let merged = MergedSource::builder()
        .source(file::spawn(config).await.unwrap())
        .build();
    merged.synced().await;
    let stats = || merged.sources().next().unwrap().1;
    let updates = stats().updates();
    // Every set published from now on, as the merged source's watchers see them.
    let mut rx = merged.watch();
    let seen = tokio::spawn(async move {
        let mut decodes = Vec::new();
        while rx.changed().await.is_ok() {
            let set = rx.borrow_and_update().clone();
            decodes.push(ids(&set, Role::Decode));
        }
        decodes
    });
    // The edit adds a decode; cut after its first entry, it has no decode at all.
    let first_entry = "[[prefill]]\nurl = \"http://10.0.0.5:8100\"\nbootstrap_port = 8998\n";
    let rest = "[[decode]]\nurl = \"http://10.0.0.7:8200\"\n\
                [[decode]]\nurl = \"http://10.0.0.8:8200\"\n";
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    file.write_all(first_entry.as_bytes()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    file.write_all(rest.as_bytes()).unwrap();
    drop(file);
    wait_for(&merged, Duration::from_secs(5), "the whole edit", |s| {
        ids(s, Role::Decode) == ["http://10.0.0.7:8200", "http://10.0.0.8:8200"]
    })
    .await;
    assert_eq!(
        stats().updates(),
        updates + 1,
        "one list published: the edit"
    );
    assert_eq!(
        stats().errors(),
        0,
        "no refused edit: the cut one was never parsed"
    );
    drop(merged);
    let decodes = seen.await.unwrap();
    assert_eq!(
        decodes,
        [vec!["http://10.0.0.7:8200", "http://10.0.0.8:8200"]],
        "the sets published"
    );
}

/// A poll interval of zero (which `tokio::time::interval` refuses with a panic, in the
/// reload task) is refused when the source starts.
#[tokio::test]
async fn a_poll_interval_of_zero_is_refused_at_start() {
    let dir = TempDir::new("file-zero-poll");
    let path = dir.path().join("endpoints.toml");
    replace(&path, FIRST);
    let mut config = FileConfig::new(&path);
    config.poll_interval = Duration::ZERO;
    let err = file::spawn(config).await.map(drop).unwrap_err();
    assert!(matches!(err, FileError::PollInterval), "{err}");
}
