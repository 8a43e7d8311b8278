"""Drive a disagg proxy serving HTTPS with API keys, with the real `openai` Python client.

Usage: python openai_https.py BASE_URL CA_PEM KEY EXPECT_JSON

BASE_URL is https://; the client trusts only CA_PEM (through httpx's `verify`). KEY is a
client key the proxy accepts. EXPECT_JSON holds the text a direct run produced:
{"chat": ...}. Exits non-zero on the first failure.
"""

import json
import ssl
import sys

import httpx
import openai
from openai import OpenAI

MODEL = "sim-model"
CHAT = [{"role": "user", "content": "tell me about disaggregated serving"}]


def client(base: str, ca: str, key: str) -> OpenAI:
    return OpenAI(
        base_url=f"{base}/v1",
        api_key=key,
        max_retries=0,
        timeout=20,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca)),
    )


def main() -> int:
    base, ca, key, expect = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    checks = 0

    good = client(base, ca, key)
    r = good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
    assert r.choices[0].message.content == expect["chat"], r
    checks += 1

    text = ""
    for chunk in good.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text == expect["chat"], text
    checks += 1

    assert [m.id for m in good.models.list()] == [MODEL]
    checks += 1

    bad = client(base, ca, "sk-not-a-key")
    try:
        bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e
        assert e.code == "invalid_api_key", e.body
        assert "sk-not-a-key" not in str(e), e
        checks += 1

    # A client that does not trust the proxy's CA never gets to send its key.
    untrusting = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20,
                        http_client=httpx.Client(verify=True))
    try:
        untrusting.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
        raise AssertionError("an untrusted certificate was accepted")
    except openai.APIConnectionError:
        checks += 1

    print(f"openai https: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
