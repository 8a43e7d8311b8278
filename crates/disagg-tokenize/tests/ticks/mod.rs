//! Whether work ran on the event loop: [`ticks_while`] runs it on a current-thread
//! runtime (one event loop, on the test's thread) beside a task that counts its turns.
//! The ticker can only turn while the work waits: work done inline, however long, leaves
//! it at zero; work handed to the blocking pool lets it turn until the work is back.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `work`'s output, and how many turns another task of the same event loop took
/// while `work` ran.
pub(crate) fn ticks_while<F: Future>(work: F) -> (F::Output, usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let ticks = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&ticks);
        // Spawned, it cannot run before `work` first waits: the event loop polls this
        // block first, and `work` starts within that poll.
        let ticker = tokio::spawn(async move {
            loop {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        });
        let out = work.await;
        let seen = ticks.load(Ordering::Relaxed);
        ticker.abort();
        (out, seen)
    })
}
