//! The media parts of a chat request's `messages`, read as raw slices: where each part
//! sits in the client's bytes, its type, its fields (sorted, as a parsed object would
//! hold them) and the `uuid` the client gave it. Nothing is built for the text around
//! the items, and an item's megabytes of base64 are never copied to be looked at.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use disagg_json::InvalidParam;

use disagg_json::raw as json;

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
/// The turns and their content lists are walked, not collected (a `Vec<&RawValue>` of
/// them was eight times a client's `[0,0,...]`), and a part's fields are mapped only
/// once its `type` says it is a media part (so at most `max` + 1 maps).
///
/// # Errors
///
/// [`InvalidParam`] (`messages`) when there are more than `max`.
pub(super) fn media_parts(
    messages: &[u8],
    max: usize,
) -> Result<Option<Vec<MediaPart<'_>>>, InvalidParam> {
    let Ok(text) = std::str::from_utf8(messages) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    let walked = super::each_element(text, |turn| {
        let Ok(turn) = serde_json::from_str::<Turn<'_>>(turn.get()) else {
            return Ok(());
        };
        let Some(content) = turn.content else {
            return Ok(());
        };
        // A content that is not a list (a string) holds no parts.
        super::each_element(content.get(), |part| {
            media_part(messages, part, max, &mut out)
        })
        .map(|_| ())
    })?;
    Ok(walked.then_some(out))
}

/// Adds `part` (a content part of `messages`) to `out` when it is a media part.
///
/// # Errors
///
/// [`InvalidParam`] (`messages`) when `out` holds `max` parts already.
fn media_part<'a>(
    messages: &'a [u8],
    part: &'a RawValue,
    max: usize,
    out: &mut Vec<MediaPart<'a>>,
) -> Result<(), InvalidParam> {
    let raw = part.get();
    if !raw.starts_with('{') {
        return Ok(());
    }
    // The type (the last, when repeated, as in a map) read without keeping the rest.
    let Some(ty) =
        json::member(raw, "type").and_then(|t| serde_json::from_str::<Cow<'_, str>>(t.get()).ok())
    else {
        return Ok(());
    };
    let Some(media) = MEDIA.iter().position(|(t, _)| *t == ty) else {
        return Ok(());
    };
    let Ok(fields) = serde_json::from_str::<BTreeMap<Cow<'_, str>, &RawValue>>(raw) else {
        return Ok(());
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
        return Ok(());
    };
    out.push(MediaPart {
        start,
        end: start + raw.len(),
        raw,
        fields,
        media,
        uuid,
    });
    Ok(())
}

/// Feeds `out` the bytes `serde_json` writes for the value `raw` holds once parsed
/// (keys sorted, no whitespace, its own escapes and number forms), without building the
/// value: a string without escapes, the bulk of a media item, goes as it is; objects and
/// arrays are walked as raw slices; the rest is parsed and written as `serde_json`
/// would. What the hash of an item's part reads, whatever its spacing.
///
/// # Errors
///
/// A syntax error when `raw` is not valid JSON (it always is: it comes from a parsed
/// body) or holds a number `serde_json` cannot (`1e400`); a data error when it nests
/// deeper than [`MAX_DEPTH`] (each level is a frame of this walk: a client's body of
/// `[[[...]]]` would have overflowed the stack).
pub(super) fn canonical(raw: &RawValue, out: &mut dyn FnMut(&[u8])) -> serde_json::Result<()> {
    // Told in one pass: the walk re-reads each level's rest, so finding the fault by
    // walking down to it would read the value `MAX_DEPTH` times.
    if disagg_json::raw::nests_deeper(raw.get().as_bytes(), MAX_DEPTH) {
        return Err(serde::de::Error::custom("nested too deeply"));
    }
    canonical_at(raw, out, 0)
}

/// Deepest a value [`canonical`] reads may nest: `serde_json`'s own ceiling for a
/// value it builds.
pub(super) const MAX_DEPTH: usize = 128;

/// [`canonical`] of a value nested `depth` deep.
fn canonical_at(
    raw: &RawValue,
    out: &mut dyn FnMut(&[u8]),
    depth: usize,
) -> serde_json::Result<()> {
    let text = raw.get();
    if depth >= MAX_DEPTH && matches!(text.as_bytes().first(), Some(b'{' | b'[')) {
        return Err(serde::de::Error::custom("nested too deeply"));
    }
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
                canonical_at(value, out, depth + 1)?;
            }
            out(b"}");
        }
        Some(b'[') => {
            // Walked, not collected: a `Vec<&RawValue>` is 16 bytes per element.
            out(b"[");
            let mut first = true;
            let walked = super::each_element(text, |item| {
                if !first {
                    out(b",");
                }
                first = false;
                canonical_at(item, out, depth + 1)
            })?;
            if !walked {
                return Err(serde::de::Error::custom("not a JSON list"));
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

    #[test]
    fn only_media_parts_are_mapped_and_the_last_type_decides() {
        // The type is the last one, an escaped key read as its text (as in a map); a
        // content that is no list, or a turn that is no object, holds no part.
        let messages = br#"[{"content":[{"type":"image_url","type":"text"},
            {"type":"text","typ\u0065":"video_url","video_url":{"url":"v"}},
            {"type":"text","":0,"":0}, 7, [{"type":"image_url"}]]},
            {"content":{"type":"image_url"}}, {"content":"image_url"}, "x",
            {"content":[{"type":"audio_url","audio_url":{"url":"a"}}]}]"#;
        let parts = media_parts(messages, 2).unwrap().unwrap();
        assert_eq!(
            parts.iter().map(MediaPart::modality).collect::<Vec<_>>(),
            ["video", "audio"]
        );
        assert_eq!(
            parts[0].fields.keys().collect::<Vec<_>>(),
            ["type", "video_url"]
        );
        assert!(media_parts(messages, 1).is_err());
        // Not a list, or not JSON: nothing to say.
        for not in [&br#"{"content":[]}"#[..], b"[1,", b"[\"\xff\"]"] {
            assert!(media_parts(not, 2).unwrap().is_none());
        }
        assert!(media_parts(b" [ ] ", 2).unwrap().unwrap().is_empty());
    }

    #[test]
    fn canonical_lists_are_walked_whatever_their_spacing() {
        let raw: &RawValue =
            serde_json::from_str(r#"[ 1 ,[ ], [ {"b":1, "a" : [2,3]} ] ]"#).unwrap();
        let mut got = Vec::new();
        canonical(raw, &mut |b| got.extend_from_slice(b)).unwrap();
        assert_eq!(got, br#"[1,[],[{"a":[2,3],"b":1}]]"#);
    }

    #[test]
    fn canonical_refuses_nesting_past_its_ceiling_without_overflowing() {
        let nested = |n: usize| format!("{}0{}", "[{\"a\":".repeat(n / 2), "}]".repeat(n / 2));
        let fits: Box<RawValue> = serde_json::from_str(&nested(MAX_DEPTH)).unwrap();
        assert!(canonical(&fits, &mut |_| {}).is_ok());
        let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        for too_deep in [nested(MAX_DEPTH + 2), deep] {
            let raw: Box<RawValue> = serde_json::from_str(&too_deep).unwrap();
            let err = canonical(&raw, &mut |_| {}).unwrap_err();
            assert!(err.is_data(), "{err}");
        }
        let big: &RawValue = serde_json::from_str("1e400").unwrap();
        assert!(canonical(big, &mut |_| {}).unwrap_err().is_syntax());
    }
}
