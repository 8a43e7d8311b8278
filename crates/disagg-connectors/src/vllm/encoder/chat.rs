//! The media parts of a chat request's `messages`, read as raw slices: where each part
//! sits in the client's bytes, its type, its fields (sorted, as a parsed object would
//! hold them) and the `uuid` the client gave it. Nothing is built for the text around
//! the items, and an item's megabytes of base64 are never copied to be looked at.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use disagg_json::InvalidParam;

/// The media part types vLLM's chat API takes, and whether items of the type may share
/// a leg (images may; audio and video go one per leg).
pub(super) const MEDIA: &[(&str, bool)] = &[
    ("image_url", true),
    ("input_audio", false),
    ("audio_url", false),
    ("video_url", false),
];

/// One media part of `messages`.
pub(super) struct MediaPart<'a> {
    /// Where the part's object starts in `messages`.
    pub(super) start: usize,
    /// Where it ends (exclusive).
    pub(super) end: usize,
    /// The part's JSON, as the client wrote it.
    pub(super) raw: &'a str,
    /// Its fields, sorted by key; the last of duplicate keys wins (as when parsed).
    pub(super) fields: BTreeMap<Cow<'a, str>, &'a RawValue>,
    /// Its type's index in [`MEDIA`].
    pub(super) media: usize,
    /// The non-empty string `uuid` the client gave it, unescaped.
    pub(super) uuid: Option<String>,
}

impl MediaPart<'_> {
    /// Whether the part's items may share a leg.
    pub(super) fn batched(&self) -> bool {
        MEDIA.get(self.media).is_some_and(|(_, b)| *b)
    }

    /// The part's modality, as vLLM names it in `ec_transfer_params` and in its
    /// `*_embeds` part types.
    pub(super) fn modality(&self) -> &'static str {
        match MEDIA.get(self.media).map(|(t, _)| *t) {
            Some("image_url") => "image",
            Some("video_url") => "video",
            _ => "audio",
        }
    }
}

/// A message: its `content` only.
#[derive(Deserialize)]
struct Turn<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// Where `inner` (a slice of `outer`) starts in `outer`.
fn offset(outer: &[u8], inner: &str) -> Option<usize> {
    let at = (inner.as_ptr() as usize).checked_sub(outer.as_ptr() as usize)?;
    (at + inner.len() <= outer.len()).then_some(at)
}

/// The media parts of `messages` in order, at most `max`; `None` when `messages` is not
/// an array of JSON values (the engine answers for it). Parts that are not objects, or
/// whose `type` is not a media type, are not items.
///
/// # Errors
///
/// [`InvalidParam`] (`messages`) when there are more than `max`.
pub(super) fn media_parts(
    messages: &[u8],
    max: usize,
) -> Result<Option<Vec<MediaPart<'_>>>, InvalidParam> {
    let Ok(turns) = serde_json::from_slice::<Vec<&RawValue>>(messages) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for turn in turns {
        let Ok(turn) = serde_json::from_str::<Turn<'_>>(turn.get()) else {
            continue;
        };
        let Some(content) = turn.content else {
            continue;
        };
        let Ok(parts) = serde_json::from_str::<Vec<&RawValue>>(content.get()) else {
            continue;
        };
        for part in parts {
            let raw = part.get();
            if !raw.starts_with('{') {
                continue;
            }
            let Ok(fields) = serde_json::from_str::<BTreeMap<Cow<'_, str>, &RawValue>>(raw) else {
                continue;
            };
            let Some(ty) = fields
                .get("type")
                .and_then(|t| serde_json::from_str::<Cow<'_, str>>(t.get()).ok())
            else {
                continue;
            };
            let Some(media) = MEDIA.iter().position(|(t, _)| *t == ty) else {
                continue;
            };
            if out.len() >= max {
                return Err(InvalidParam::new(
                    "messages",
                    "holds more media items than the encoder stage takes",
                ));
            }
            let uuid = fields
                .get("uuid")
                .and_then(|u| serde_json::from_str::<String>(u.get()).ok())
                .filter(|u| !u.is_empty());
            let Some(start) = offset(messages, raw) else {
                continue;
            };
            out.push(MediaPart {
                start,
                end: start + raw.len(),
                raw,
                fields,
                media,
                uuid,
            });
        }
    }
    Ok(Some(out))
}

