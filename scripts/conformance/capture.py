"""Capture engines: HTTP servers that record every leg the proxy sends and answer it
the way the real engine would, refusals included.

Each leg is judged by the engine's own request code (``engines.Vllm`` or
``engines.Sglang``). A leg the engine refuses gets the engine's status and error body,
so the proxy's handling of an engine refusal is exercised for real; an accepted leg gets
a small answer in the shape that engine and role give:

- vLLM NIXL prefill: a one-token completion with ``kv_transfer_params`` {do_remote_prefill,
  remote_engine_id, remote_block_ids, remote_host, remote_port, remote_request_id,
  tp_size} (vLLM ``…/kv_connector/v1/nixl/`` ``request_finished``);
- vLLM Mooncake prefill: a one-token completion without handoff (its ``request_finished``
  returns none); its bootstrap server answers ``GET /query`` with one entry per
  data-parallel rank (``MooncakeBootstrapServer``);
- decode (any), and SGLang prefill: a short completion, JSON or SSE after the leg's own
  ``stream`` (as the engine parsed it, so ``"stream": "yes"`` streams). A Mooncake or
  SGLang decode carrying a handoff first waits for the prefill leg with the same
  transfer id or room, as the engine waits for its KV: if that leg was refused or never
  comes, it answers 500 after ``KV_WAIT``.

Standard library only (``http.server``, threaded); every server binds 127.0.0.1:0.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The NIXL handoff a capture prefill answers with: the keys a vLLM 0.33 decode requires
# (do_remote_prefill, remote_block_ids, remote_engine_id, remote_request_id,
# remote_host, remote_port) plus tp_size, which it reads with default 1.
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "capture-prefill-engine",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "cmpl-capture-0",
    "tp_size": 1,
}


# How long a concurrent decode waits for its prefill, standing in for the engines' own
# waits (vLLM Mooncake VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT 480 s, SGLang
# SGLANG_DISAGGREGATION_WAITING_TIMEOUT 300 s): long enough that a proxy answering for
# the prefill's refusal does so before the decode gives up.
KV_WAIT = 3.0


def handoff_key(body: Any) -> Any:
    """What links a concurrent decode to its prefill: the Mooncake ``transfer_id`` or
    the SGLang ``bootstrap_room`` (the first one of a batch); None for other legs."""
    if not isinstance(body, dict):
        return None
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and isinstance(kv.get("transfer_id"), str):
        return ("transfer", kv["transfer_id"])
    room = body.get("bootstrap_room")
    if isinstance(room, list):
        room = room[0] if room else None
    if isinstance(room, int) and not isinstance(room, bool):
        return ("room", room)
    return None


def mooncake_engine_id(rank: int) -> str:
    """The engine id the capture bootstrap server gives data-parallel rank ``rank``."""
    return f"capture-mooncake-rank-{rank}"


@dataclass
class Leg:
    """One request an engine received."""

    role: str  # "prefill" or "decode"
    path: str
    headers: dict  # lower-cased names
    raw: bytes
    body: Any = None  # the parsed JSON, or None when the bytes are not JSON
    verdict: Any = None  # engines.Verdict
    at: float = field(default_factory=time.monotonic)

    def to_json(self) -> dict:
        return {
            "role": self.role,
            "path": self.path,
            "headers": self.headers,
            "body": self.body if self.body is not None else self.raw.decode("utf-8", "replace"),
            "verdict": self.verdict.to_json() if self.verdict is not None else None,
        }


class Recorder:
    """The legs received by all capture engines, in arrival order."""

    def __init__(self):
        self._lock = threading.Condition()
        self._legs: list[Leg] = []
        # Verdicts of prefill legs by handoff key (transfer id or room), for decodes
        # that wait for their KV.
        self._prefills: dict[Any, Any] = {}

    def add(self, leg: Leg) -> None:
        with self._lock:
            self._legs.append(leg)
            key = handoff_key(leg.body)
            if leg.role == "prefill" and key is not None:
                self._prefills[key] = leg.verdict
                self._lock.notify_all()

    def wait_prefill(self, key: Any, timeout: float) -> Any:
        """The verdict on the prefill leg with handoff ``key``, once it has arrived, or
        None if none arrives within ``timeout`` seconds."""
        with self._lock:
            self._lock.wait_for(lambda: key in self._prefills, timeout)
            return self._prefills.get(key)

    def take(self) -> list[Leg]:
        """The legs received since the last call, and forget them."""
        with self._lock:
            legs, self._legs = self._legs, []
        return legs

    def count(self) -> int:
        with self._lock:
            return len(self._legs)


def _api_of(path: str) -> str | None:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path)


def _answer(api: str, text: str, finish: str, extra: dict | None = None) -> dict:
    """A non-streaming OpenAI answer of ``api``."""
    if api == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    answer = {
        "id": "capture-0",
        "object": obj,
        "created": 0,
        "model": "capture",
        "choices": [choice],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }
    answer.update(extra or {})
    return answer


def _chunk(api: str, text: str, finish: str | None) -> dict:
    """One streamed chunk of ``api``."""
    if api == "chat":
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    return {"id": "capture-0", "object": obj, "created": 0, "model": "capture", "choices": [choice]}


class Engine:
    """One capture engine (prefill or decode) on its own port.

    ``kind`` says how a prefill answers: "nixl" (with the NIXL handoff), "mooncake"
    (without), "sglang" (a full answer: SGLang's prefill streams like a decode).
    """

    def __init__(self, role: str, kind: str, judge, recorder: Recorder):
        self.role = role
        self.kind = kind
        self.judge = judge  # (api, body, headers) -> engines.Verdict
        self.recorder = recorder
        self.server = _server(self._handle)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> Engine:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, h: _Handler, method: str) -> None:
        if method == "GET":
            # Health checks and model lists: the engine is up.
            h.send_json(200, {"object": "list", "data": []})
            return
        raw = h.read_body()
        api = _api_of(h.path.split("?")[0])
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in h.headers.items()}
        leg = Leg(role=self.role, path=h.path, headers=headers, raw=raw, body=body)
        if api is None:
            self.recorder.add(leg)
            h.send_json(404, {"error": {"message": f"no route {h.path}", "code": 404}})
            return
        if body is None:
            leg.verdict = None
            self.recorder.add(leg)
            h.send_json(400, {"error": {"message": "body is not JSON", "code": 400}})
            return
        verdict = self.judge(api, body, headers)
        leg.verdict = verdict
        self.recorder.add(leg)
        if not verdict.ok:
            h.send_json(verdict.status, verdict.error_body)
            return
        stream = bool(verdict.facts.get("stream"))
        key = handoff_key(body)
        if self.role == "decode" and self.kind in ("mooncake", "sglang") and key is not None:
            # A concurrent decode answers only once its KV has come: here, once the
            # prefill leg with the same key was accepted. A refused or missing prefill
            # leaves it waiting, as the engine would, until KV_WAIT runs out.
            start = time.monotonic()
            prefill = self.recorder.wait_prefill(key, KV_WAIT)
            if prefill is None or not prefill.ok:
                time.sleep(max(0.0, KV_WAIT - (time.monotonic() - start)))
                h.send_json(
                    500,
                    {
                        "error": {
                            "message": "capture decode: the KV of this request never arrived "
                            + (
                                "(its prefill leg was refused)"
                                if prefill is not None
                                else "(no prefill leg)"
                            ),
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    },
                )
                return
        if self.role == "prefill" and self.kind in ("nixl", "mooncake"):
            extra = {"kv_transfer_params": NIXL_PARAMS} if self.kind == "nixl" else {}
            if stream:
                # A streamed prefill leg cannot carry the handoff (vLLM puts
                # kv_transfer_params only in non-streaming answers).
                h.send_sse([_chunk(api, "P", "length")])
            else:
                h.send_json(200, _answer(api, "P", "length", extra))
            return
        if stream:
            h.send_sse([_chunk(api, "Hello", None), _chunk(api, " world", "length")])
        else:
            h.send_json(200, _answer(api, "Hello world", "length"))


class Bootstrap:
    """vLLM Mooncake's bootstrap server: ``GET /query`` lists the prefill's DP ranks."""

    def __init__(self, dp_size: int, recorder: Recorder | None = None):
        self.dp_size = dp_size
        self.queries = 0
        self.server = _server(self._handle)
        self.port = self.server.server_address[1]

    def start(self) -> Bootstrap:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, h: _Handler, method: str) -> None:
        if method == "GET" and h.path.split("?")[0] == "/query":
            self.queries += 1
            h.send_json(
                200,
                {
                    str(rank): {
                        "engine_id": mooncake_engine_id(rank),
                        "worker_addr": {"0": {"0": f"127.0.0.1:{17000 + rank}"}},
                    }
                    for rank in range(self.dp_size)
                },
            )
        else:
            h.send_json(404, {"error": "not found"})


class _Handler(http.server.BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 handler dispatching to the owning server's callback."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server naming
        self.server.callback(self, "GET")

    def do_POST(self):  # noqa: N802
        self.server.callback(self, "POST")

    def log_message(self, *args):  # keep the table readable
        pass

    def read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_sse(self, chunks: list[dict]) -> None:
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        data += b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # The proxy drops a leg's connection when it no longer needs the answer (the
        # other leg failed, the client left): not an error of the capture engine.
        pass


def _server(callback) -> _Server:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.callback = callback
    return server
