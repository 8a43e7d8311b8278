"""Send an image through a disagg proxy's encoder stage with the real `openai` client.

Usage: python openai_image.py BASE_URL EXPECT_TEXT

`client.chat.completions.create` with a text part and an `image_url` part (a data: URL),
whole and streamed, must both answer EXPECT_TEXT, the text an engine alone gives.
Exits non-zero on the first failure.
"""

import sys

from openai import OpenAI

MODEL = "sim-model"
# A 1x1 PNG, as a data: URL (the simulated encoder treats it as opaque bytes).
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": PNG}},
        ],
    }
]


def main() -> None:
    base, expect = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20)
    checks = 0

    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert whole.choices[0].message.content == expect, (whole, expect)
    checks += 1

    deltas = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    assert "".join(deltas) == expect, (deltas, expect)
    checks += 1

    print(f"openai image: {checks} checks passed")


if __name__ == "__main__":
    main()
