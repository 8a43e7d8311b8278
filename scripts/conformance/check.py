#!/usr/bin/env python3
"""Check every leg disagg-proxy sends against vLLM's and SGLang's own request code.

For each connector (nixl, mooncake, sglang) and routing mode (plain: no data-parallel
ranks; dp: the prefill engine given as rank 2 and the decode engine as rank 1), this
starts capture engines (capture.py) and the real proxy (``disagg-proxy serve``) in front
of them, sends every client body of the case matrix (cases.json) through the proxy, and
judges the client body and every captured leg with the engine's own code (engines.py).

Invariants (each broken one is a violation; any violation makes the exit status 1):

  refused-not-4xx    the engine refuses the client's body, the proxy answers non-4xx
  rewritten-valid    the engine refuses the client's body but accepts a leg the proxy
                     sent for it (an invalid body made valid by the rewrite)
  leg-refused        the engine accepts the client's body but refuses a leg
  proxy-refuses      the engine accepts the body; the proxy answers 4xx of its own
                     without contacting an engine
  not-served         the engine accepts the body; the proxy answers neither 2xx nor an
                     engine's refusal
  grammar-on-prefill a NIXL/Mooncake prefill leg carries response_format json_*,
                     structured_outputs or guided_*
  dp-field           a leg carries a data-parallel field or header the proxy did not
                     choose (plain mode: any; dp mode: any other than the proxy's)
  dp-rank            dp mode: a leg does not reach the rank the proxy picked, or an
                     SGLang decode is not told the prefill's rank
  handoff            a leg's kv_transfer_params / bootstrap fields are not exactly the
                     connector's (a client value survived, or the proxy's is wrong)
  refusal-hidden     an engine refused a leg, yet the proxy answered 2xx (with concurrent
                     connectors the decode then waits for KV that never comes)
  beam-prefill       use_beam_search is set and a prefill leg was sent (vLLM's beam search
                     sends no kv_transfer_params to the engine, so the prefill is wasted)

Run it with the engines' Python (see README.md): ``scripts/conformance/run.sh``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import capture  # noqa: E402
import engines  # noqa: E402

CONNECTORS = ("nixl", "mooncake", "sglang")
MODES = ("plain", "dp")
# dp mode: the prefill engine is rank 2 and the decode engine rank 1 of engines running
# 4 ranks (engines.ModelShape.dp_size), so a leg naming the wrong one is visible.
PREFILL_RANK = 2
DECODE_RANK = 1
# The bootstrap port the SGLang connector is given for the prefill (only written into
# the bodies; nothing listens on it: capture engines do not transfer KV).
SGLANG_BOOTSTRAP_PORT = 8998
# Body fields and headers naming a data-parallel rank (vLLM: X-data-parallel-rank;
# SGLang: routed_dp_rank, its deprecated alias data_parallel_rank, disagg_prefill_dp_rank,
# X-Data-Parallel-Rank and, when SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES is set, the
# x-override-* headers; data_parallel_rank_decode is read by no current engine).
DP_FIELDS = (
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank_decode",
)
DP_HEADERS = (
    "x-data-parallel-rank",
    "x-override-routed-dp-rank",
    "x-override-disagg-prefill-dp-rank",
)
ROOM_MAX = 2**63 - 1  # SGLang rooms are non-negative i64 values
# How long to wait for legs still in flight after the proxy's answer: legs stop
# arriving once none came for SETTLE seconds, or after SETTLE_MAX.
SETTLE = 0.1
SETTLE_MAX = 2.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# === cases ===


@dataclass
class Case:
    name: str
    api: str
    body: Any
    headers: dict
    expect: dict
    note: str = ""


def load_cases(path: str, only: str | None) -> list[Case]:
    with open(path) as f:
        doc = json.load(f)
    cases = []
    for c in doc["cases"]:
        if only and not re.search(only, c["name"]):
            continue
        body = dict(doc["defaults"][c["api"]])
        for key in c.get("omit", []):
            body.pop(key, None)
        body.update(c["body"])
        cases.append(
            Case(
                c["name"],
                c["api"],
                body,
                c.get("headers", {}),
                c.get("expect", {}),
                c.get("note", ""),
            )
        )
    return cases


# === the proxy ===


class Proxy:
    """``disagg-proxy serve`` in front of the capture engines, on a port it picks."""

    def __init__(self, binary: str, args: list[str]):
        cmd = [
            binary,
            "serve",
            *args,
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--health-check-interval",
            "0",
        ]
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"), NO_COLOR="1")
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        self.log: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                text = ANSI.sub("", line.decode("utf-8", "replace")).rstrip()
                self.log.append(text)
                m = re.search(r"listen=(\S+)", text)
                if m and self.url is None:
                    self.url = "http://" + m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30) or self.url is None:
            self.stop()
            raise RuntimeError(
                "disagg-proxy did not start:\n  "
                + " ".join(cmd)
                + "\n  "
                + "\n  ".join(self.log[-20:])
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM starts the drain; a second one exits at once.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Answer:
    status: int
    code: str | None
    message: str
    headers: dict
    body: bytes


def _read_all(r) -> bytes | None:
    """The whole body, or None when the connection ends before it does."""
    try:
        return r.read()
    except (http.client.IncompleteRead, OSError):
        return None


def send(url: str, case: Case, request_id: str) -> Answer:
    """POST the case's body to the proxy and read the whole answer."""
    data = json.dumps(case.body).encode()
    headers = {"content-type": "application/json", "x-request-id": request_id, **case.headers}
    req = urllib.request.Request(
        url + ("/v1/chat/completions" if case.api == "chat" else "/v1/completions"),
        data=data,
        headers=headers,
        method="POST",
    )
    code, message = None, ""
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, hdrs = r.status, dict(r.headers)
            raw = _read_all(r)
    except urllib.error.HTTPError as e:
        status, hdrs = e.code, dict(e.headers)
        raw = _read_all(e)
    except (OSError, http.client.HTTPException) as e:
        return Answer(0, "no-answer", f"{type(e).__name__}: {e}", {}, b"")
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    if raw is None:
        return Answer(status, "cut", "the answer's body ended early", hdrs, b"")
    try:
        obj = json.loads(raw)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            code = err.get("code") if err.get("code") is not None else err.get("type")
            message = err.get("message", "")
        elif isinstance(obj, dict) and obj.get("object") == "error":
            code, message = obj.get("code"), obj.get("message", "")
    except ValueError:
        pass
    return Answer(status, None if code is None else str(code), message, hdrs, raw)


