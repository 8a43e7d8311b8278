"""Drive a disagg proxy's `/v1/messages` with the real `anthropic` Python client.

Usage: python anthropic_messages.py BASE_URL EXPECT_TEXT [BROKEN_URL]

The client sends one Messages request whole and one streamed; both must answer
EXPECT_TEXT, the text an engine alone gives. Then a request the proxy refuses (a
`thinking` budget not below `max_tokens`) must raise the client's 400 error. With
BROKEN_URL (a proxy whose decode breaks its stream after its first events), a streamed
request there must raise the client's error (`APIStatusError`), not end as a short
answer: the client reads only `event: error`. Exits non-zero on the first failure.
"""

import sys

import anthropic

MODEL = "sim-model"
MESSAGES = [{"role": "user", "content": "tell me about disaggregated serving " * 8}]


def main() -> None:
    base, expect = sys.argv[1], sys.argv[2]
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=20)
    checks = 0

    whole = client.messages.create(model=MODEL, max_tokens=6, messages=MESSAGES)
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert text == expect, (text, expect)
    assert whole.stop_reason == "max_tokens", whole.stop_reason
    checks += 1

    streamed = []
    with client.messages.stream(model=MODEL, max_tokens=6, messages=MESSAGES) as stream:
        for piece in stream.text_stream:
            streamed.append(piece)
        final = stream.get_final_message()
    assert "".join(streamed) == expect, (streamed, expect)
    assert final.stop_reason == "max_tokens", final.stop_reason
    checks += 1

    try:
        client.messages.create(
            model=MODEL,
            max_tokens=6,
            messages=MESSAGES,
            thinking={"type": "enabled", "budget_tokens": 6},
        )
        raise AssertionError("a thinking budget of max_tokens was accepted")
    except anthropic.BadRequestError:
        checks += 1

    if len(sys.argv) > 3:
        broken = anthropic.Anthropic(
            base_url=sys.argv[3], api_key="unused", max_retries=0, timeout=20
        )
        got = []
        try:
            with broken.messages.stream(model=MODEL, max_tokens=6, messages=MESSAGES) as stream:
                for piece in stream.text_stream:
                    got.append(piece)
            raise AssertionError(f"a broken stream ended as an answer: {got!r}")
        except anthropic.APIStatusError as e:
            assert "decode stream broke" in str(e), str(e)
            checks += 1

    print(f"anthropic messages: {checks} checks passed")


if __name__ == "__main__":
    main()
