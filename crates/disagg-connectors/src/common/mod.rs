//! What the engine protocols share.
//!
//! | file | holds |
//! |---|---|
//! | `room.rs` | [`Rooms`]: handoff ids that never repeat within a process and cannot be predicted from the ones seen (SGLang's `bootstrap_room`, vLLM Mooncake's `transfer_id`) |
//! | `sse.rs` | [`sse::MapEvents`]: a decode stream rewritten event by event (SGLang's logprob merge, LMCache's chat reshape) |
//! | `mod.rs` | `openai_only`: the refusal of SGLang's native `/generate` by the connectors whose engines do not serve it; `carries`: the refusal of any API outside a connector's list; `bootstrap_port`: a prefill's bootstrap port read from its facts; `completion_batch` and `several_prompts`: how many prompts a completions `prompt` lists, told by a byte scan; `lock`: a mutex locked through poisoning |

use disagg_core::endpoint::{Endpoint, Facts};
use disagg_core::error::ConnectorError;
use disagg_core::request::Api;
use disagg_json::raw::validated_value_end;

mod room;
pub mod sse;

#[cfg(all(test, feature = "sglang"))]
pub(crate) use room::MAX_ROOM;
pub use room::Rooms;

/// Locks `m`, recovering the data if a panicking thread poisoned it (every critical
/// section of the connectors leaves its data consistent).
#[allow(dead_code)] // used by the features that keep state (vLLM Mooncake)
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Refuse SGLang's native `/generate` in a connector whose engines do not serve it (the
/// vLLM connectors): 400 `unsupported_by_connector`, as for anything else the protocol
/// cannot carry.
#[cfg_attr(not(feature = "vllm"), allow(dead_code))]
pub(crate) fn openai_only(connector: &'static str, api: Api) -> Result<(), ConnectorError> {
    match api {
        Api::Generate => Err(ConnectorError::Unsupported {
            connector,
            what: "SGLang's native /generate API (only the SGLang connector carries it)".to_owned(),
        }),
        _ => Ok(()),
    }
}

/// Refuse an API outside `apis`, the ones the connector's legs can carry: 400
/// `unsupported_by_connector`, before any leg is sent (the SGLang and LMCache
/// connectors carry neither vLLM's token-in route nor its Anthropic, Responses or
/// Cohere routes).
#[cfg_attr(not(any(feature = "sglang", feature = "lmcache")), allow(dead_code))]
pub(crate) fn carries(
    connector: &'static str,
    api: Api,
    apis: &[Api],
) -> Result<(), ConnectorError> {
    if apis.contains(&api) {
        return Ok(());
    }
    let list: Vec<&str> = apis.iter().map(|a| a.path()).collect();
    Err(ConnectorError::Unsupported {
        connector,
        what: format!(
            "the route {} (this connector carries {} only)",
            api.path(),
            list.join(", ")
        ),
    })
}

/// What an endpoint with a malformed [`Facts::BOOTSTRAP_PORT`] lacks, in
/// [`ConnectorError::NotConfigured`].
const BAD_BOOTSTRAP_PORT: &str = "usable `bootstrap_port` fact (a port number, 0-65535)";

/// A prefill endpoint's bootstrap port, from its [`Facts::BOOTSTRAP_PORT`] fact (the
/// protocols whose engines meet through a bootstrap server: SGLang, vLLM Mooncake):
/// `None` when it declares none. A map lookup and a `u16` parse per request, no
/// allocation.
///
/// # Errors
///
/// [`ConnectorError::NotConfigured`] naming the endpoint and the key when the value is
/// not a port number (the command line and discovery refuse one before it gets here;
/// an embedder's own facts may not).
#[cfg_attr(not(any(feature = "vllm", feature = "sglang")), allow(dead_code))]
pub(crate) fn bootstrap_port(ep: &Endpoint) -> Result<Option<u16>, ConnectorError> {
    ep.facts()
        .get(Facts::BOOTSTRAP_PORT)
        .map(str::parse::<u16>)
        .transpose()
        .map_err(|_| ConnectorError::NotConfigured {
            endpoint: ep.id().clone(),
            what: BAD_BOOTSTRAP_PORT,
        })
}

