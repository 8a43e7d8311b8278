#!/usr/bin/env python3
"""vLLM 0.33's own request classes on the legs of the generation routes beyond chat and
completions: ``/v1/responses``, ``/v1/messages``, ``/cohere/v2/chat`` and
``/inference/v1/generate`` (scripts/conformance/README.md, "Other generation routes").

The proxy runs in front of two simulated engines (``disagg-proxy sim``, which serves
these routes as vLLM 0.33 does), each behind a recorder that keeps every request it
passes on. For each body of ``ROUTE_CASES`` the proxy must answer 2xx, and every leg it
sent is judged by vLLM's code:

- parse: the route's request model (``ResponsesRequest``, ``AnthropicMessagesRequest``,
  ``CohereChatV2Request``, ``GenerateRequest``) ``model_validate``, as FastAPI does;
- convert: Anthropic and Cohere requests become a ``ChatCompletionRequest`` by the
  serving classes' own conversion (``AnthropicServingMessages.to_chat_completion_request``,
  ``CohereServingChatV2._convert_v2_to_chat_completion``), then go through the chat
  verdict of ``engines.Vllm``; Responses requests become ``SamplingParams`` by
  ``ResponsesRequest.to_sampling_params``; token-in requests carry their own
  ``SamplingParams``;
- engine: ``InputProcessor._validate_params`` on the sampling parameters.

And the legs must be what the connector promises: the prefill leg's token limit is 1
(read from vLLM's own sampling parameters), it does not stream, and its
``kv_transfer_params`` ask for a remote decode (NIXL: ``do_remote_decode``; Mooncake:
``do_remote_decode`` and a ``transfer_id``); the decode leg carries the prefill's
handoff (NIXL: ``do_remote_prefill`` with block ids, engine id, host, port; Mooncake:
``do_remote_prefill`` and the same ``transfer_id``) and the client's own limit.

    DISAGG_ENGINES_PYTHON=... scripts/conformance/run.sh --routes [--proxy BIN]

Exit status: 0 every leg accepted, 1 a violation, 2 setup error.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import engines

# (route, name, body): every body is one a vLLM 0.33 engine accepts.
MESSAGES = [{"role": "user", "content": "Say hello to the conformance check."}]
ROUTE_CASES: list[tuple[str, str, dict]] = [
    ("/v1/responses", "text input", {"model": "sim-model", "input": "hello there", "max_output_tokens": 12}),
    ("/v1/responses", "text input streamed", {"model": "sim-model", "input": "hello there", "max_output_tokens": 12, "stream": True}),
    ("/v1/responses", "messages input, sampling", {
        "model": "sim-model",
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "Be brief.",
        "temperature": 0.7,
        "top_p": 0.9,
        "max_output_tokens": 20,
        "store": False,
    }),
    ("/v1/responses", "no limit", {"model": "sim-model", "input": "hello"}),
    ("/v1/messages", "plain", {"model": "sim-model", "max_tokens": 16, "messages": MESSAGES}),
    ("/v1/messages", "streamed", {"model": "sim-model", "max_tokens": 16, "messages": MESSAGES, "stream": True}),
    ("/v1/messages", "system and stops", {
        "model": "sim-model",
        "max_tokens": 16,
        "system": "You are terse.",
        "stop_sequences": ["\n\n", "END"],
        "temperature": 0.5,
        "messages": MESSAGES,
    }),
    ("/v1/messages", "thinking", {
        "model": "sim-model",
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": MESSAGES,
    }),
    ("/cohere/v2/chat", "plain", {"model": "sim-model", "messages": MESSAGES, "max_tokens": 16}),
    ("/cohere/v2/chat", "streamed", {"model": "sim-model", "messages": MESSAGES, "max_tokens": 16, "stream": True}),
    ("/cohere/v2/chat", "stops and sampling", {
        "model": "sim-model",
        "messages": MESSAGES,
        "max_tokens": 16,
        "stop_sequences": ["END"],
        "temperature": 0.3,
        "p": 0.9,
    }),
    ("/inference/v1/generate", "token ids", {
        "model": "sim-model",
        "token_ids": [1, 15, 27, 99, 4],
        "sampling_params": {"max_tokens": 12, "temperature": 0.0},
    }),
    ("/inference/v1/generate", "token ids streamed", {
        "model": "sim-model",
        "token_ids": [1, 15, 27, 99, 4],
        "sampling_params": {"max_tokens": 12, "stop": ["x"]},
        "stream": True,
    }),
]


# The simulated engines' vocabulary (`VOCAB_SIZE` in crates/disagg-sim/src/generate.rs).
SIM_VOCAB_SIZE = 1 << 20

# Prompt-token reuse (`--prompt-token-reuse on`): the chat prefill leg asks for
# `return_token_ids`, the decode leg's `kv_transfer_params` carries the prompt's ids.
REUSE_CASES: list[tuple[str, str, dict]] = [
    ("/v1/chat/completions", "reuse", {"model": "sim-model", "max_tokens": 12, "messages": MESSAGES}),
    ("/v1/chat/completions", "reuse streamed", {"model": "sim-model", "max_tokens": 12, "messages": MESSAGES, "stream": True}),
]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Recorder:
    """An HTTP forwarder in front of one simulated engine that keeps what it passes on.

    Answers are read whole before they are relayed: the check judges requests, and a
    streamed answer needs no timing here.
    """

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.legs: list[tuple[str, str, dict, bytes]] = []
        # (request body, answer body) of each POST passed on, for checks that compare
        # an engine's answer with what the proxy made of it (epd.py).
        self.answers: list[tuple[bytes, bytes]] = []
        self.lock = threading.Lock()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length", "0")))

            def _pass(self) -> None:
                body = self._body()
                headers = {k.lower(): v for k, v in self.headers.items()}
                with rec.lock:
                    rec.legs.append((self.command, self.path, headers, body))
                conn = http.client.HTTPConnection("127.0.0.1", rec.upstream, timeout=30)
                fwd = {
                    k: v
                    for k, v in headers.items()
                    if k not in ("host", "content-length", "transfer-encoding", "connection")
                }
                conn.request(self.command, self.path, body=body or None, headers=fwd)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                if self.command == "POST":
                    with rec.lock:
                        rec.answers.append((body, data))
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_POST = _pass
            do_GET = _pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> list[tuple[str, str, dict, bytes]]:
        with self.lock:
            legs, self.legs = self.legs, []
        return [leg for leg in legs if leg[0] == "POST"]

    def take_answers(self) -> list[tuple[bytes, bytes]]:
        """The (request, answer) bodies of the POSTs answered since the last call."""
        with self.lock:
            answers, self.answers = self.answers, []
        return answers


def wait_http(port: int, what: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"routes.py: {what} exited at start ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"routes.py: {what} did not listen on {port}")


def spawn_sim(binary: str, port: int, side: int, mode: str, extra=()) -> subprocess.Popen:
    """``disagg-proxy sim`` on ``port`` (side channel ``side``), listening when it returns."""
    cmd = [binary, "sim", "--listen", f"127.0.0.1:{port}", "--side-channel",
           f"127.0.0.1:{side}", "--kv-mode", mode, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(port, f"sim {mode}", proc)
    return proc


class Setup:
    """Two simulated engines of one connector, their recorders and the proxy."""

    def __init__(self, binary: str, connector: str, proxy_args=(), decode_args=()):
        self.procs: list[subprocess.Popen] = []
        p, d, ps, ds = (free_port() for _ in range(4))
        if connector == "nixl":
            pmode, dmode, boot = "nixl", "nixl", []
        else:
            pmode, dmode = "mooncake-prefill", "mooncake-decode"
            self.bootstrap = free_port()
            boot = ["--bootstrap", f"127.0.0.1:{self.bootstrap}"]
        for port, side, mode, extra in ((p, ps, pmode, boot), (d, ds, dmode, list(decode_args))):
            self.procs.append(spawn_sim(binary, port, side, mode, extra))
        self.prefill, self.decode = Recorder(p), Recorder(d)
        self.recorders = {"prefill": self.prefill, "decode": self.decode}
        self.port = free_port()
        prefill = [f"http://127.0.0.1:{self.prefill.port}"]
        conn = []
        if connector != "nixl":
            prefill.append(str(self.bootstrap))
            conn = ["--connector", connector]
        cmd = [binary, "serve", "--listen", f"127.0.0.1:{self.port}", *conn,
               "--prefill", *prefill, "--decode", f"http://127.0.0.1:{self.decode.port}",
               *proxy_args]
        proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proxy)
        wait_http(self.port, "disagg-proxy serve", proxy)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


class Judge:
    """vLLM 0.33's verdict on a body of one of the four routes."""

    def __init__(self) -> None:
        self.vllm = engines.Vllm()
        # The engine judged is one started with a reasoning parser (`--reasoning-parser`),
        # which Anthropic requests with `thinking` need: `_validate_params` refuses a
        # thinking budget otherwise, on the client's body as on any leg.
        import types

        self.vllm.processor.vllm_config.reasoning_config = types.SimpleNamespace(enabled=True)
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
        from vllm.entrypoints.cohere.protocol import CohereChatV2Request
        from vllm.entrypoints.cohere.serving import CohereServingChatV2
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

        self.models = {
            "/v1/responses": ResponsesRequest,
            "/v1/messages": AnthropicMessagesRequest,
            "/cohere/v2/chat": CohereChatV2Request,
            "/inference/v1/generate": GenerateRequest,
        }
        self.anthropic = AnthropicServingMessages
        self.cohere = CohereServingChatV2
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.renderers.online_renderer import _reused_prompt_token_ids

        self.models["/v1/chat/completions"] = ChatCompletionRequest
        self.reused_ids = _reused_prompt_token_ids
        class Vocabulary:
            """The renderer's vocabulary check without a tokenizer (the model's size).

            The reused ids are the prefill engine's own, so the bound is the simulated
            engines' vocabulary (`disagg_sim::VOCAB_SIZE`, 2^20), not the stand-in
            model's of the chat checks.
            """

            def validate_token_ids(self, ids, *, parameter=None):
                if ids and not 0 <= min(ids) <= max(ids) < SIM_VOCAB_SIZE:
                    raise ValueError(f"{parameter}: token id out of vocabulary")

        self.vocabulary = Vocabulary()

    def _validate(self, params: Any) -> None:
        v = self.vllm
        v.InputProcessor._validate_params(v.processor, params, ("generate",))

    def verdict(self, route: str, body: dict) -> tuple[str | None, dict]:
        """(None, facts) when vLLM accepts ``body`` on ``route``, else (refusal, {})."""
        v = self.vllm
        try:
            req = self.models[route].model_validate(engines._copy(body))
        except v.ValidationError as e:
            return f"parse: {e.errors()[0].get('msg')}", {}
        except v.errors as e:
            return f"parse: {e}", {}
        facts: dict = {"kv_transfer_params": getattr(req, "kv_transfer_params", None)}
        try:
            if route == "/v1/chat/completions":
                # What the decode renders from: vLLM pops and checks the reused ids first.
                facts["reused_ids"] = self.reused_ids(req, self.vocabulary, req.messages)
                facts["return_token_ids"] = bool(req.return_token_ids)
                verdict = v.verdict("chat", body)
                if not verdict.ok:
                    return f"chat: {verdict.short()}", {}
                facts["max_tokens"] = verdict.facts["max_tokens"]
                facts["stream"] = verdict.facts["stream"]
            elif route in ("/v1/messages", "/cohere/v2/chat"):
                if route == "/v1/messages":
                    chat = self.anthropic.to_chat_completion_request(req)
                else:
                    chat = self.cohere._convert_v2_to_chat_completion(req)
                dumped = chat.model_dump(mode="json", exclude_none=True)
                verdict = v.verdict("chat", dumped)
                if not verdict.ok:
                    return f"as chat: {verdict.short()}", {}
                facts["max_tokens"] = verdict.facts["max_tokens"]
                facts["stream"] = verdict.facts["stream"]
                # The conversion keeps the handoff on the chat request it builds.
                facts["kv_transfer_params"] = verdict.facts["kv_transfer_params"]
            elif route == "/v1/responses":
                limit = v.shape.max_model_len - v.shape.prompt_len
                params = req.to_sampling_params(limit, {})
                self._validate(params)
                facts["max_tokens"] = params.max_tokens
                facts["stream"] = bool(req.stream)
            else:
                params = req.sampling_params
                self._validate(params)
                facts["max_tokens"] = params.max_tokens
                facts["stream"] = bool(getattr(req, "stream", False))
        except v.errors as e:
            return f"engine: {e}", {}
        return None, facts


