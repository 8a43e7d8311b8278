//! A disaggregation policy: [`PromptThreshold`], which sends short prompts to a decode
//! engine alone (a [`Disaggregate`] hook, the seam `disagg-core` defines).
//!
//! Disaggregation pays a second round trip and a KV transfer to keep long prefills off
//! the decode engines; for a short prompt that trade is a loss, since the decode engine
//! computes a few hundred tokens of prompt faster than the prefill leg and the KV pull
//! take.

use disagg_core::policy::{Decision, Disaggregate};
use disagg_core::request::Api;
use disagg_core::router::RequestView;

/// Disaggregate only requests whose prompt is estimated at `min_tokens` or more.
///
/// The estimate reads the raw JSON of the prompt field the request's API reads
/// ([`estimate`](Self::estimate)), with no parse:
///
/// - a completions `prompt` that is an array of numbers is a token-id list: its tokens
///   are counted exactly (one more than its commas);
/// - anything else (a chat's `messages`, a `prompt` string or a list of strings) counts
///   one token per [`BYTES_PER_TOKEN`] bytes of its JSON text. English text runs at
///   about four bytes per token in the BPE vocabularies of current models; the JSON
///   around chat text (`{"role":"user","content":""}`, about 30 bytes a message) and
///   escapes make the estimate a little high, which errs towards disaggregating.
///
/// A request with no prompt field (or one set to `null`, or an API without one) is
/// disaggregated (the engines answer it as they would).
///
/// # Examples
///
/// ```
/// use disagg_affinity::PromptThreshold;
/// use disagg_core::policy::{Decision, Disaggregate};
/// use disagg_core::router::RequestView;
/// use disagg_core::{request::Api, json::JsonBody};
/// use http::HeaderMap;
///
/// let hook = PromptThreshold::new(256);
/// let headers = HeaderMap::new();
/// let body = JsonBody::parse(br#"{"model":"m","prompt":"Say hi."}"#)?;
/// let view = RequestView::new(Api::Completions, Some("m"), &headers, &body);
/// assert!(matches!(hook.decide(&view), Decision::Direct { .. }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct PromptThreshold {
    min_tokens: usize,
}

/// The bytes of prompt JSON counted as one token by [`PromptThreshold`].
pub const BYTES_PER_TOKEN: usize = 4;

impl PromptThreshold {
    /// Disaggregate prompts estimated at `min_tokens` tokens or more.
    pub fn new(min_tokens: usize) -> Self {
        PromptThreshold { min_tokens }
    }

    /// The threshold, in tokens.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// The estimated prompt length of `req`, in tokens; `None` when it has no prompt.
    ///
    /// The prompt is the field the request's API reads, whatever else the body holds:
    /// `messages` for chat (OpenAI's, Anthropic's Messages, Cohere's), `prompt` for
    /// completions, `text` or else `input_ids` for SGLang's `/generate`; other APIs have
    /// none. A field set to `null` is absent.
    pub fn estimate(req: &RequestView<'_>) -> Option<usize> {
        let field = |key: &str| req.body.get(key).filter(|raw| raw.trim_ascii() != b"null");
        let raw = match req.api {
            Api::Chat | Api::Messages | Api::CohereChat => field("messages"),
            Api::Completions => field("prompt"),
            Api::Generate => field("text").or_else(|| field("input_ids")),
            _ => None,
        }?;
        if is_token_ids(raw) {
            return Some(raw.iter().filter(|b| **b == b',').count() + 1);
        }
        Some(raw.len() / BYTES_PER_TOKEN)
    }
}

/// Whether `raw` is a non-empty JSON array of numbers only.
fn is_token_ids(raw: &[u8]) -> bool {
    match raw {
        [b'[', inner @ .., b']'] => {
            inner.iter().any(u8::is_ascii_digit)
                && inner
                    .iter()
                    .all(|b| b.is_ascii_digit() || b" \t\r\n,-".contains(b))
        }
        _ => false,
    }
}

