//! The conversation as vLLM hands it to the chat template.
//!
//! vLLM 0.33 does not pass the client's messages through untouched
//! (`vllm/renderers/chat_utils/chat_message.py`, `parse_chat_message_content`,
//! `_postprocess_messages`; `vllm/renderers/hf.py`, `safe_apply_chat_template`):
//!
//! - `content` becomes, in the *string* content format, the text parts joined with
//!   `"\n"` (`null` gives `""`); in the *openai* format (templates that loop over the
//!   content), a list of `{"type": "text", "text": ...}` parts, a plain string included;
//! - a system message's text part starting with Claude Code's
//!   `x-anthropic-billing-header` line loses that line;
//! - assistant messages keep `tool_calls` (an empty list is dropped; each call's
//!   `arguments` string is parsed into an object, anything else becomes `{}`) and copy
//!   `reasoning` into `reasoning` and `reasoning_content`;
//! - tool messages keep `tool_call_id`, and their content is always a string;
//! - `name` and `task` are kept when they are strings; developer messages keep `tools`;
//! - when the template never names the `developer` role, developer messages become
//!   system messages and all system messages are merged (`"\n\n"`) into one, first.
//!
//! Other fields of a message are dropped. Content parts other than text (images, audio,
//! video, embeddings) are [not supported](crate::TokenizeError::NotSupported).

use disagg_core::json::raw;
use minijinja::value::{Value, ValueKind};

use super::template::Fields;
use crate::error::TokenizeError;

/// The first line of Claude Code's per-request attribution header, which vLLM strips.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

const FIELD: &str = "messages";

/// The conversation vLLM renders for `json` (a JSON array of messages).
///
/// `containers` is what is left of the request's budget of JSON objects and lists
/// ([`MAX_TEMPLATE_CONTAINERS`](super::MAX_TEMPLATE_CONTAINERS), the client's fields
/// counted already): the tool-call `arguments` strings parsed into objects take from it
/// too, each counted before it is parsed, and a chat past it is not supported.
pub(crate) fn conversation(
    json: &[u8],
    openai_format: bool,
    developer_role: bool,
    containers: &mut usize,
) -> Result<Vec<Fields>, TokenizeError> {
    let messages: Vec<Fields> = serde_json::from_slice(json)
        .map_err(|_| TokenizeError::invalid(FIELD, "expected a list of objects"))?;
    let mut out = Vec::with_capacity(messages.len());
    let mut developer = false;
    for m in &messages {
        let msg = message(m, openai_format, containers)?;
        developer |= role(&msg) == "developer";
        out.push(msg);
    }
    if developer && !developer_role {
        for m in &mut out {
            if role(m) == "developer" {
                m.set("role", Value::from("system"));
                m.remove("tools");
            }
        }
        out = consolidate_system(out);
    }
    Ok(out)
}

fn role(m: &Fields) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn present(m: &Fields, key: &str) -> Option<Value> {
    m.get(key)
        .filter(|v| !v.is_none() && !v.is_undefined())
        .cloned()
}

