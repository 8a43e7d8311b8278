//! What refusing an engine with an over-long URL and many data-parallel ranks costs: the
//! URL is checked once, before anything is made per rank, so the refusal allocates
//! about the URL's size, not the URL once per rank (a 64 KiB URL with 1,024 ranks was
//! 64 MiB of endpoint ids, and as much again of their identities, before the first
//! endpoint refused it; a 4 MB URL, 8 GiB).
//!
//! Every allocation of this test binary goes through a counting global allocator
//! (`cap`'s), as in `pod_memory.rs`; each test holds [`ALONE`] while it measures.

use std::alloc::System;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cap::Cap;
use disagg_core::Role;
use disagg_discovery::{EndpointSpec, MergedSource, Ranks, SpecSource, file};

#[global_allocator]
static HEAP: Cap<System> = Cap::new(System, usize::MAX);

static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The URL under test: 64 KiB of host name.
fn long_url() -> String {
    format!("http://{}:8200", "a".repeat(64 * 1024))
}

/// The most a refusal may allocate in all: a few copies of the URL, and the parse.
const AT_MOST: usize = 4 * 1024 * 1024;

#[test]
fn the_endpoints_file_refuses_an_over_long_url_without_a_copy_per_rank() {
    let text = format!("[[decode]]\nurl = \"{}\"\nranks = \"0-1023\"\n", long_url());
    let _alone = alone();
    let before = HEAP.total_allocated();
    let refused = file::parse(&text);
    let allocated = HEAP.total_allocated() - before;
    assert!(refused.is_err());
    assert!(
        allocated < AT_MOST,
        "the refusal allocated {allocated} bytes in all"
    );
}

#[test]
fn the_merge_refuses_an_over_long_url_without_a_copy_per_rank() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut spec = EndpointSpec::new(long_url(), Role::Decode);
    spec.ranks = Some(Ranks::new(0, 1023).unwrap());
    let (publisher, source) = SpecSource::channel("embedder");
    let merged = runtime.block_on(async { MergedSource::builder().source(source).build() });
    let _alone = alone();
    let before = HEAP.total_allocated();
    publisher.publish(vec![spec]);
    runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), merged.synced())
            .await
            .expect("the list merged");
    });
    let allocated = HEAP.total_allocated() - before;
    let stats = merged.sources().next().unwrap().1;
    assert_eq!(stats.rejected(), 1, "the engine left out");
    assert!(
        allocated < AT_MOST,
        "the refusal allocated {allocated} bytes in all"
    );
}
