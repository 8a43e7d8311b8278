"""Drive a disagg proxy's `/v1/responses` with the real `openai` Python client.

Usage: python openai_responses.py BASE_URL EXPECT_TEXT

`client.responses.create` whole and streamed must both answer EXPECT_TEXT, the text an
engine alone gives. Exits non-zero on the first failure.
"""

import sys

from openai import OpenAI

MODEL = "sim-model"
INPUT = "tell me about disaggregated serving " * 8


def main() -> None:
    base, expect = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20)
    checks = 0

    whole = client.responses.create(model=MODEL, input=INPUT, max_output_tokens=6)
    assert whole.output_text == expect, (whole.output_text, expect)
    checks += 1

    deltas = []
    terminal = None
    for event in client.responses.create(
        model=MODEL, input=INPUT, max_output_tokens=6, stream=True
    ):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            terminal = event.type
    assert "".join(deltas) == expect, (deltas, expect)
    assert terminal is not None
    checks += 1

    print(f"openai responses: {checks} checks passed")


if __name__ == "__main__":
    main()