# === one run: a connector in a mode ===


@dataclass
class Result:
    case: Case
    connector: str
    mode: str
    client: engines.Verdict
    answer: Answer | None
    legs: list
    violations: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def fail(self, rule: str, detail: str) -> None:
        self.violations.append((rule, detail))

    def to_json(self) -> dict:
        return {
            "case": self.case.name,
            "api": self.case.api,
            "connector": self.connector,
            "mode": self.mode,
            "client_body": self.case.body,
            "client_verdict": self.client.to_json(),
            "proxy": None
            if self.answer is None
            else {
                "status": self.answer.status,
                "code": self.answer.code,
                "message": self.answer.message,
                "handoff": self.answer.headers.get("x-disagg-handoff"),
            },
            "legs": [leg.to_json() for leg in self.legs],
            "violations": [{"rule": r, "detail": d} for r, d in self.violations],
            "notes": self.notes,
        }


class Run:
    """Capture engines and a proxy for one connector in one mode."""

    def __init__(self, binary: str, connector: str, mode: str, judge, shape: engines.ModelShape):
        self.connector, self.mode = connector, mode
        self.recorder = capture.Recorder()
        kind = connector
        self.prefill = capture.Engine("prefill", kind, judge, self.recorder).start()
        self.decode = capture.Engine("decode", kind, judge, self.recorder).start()
        self.bootstrap = (
            capture.Bootstrap(shape.dp_size).start() if connector == "mooncake" else None
        )
        p_url, d_url = self.prefill.url, self.decode.url
        if mode == "dp":
            p_url, d_url = f"{p_url}@{PREFILL_RANK}", f"{d_url}@{DECODE_RANK}"
        prefill = ["--prefill", p_url]
        if connector == "mooncake":
            prefill.append(str(self.bootstrap.port))
        elif connector == "sglang":
            prefill.append(str(SGLANG_BOOTSTRAP_PORT))
        try:
            self.proxy = Proxy(binary, ["--connector", connector, *prefill, "--decode", d_url])
        except Exception:
            self._stop_engines()
            raise

    def stop(self) -> None:
        self.proxy.stop()
        self._stop_engines()

    def _stop_engines(self) -> None:
        self.prefill.stop()
        self.decode.stop()
        if self.bootstrap:
            self.bootstrap.stop()

    def exchange(self, case: Case, n: int) -> tuple[Answer, list]:
        self.recorder.take()
        answer = send(self.proxy.url, case, f"conformance-{self.connector}-{self.mode}-{n}")
        # Concurrent connectors may still be sending a leg when the answer is complete.
        start = last_change = time.monotonic()
        seen = self.recorder.count()
        while time.monotonic() - last_change < SETTLE and time.monotonic() - start < SETTLE_MAX:
            time.sleep(0.02)
            if self.recorder.count() != seen:
                seen, last_change = self.recorder.count(), time.monotonic()
        return answer, self.recorder.take()


