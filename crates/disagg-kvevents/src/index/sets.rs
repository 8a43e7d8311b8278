//! The sets of holders the index keeps per key: a short list inline, a bit set past
//! it, so that a lookup intersects holders a word at a time.

use smallvec::SmallVec;

/// The holders of one key, by slot: a list inline up to [`FEW`] holders (most blocks
/// of most prompts sit on one or two engines), a bit set beyond (a system prompt cached
/// by hundreds of engines), so that a lookup intersects sets a word at a time.
#[derive(Debug, Clone)]
pub(super) enum HolderSet {
    Few(SmallVec<[u32; FEW]>),
    /// Bit `s` set when slot `s` holds the key.
    Many(Box<[u64]>),
}

/// Holders kept as a list before a key's set turns into a bit set.
const FEW: usize = 4;

impl Default for HolderSet {
    fn default() -> Self {
        HolderSet::Few(SmallVec::new())
    }
}

impl HolderSet {
    pub(super) fn insert(&mut self, slot: u32) {
        match self {
            HolderSet::Few(list) if list.contains(&slot) => {}
            HolderSet::Few(list) if list.len() < FEW => list.push(slot),
            HolderSet::Few(list) => {
                let mut bits = Bits::default();
                for &s in list.iter().chain(std::iter::once(&slot)) {
                    bits.set(s);
                }
                *self = HolderSet::Many(bits.0.into_boxed_slice());
            }
            HolderSet::Many(words) => {
                let mut bits = Bits(std::mem::take(words).into_vec());
                bits.set(slot);
                *words = bits.0.into_boxed_slice();
            }
        }
    }

    /// Removes `slot`; whether the set is now empty.
    pub(super) fn remove(&mut self, slot: u32) -> bool {
        match self {
            HolderSet::Few(list) => {
                list.retain(|s| *s != slot);
                list.is_empty()
            }
            HolderSet::Many(words) => {
                let (w, b) = (slot as usize / 64, slot % 64);
                if let Some(word) = words.get_mut(w) {
                    *word &= !(1u64 << b);
                }
                words.iter().all(|w| *w == 0)
            }
        }
    }

    #[cfg(test)]
    pub(super) fn contains(&self, slot: u32) -> bool {
        match self {
            HolderSet::Few(list) => list.contains(&slot),
            HolderSet::Many(words) => words
                .get(slot as usize / 64)
                .is_some_and(|w| w & (1u64 << (slot % 64)) != 0),
        }
    }
}

/// A growable bit set of slots.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Bits(pub(super) Vec<u64>);

impl Bits {
    pub(super) fn zeroed(words: usize) -> Self {
        Bits(vec![0; words])
    }

    pub(super) fn set(&mut self, slot: u32) {
        let w = slot as usize / 64;
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1u64 << (slot % 64);
    }

    pub(super) fn has(&self, slot: u32) -> bool {
        self.0
            .get(slot as usize / 64)
            .is_some_and(|w| w & (1u64 << (slot % 64)) != 0)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    /// The slots set, in order.
    pub(super) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(i, &word)| {
            let mut w = word;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros();
                w &= w - 1;
                u32::try_from(i * 64).ok().map(|base| base + b)
            })
        })
    }
}