def leg_problems(connector: str, role: str, facts: dict, client_limit: int | None) -> list[str]:
    kv = facts.get("kv_transfer_params") or {}
    out = []
    if role == "prefill":
        if facts.get("max_tokens") != 1:
            out.append(f"prefill token limit {facts.get('max_tokens')}, not 1")
        if facts.get("stream"):
            out.append("prefill leg streams")
        if not kv.get("do_remote_decode"):
            out.append(f"prefill handoff lacks do_remote_decode: {kv}")
        if connector == "mooncake" and not kv.get("transfer_id"):
            out.append(f"prefill handoff lacks transfer_id: {kv}")
    else:
        if not kv.get("do_remote_prefill"):
            out.append(f"decode handoff lacks do_remote_prefill: {kv}")
        if connector == "nixl":
            for key in ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port"):
                if not kv.get(key):
                    out.append(f"decode handoff lacks {key}")
        elif not kv.get("transfer_id"):
            out.append(f"decode handoff lacks transfer_id: {kv}")
        if client_limit is not None and facts.get("max_tokens") != client_limit:
            out.append(f"decode token limit {facts.get('max_tokens')}, client asked {client_limit}")
    return out


def client_limit(route: str, body: dict) -> int | None:
    if route == "/v1/responses":
        return body.get("max_output_tokens")
    if route == "/inference/v1/generate":
        return body.get("sampling_params", {}).get("max_tokens")
    return body.get("max_tokens")


