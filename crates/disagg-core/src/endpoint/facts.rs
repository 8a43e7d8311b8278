//! An endpoint's protocol facts: ordered string keys to string values, filled by
//! whoever makes the endpoint (the command line, a discovery source, an embedder) and
//! read by the connector whose protocol needs them.
//!
//! The core reads no fact: it only keeps them, bounded. Each connector parses the keys
//! it needs (a bootstrap port, an LMCache receiver) and refuses a malformed value with
//! an error naming the endpoint and the key. The well-known keys are constants here, so
//! that the sources and the connectors spell them alike without depending on each other.
//!
//! Facts often come from peers (a discovery file, a pod's annotations, DNS answers), so
//! every insertion is held to ceilings before anything is kept: 32 entries, keys of 64
//! bytes from `[a-z0-9_.-]`, values of 4096 bytes without control characters.

use std::fmt;
use std::sync::Arc;

/// An endpoint's protocol facts: ordered string keys to string values, filled by
/// whoever makes the endpoint (the command line, a discovery source, an embedder) and
/// read by the connector whose protocol needs them.
///
/// The core reads no fact: it only keeps them, bounded. Each connector parses the keys
/// it needs and refuses a malformed value with an error naming the endpoint and the
/// key. The well-known keys are constants here ([`BOOTSTRAP_PORT`](Self::BOOTSTRAP_PORT),
/// [`KV_RECEIVER`](Self::KV_RECEIVER)), so that the sources and the
/// connectors spell them alike without depending on each other. Facts often come from
/// peers (a discovery file, a pod's annotations, DNS answers), so every insertion is
/// held to ceilings before anything is kept: at most **32 entries**, keys of at most
/// **64 bytes** from `[a-z0-9_.-]`, values of at most **4096 bytes** (an LMCache
/// receiver of 64 ranks fits with room) without control characters. A [`FactError`]
/// names the ceiling a refused insertion passed.
///
/// # Examples
///
/// ```
/// use disagg_core::endpoint::{Endpoint, Facts, Role};
///
/// let facts = Facts::default().with(Facts::BOOTSTRAP_PORT, "8998")?;
/// let p = Endpoint::new("http://10.0.0.5:30000", Role::Prefill)?.with_facts(facts);
/// assert_eq!(p.facts().get(Facts::BOOTSTRAP_PORT), Some("8998"));
/// assert_eq!(p.facts().get(Facts::BOOTSTRAP_PORT).map(str::parse::<u16>), Some(Ok(8998)));
///
/// // A peer's oversized value is refused before it is kept.
/// let long = "x".repeat(4097);
/// assert!(Facts::default().with("note", long).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Facts {
    /// Sorted by key, keys unique. Shared: an engine's facts go to each of its rank
    /// endpoints (up to 1,024 of them, 128 KiB of facts each at the ceilings), so a
    /// clone is a reference count, and a change copies the entries first
    /// ([`Arc::make_mut`]) when another copy holds them.
    entries: Arc<Vec<(Box<str>, Box<str>)>>,
}

impl Facts {
    /// A prefill engine's KV bootstrap port, a decimal `u16` (SGLang's
    /// `--disaggregation-bootstrap-port`, vLLM Mooncake's `VLLM_MOONCAKE_BOOTSTRAP_PORT`);
    /// absent: none declared.
    pub const BOOTSTRAP_PORT: &'static str = "bootstrap_port";
    /// Where a decode engine receives KV a prefill pushes to it, in its connector's
    /// text form (LMCache's `HOST:INIT[,INIT...]:ALLOC[,ALLOC...]`, one init and one
    /// alloc port per tensor-parallel rank, as `serve --lmcache-receiver` writes it).
    pub const KV_RECEIVER: &'static str = "kv_receiver";
    /// The engine's release as its `GET /version` answers it (vLLM: `"0.33.0"`), filled
    /// by whoever probed it (`serve` for its `--decode` engines when
    /// `--prompt-token-reuse auto`) or declared by a discovery source; connectors read it
    /// for features that depend on the engine's release (vLLM's prompt-token reuse).
    pub const ENGINE_VERSION: &'static str = "engine_version";

    /// The most entries one endpoint keeps (documented on [`Facts`]).
    pub(crate) const MAX_ENTRIES: usize = 32;
    /// The longest key, in bytes.
    pub(crate) const MAX_KEY_LEN: usize = 64;
    /// The longest value, in bytes (an LMCache receiver of 64 ranks fits with room).
    pub(crate) const MAX_VALUE_LEN: usize = 4096;

    /// Sets `key` to `value`, replacing a value already there, within the ceilings.
    ///
    /// # Errors
    ///
    /// [`FactError`] when the key is empty, too long or has a character outside
    /// `[a-z0-9_.-]`, the value is too long or has a control character, or a new key
    /// would pass the 32 entries one endpoint keeps; the facts are then unchanged.
    pub fn insert(&mut self, key: &str, value: impl Into<String>) -> Result<(), FactError> {
        check_key(key)?;
        let value = value.into();
        if value.len() > Self::MAX_VALUE_LEN {
            return Err(FactError::ValueTooLong {
                key: key.to_owned(),
                len: value.len(),
                max: Self::MAX_VALUE_LEN,
            });
        }
        if value.chars().any(char::is_control) {
            return Err(FactError::ControlCharacter {
                key: key.to_owned(),
            });
        }
        match self.entries.binary_search_by(|(k, _)| (**k).cmp(key)) {
            Ok(i) => Arc::make_mut(&mut self.entries)[i].1 = value.into_boxed_str(),
            Err(i) => {
                if self.entries.len() >= Self::MAX_ENTRIES {
                    return Err(FactError::TooMany {
                        max: Self::MAX_ENTRIES,
                    });
                }
                Arc::make_mut(&mut self.entries).insert(i, (key.into(), value.into_boxed_str()));
            }
        }
        Ok(())
    }