impl Disaggregate for PromptThreshold {
    fn decide(&self, req: &RequestView<'_>) -> Decision {
        match Self::estimate(req) {
            Some(tokens) if tokens < self.min_tokens => Decision::Direct {
                reason: "short_prompt",
            },
            _ => Decision::Disaggregate,
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;
    use disagg_core::json::JsonBody;

    fn estimate(api: Api, body: &str) -> Option<usize> {
        let (h, b) = (HeaderMap::new(), JsonBody::parse(body.as_bytes()).unwrap());
        PromptThreshold::estimate(&RequestView::new(api, None, &h, &b))
    }

    #[test]
    fn token_id_prompts_are_counted_exactly() {
        assert_eq!(estimate(Api::Completions, r#"{"prompt":[1]}"#), Some(1));
        assert_eq!(
            estimate(Api::Completions, r#"{"prompt":[1, 22, 333,4444]}"#),
            Some(4)
        );
    }

    #[test]
    fn text_counts_four_bytes_a_token() {
        let text = "x".repeat(400);
        let n = estimate(Api::Completions, &format!(r#"{{"prompt":"{text}"}}"#)).unwrap();
        assert_eq!(n, 402 / 4);
        let chat = format!(r#"{{"messages":[{{"role":"user","content":"{text}"}}]}}"#);
        let n = estimate(Api::Chat, &chat).unwrap();
        assert!((100..=110).contains(&n), "{n}");
        // A list of strings is text, not token ids.
        assert_eq!(
            estimate(Api::Completions, r#"{"prompt":["12","34"]}"#),
            Some(br#"["12","34"]"#.len() / 4)
        );
        assert_eq!(estimate(Api::Chat, r#"{"model":"m"}"#), None);
    }

    /// The prompt is the field the request's API reads: a completions request's
    /// `prompt`, whatever `messages` it carries (here an empty list, which estimated a
    /// 100 KB prompt at 0 tokens and sent it to a decode engine alone), and a chat's
    /// `messages`, whatever `prompt`. `null` is no prompt.
    #[test]
    fn the_prompt_is_the_field_the_api_reads() {
        let text = "x".repeat(100_000);
        let body = format!(r#"{{"prompt":"{text}","messages":[]}}"#);
        assert_eq!(estimate(Api::Completions, &body), Some(100_002 / 4));
        assert_eq!(estimate(Api::Chat, &body), Some(0));
        let body =
            format!(r#"{{"messages":[{{"role":"user","content":"{text}"}}],"prompt":"hi"}}"#);
        assert!(estimate(Api::Chat, &body) > Some(25_000));
        assert_eq!(estimate(Api::Completions, &body), Some(1));
        // SGLang's `/generate`: `text`, else `input_ids`; a null one is absent.
        let body = r#"{"text":null,"input_ids":[1,2,3],"prompt":"x","messages":"x"}"#;
        assert_eq!(estimate(Api::Generate, body), Some(3));
        assert_eq!(estimate(Api::Generate, r#"{"text":"12345678"}"#), Some(2));
        for (api, body) in [
            (Api::Completions, r#"{"prompt":null,"messages":[]}"#),
            (Api::Chat, r#"{"messages":null,"prompt":"a long prompt"}"#),
            (Api::Generate, r#"{"text":null,"input_ids":null}"#),
        ] {
            assert_eq!(estimate(api, body), None, "{body}");
        }
        let hook = PromptThreshold::new(256);
        let h = HeaderMap::new();
        let body = format!(r#"{{"prompt":"{text}","messages":[]}}"#);
        let b = JsonBody::parse(body.as_bytes()).unwrap();
        assert_eq!(
            hook.decide(&RequestView::new(Api::Completions, None, &h, &b)),
            Decision::Disaggregate
        );
    }

    #[test]
    fn the_threshold_splits_short_from_long() {
        let hook = PromptThreshold::new(100);
        let h = HeaderMap::new();
        let decide = |body: String| {
            let b = JsonBody::parse(body.as_bytes()).unwrap();
            hook.decide(&RequestView::new(Api::Completions, None, &h, &b))
        };
        assert_eq!(
            decide(format!(r#"{{"prompt":"{}"}}"#, "y".repeat(100))),
            Decision::Direct {
                reason: "short_prompt"
            }
        );
        assert_eq!(
            decide(format!(r#"{{"prompt":"{}"}}"#, "y".repeat(400))),
            Decision::Disaggregate
        );
        let ids: Vec<String> = (0..100).map(|i| i.to_string()).collect();
        assert_eq!(
            decide(format!(r#"{{"prompt":[{}]}}"#, ids.join(","))),
            Decision::Disaggregate
        );
        assert_eq!(decide("{}".into()), Decision::Disaggregate);
    }
}