def exchange(setup: Setup, route: str, body: dict) -> tuple[list[str], dict]:
    """Send ``body``; the problems seen at the client, and the legs each engine got
    (by role: ``setup.recorders``' keys)."""
    for rec in setup.recorders.values():
        rec.take(), rec.take_answers()
    conn = http.client.HTTPConnection("127.0.0.1", setup.port, timeout=60)
    conn.request("POST", route, body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    answer = resp.read()
    conn.close()
    problems = []
    if resp.status // 100 != 2:
        problems.append(f"proxy answered {resp.status}: {answer[:200]!r}")
    if re.search(rb'"kv_transfer_params"\s*:\s*\{', answer):
        problems.append("the client's answer carries a handoff")
    if re.search(rb'"ec_transfer_params"\s*:\s*\{', answer):
        problems.append("the client's answer carries the encoders' ec_transfer_params")
    if re.search(rb'"prompt_token_ids"\s*:\s*\[', answer) and not body.get("return_token_ids"):
        problems.append("the client's answer carries prompt_token_ids it did not ask for")
    return problems, {role: rec.take() for role, rec in setup.recorders.items()}


def judge_legs(judge: Judge, connector: str, route: str, body: dict, legs: dict) -> tuple[list[str], dict]:
    """vLLM's verdict on each leg and the connector's promises; the facts of the legs
    vLLM accepted, by role."""
    problems, accepted = [], {}
    for role, sent in legs.items():
        if len(sent) != 1:
            problems.append(f"{len(sent)} {role} legs")
            continue
        _, path, _, raw = sent[0]
        if path.split("?")[0] != route:
            problems.append(f"{role} leg went to {path}")
        refusal, facts = judge.verdict(route, json.loads(raw))
        if refusal is not None:
            problems.append(f"vLLM refuses the {role} leg: {refusal}")
            continue
        problems += leg_problems(connector, role, facts, client_limit(route, body))
        accepted[role] = facts
    return problems, accepted


def report(label: str, problems: list[str]) -> int:
    if problems:
        print(f"FAIL     {label}")
        for p in problems:
            print(f"           {p}")
        return 1
    print(f"ok       {label}")
    return 0


def run_handoffs(binary: str, judge: Judge) -> int:
    """NIXL's two vLLM 0.33 handoffs: prompt-token reuse and bidirectional KV."""
    failures = 0
    setup = Setup(binary, "nixl", proxy_args=["--prompt-token-reuse", "on"])
    try:
        for route, name, body in REUSE_CASES:
            problems, legs = exchange(setup, route, body)
            found, facts = judge_legs(judge, "nixl", route, body, legs)
            problems += found
            if "prefill" in facts and not facts["prefill"]["return_token_ids"]:
                problems.append("the prefill leg does not ask for return_token_ids")
            if "decode" in facts and not facts["decode"]["reused_ids"]:
                problems.append("vLLM's decode reuses no prompt ids from the leg")
            failures += report(f"nixl     {route:24} {name}", problems)
    finally:
        setup.close()
    # Bidirectional KV: the decode returns its own handoff; the conversation's next turn
    # sends it on its prefill leg, which vLLM must accept as a request.
    setup = Setup(binary, "nixl", proxy_args=["--bidirectional-kv"], decode_args=["--decode-handoff"])
    try:
        route = "/v1/chat/completions"
        body = {"model": "sim-model", "max_tokens": 8, "messages": MESSAGES, "conversation_id": "conformance-1"}
        for turn in (1, 2):
            problems, legs = exchange(setup, route, body)
            for role, sent in legs.items():
                if len(sent) != 1:
                    problems.append(f"{len(sent)} {role} legs")
                    continue
                leg = json.loads(sent[0][3])
                refusal, facts = judge.verdict(route, leg)
                if refusal is not None:
                    problems.append(f"vLLM refuses the {role} leg: {refusal}")
                    continue
                kv = facts.get("kv_transfer_params") or {}
                if role == "prefill" and facts.get("max_tokens") != 1:
                    problems.append(f"prefill token limit {facts.get('max_tokens')}")
                if role == "prefill" and turn == 2:
                    for key in ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_num_tokens"):
                        if not kv.get(key):
                            problems.append(f"turn 2's prefill handoff lacks {key}: {kv}")
                    if not kv.get("do_remote_decode"):
                        problems.append("turn 2's prefill handoff lacks do_remote_decode")
            failures += report(f"nixl     {route:24} bidirectional turn {turn}", problems)
            body = {**body, "messages": MESSAGES + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and again"}]}
    finally:
        setup.close()
    return failures


def run(binary: str, connectors: list[str]) -> int:
    judge = Judge()
    failures = run_handoffs(binary, judge)
    for connector in connectors:
        setup = Setup(binary, connector)
        try:
            for route, name, body in ROUTE_CASES:
                verdict, _ = judge.verdict(route, body)
                label = f"{connector:8} {route:24} {name}"
                if verdict is not None:
                    print(f"SETUP    {label}: vLLM refuses the client's body ({verdict})")
                    failures += 1
                    continue
                problems, legs = exchange(setup, route, body)
                failures += report(label, problems + judge_legs(judge, connector, route, body, legs)[0])
        finally:
            setup.close()
    print(f"\n{failures} violation(s)" if failures else "\nevery leg accepted by vLLM 0.33")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy", required=True, help="the disagg-proxy binary")
    ap.add_argument("--connector", action="append", choices=["nixl", "mooncake"],
                    help="connectors to check (default: both)")
    args = ap.parse_args()
    return run(args.proxy, args.connector or ["nixl", "mooncake"])


if __name__ == "__main__":
    sys.exit(main())