    /// These facts with `key` set to `value`, as [`insert`](Self::insert).
    ///
    /// # Errors
    ///
    /// As [`insert`](Self::insert).
    pub fn with(mut self, key: &str, value: impl Into<String>) -> Result<Self, FactError> {
        self.insert(key, value)?;
        Ok(self)
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i| &*self.entries[i].1)
    }

    /// Removes `key`, returning its value.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, key: &str) -> Option<String> {
        let i = self
            .entries
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()?;
        Some(Arc::make_mut(&mut self.entries).remove(i).1.into_string())
    }

    /// The entries, in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(k, v)| (&**k, &**v))
    }

    /// How many entries there are.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

impl fmt::Debug for Facts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

fn check_key(key: &str) -> Result<(), FactError> {
    if key.len() > Facts::MAX_KEY_LEN {
        return Err(FactError::KeyTooLong {
            len: key.len(),
            max: Facts::MAX_KEY_LEN,
        });
    }
    let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b);
    if key.is_empty() || !key.bytes().all(allowed) {
        return Err(FactError::Key {
            key: key.to_owned(),
        });
    }
    Ok(())
}

/// A fact refused by [`Facts::insert`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FactError {
    /// The key is empty or has a character outside `[a-z0-9_.-]`.
    #[error("fact key `{key}` is not made of a-z, 0-9, `_`, `.` and `-`")]
    Key {
        /// The key (at most 64 bytes: a longer one is
        /// [`KeyTooLong`](Self::KeyTooLong)).
        key: String,
    },
    /// The key is longer than 64 bytes.
    #[error("a fact key of {len} bytes is longer than the {max} allowed")]
    KeyTooLong {
        /// Its length.
        len: usize,
        /// The ceiling.
        max: usize,
    },
    /// The value is longer than 4096 bytes.
    #[error("fact `{key}`: a value of {len} bytes is longer than the {max} allowed")]
    ValueTooLong {
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
        /// The ceiling.
        max: usize,
    },
    /// The value has a control character.
    #[error("fact `{key}`: the value has a control character")]
    ControlCharacter {
        /// The key.
        key: String,
    },
    /// A new key would pass the 32 entries an endpoint keeps.
    #[error("more than {max} facts for one endpoint")]
    TooMany {
        /// The ceiling.
        max: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_keys_in_order_and_replaces() {
        let mut f = Facts::default()
            .with("b", "2")
            .unwrap()
            .with("a", "1")
            .unwrap();
        f.insert("b", "3").unwrap();
        assert_eq!(f.iter().collect::<Vec<_>>(), [("a", "1"), ("b", "3")]);
        assert_eq!(f.get("b").map(str::parse::<u16>), Some(Ok(3)));
        assert!(f.get("a").map(str::parse::<u16>).is_some());
        assert_eq!(f.get("c").map(str::parse::<u16>), None);
        assert_eq!(f.remove("a").as_deref(), Some("1"));
        assert_eq!(f.len(), 1);
    }

    /// An engine's facts go to each of its rank endpoints (up to 1,024 of them): a clone
    /// shares the entries, and a change to one copy leaves the others as they were.
    #[test]
    fn a_clone_shares_the_entries_until_one_copy_changes() {
        let a = Facts::default()
            .with("note", "v".repeat(Facts::MAX_VALUE_LEN))
            .unwrap();
        let mut b = a.clone();
        let value = |f: &Facts| f.get("note").map(str::as_ptr);
        assert_eq!(value(&a), value(&b), "one copy of the value, not two");
        b.insert("other", "x").unwrap();
        assert_eq!(a.get("other"), None);
        assert_eq!(b.get("other"), Some("x"));
        assert_eq!(a.get("note"), b.get("note"));
        b.insert("note", "w").unwrap();
        assert_eq!(a.get("note").map(str::len), Some(Facts::MAX_VALUE_LEN));
        assert_eq!(b.get("note"), Some("w"));
    }

    #[test]
    fn refuses_what_passes_a_ceiling_and_keeps_the_rest() {
        let mut f = Facts::default();
        let long_key = "k".repeat(Facts::MAX_KEY_LEN + 1);
        assert!(matches!(
            f.insert(&long_key, "v"),
            Err(FactError::KeyTooLong { .. })
        ));
        for bad in ["", "Upper", "a b", "a/b", "é"] {
            assert!(
                matches!(f.insert(bad, "v"), Err(FactError::Key { .. })),
                "{bad}"
            );
        }
        let long = "v".repeat(Facts::MAX_VALUE_LEN + 1);
        assert!(matches!(
            f.insert("k", long),
            Err(FactError::ValueTooLong { .. })
        ));
        assert!(matches!(
            f.insert("k", "a\nb"),
            Err(FactError::ControlCharacter { .. })
        ));
        assert_eq!(f, Facts::default());
        f.insert("k", "v".repeat(Facts::MAX_VALUE_LEN)).unwrap();
        for i in 1..Facts::MAX_ENTRIES {
            f.insert(&format!("k{i}"), "v").unwrap();
        }
        assert_eq!(
            f.insert("one-more", "v"),
            Err(FactError::TooMany {
                max: Facts::MAX_ENTRIES
            })
        );
        // Replacing a key already there is no new entry.
        f.insert("k1", "w").unwrap();
        assert_eq!(f.len(), Facts::MAX_ENTRIES);
    }
}