/// Feeds `out` the bytes `serde_json` writes for the value `raw` holds once parsed
/// (keys sorted, no whitespace, its own escapes and number forms), without building the
/// value: a string without escapes, the bulk of a media item, goes as it is; objects and
/// arrays are walked as raw slices; the rest is parsed and written as `serde_json`
/// would. What the hash of an item's part reads, whatever its spacing.
///
/// # Errors
///
/// When `raw` is not valid JSON (it always is: it comes from a parsed body).
pub(super) fn canonical(raw: &RawValue, out: &mut dyn FnMut(&[u8])) -> serde_json::Result<()> {
    let text = raw.get();
    match text.as_bytes().first() {
        // A JSON string holds no quote or control character unescaped: without a
        // backslash it is written back exactly as it is.
        Some(b'"') if !text.contains('\\') => out(text.as_bytes()),
        Some(b'"') => {
            let s: String = serde_json::from_str(text)?;
            out(&serde_json::to_vec(&s)?);
        }
        Some(b'{') => {
            let fields: BTreeMap<Cow<'_, str>, &RawValue> = serde_json::from_str(text)?;
            out(b"{");
            for (i, (key, value)) in fields.iter().enumerate() {
                if i > 0 {
                    out(b",");
                }
                out(&serde_json::to_vec(key)?);
                out(b":");
                canonical(value, out)?;
            }
            out(b"}");
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(text)?;
            out(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out(b",");
                }
                canonical(item, out)?;
            }
            out(b"]");
        }
        _ => {
            let value: serde_json::Value = serde_json::from_str(text)?;
            out(&serde_json::to_vec(&value)?);
        }
    }
    Ok(())
}

/// `messages` with the parts at the given spans (sorted, not overlapping) replaced.
pub(super) fn splice(messages: &[u8], edits: &[(usize, usize, Vec<u8>)]) -> Vec<u8> {
    let added: usize = edits.iter().map(|(_, _, b)| b.len()).sum();
    let mut out = Vec::with_capacity(messages.len() + added);
    let mut at = 0;
    for (start, end, with) in edits {
        out.extend_from_slice(messages.get(at..*start).unwrap_or_default());
        out.extend_from_slice(with);
        at = *end;
    }
    out.extend_from_slice(messages.get(at..).unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_bytes_are_serde_jsons() {
        let cases = [
            r#""plain""#,
            r#""esc\/aped \u00e9 \n \u0001 \"q\"""#,
            r#" { "b" : [1, 1.50, -0, 1e2, 2E-3, true, null], "a":{"z":"\\","y":{}} , "a2":[] } "#,
            r#"{"k":1,"k":2}"#,
            "12345678901234567890",
        ];
        for case in cases {
            let raw: &RawValue = serde_json::from_str(case.trim()).unwrap();
            let mut got = Vec::new();
            canonical(raw, &mut |b| got.extend_from_slice(b)).unwrap();
            let value: serde_json::Value = serde_json::from_str(case).unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                serde_json::to_string(&value).unwrap(),
                "{case}"
            );
        }
    }

    #[test]
    fn parts_are_found_where_they_are_with_their_uuid() {
        let messages = br#"[{"role":"system","content":"hi"},
            {"role":"user","content":[{"type":"text","text":"image_url"},
             { "type" : "image_url", "image_url":{"url":"data:x"}, "uuid":"u\u0031"},
             {"type":"input_audio","input_audio":{"data":"a","format":"wav"},"uuid":""},
             "plain", {"type":"video_url","video_url":{"url":"v"},"uuid":null}]}]"#;
        let parts = media_parts(messages, 8).unwrap().unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(
            &messages[parts[0].start..parts[0].end],
            br#"{ "type" : "image_url", "image_url":{"url":"data:x"}, "uuid":"u\u0031"}"#
        );
        assert_eq!(parts[0].uuid.as_deref(), Some("u1"));
        assert_eq!(parts[0].modality(), "image");
        assert!(parts[0].batched() && !parts[1].batched());
        assert_eq!(
            parts[0].fields.keys().collect::<Vec<_>>(),
            ["image_url", "type", "uuid"]
        );
        assert_eq!(parts[1].uuid, None);
        assert_eq!(
            (parts[1].modality(), parts[2].modality()),
            ("audio", "video")
        );
        assert_eq!(parts[2].uuid, None);
        assert!(media_parts(messages, 2).is_err());
        assert!(media_parts(br#""text""#, 2).unwrap().is_none());
        let out = splice(
            messages,
            &[
                (parts[0].start, parts[0].end, b"A".to_vec()),
                (parts[2].start, parts[2].end, b"B".to_vec()),
            ],
        );
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains(
                r#""text":"image_url"},
             A,"#
            ),
            "{out}"
        );
        assert!(out.ends_with(r#""plain", B]}]"#), "{out}");
    }
}
