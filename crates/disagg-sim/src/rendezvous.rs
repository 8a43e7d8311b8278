//! Where a prefill and a decode that were sent their requests at the same
//! time meet: KV registered under a key (an SGLang room, a Mooncake transfer
//! id) by the prefill and taken once by the decode, each side waiting for
//! the other without polling.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::{Instant, timeout_at};

use crate::generate::KvDigest;
use crate::kv::lock;
use crate::stats::Counters;

/// A value held at a rendezvous that occupies KV blocks, counted in
/// [`Counters::blocks_held`] while it is held.
pub(crate) trait HeldBlocks {
    /// How many KV blocks the value occupies.
    fn held_blocks(&self) -> u64;
}

impl HeldBlocks for KvDigest {
    fn held_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }
}

#[derive(Debug)]
struct Slot<V> {
    value: V,
    /// The registration the slot belongs to: only it may withdraw the slot.
    owner: u64,
    /// When the slot is swept if nobody took it.
    expires: Option<Instant>,
    /// Told when a taker has the value.
    taken: oneshot::Sender<()>,
}

/// Values registered under unique keys, each taken at most once.
///
/// Every slot is counted in [`Counters::kv_transfers_pending`], and its
/// blocks in [`Counters::blocks_held`], from its registration until it is
/// taken, withdrawn or swept.
#[derive(Debug)]
pub(crate) struct Rendezvous<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
    /// Woken on every registration, for takers waiting for their key.
    registered: Notify,
    next_owner: AtomicU64,
}

impl<K, V> Default for Rendezvous<K, V> {
    fn default() -> Self {
        Self {
            slots: Mutex::default(),
            registered: Notify::new(),
            next_owner: AtomicU64::new(0),
        }
    }
}

/// A successful [`Rendezvous::register`].
#[derive(Debug)]
pub(crate) struct Registration<K> {
    /// Whose slots these are (for [`Rendezvous::withdraw`]).
    pub(crate) owner: u64,
    /// One receiver per registered key, in order, told when it is taken.
    pub(crate) taken: Vec<(K, oneshot::Receiver<()>)>,
}

impl<K: Eq + Hash + Clone, V: HeldBlocks> Rendezvous<K, V> {
    /// Registers every entry, or none when one of the keys is already
    /// registered (that key is returned). A `lease` makes the slots expire
    /// (see [`Rendezvous::sweep`]).
    pub(crate) fn register(
        &self,
        counters: &Counters,
        entries: Vec<(K, V)>,
        lease: Option<Duration>,
    ) -> Result<Registration<K>, K> {
        let owner = self.next_owner.fetch_add(1, Relaxed);
        let expires = lease.map(|l| Instant::now() + l);
        let mut taken = Vec::with_capacity(entries.len());
        {
            let mut slots = lock(&self.slots);
            if let Some((key, _)) = entries.iter().find(|(k, _)| slots.contains_key(k)) {
                return Err(key.clone());
            }
            for (key, value) in entries {
                let (tx, rx) = oneshot::channel();
                counters.blocks_held.fetch_add(value.held_blocks(), Relaxed);
                let slot = Slot {
                    value,
                    owner,
                    expires,
                    taken: tx,
                };
                slots.insert(key.clone(), slot);
                counters.kv_transfers_pending.fetch_add(1, Relaxed);
                taken.push((key, rx));
            }
        }
        self.registered.notify_waiters();
        Ok(Registration { owner, taken })
    }

    /// Removes the slots of `keys` that still belong to `owner` (not taken
    /// yet, not re-registered by someone else since).
    pub(crate) fn withdraw<'k>(
        &self,
        counters: &Counters,
        keys: impl IntoIterator<Item = &'k K>,
        owner: u64,
    ) where
        K: 'k,
    {
        let mut slots = lock(&self.slots);
        for key in keys {
            if slots.get(key).is_some_and(|s| s.owner == owner)
                && let Some(slot) = slots.remove(key)
            {
                release(counters, &slot);
            }
        }
    }

    /// Takes the value of `key` if it is registered (and not expired).
    fn try_take(&self, counters: &Counters, key: &K) -> Option<V> {
        let slot = {
            let mut slots = lock(&self.slots);
            let slot = slots.remove(key)?;
            release(counters, &slot);
            slot
        };
        if slot.expires.is_some_and(|e| e <= Instant::now()) {
            return None;
        }
        // The registrant may have stopped listening; the value is taken anyway.
        let _ = slot.taken.send(());
        Some(slot.value)
    }

    /// Takes the value of `key`, waiting up to `wait` for it to be
    /// registered. `None` when the wait ran out.
    pub(crate) async fn take(&self, counters: &Counters, key: &K, wait: Duration) -> Option<V> {
        let deadline = Instant::now() + wait;
        loop {
            let registered = self.registered.notified();
            tokio::pin!(registered);
            // Listen before looking, so that a registration in between is not missed.
            registered.as_mut().enable();
            if let Some(value) = self.try_take(counters, key) {
                return Some(value);
            }
            timeout_at(deadline, registered).await.ok()?;
        }
    }

    /// Removes the slots whose lease ran out.
    pub(crate) fn sweep(&self, counters: &Counters) {
        let now = Instant::now();
        let mut slots = lock(&self.slots);
        slots.retain(|_, slot| {
            let keep = slot.expires.is_none_or(|e| e > now);
            if !keep {
                release(counters, slot);
            }
            keep
        });
    }
}