# === invariants ===


def _grammar_fields(body: dict) -> list[str]:
    found = []
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        found.append(f"response_format.type={rf.get('type')}")
    if body.get("structured_outputs") is not None:
        found.append("structured_outputs")
    found += sorted(k for k in body if k.startswith("guided_"))
    return found


def _nixl_prefill_params() -> dict:
    # vLLM's toy proxy and disagg: only do_remote_decode matters, the nulls are conventional.
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


MOONCAKE_PREFILL_KEYS = {"do_remote_decode", "do_remote_prefill", "transfer_id"}
MOONCAKE_DECODE_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_bootstrap_addr",
    "remote_engine_id",
    "transfer_id",
}


def _nixl_handoff(leg: capture.Leg, legs: dict, r: Result, run: Run) -> str | None:
    kv = leg.body.get("kv_transfer_params")
    if leg.role == "decode" and "kv_transfer_params" not in leg.body:
        return None  # a decode without the handoff (no prefill, or none returned)
    want = _nixl_prefill_params() if leg.role == "prefill" else capture.NIXL_PARAMS
    if kv != want:
        return f"{leg.role} kv_transfer_params={engines.dump(kv)}, expected {engines.dump(want)}"
    return None


def _mooncake_handoff(leg: capture.Leg, legs: dict, r: Result, run: Run) -> str | None:
    kv = leg.body.get("kv_transfer_params")
    problem = f"{leg.role} kv_transfer_params={engines.dump(kv)}"
    if leg.role == "prefill":
        ok = (
            isinstance(kv, dict)
            and set(kv) == MOONCAKE_PREFILL_KEYS
            and kv["do_remote_decode"] is True
            and kv["do_remote_prefill"] is False
            and isinstance(kv["transfer_id"], str)
        )
        return None if ok else problem
    prefill = legs.get("prefill")
    if prefill is None and "kv_transfer_params" not in leg.body:
        return None  # decode alone: no handoff
    pkv = prefill.body.get("kv_transfer_params") if prefill is not None else None
    if r.mode == "dp":
        rank = PREFILL_RANK
    else:
        # No rank configured: the proxy must still pin the prefill leg (a vLLM engine
        # with several DP ranks places an unpinned request on a rank of its own), and
        # give the decode exactly that rank's engine id.
        pinned = prefill.headers.get("x-data-parallel-rank") if prefill is not None else None
        if pinned is None or not pinned.isdigit():
            return f"prefill leg not pinned to a rank (X-data-parallel-rank {pinned})"
        rank = int(pinned)
    ok = (
        isinstance(kv, dict)
        and set(kv) == MOONCAKE_DECODE_KEYS
        and kv["do_remote_prefill"] is True
        and kv["do_remote_decode"] is False
        and kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{run.bootstrap.port}"
        and kv["remote_engine_id"] == capture.mooncake_engine_id(rank)
        and isinstance(pkv, dict)
        and kv["transfer_id"] == pkv.get("transfer_id")
    )
    return None if ok else problem