/// How many prompts a completions request's `prompt` lists when it is a batch: a list
/// whose first element is a string or a list (vLLM and SGLang read `["a","b"]` and
/// `[[1],[2]]` as one prompt per element; a flat list of token ids is one prompt).
/// `None` for anything else. Read by [`batch_len`]: a list whose first element is a
/// number is told at a glance, never walked (a client's prompt of millions of ids); a
/// batch's elements are skipped over, byte by byte, never parsed or built.
#[cfg_attr(not(feature = "sglang"), allow(dead_code))]
pub(crate) fn completion_batch(body: &disagg_json::JsonBody) -> Option<usize> {
    batch_len(body.get("prompt")?, usize::MAX)
}

/// Whether a completions request's `prompt` lists more than one prompt (a batch of
/// [`completion_batch`]'s reading), told without reading past the end of its first
/// element (a one-prompt list of megabytes is skipped over once, never parsed).
#[cfg_attr(not(feature = "vllm"), allow(dead_code))]
pub(crate) fn several_prompts(body: &disagg_json::JsonBody) -> bool {
    body.get("prompt")
        .and_then(|raw| batch_len(raw, 2))
        .is_some_and(|n| n > 1)
}

/// The number of elements of the batch `raw` (a JSON list whose first element is a
/// string or a list), counted up to `most` (the scan stops at the separator before the
/// `most`-th element, never reading it); `None` when `raw` is no such list. `raw` is a
/// value the body's parse validated: its elements are skipped by their shape alone
/// (strings to their closing quote, escapes stepped over; lists and objects to their
/// matching bracket: [`validated_value_end`]), nothing is built.
#[cfg_attr(not(any(feature = "vllm", feature = "sglang")), allow(dead_code))]
fn batch_len(raw: &[u8], most: usize) -> Option<usize> {
    let space = |b: &[u8], mut i: usize| {
        while b.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    let mut i = space(raw, 1);
    if raw.first() != Some(&b'[') || !matches!(raw.get(i), Some(b'"' | b'[')) {
        return None;
    }
    let mut len = 1usize;
    loop {
        i = space(raw, validated_value_end(raw, i)?);
        match raw.get(i)? {
            b']' => return Some(len),
            b',' => {
                len += 1;
                if len >= most {
                    return Some(len);
                }
                i = space(raw, i + 1);
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use disagg_json::JsonBody;

    /// A body whose `prompt` is `raw` as it is (not validated: a cut list shows what
    /// the scan never reads).
    fn prompt(raw: &'static [u8]) -> JsonBody {
        let mut body = JsonBody::default();
        body.set_raw("prompt", Bytes::from_static(raw));
        body
    }

    /// "More than one prompt" is told by skipping the first element and looking at the
    /// byte after it: the rest of the list is never read. Here each prompt is cut
    /// after its second element's first byte, which a parser of the whole list would
    /// refuse; strings' escapes and brackets, and nested lists, are skipped over.
    #[test]
    fn several_prompts_are_told_at_the_first_elements_end() {
        for several in [
            &b"[[1,2],[3"[..],
            br#"["a\"],[","#,
            br#"[ [[1],"]"] , {"#,
            br#"["\\",x"#,
        ] {
            assert!(
                several_prompts(&prompt(several)),
                "{}",
                String::from_utf8_lossy(several)
            );
        }
        for one in [
            &b"[[1,2]]"[..],
            br#"["a,b"]"#,
            br#"[ "]\"," ]"#,
            b"[1,2,3]",
            b"[]",
            br#""a,b""#,
        ] {
            assert!(
                !several_prompts(&prompt(one)),
                "{}",
                String::from_utf8_lossy(one)
            );
        }
    }

    /// A prompt of 8 MiB of token ids is one prompt, and so is one of text (its
    /// escapes, quotes and brackets skipped); a batch whose second prompt is 8 MiB is
    /// several, told before that prompt. The bodies are set, not parsed: the test costs
    /// the scans alone.
    #[test]
    fn a_long_single_prompt_is_one_prompt() {
        let ids = "12345,".repeat((8 << 20) / 6);
        let text = format!(r#"{}\"[,]{{\\"#, "a".repeat(4096)).repeat(256);
        for (raw, several, count) in [
            (format!("[[{ids}1]]"), false, 1),
            (format!(r#"[ ["{text}"] ]"#), false, 1),
            (format!("[[1],[{ids}1]]"), true, 2),
            (format!(r#"["{text}",[{ids}1],"b"]"#), true, 3),
        ] {
            let mut body = JsonBody::default();
            body.set_raw("prompt", Bytes::from(raw));
            assert_eq!(several_prompts(&body), several);
            assert_eq!(completion_batch(&body), Some(count));
        }
    }

    /// SGLang counts every prompt of a batch: the count is the one a parser of the
    /// whole list finds, for each shape of list.
    #[test]
    fn a_batch_counts_its_prompts_as_a_parser_does() {
        let cases: [(&str, Option<usize>); 12] = [
            (r#""a""#, None),
            ("[1,2,3]", None),
            ("[]", None),
            ("[ ]", None),
            (r#"[{"a":1}]"#, None),
            (r#"["a"]"#, Some(1)),
            (r#"[ "a" , "b" , "c" ]"#, Some(3)),
            ("[[1,2],[3]]", Some(2)),
            (r#"["a",1,null,{"b":["]"]},[]]"#, Some(5)),
            (r#"["\"]\\",["[",{"]":"}"}],"x"]"#, Some(3)),
            ("[\n[1]\n,\t[2]\r\n]", Some(2)),
            (r#"[[],[[],[[]]],"",""]"#, Some(4)),
        ];
        for (raw, count) in cases {
            let body = format!(r#"{{"prompt":{raw}}}"#);
            let body = JsonBody::parse(body.as_bytes()).unwrap();
            assert_eq!(completion_batch(&body), count, "{raw}");
            assert_eq!(
                several_prompts(&body),
                count.is_some_and(|n| n > 1),
                "{raw}"
            );
        }
    }

    /// What the reading was before the scan: a parser's walk of the whole list.
    fn parsed(raw: &[u8]) -> Option<usize> {
        let list = disagg_json::raw::list_head(raw)?;
        matches!(list.first, Some(b'"' | b'[')).then_some(list.len)
    }

    /// Any JSON value, strings of any characters (quotes, backslashes and brackets
    /// among them) and containers nested a few deep.
    fn value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[\\[\\]{}\",\\\\ a\\n\u{e9}]{0,6}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map("[\\[\\]\"a]{0,3}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The scan counts what a parser of the whole list counts, for any list,
        /// written compactly or spaced: SGLang's rooms and vLLM's "several prompts"
        /// are decided as before.
        #[test]
        fn the_scan_counts_as_a_parser_does(
            list in proptest::collection::vec(value(), 0..6),
            spaced in proptest::prelude::any::<bool>(),
        ) {
            let list = serde_json::Value::from(list);
            let raw = if spaced {
                serde_json::to_string_pretty(&list)
            } else {
                serde_json::to_string(&list)
            }
            .unwrap();
            let body = JsonBody::parse(format!(r#"{{"prompt":{raw}}}"#).as_bytes()).unwrap();
            let before = parsed(raw.as_bytes());
            proptest::prop_assert_eq!(completion_batch(&body), before, "{}", raw);
            proptest::prop_assert_eq!(several_prompts(&body), before.is_some_and(|n| n > 1));
        }
    }
}