fn message(
    m: &Fields,
    openai_format: bool,
    containers: &mut usize,
) -> Result<Fields, TokenizeError> {
    let Some(role) = m.get("role").and_then(Value::as_str).map(str::to_owned) else {
        return Err(TokenizeError::invalid(
            FIELD,
            "each message needs a string role",
        ));
    };
    let mut texts = texts(m.get("content"))?;
    if role == "system" {
        texts = texts
            .into_iter()
            .filter_map(|t| match t.strip_prefix(BILLING_HEADER) {
                Some(_) => t
                    .split_once('\n')
                    .map(|(_, rest)| rest.to_owned())
                    .filter(|r| !r.is_empty()),
                None => Some(t),
            })
            .collect();
    }
    let content = if openai_format && role != "tool" {
        Value::from_iter(texts.into_iter().map(|t| {
            Fields::new(vec![
                ("type".to_owned(), Value::from("text")),
                ("text".to_owned(), Value::from(t)),
            ])
            .into_value()
        }))
    } else {
        // Tool results are joined in both formats: most templates take them as strings.
        Value::from(texts.join("\n"))
    };
    let mut out = Fields::new(vec![
        ("role".to_owned(), Value::from(role.as_str())),
        ("content".to_owned(), content),
    ]);
    match role.as_str() {
        "assistant" => {
            if let Some(calls) = present(m, "tool_calls")
                && let Some(calls) = tool_calls(&calls, containers)?
            {
                out.set("tool_calls", calls);
            }
            if let Some(reasoning) = present(m, "reasoning") {
                out.set("reasoning", reasoning.clone());
                out.set("reasoning_content", reasoning);
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.set("tool_call_id", id.clone());
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = m.get(key).filter(|v| v.kind() == ValueKind::String) {
            out.set(key, v.clone());
        }
    }
    if role == "developer" {
        out.set("tools", m.get("tools").cloned().unwrap_or(Value::from(())));
    }
    Ok(out)
}

/// The text parts of a message's content (`null` and absent: none).
fn texts(content: Option<&Value>) -> Result<Vec<String>, TokenizeError> {
    let Some(content) = content.filter(|c| !c.is_none() && !c.is_undefined()) else {
        return Ok(Vec::new());
    };
    if let Some(s) = content.as_str() {
        return Ok(vec![s.to_owned()]);
    }
    if content.kind() != ValueKind::Seq {
        return Err(TokenizeError::invalid(
            FIELD,
            "content must be a string or a list of parts",
        ));
    }
    let mut out = Vec::new();
    let parts = content
        .try_iter()
        .map_err(|_| TokenizeError::invalid(FIELD, "content must be a list of parts"))?;
    for part in parts {
        if let Some(s) = part.as_str() {
            out.push(s.to_owned());
            continue;
        }
        if part.kind() != ValueKind::Map {
            return Err(TokenizeError::invalid(
                FIELD,
                "a content part must be an object",
            ));
        }
        let kind = part.get_attr("type").ok();
        match kind.as_ref().and_then(Value::as_str) {
            Some("text" | "input_text" | "output_text") => {
                // vLLM skips a text part whose text is missing or null.
                if let Some(text) = part
                    .get_attr("text")
                    .ok()
                    .filter(|t| !t.is_none() && !t.is_undefined())
                {
                    match text.as_str() {
                        Some(t) => out.push(t.to_owned()),
                        None => {
                            return Err(TokenizeError::invalid(
                                FIELD,
                                "a text part's text must be a string",
                            ));
                        }
                    }
                }
            }
            _ => return Err(TokenizeError::not_supported("non-text content parts")),
        }
    }
    Ok(out)
}

/// An assistant message's `tool_calls`, as vLLM's `_postprocess_messages` leaves them
/// (`None`: the list was empty and is dropped).
fn tool_calls(calls: &Value, containers: &mut usize) -> Result<Option<Value>, TokenizeError> {
    if calls.kind() != ValueKind::Seq {
        // Not a list: vLLM leaves it as it is.
        return Ok(Some(calls.clone()));
    }
    let items: Vec<Value> = calls
        .try_iter()
        .map_err(|_| TokenizeError::invalid("tool_calls", "expected a list"))?
        .collect();
    if items.is_empty() {
        return Ok(None);
    }
    let bad = |reason: &'static str| TokenizeError::invalid("tool_calls", reason);
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if item.kind() != ValueKind::Map {
            return Err(bad("assistant tool_calls entries must be objects"));
        }
        let mut call = Fields::of(&item).map_err(|_| bad("unreadable entry"))?;
        let kind = call.get("type").cloned();
        let function = call.get("function").cloned();
        let is_function = match &kind {
            None => true,
            Some(k) => k.as_str() == Some("function"),
        };
        let Some(function) = function.filter(|f| f.kind() == ValueKind::Map && is_function) else {
            return Err(bad("only tool_calls of type 'function' are supported"));
        };
        let mut function = Fields::of(&function).map_err(|_| bad("unreadable function"))?;
        let arguments = function.get("arguments").cloned();
        function.set("arguments", arguments_object(arguments, containers)?);
        call.set("function", function.into_value());
        out.push(call.into_value());
    }
    Ok(Some(Value::from(out)))
}

/// A tool call's `arguments` as an object: kept when it is one, parsed when it is a
/// string holding one, `{}` otherwise (vLLM coerces rather than fail the conversation).
///
/// A string's objects and lists are counted first, against what is left of the
/// request's `containers` budget: past it the chat is not supported (the string would
/// be built as a template value of its own for each, a hundred times its size).
fn arguments_object(
    arguments: Option<Value>,
    containers: &mut usize,
) -> Result<Value, TokenizeError> {
    let empty = || Fields::default().into_value();
    let Some(a) = arguments.filter(|a| a.is_true()) else {
        return Ok(empty());
    };
    Ok(match a.kind() {
        ValueKind::Map => a,
        ValueKind::String => {
            let text = a.as_str().unwrap_or("");
            let held = raw::containers(text.as_bytes(), *containers);
            if held > *containers {
                return Err(TokenizeError::not_supported(
                    "a chat of more JSON objects and lists than the template renders",
                ));
            }
            *containers -= held;
            match serde_json::from_str::<Fields>(text) {
                Ok(fields) => fields.into_value(),
                Err(_) => empty(),
            }
        }
        _ => empty(),
    })
}

/// All system messages merged into one, first (vLLM's `_consolidate_system_messages`),
/// when any is not first or there are several.
fn consolidate_system(conversation: Vec<Fields>) -> Vec<Fields> {
    let mut contents = Vec::new();
    let mut rest = Vec::with_capacity(conversation.len());
    let mut needed = false;
    for (i, m) in conversation.iter().enumerate() {
        if role(m) != "system" {
            rest.push(m.clone());
            continue;
        }
        if i > 0 || !contents.is_empty() {
            needed = true;
        }
        let content = m.get("content").cloned().unwrap_or(Value::from(""));
        let text = if content.kind() == ValueKind::Seq {
            content
                .try_iter()
                .map(|parts| {
                    parts
                        .filter_map(|p| match p.as_str() {
                            Some(s) => Some(s.to_owned()),
                            None => p
                                .get_attr("text")
                                .ok()
                                .and_then(|t| t.as_str().map(str::to_owned)),
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default()
        } else {
            content.as_str().unwrap_or("").to_owned()
        };
        if !text.is_empty() {
            contents.push(text);
        }
    }
    if !needed {
        return conversation;
    }
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(Fields::new(vec![
        ("role".to_owned(), Value::from("system")),
        ("content".to_owned(), Value::from(contents.join("\n\n"))),
    ]));
    out.extend(rest);
    out
}

/// Tool definitions as vLLM's request model dumps them
/// (`ChatCompletionToolsParam.model_dump()`, `FunctionDefinition`): `{"type":
/// "function", "function": {"name", "description", "parameters"}}` with `description`
/// and `parameters` `null` when absent, `strict` and `defer_loading` only when set, a
/// tool's `defer_loading` copied into its function; other fields dropped.
pub(crate) fn tools(raw: &[u8]) -> Result<Value, TokenizeError> {
    let bad = |reason: &'static str| TokenizeError::invalid("tools", reason);
    let tools: Vec<Fields> =
        serde_json::from_slice(raw).map_err(|_| bad("expected a list of objects"))?;
    if tools.is_empty() {
        // The chat route refuses an empty list.
        return Err(bad("an empty list of tools"));
    }
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        if tool
            .get("type")
            .is_some_and(|t| t.as_str() != Some("function"))
        {
            return Err(bad("only tools of type 'function' are supported"));
        }
        let Some(function) = tool.get("function").filter(|f| f.kind() == ValueKind::Map) else {
            return Err(bad("a tool needs a function"));
        };
        let function = Fields::of(function).map_err(|_| bad("unreadable function"))?;
        let Some(name) = function
            .get("name")
            .filter(|n| n.kind() == ValueKind::String)
        else {
            return Err(bad("a function needs a string name"));
        };
        let mut dumped = Fields::new(vec![
            ("name".to_owned(), name.clone()),
            (
                "description".to_owned(),
                function
                    .get("description")
                    .cloned()
                    .unwrap_or(Value::from(())),
            ),
            (
                "parameters".to_owned(),
                function
                    .get("parameters")
                    .cloned()
                    .unwrap_or(Value::from(())),
            ),
        ]);
        let tool_defer = tool.get("defer_loading").filter(|v| !v.is_none()).cloned();
        if let Some(strict) = function.get("strict").filter(|v| !v.is_none()) {
            dumped.set("strict", strict.clone());
        }
        if let Some(defer) = function
            .get("defer_loading")
            .filter(|v| !v.is_none())
            .cloned()
            .or_else(|| tool_defer.clone())
        {
            dumped.set("defer_loading", defer);
        }
        let mut t = Fields::new(vec![
            ("type".to_owned(), Value::from("function")),
            ("function".to_owned(), dumped.into_value()),
        ]);
        if let Some(defer) = tool_defer {
            t.set("defer_loading", defer);
        }
        out.push(t.into_value());
    }
    Ok(Value::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No ceiling on the objects and lists of tool-call arguments.
    fn budget() -> usize {
        usize::MAX
    }

    fn json(fields: &[Fields]) -> String {
        // Through the same Python-style dumper the templates use.
        let t = super::super::template::Templates::new(vec![(
            "default".into(),
            "{{ m | tojson }}".into(),
        )])
        .unwrap();
        let m = Value::from(
            fields
                .iter()
                .cloned()
                .map(Fields::into_value)
                .collect::<Vec<_>>(),
        );
        t.render(
            "default",
            minijinja::context! { m => m },
            usize::MAX,
            u64::MAX,
        )
        .unwrap()
    }

    #[test]
    fn string_format_joins_text_parts_and_drops_unknown_fields() {
        let c = conversation(
            br#"[{"role":"user","content":[{"type":"text","text":"a"},"b"],"extra":1,"name":"n"},
                 {"role":"assistant","content":null,"reasoning":"r",
                  "tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"y\":1,\"x\":2}"}}]},
                 {"role":"tool","content":[{"type":"text","text":"t1"},{"type":"text","text":"t2"}],"tool_call_id":"1"}]"#,
            false,
            false,
            &mut budget(),
        )
        .unwrap();
        assert_eq!(
            json(&c),
            r#"[{"role": "user", "content": "a\nb", "name": "n"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"y": 1, "x": 2}}}], "reasoning": "r", "reasoning_content": "r"}, {"role": "tool", "content": "t1\nt2", "tool_call_id": "1"}]"#
        );
    }

    #[test]
    fn openai_format_keeps_parts_and_empty_tool_calls_are_dropped() {
        let c = conversation(
            br#"[{"role":"user","content":"hi"},{"role":"assistant","content":"x","tool_calls":[]},
                 {"role":"assistant","content":"y","tool_calls":[{"function":{"name":"g","arguments":"not json"}}]}]"#,
            true,
            true,
            &mut budget(),
        )
        .unwrap();
        assert_eq!(
            json(&c),
            r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}, {"role": "assistant", "content": [{"type": "text", "text": "y"}], "tool_calls": [{"function": {"name": "g", "arguments": {}}}]}]"#
        );
    }

    #[test]
    fn developer_messages_become_one_system_message_first() {
        let raw = br#"[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"developer","content":"d","tools":[]}]"#;
        let c = conversation(raw, false, false, &mut budget()).unwrap();
        assert_eq!(
            json(&c),
            r#"[{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]"#
        );
        // A template that names the role gets the message as it is.
        let c = conversation(raw, false, true, &mut budget()).unwrap();
        assert_eq!(
            json(&c[2..]),
            r#"[{"role": "developer", "content": "d", "tools": []}]"#
        );
    }

    #[test]
    fn billing_header_line_is_stripped_from_system_text() {
        let c = conversation(
            br#"[{"role":"system","content":"x-anthropic-billing-header: cch=1\nkeep"},{"role":"user","content":"x-anthropic-billing-header: stays"}]"#,
            false,
            false,
            &mut budget(),
        )
        .unwrap();
        assert_eq!(
            json(&c),
            r#"[{"role": "system", "content": "keep"}, {"role": "user", "content": "x-anthropic-billing-header: stays"}]"#
        );
    }

    #[test]
    fn images_are_not_supported_and_roles_are_required() {
        let err = conversation(
            br#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]"#,
            false,
            false,
            &mut budget(),
        )
        .unwrap_err();
        assert!(err.is_not_supported());
        let err = conversation(br#"[{"content":"x"}]"#, false, false, &mut budget()).unwrap_err();
        assert!(matches!(
            err,
            TokenizeError::Invalid {
                field: "messages",
                ..
            }
        ));
    }

    #[test]
    fn tools_are_dumped_as_vllm_dumps_them() {
        let t = tools(
            br#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"},"extra":1}},
                 {"function":{"name":"g","description":"d","strict":true},"defer_loading":true}]"#,
        )
        .unwrap();
        let fields: Vec<Fields> = t
            .try_iter()
            .unwrap()
            .map(|v| Fields::of(&v).unwrap())
            .collect();
        assert_eq!(
            json(&fields),
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}, {"type": "function", "function": {"name": "g", "description": "d", "parameters": null, "strict": true, "defer_loading": true}, "defer_loading": true}]"#
        );
        assert!(tools(b"[]").is_err());
    }
}
