//! Media in a chat: LMCache's legs are token-id completions (the prompt tokenized by
//! the prefill's `/tokenize`), which carry no image, audio or video. A chat with media
//! parts would reach both engines as its placeholder tokens alone, so it is refused
//! (400) rather than answered without its media.

/// The content part types that carry media in vLLM's chat API
/// (`vllm/entrypoints/chat_utils.py`), and the Responses-style `input_image` and
/// `file` parts it takes too. A part may name its kind by `type` or, in vLLM's
/// shorthand, by a member of that name alone.
const MEDIA_PARTS: [&str; 9] = [
    "image_url",
    "image_embeds",
    "image_pil",
    "input_image",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "file",
];

/// The first media part kind in a chat's `messages` (as the client sent them), if
/// any: a part of `content` whose `type`, or one of whose members, names a media kind.
/// Keys and strings are read decoded, so an escaped spelling (`"image\u005furl"`) is
/// the same kind. Messages that are not the expected shapes hold no media here (the
/// engine refuses them).
pub(super) fn media_part(messages: &[u8]) -> Option<&'static str> {
    // Most chats are text: without a media kind's name or an escape in the bytes, no
    // part can name one.
    let named = |name: &str| memchr::memmem::find(messages, name.as_bytes()).is_some();
    if !MEDIA_PARTS.iter().any(|m| named(m)) && memchr::memmem::find(messages, b"\\u").is_none() {
        return None;
    }
    let messages = std::str::from_utf8(messages).ok()?;
    let kind = |name: &str| MEDIA_PARTS.iter().copied().find(|m| *m == name);
    let mut found = None;
    let _ = disagg_json::raw::elements(messages, |message| {
        if found.is_some() {
            return;
        }
        let Some(content) = disagg_json::raw::member(message.get(), "content") else {
            return;
        };
        let _ = disagg_json::raw::elements(content.get(), |part| {
            if found.is_some() {
                return;
            }
            let _ = disagg_json::raw::members(part.get(), |key, value| {
                if found.is_some() {
                    return;
                }
                found = if key == "type" {
                    serde_json::from_str::<String>(value.get())
                        .ok()
                        .and_then(|t| kind(&t))
                } else {
                    kind(&key)
                };
            });
        });
    });
    found
}

#[cfg(test)]
mod tests {
    use super::media_part;

    #[test]
    fn text_chats_hold_no_media() {
        for messages in [
            r#"[{"role":"user","content":"what is an image_url?"}]"#,
            r#"[{"role":"user","content":[{"type":"text","text":"\"image_url\" \u0041"}]}]"#,
            r#"[{"role":"system","content":null},{"role":"user","content":"hi"}]"#,
            r#"[]"#,
        ] {
            assert_eq!(media_part(messages.as_bytes()), None, "{messages}");
        }
    }

    #[test]
    fn media_parts_are_found_in_every_spelling() {
        for (messages, kind) in [
            (
                r#"[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:,"}}]}]"#,
                "image_url",
            ),
            (
                r#"[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"","format":"wav"}}]}]"#,
                "input_audio",
            ),
            // vLLM's shorthand: the kind as a member, no `type`.
            (
                r#"[{"role":"user","content":[{"video_url":{"url":"http://v"}}]}]"#,
                "video_url",
            ),
            // An escaped spelling of the type and of a key.
            (
                r#"[{"role":"user","content":[{"type":"image\u005furl","image_url":{"url":"x"}}]}]"#,
                "image_url",
            ),
            (
                r#"[{"role":"user","content":[{"audio\u005furl":{"url":"x"}}]}]"#,
                "audio_url",
            ),
        ] {
            assert_eq!(media_part(messages.as_bytes()), Some(kind), "{messages}");
        }
    }
}