/// Uncounts a slot that left the rendezvous.
fn release<V: HeldBlocks>(counters: &Counters, slot: &Slot<V>) {
    counters.kv_transfers_pending.fetch_sub(1, Relaxed);
    counters
        .blocks_held
        .fetch_sub(slot.value.held_blocks(), Relaxed);
}

/// Withdraws the slots of a registration that were not taken when dropped:
/// on every path out of a request, cancellation included.
#[derive(Debug)]
pub(crate) struct WithdrawOnDrop<'a, K: Eq + Hash + Clone, V: HeldBlocks> {
    pub(crate) rendezvous: &'a Rendezvous<K, V>,
    pub(crate) counters: &'a Counters,
    pub(crate) keys: Vec<K>,
    pub(crate) owner: u64,
}

impl<K: Eq + Hash + Clone, V: HeldBlocks> Drop for WithdrawOnDrop<'_, K, V> {
    fn drop(&mut self) {
        self.rendezvous
            .withdraw(self.counters, &self.keys, self.owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test values occupy as many blocks as their length.
    impl HeldBlocks for &str {
        fn held_blocks(&self) -> u64 {
            self.len() as u64
        }
    }

    impl HeldBlocks for u32 {
        fn held_blocks(&self) -> u64 {
            u64::from(*self)
        }
    }

    #[tokio::test]
    async fn register_take_withdraw() {
        let counters = Counters::default();
        let r = Rendezvous::<u64, &str>::default();
        let reg = r
            .register(&counters, vec![(1, "a"), (2, "b")], None)
            .unwrap();
        assert_eq!(counters.snapshot().kv_transfers_pending, 2);
        assert_eq!(counters.snapshot().blocks_held, 2);
        assert_eq!(
            r.register(&counters, vec![(3, "c"), (2, "x")], None)
                .unwrap_err(),
            2
        );
        assert_eq!(counters.snapshot().kv_transfers_pending, 2);
        let mut taken = reg.taken.into_iter();
        let (k, rx) = taken.next().unwrap();
        assert_eq!(k, 1);
        assert_eq!(r.take(&counters, &1, Duration::ZERO).await, Some("a"));
        rx.await.unwrap();
        assert_eq!(r.take(&counters, &1, Duration::from_millis(5)).await, None);
        // Someone else's slot is not withdrawn.
        r.withdraw(&counters, &[2], reg.owner + 1);
        assert_eq!(counters.snapshot().kv_transfers_pending, 1);
        assert_eq!(counters.snapshot().blocks_held, 1);
        r.withdraw(&counters, &[1, 2], reg.owner);
        assert_eq!(counters.snapshot().kv_transfers_pending, 0);
        assert_eq!(counters.snapshot().blocks_held, 0);
    }

    #[tokio::test]
    async fn taker_waits_for_registration() {
        let counters = std::sync::Arc::new(Counters::default());
        let r = std::sync::Arc::new(Rendezvous::<u64, u32>::default());
        let waiter = {
            let (r, c) = (r.clone(), counters.clone());
            tokio::spawn(async move { r.take(&c, &7, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        r.register(&counters, vec![(6, 1)], None).unwrap();
        r.register(&counters, vec![(7, 2)], None).unwrap();
        assert_eq!(waiter.await.unwrap(), Some(2));
        assert_eq!(counters.snapshot().kv_transfers_pending, 1);
    }

    #[tokio::test]
    async fn leases_expire() {
        let counters = Counters::default();
        let r = Rendezvous::<u64, u32>::default();
        r.register(&counters, vec![(1, 1)], Some(Duration::ZERO))
            .unwrap();
        r.register(&counters, vec![(2, 2)], Some(Duration::from_secs(60)))
            .unwrap();
        assert_eq!(counters.snapshot().blocks_held, 3);
        r.sweep(&counters);
        assert_eq!(counters.snapshot().kv_transfers_pending, 1);
        assert_eq!(counters.snapshot().blocks_held, 2);
        assert_eq!(r.take(&counters, &2, Duration::ZERO).await, Some(2));
        assert_eq!(counters.snapshot().blocks_held, 0);
    }
}
