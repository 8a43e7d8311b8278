"""List and retrieve models through a disagg proxy with the real `openai` Python client.

Usage: python models.py BASE_URL EXPECT_JSON

EXPECT_JSON is the decode engine's own `GET /v1/models` answer. The client must see
the same cards through the proxy, with every field vLLM sets (`vllm bench serve` reads
`root`), retrieve one by id, and get `NotFoundError` for an unknown id. Exits non-zero
on the first failure.
"""

import json
import sys

import openai
from openai import OpenAI

FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


def main() -> int:
    base, expect = sys.argv[1], json.loads(sys.argv[2])
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20)
    checks = 0

    own = expect["data"]
    listed = list(client.models.list())
    assert [m.id for m in listed] == [c["id"] for c in own], listed
    for model, card in zip(listed, own):
        dumped = model.model_dump()
        for field in FIELDS:
            assert dumped.get(field) == card[field], (field, dumped, card)
    checks += 1

    one = client.models.retrieve(own[0]["id"])
    dumped = one.model_dump()
    for field in FIELDS:
        assert dumped.get(field) == own[0][field], (field, dumped)
    checks += 1

    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
        assert e.body["code"] == "model_not_found", e.body
        checks += 1
    else:
        raise AssertionError("an unknown model was found")

    print(f"openai models: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
