"""Drive a disagg proxy with the real `openai` Python client.

Usage: python openai_client.py BASE_URL BROKEN_BASE_URL EXPECT_JSON

BASE_URL serves healthy simulated engines; BROKEN_BASE_URL a decode engine that breaks
its stream after a few chunks. EXPECT_JSON holds the texts a direct (non-disaggregated)
run produced: {"chat": ..., "completion": ...}. Exits non-zero on the first failure.
"""

import json
import sys

import openai
from openai import OpenAI

MODEL = "sim-model"
CHAT = [{"role": "user", "content": "tell me about disaggregated serving"}]
PROMPT = "the prefill engine computes"


def main() -> int:
    base, broken, expect = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20)
    checks = 0

    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
    assert r.choices[0].message.content == expect["chat"], r
    assert r.usage.completion_tokens == 8, r.usage
    checks += 1

    text, usage = "", None
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text == expect["chat"], text
    assert usage is not None and usage.completion_tokens == 8, usage
    checks += 1

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert r.choices[0].text == expect["completion"], r
    checks += 1

    text = "".join(
        c.text
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True)
        for c in chunk.choices
    )
    assert text == expect["completion"], text
    checks += 1

    models = [m.id for m in client.models.list()]
    assert models == [MODEL], models
    checks += 1

    try:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError:
        checks += 1

    broken_client = OpenAI(base_url=f"{broken}/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        for _ in broken_client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, stream=True
        ):
            pass
        raise AssertionError("a broken stream looked complete")
    except openai.APIError as e:
        assert "decode stream broke" in str(e), e
        checks += 1

    print(f"openai client: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
