#!/usr/bin/env python3
"""Token ids of prompts as Hugging Face's Python stack computes them, for disagg-tokenize's
cross-check test (crates/disagg-tokenize/tests/crosscheck.rs).

Usage: tokenize_crosscheck.py MODEL_DIR < cases.json > ids.json

MODEL_DIR holds tokenizer.json and tokenizer_config.json. Each case is
{"kind": "text", "text": ..., "add_special_tokens": bool} or
{"kind": "chat", "messages": [...], "add_generation_prompt": bool, "tools": [...]?,
 "kwargs": {...}?}; the answer is one list of ids per case.

Needs only the `tokenizers` and `jinja2` packages. Chat templates are rendered as
transformers 5 renders them (transformers/utils/chat_template_utils.py,
`_compile_jinja_template`: a sandboxed environment with trim_blocks, lstrip_blocks and
loop controls, a json.dumps `tojson`, `raise_exception` and `strftime_now`), then
tokenized without special tokens, as vLLM 0.33 does for chat. When `transformers` is
importable too, its own `apply_chat_template` is run as well and must agree.
"""

import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

SPECIAL = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def dump_tool(tool):
    """A tool as vLLM 0.33's request model dumps it (`ChatCompletionToolsParam.model_dump()`):
    fields in model order, `description`/`parameters` None when absent, unknown fields dropped."""
    function = tool["function"]
    out = {"name": function["name"], "description": function.get("description"), "parameters": function.get("parameters")}
    for key in ("strict", "defer_loading"):
        if function.get(key) is not None:
            out[key] = function[key]
    return {"type": "function", "function": out}


def special_tokens(config):
    out = {}
    for name in SPECIAL:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            out[name] = value
    return out


def main():
    model = Path(sys.argv[1])
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = environment().from_string(config["chat_template"])
    specials = special_tokens(config)
    cases = json.load(sys.stdin)

    hf = None
    try:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast.from_pretrained(str(model))
        print("tokenize_crosscheck: transformers agrees too", file=sys.stderr)
    except ImportError:
        pass

    answers = []
    for case in cases:
        if case.get("tools") is not None:
            case["tools"] = [dump_tool(t) for t in case["tools"]]
        if case["kind"] == "text":
            ids = tokenizer.encode(case["text"], add_special_tokens=case["add_special_tokens"]).ids
            if hf is not None:
                assert hf(case["text"], add_special_tokens=case["add_special_tokens"])["input_ids"] == ids
        else:
            context = dict(specials)
            context.update(case.get("kwargs") or {})
            text = template.render(
                messages=case["messages"],
                tools=case.get("tools"),
                documents=None,
                add_generation_prompt=case["add_generation_prompt"],
                **context,
            )
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if hf is not None:
                rendered = hf.apply_chat_template(
                    case["messages"],
                    tools=case.get("tools"),
                    add_generation_prompt=case["add_generation_prompt"],
                    tokenize=False,
                    **(case.get("kwargs") or {}),
                )
                assert rendered == text, (rendered, text)
                assert hf(rendered, add_special_tokens=False)["input_ids"] == ids
        answers.append(ids)
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