def _is_room(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= ROOM_MAX


def _sglang_handoff(leg: capture.Leg, legs: dict, r: Result, run: Run) -> str | None:
    b = leg.body
    if "kv_transfer_params" in b:
        return f"{leg.role} carries kv_transfer_params={engines.dump(b['kv_transfer_params'])}"
    if "bootstrap_host" not in b and legs.get("prefill") is None:
        return None  # decode alone
    host, port, room = b.get("bootstrap_host"), b.get("bootstrap_port"), b.get("bootstrap_room")
    hosts = host if isinstance(host, list) else [host]
    ports = port if isinstance(port, list) else [port]
    rooms = room if isinstance(room, list) else [room]
    if (
        any(h != "127.0.0.1" for h in hosts)
        or any(p != SGLANG_BOOTSTRAP_PORT for p in ports)
        or not all(_is_room(x) for x in rooms)
        or not len(hosts) == len(ports) == len(rooms)
    ):
        return f"{leg.role} bootstrap_host={host} bootstrap_port={port} bootstrap_room={room}"
    other = legs.get("decode" if leg.role == "prefill" else "prefill")
    if other is not None and other.body.get("bootstrap_room") != room:
        return f"{leg.role} bootstrap_room {room} is not the other leg's"
    v = leg.verdict
    if v is not None and v.ok:
        # The rooms each request of SGLang's batch gets after normalisation.
        batch = v.facts.get("batch", 1)
        used = v.facts.get("bootstrap_room")
        used = used[:batch] if isinstance(used, list) else [used]
        if len(set(used)) != len(used):
            return f"{leg.role}: SGLang's batch of {batch} gets rooms {used} (not distinct)"
    return None


HANDOFF_CHECKS = {"nixl": _nixl_handoff, "mooncake": _mooncake_handoff, "sglang": _sglang_handoff}


def check_handoff(r: Result, run: Run) -> None:
    """The handoff fields of each leg are exactly the connector's."""
    legs = [leg for leg in r.legs if isinstance(leg.body, dict)]
    by_role = {}
    for leg in legs:
        by_role.setdefault(leg.role, leg)
    for leg in legs:
        problem = HANDOFF_CHECKS[r.connector](leg, by_role, r, run)
        if problem:
            r.fail("handoff", problem)


def check_dp(r: Result) -> None:
    """Data-parallel fields: only the proxy's, naming the ranks it picked."""
    for leg in r.legs:
        if not isinstance(leg.body, dict):
            continue
        fields = {k: leg.body[k] for k in DP_FIELDS if k in leg.body}
        headers = {k: leg.headers[k] for k in DP_HEADERS if k in leg.headers}
        if r.connector == "sglang":
            ignored = ""
        else:
            ignored = " (vLLM 0.33 ignores body DP fields)"
        if r.mode == "plain":
            # No ranks configured: the proxy chooses none, so any is the client's; but a
            # Mooncake prefill leg is always pinned, to the rank whose engine id the
            # decode gets (checked with the handoff).
            if fields:
                r.fail("dp-field", f"{leg.role} leg carries {engines.dump(fields)}{ignored}")
            if r.connector == "mooncake" and leg.role == "prefill":
                headers.pop("x-data-parallel-rank", None)
            if headers:
                r.fail("dp-field", f"{leg.role} leg carries headers {engines.dump(headers)}")
            continue
        want = PREFILL_RANK if leg.role == "prefill" else DECODE_RANK
        if r.connector != "sglang":
            # vLLM reads the rank from X-data-parallel-rank only.
            got = headers.get("x-data-parallel-rank")
            if got != str(want):
                r.fail("dp-rank", f"{leg.role} leg has X-data-parallel-rank {got}, not {want}")
            if fields:
                r.fail("dp-field", f"{leg.role} leg carries {engines.dump(fields)}{ignored}")
            continue
        # SGLang: the rank its own code resolves (header, routed_dp_rank, then the
        # deprecated data_parallel_rank), read from the leg's verdict.
        v = leg.verdict
        if v is None or not v.ok:
            continue
        got = v.facts.get("routed_dp_rank")
        if got != want:
            r.fail(
                "dp-rank",
                f"{leg.role} leg goes to rank {got}, not {want} "
                f"(body {engines.dump(fields)}, headers {engines.dump(headers)})",
            )
        told = v.facts.get("disagg_prefill_dp_rank")
        if leg.role == "decode" and told != PREFILL_RANK:
            r.fail(
                "dp-rank",
                f"decode leg names prefill rank {told}, not {PREFILL_RANK} "
                "(SGLang then takes bootstrap_room % dp_size)",
            )


def evaluate(r: Result, run: Run) -> None:
    """Check every invariant of the module docs on one exchange."""
    a, legs, client = r.answer, r.legs, r.client
    accepted = [leg for leg in legs if leg.verdict is not None and leg.verdict.ok]
    refused = [leg for leg in legs if leg.verdict is None or not leg.verdict.ok]
    said = f"proxy answered {a.status} {a.code or ''}".rstrip()
    if not client.ok:
        if not 400 <= a.status < 500:
            r.fail("refused-not-4xx", said)
        for leg in accepted:
            r.fail("rewritten-valid", f"{leg.role} leg accepted")
        if not legs:
            r.notes.append("no engine contacted")
        elif refused:
            r.notes.append("engine refusal passed through")
    else:
        for leg in refused:
            why = leg.verdict.short() if leg.verdict is not None else "not JSON"
            r.fail("leg-refused", f"{leg.role} leg refused: {why}")
        if 400 <= a.status < 500 and not legs:
            r.fail("proxy-refuses", f"{said}: {a.message[:90]}")
        elif (not 200 <= a.status < 300 or a.code in ("cut", "no-answer")) and not refused:
            r.fail("not-served", f"{said}: {a.message[:90]}")
    if refused and 200 <= a.status < 300:
        roles = ", ".join(leg.role for leg in refused)
        r.fail("refusal-hidden", f"the engine refused the {roles} leg, the {said}")
    if r.connector in ("nixl", "mooncake"):
        for leg in legs:
            if leg.role == "prefill" and isinstance(leg.body, dict):
                found = _grammar_fields(leg.body)
                if found:
                    r.fail("grammar-on-prefill", ", ".join(found))
        if client.facts.get("use_beam_search") and any(leg.role == "prefill" for leg in legs):
            r.fail("beam-prefill", "a prefill leg was sent for a beam-search request")
    check_dp(r)
    check_handoff(r, run)


# === output ===


def _columns(rows: list[tuple], out) -> None:
    """Rows as aligned columns; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        out.write("  ".join([*cells, row[-1]]) + "\n")


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def leg_summary(legs: list) -> str:
    """``P:ok D:parse``: each leg in arrival order with the engine's verdict."""
    if not legs:
        return "-"
    parts = []
    for leg in legs:
        v = leg.verdict
        said = "not-json" if v is None else ("ok" if v.ok else v.stage)
        parts.append(f"{leg.role[0].upper()}:{said}")
    return " ".join(parts)


def print_table(results: list[Result], out) -> None:
    rows = [("case", "run", "engine on client body", "proxy", "legs", "violations")]
    for r in results:
        a = r.answer
        proxy = str(a.status)
        if a.code and (a.status >= 400 or a.code in ("cut", "no-answer")):
            proxy += f" {a.code}"
        rule_names = ", ".join(sorted({rule for rule, _ in r.violations})) or "ok"
        rows.append(
            (
                r.case.name,
                f"{r.connector}/{r.mode}",
                _cut(r.client.short(), 48),
                proxy,
                leg_summary(r.legs),
                rule_names,
            )
        )
    _columns(rows, out)


def print_violations(results: list[Result], out) -> None:
    bad = [r for r in results if r.violations]
    if not bad:
        out.write("\nno violations\n")
        return
    count = sum(len(r.violations) for r in bad)
    out.write(f"\n{count} violations in {len(bad)} of {len(results)} exchanges:\n")
    for r in bad:
        out.write(f"\n{r.case.name} [{r.connector}/{r.mode}] {engines.dump(r.case.body)}\n")
        out.write(f"  {r.client.engine} on the client body: {r.client.short()}\n")
        for rule, detail in r.violations:
            out.write(f"  {rule}: {detail}\n")
        for leg in r.legs:
            if leg.verdict is not None and not leg.verdict.ok:
                v = leg.verdict
                out.write(f"  {leg.role} leg refused by {v.engine}: {v.short()}\n")


def expectation_notes(cases: list[Case], judges: dict) -> list[str]:
    """Cases where an engine's verdict is not the stage cases.json expects."""
    notes = []
    for c in cases:
        for name, judge in judges.items():
            want = c.expect.get(name)
            if want is None:
                continue
            v = judge.verdict(c.api, c.body)
            if want != ("ok" if v.ok else v.stage):
                notes.append(f"{c.name}: {name} expected {want}, got {v.short()}")
    return notes


def print_verdicts(cases: list[Case], judges: dict, out) -> None:
    """Each engine's verdict on each client body (--verdicts-only)."""
    rows = [("case", "api", *judges)]
    for c in cases:
        rows.append((c.name, c.api, *(j.verdict(c.api, c.body).short() for j in judges.values())))
    _columns(rows, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy", help="the disagg-proxy binary (required unless --verdicts-only)")
    ap.add_argument("--cases", default=os.path.join(HERE, "cases.json"))
    ap.add_argument(
        "--connector", action="append", choices=CONNECTORS, help="repeatable; default: all"
    )
    ap.add_argument("--mode", action="append", choices=MODES, help="repeatable; default: all")
    ap.add_argument("--only", help="regular expression on case names")
    ap.add_argument("--json", help="write every exchange (bodies, legs, verdicts) to this file")
    ap.add_argument(
        "--verdicts-only",
        action="store_true",
        help="print the engines' verdicts on the client bodies; no proxy",
    )
    args = ap.parse_args()

    cases = load_cases(args.cases, args.only)
    shape = engines.ModelShape()
    t0 = time.monotonic()
    judges = {"vllm": engines.Vllm(shape)}
    try:
        judges["sglang"] = engines.Sglang(shape)
    except ImportError as e:
        print(f"warning: SGLang not importable ({e}); its connector is skipped", file=sys.stderr)
    print(f"engines loaded in {time.monotonic() - t0:.0f} s", file=sys.stderr)

    if args.verdicts_only:
        print_verdicts(cases, judges, sys.stdout)
        for line in expectation_notes(cases, judges):
            print("note: " + line)
        return 0
    if not args.proxy:
        ap.error("--proxy is required (or --verdicts-only)")

    results: list[Result] = []
    for connector in args.connector or CONNECTORS:
        engine = engines.engines_for(connector)
        if engine not in judges:
            continue
        judge = judges[engine].verdict
        for mode in args.mode or MODES:
            run = Run(args.proxy, connector, mode, judge, shape)
            try:
                for n, case in enumerate(cases):
                    client = judge(case.api, case.body)
                    answer, legs = run.exchange(case, n)
                    r = Result(case, connector, mode, client, answer, legs)
                    evaluate(r, run)
                    results.append(r)
            finally:
                run.stop()
    print_table(results, sys.stdout)
    print_violations(results, sys.stdout)
    for line in expectation_notes(cases, judges):
        print("note: " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in results], f, indent=1, default=str)
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
