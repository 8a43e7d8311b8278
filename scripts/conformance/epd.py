#!/usr/bin/env python3
"""vLLM 0.33's own request code on the legs of encoder disaggregation (E/P/D):
``run.sh --epd`` (scripts/conformance/README.md, "Encoder disaggregation").

The proxy runs in front of a simulated encoder (``sim --ec-role producer``), a
simulated NIXL prefill that consumes its output (``--ec-role consumer``) and a NIXL
decode, each behind a recorder (``routes.Recorder``). For each body of ``CASES`` the
proxy must answer 2xx, and every leg is judged by vLLM's code:

- encoder legs: ``ChatCompletionRequest.model_validate`` and the chat verdict of
  ``engines.Vllm``; every media part through vLLM's own chat parsing
  (``renderers/chat_utils/``: ``parse_chat_message_content`` →
  ``parse_chat_message_content_part`` → ``MultiModalContentParser`` →
  ``MultiModalItemTracker.resolve_items``, with stand-ins for what needs a model:
  ``MmJudge``), which gives each item's modality, data and ``uuid``; on chat the
  ``uuid`` is present and the consumer's item carries the same one; an encoder leg asks
  for one token and does not stream (vLLM writes ``ec_transfer_params`` only into a
  whole answer);
- prefill and decode legs: the route's request model (``routes.Judge``: chat,
  ``ResponsesRequest``, ``AnthropicMessagesRequest`` → ``to_chat_completion_request``)
  and the connector's promises (``routes.leg_problems``); ``ec_transfer_params`` read
  where the engine reads it (the sampling parameters' ``extra_args``), shaped as
  ``collect_ec_item_metadata`` builds it (``distributed/ec_transfer/ec_connector/
  utils.py``: keys the items' identifiers, entries ``modality``, ``item_indices``,
  ``metadata``) and holding every entry the encoders answered; on chat its keys are the
  ``uuid``s of the consumer's items (without processor kwargs: with them vLLM keys a
  hash of uuid and kwargs); with ``--encode-placeholders`` each
  ``image_embeds`` / ``audio_embeds`` part through the same content-part parser;
- the client's answer carries no ``kv_transfer_params`` nor ``ec_transfer_params``.

Every case runs again in Mooncake push mode (``--ec-connector mooncake``: ``PushJudge``,
``judge_push``), where vLLM's own ``ECMooncakeScheduler._request_transfer_id`` decides
which transfer id each item of an encoder leg is pushed under and which one the
consumer waits for.

    DISAGG_ENGINES_PYTHON=... scripts/conformance/run.sh --epd [--proxy BIN]

Exit status: 0 every leg accepted, 1 a violation, 2 setup error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from typing import Any

import routes
from routes import MESSAGES, Judge, Recorder, free_port, leg_problems, report, spawn_sim, wait_http

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ANTHROPIC = "/v1/messages"

# Small payloads: the simulated encoder never decodes them, and vLLM's parsers checked
# here only read the parts (loading the media needs the model's processor).
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
HTTP_IMAGE = "http://images.example/cat.png"
WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="


def image(url: str, **extra: Any) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def video(url: str = "http://videos.example/clip.mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def audio() -> dict:
    return {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def chat(content: list, stream: bool = False, **extra: Any) -> dict:
    return {"model": "sim-model", "max_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


def chat_cases() -> list[tuple[str, str, dict]]:
    out = []
    for stream in (False, True):
        tag = " streamed" if stream else ""
        out += [
            (CHAT, "one image" + tag, chat([text("what is this?"), image(PNG)], stream)),
            (CHAT, "three images, data: and http" + tag, chat(
                [text("compare"), image(PNG), image(HTTP_IMAGE), image(PNG + "AA")], stream)),
            (CHAT, "audio" + tag, chat([text("transcribe"), audio()], stream)),
            (CHAT, "video" + tag, chat([text("describe"), video()], stream)),
            (CHAT, "mixed text, image, audio" + tag, chat(
                [text("look"), image(PNG), text("and listen"), audio(), text("then answer")],
                stream)),
        ]
    out += [
        (CHAT, "image with the client's uuid", chat([text("this"), image(PNG, uuid="client-item-1")])),
        (CHAT, "image with processor kwargs", chat(
            [text("this"), image(HTTP_IMAGE)], mm_processor_kwargs={"max_pixels": 4096})),
        (CHAT, "two turns with images", {
            "model": "sim-model", "max_tokens": 8, "messages": [
                {"role": "user", "content": [text("first"), image(PNG)]},
                {"role": "assistant", "content": "a dot"},
                {"role": "user", "content": [text("second"), image(HTTP_IMAGE)]},
            ]}),
    ]
    return out


def responses(stream: bool) -> dict:
    return {"model": "sim-model", "max_output_tokens": 8, "stream": stream, "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is in these?"},
            {"type": "input_image", "image_url": PNG, "detail": "auto"},
            {"type": "input_image", "image_url": HTTP_IMAGE, "detail": "auto"},
        ]}]}


def anthropic(stream: bool) -> dict:
    return {"model": "sim-model", "max_tokens": 8, "stream": stream, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "what is in these?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG.split(",", 1)[1]}},
            {"type": "image", "source": {"type": "url", "url": HTTP_IMAGE}},
        ]}]}


CASES: list[tuple[str, str, dict]] = chat_cases() + [
    (RESPONSES, "input_image", responses(False)),
    (RESPONSES, "input_image streamed", responses(True)),
    (ANTHROPIC, "image blocks", anthropic(False)),
    (ANTHROPIC, "image blocks streamed", anthropic(True)),
]

# With --encode-placeholders: chat items reach the consumers as `<modality>_embeds`.
PLACEHOLDER_CASES: list[tuple[str, str, dict]] = [
    (CHAT, "placeholders: one image", chat([text("what is this?"), image(PNG)])),
    (CHAT, "placeholders: images and audio streamed", chat(
        [text("look"), image(PNG), image(HTTP_IMAGE), audio()], True)),
    (CHAT, "placeholders: two videos and an image", chat(
        [text("watch"), video(), video("http://videos.example/other.mp4"), image(PNG)])),
    # vLLM keys these entries by a hash of uuid and kwargs: the media stay.
    (CHAT, "placeholders: processor kwargs keep the media", chat(
        [text("this"), image(PNG)], mm_processor_kwargs={"max_pixels": 4096})),
]


class EpdSetup:
    """A simulated encoder, a consuming NIXL prefill and a NIXL decode, each behind a
    recorder, sharing an EC store; and the proxy in front of them."""

    def __init__(self, binary: str, proxy_args=(), push: bool = False):
        self.procs = []
        self.args = list(proxy_args)
        self.push = push
        self.store = tempfile.mkdtemp(prefix="disagg-epd-conformance-")
        ec = lambda role: ["--ec-role", role, "--ec-store", self.store]  # noqa: E731
        producer, consumer = ec("producer"), ec("consumer")
        self.ec_port = None
        if push:
            # vLLM's Mooncake EC connector: the prefill listens for its encoders' pushes.
            self.ec_port = free_port()
            producer += ["--ec-push"]
            consumer += ["--ec-push-port", str(self.ec_port)]
        self.recorders: dict[str, Recorder] = {}
        for role, extra in (("encode", producer), ("prefill", consumer), ("decode", [])):
            port = free_port()
            self.procs.append(spawn_sim(binary, port, free_port(), "nixl", extra))
            self.recorders[role] = Recorder(port)
        self.port = free_port()
        url = lambda role: f"http://127.0.0.1:{self.recorders[role].port}"  # noqa: E731
        cmd = [binary, "serve", "--listen", f"127.0.0.1:{self.port}",
               "--prefill", url("prefill"), "--decode", url("decode"),
               "--encode", url("encode"), *proxy_args]
        if push:
            cmd += ["--ec-connector", "mooncake",
                    "--ec-address", f"{url('prefill')}=127.0.0.1:{self.ec_port}"]
        proxy = routes.subprocess.Popen(cmd, stdout=routes.subprocess.DEVNULL,
                                        stderr=routes.subprocess.PIPE)
        self.procs.append(proxy)
        wait_http(self.port, "disagg-proxy serve", proxy)

    def close(self) -> None:
        routes.Setup.close(self)  # type: ignore[arg-type]
        shutil.rmtree(self.store, ignore_errors=True)


class MmJudge:
    """vLLM 0.33's chat parser (``renderers/chat_utils/``) on the media of a body.

    ``parse_chat_message_content`` runs as the server runs it, part by part through
    ``parse_chat_message_content_part`` into vLLM's ``MultiModalContentParser`` and
    ``MultiModalItemTracker``, then ``resolve_items`` (``_resolve_items``: no raw and
    embedded items of one modality). Stand-ins for what needs a model: the media
    connector (the media are not fetched nor decoded: an item's data is the URL it would
    be loaded from), the model class's placeholder string, the processor's item limit
    and the model config (multimodal, ``--enable-mm-embeds`` as asked).
    """

    def __init__(self) -> None:
        import types

        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_input_messages
        from vllm.renderers.chat_utils import chat_message, item_tracker

        self.chat_message = chat_message
        self.anthropic = AnthropicServingMessages
        self.responses = ResponsesRequest
        self.construct_input_messages = construct_input_messages

        class Connector:
            """The media connector: what each item would be loaded from."""

            fetch_image = fetch_audio = staticmethod(lambda url, **_: url)
            fetch_video = staticmethod(lambda video_url=None, **_: video_url)
            fetch_image_embedding = fetch_audio_embedding = fetch_video_embedding = staticmethod(
                lambda v: ("embedding", v))

        class Tracker(item_tracker.MultiModalItemTracker):
            # What the served model would answer (cached properties in vLLM's class).
            video_processor_name = None
            model_cls = types.SimpleNamespace(get_placeholder_str=lambda m, n: f"<{m}>")
            mm_processor = types.SimpleNamespace(info=types.SimpleNamespace(
                validate_num_items=lambda m, n: None,
                data_parser=types.SimpleNamespace(placeholder_metadata_fields=lambda m: set()),
            ))

            def create_parser(self, mm_processor_kwargs=None):
                parser = super().create_parser(mm_processor_kwargs)
                parser.__dict__["_connector"] = Connector()
                return parser

        self.Tracker = Tracker

    def model_config(self, mm_embeds: bool):
        import types

        mm = types.SimpleNamespace(
            enable_mm_embeds=mm_embeds,
            get_limit_per_prompt=lambda m: 256,
            media_io_kwargs=None,
            interleave_mm_strings=False,
        )
        return types.SimpleNamespace(
            hf_config=types.SimpleNamespace(),
            multimodal_config=mm,
            get_multimodal_config=lambda: mm,
            enable_prompt_embeds=False,
            allowed_local_media_path="",
            allowed_media_domains=None,
            is_multimodal_model=True,
        )

    def chat_messages(self, route: str, body: dict) -> tuple[list, dict | None]:
        """The chat messages vLLM parses for a body of ``route``, and the processor
        kwargs it passes with them."""
        if route == "/v1/responses":
            req = self.responses.model_validate(json.loads(json.dumps(body)))
            messages = self.construct_input_messages(
                request_instructions=req.instructions, request_input=req.input)
            return messages, req.mm_processor_kwargs
        if route == "/v1/messages":
            from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

            req = AnthropicMessagesRequest.model_validate(json.loads(json.dumps(body)))
            chat = self.anthropic.to_chat_completion_request(req)
            return chat.messages, None
        return body.get("messages") or [], body.get("mm_processor_kwargs")

    def items(self, route: str, body: dict, mm_embeds: bool) -> tuple[list[tuple], str | None]:
        """Each media item vLLM's parser finds in ``body``: ``(modality, data, uuid)``,
        ``data`` the URL it is loaded from (``("embedding", M)`` or ``None`` for an
        embeddings part); or the parser's refusal."""
        try:
            messages, kwargs = self.chat_messages(route, body)
            tracker = self.Tracker(self.model_config(mm_embeds))
            for msg in messages:
                self.chat_message.parse_chat_message_content(
                    msg, tracker, "openai", interleave_strings=False, mm_processor_kwargs=kwargs)
            mm_data, mm_uuids = tracker.resolve_items()
        except Exception as e:  # noqa: BLE001 - any refusal of the parser is the verdict
            return [], f"{type(e).__name__}: {e}"
        out = []
        for modality, data in (mm_data or {}).items():
            uuids = (mm_uuids or {}).get(modality) or [None] * len(data)
            out += [(modality, d, u) for d, u in zip(data, uuids)]
        return out, None


def ec_problems(ec: Any, answered: dict) -> list[str]:
    """``ec_transfer_params`` of a consumer leg, as vLLM read it, against the shape
    ``collect_ec_item_metadata`` builds and the entries the encoders answered."""
    if not isinstance(ec, dict) or not ec:
        return [f"ec_transfer_params is {ec!r}, not the encoders' entries"]
    out = []
    for key, entry in ec.items():
        if not isinstance(entry, dict):
            out.append(f"ec_transfer_params[{key!r}] is not an object")
            continue
        if entry.get("modality") not in ("image", "audio", "video"):
            out.append(f"ec_transfer_params[{key!r}].modality is {entry.get('modality')!r}")
        idx = entry.get("item_indices")
        if not (isinstance(idx, list) and idx and all(isinstance(i, int) and i >= 0 for i in idx)):
            out.append(f"ec_transfer_params[{key!r}].item_indices is {idx!r}")
        if not isinstance(entry.get("metadata"), dict):
            out.append(f"ec_transfer_params[{key!r}].metadata is {entry.get('metadata')!r}")
    if set(ec) != set(answered):
        out.append(f"ec_transfer_params keys {sorted(ec)} are not the encoders' {sorted(answered)}")
    return out


def read_ec(judge: Judge, route: str, leg: dict) -> Any:
    """``ec_transfer_params`` where the engine reads it: the sampling parameters'
    ``extra_args`` (``v1/request.py``), as the route's request model builds them
    (Messages: the chat request ``to_chat_completion_request`` makes)."""
    req = judge.models[route].model_validate(json.loads(json.dumps(leg)))
    if route == ANTHROPIC:
        req = judge.anthropic.to_chat_completion_request(req)
    params = req.to_sampling_params(64, {})
    return (params.extra_args or {}).get("ec_transfer_params")


def hash_factors(body: dict) -> bool:
    """Whether vLLM names a chat item by a hash of its uuid and the request's processor
    kwargs rather than by the uuid (``multimodal/processing/inputs.py``,
    ``get_mm_hashes``)."""
    return bool(body.get("mm_processor_kwargs") or body.get("media_io_kwargs"))


def answered_entries(answers: list) -> dict:
    """The ``ec_transfer_params`` entries the encoders answered, merged."""
    out: dict = {}
    for _, answer in answers:
        ec = json.loads(answer).get("ec_transfer_params")
        if isinstance(ec, dict):
            out.update(ec)
    return out


def consumer_ec(judge: Judge, route: str, role: str, raw: bytes, problems: list) -> tuple[bool, dict, Any]:
    """A consumer leg and its ``ec_transfer_params`` as the engine reads them; ``False``
    (and a problem noted) when they cannot be read."""
    leg = json.loads(raw)
    try:
        return True, leg, read_ec(judge, route, leg)
    except Exception as e:  # noqa: BLE001 - refused: judge_legs said so already
        problems.append(f"{role}: ec_transfer_params not read: {e}")
        return False, leg, None


def judge_exchange(judge: Judge, mm: MmJudge, setup: EpdSetup, route: str, body: dict,
                   placeholders: bool) -> tuple[list[str], int]:
    """Problems of one exchange, and how many legs were judged."""
    problems, legs = routes.exchange(setup, route, body)
    answers = setup.recorders["encode"].take_answers()
    judged = 0
    # The encoder legs.
    enc_items: list[tuple] = []
    answered: dict = {}
    if not legs["encode"]:
        problems.append("no encoder leg")
    for _, path, _, raw in legs["encode"]:
        judged += 1
        leg = json.loads(raw)
        if path.split("?")[0] != CHAT:
            problems.append(f"encoder leg went to {path}")
        refusal, facts = judge.verdict(CHAT, leg)
        if refusal is not None:
            problems.append(f"vLLM refuses the encoder leg: {refusal}")
            continue
        if facts.get("max_tokens") != 1 or facts.get("stream"):
            problems.append(f"encoder leg: max_tokens {facts.get('max_tokens')}, stream {facts.get('stream')}")
        items, refusal = mm.items(CHAT, leg, False)
        if refusal is not None:
            problems.append(f"vLLM's chat parser refuses the encoder leg: {refusal}")
        if not items:
            problems.append("an encoder leg without media items")
        if route == CHAT and any(u is None for _, _, u in items):
            problems.append("a media item of a chat encoder leg has no uuid")
        if route != CHAT and any(u is not None for _, _, u in items):
            problems.append(f"an encoder leg of {route} names an item by uuid (the consumer hashes it)")
        enc_items += items
    answered.update(answered_entries(answers))
    # The consumers' legs.
    found, _ = routes.judge_legs(judge, "nixl", route, body, {k: legs[k] for k in ("prefill", "decode")})
    problems += found
    for role in ("prefill", "decode"):
        for _, _, _, raw in legs[role]:
            judged += 1
            ok, leg, ec = consumer_ec(judge, route, role, raw, problems)
            if not ok:
                continue
            problems += [f"{role}: {p}" for p in ec_problems(ec, answered)]
            items, refusal = mm.items(route, leg, placeholders)
            if refusal is not None:
                problems.append(f"{role}: vLLM's chat parser refuses the leg: {refusal}")
                continue
            if placeholders:
                # Without --enable-mm-embeds the engine refuses the placeholders.
                _, plain = mm.items(route, leg, False)
                if plain is None and any(d is None or isinstance(d, tuple) for _, d, _ in items):
                    problems.append(f"{role}: placeholders accepted without --enable-mm-embeds")
            if route == CHAT:
                uuids = [u for _, _, u in items]
                if None in uuids:
                    problems.append(f"{role}: a media item has no uuid")
                if hash_factors(body):
                    # Keys are vLLM's hashes of uuid and kwargs, one per distinct item.
                    if isinstance(ec, dict) and len(set(uuids)) != len(ec):
                        problems.append(f"{role}: {len(set(uuids))} items, {len(ec)} entries")
                elif isinstance(ec, dict) and set(uuids) != set(ec):
                    problems.append(f"{role}: item uuids {sorted(map(str, uuids))} are not ec_transfer_params' keys {sorted(ec)}")
                by_uuid = {u: (m, d) for m, d, u in enc_items}
                for m, d, u in items:
                    if u not in by_uuid:
                        problems.append(f"{role}: item {u} was not on an encoder leg")
                    elif by_uuid[u][0] != m:
                        problems.append(f"{role}: item {u} is {m}, the encoder's {by_uuid[u][0]}")
                    elif d is not None and not isinstance(d, tuple) and by_uuid[u][1] != d:
                        problems.append(f"{role}: item {u} is not the media the encoder got")
                    elif (placeholders and not hash_factors(body) and m in ("image", "audio", "video")
                          and not (d is None or isinstance(d, tuple))):
                        problems.append(f"{role}: item {u} still carries its media")
            else:
                mine = sorted((m, str(d), u) for m, d, u in items)
                theirs = sorted((m, str(d), u) for m, d, u in enc_items)
                if mine != theirs:
                    problems.append(f"{role}: its items are not the encoder legs' (the hashes differ)")
    return problems, judged


class PushJudge:
    """vLLM 0.33's Mooncake EC connector (``distributed/ec_transfer/ec_connector/
    mooncake/scheduler.py``, ``ECMooncakeScheduler``) on the push legs: its own
    ``_request_transfer_id`` gives the transfer id each item of a request is pushed
    under (an encoder, ``_prepare_push_spec``) or waited for (the consumer,
    ``ensure_cache_available``), from the request's ``ec_transfer_params`` and its items'
    identifiers; ``consumer_zmq`` is where an encoder pushes them."""

    def __init__(self) -> None:
        from vllm.distributed.ec_transfer.ec_connector.mooncake.scheduler import ECMooncakeScheduler

        self.transfer_id = ECMooncakeScheduler._request_transfer_id

    def ids(self, ec: Any, identifiers: list[str]) -> list[str | None]:
        """The transfer id vLLM takes for each item of a request."""
        import types

        req = types.SimpleNamespace(
            ec_transfer_params=ec,
            mm_features=[types.SimpleNamespace(identifier=i) for i in identifiers])
        return [self.transfer_id(req, i) for i in range(len(identifiers))]


def identifier(route: str, body: dict, item: tuple) -> str:
    """What this conformance run can name an item by on both sides: on chat without
    processor kwargs vLLM's own identifier, the uuid; elsewhere a stand-in that is the
    same for the same media (vLLM's is a hash of the loaded media and kwargs)."""
    modality, data, uuid = item
    if route == CHAT and not hash_factors(body) and uuid is not None:
        return uuid
    return f"{modality}:{data}"


def judge_push(judge: Judge, mm: MmJudge, push: PushJudge, setup: EpdSetup, route: str,
               body: dict) -> tuple[list[str], int]:
    """Problems of one exchange in Mooncake EC push mode, and how many legs were judged."""
    problems, legs = routes.exchange(setup, route, body)
    answers = setup.recorders["encode"].take_answers()
    judged = 0
    zmq = f"tcp://127.0.0.1:{setup.ec_port}"
    pushed: dict[str, str] = {}  # item identifier -> the transfer id its encoder pushes under
    every_id: list[str] = []
    if not legs["encode"]:
        problems.append("no encoder leg")
    for _, path, _, raw in legs["encode"]:
        judged += 1
        leg = json.loads(raw)
        refusal, _ = judge.verdict(CHAT, leg)
        if refusal is not None:
            problems.append(f"vLLM refuses the encoder leg: {refusal}")
            continue
        ec = read_ec(judge, CHAT, leg)
        items, refusal = mm.items(CHAT, leg, False)
        if refusal is not None or not items:
            problems.append(f"vLLM's chat parser on the encoder leg: {refusal or 'no item'}")
            continue
        if not isinstance(ec, dict):
            problems.append(f"encoder leg: ec_transfer_params is {ec!r}")
            continue
        if ec.get("consumer_zmq") != zmq:
            problems.append(f"encoder leg: consumer_zmq {ec.get('consumer_zmq')!r}, the consumer listens at {zmq}")
        idents = [identifier(route, body, it) for it in items]
        ids = push.ids(ec, idents)
        if None in ids:
            problems.append(f"encoder leg: vLLM finds no transfer id for item(s) {[i for i, t in zip(idents, ids) if t is None]}"
                            " and would push under an id of its own the consumer never waits for")
        for ident, tid in zip(idents, ids):
            if tid is not None:
                pushed.setdefault(ident, tid)
                every_id.append(tid)
    if len(set(every_id)) != len(every_id):
        problems.append(f"transfer ids repeat across the encoder legs: {every_id}")
    answered = answered_entries(answers)
    found, _ = routes.judge_legs(judge, "nixl", route, body, {k: legs[k] for k in ("prefill", "decode")})
    problems += found
    for _, _, _, raw in legs["prefill"]:
        judged += 1
        ok, leg, ec = consumer_ec(judge, route, "prefill", raw, problems)
        if not ok:
            continue
        if not isinstance(ec, dict) or not isinstance(ec.get("ec_items"), list):
            problems.append(f"prefill: ec_transfer_params is {ec!r}, not {{ec_items: [...]}}")
            continue
        if "consumer_zmq" in ec:
            problems.append("prefill: the consumer's leg names a consumer_zmq (it would push)")
        entries = ec["ec_items"]
        if sorted(e.get("mm_hash") for e in entries) != sorted(answered):
            problems.append(f"prefill: ec_items name {sorted(e.get('mm_hash') for e in entries)}, the encoders answered {sorted(answered)}")
        if sorted(e.get("transfer_id") for e in entries) != sorted(set(pushed.values())):
            problems.append("prefill: ec_items' transfer ids are not those the encoders push under")
        items, refusal = mm.items(route, leg, "--encode-placeholders" in setup.args)
        if refusal is not None:
            problems.append(f"prefill: vLLM's chat parser refuses the leg: {refusal}")
            continue
        if route == CHAT and not hash_factors(body):
            # vLLM's own identifiers on both sides: the consumer must wait for each item
            # under the id its encoder pushes it with.
            idents = [u for _, _, u in items]
            for ident, tid in zip(idents, push.ids(ec, idents)):
                if tid is None:
                    problems.append(f"prefill: vLLM finds no transfer id for item {ident}")
                elif pushed.get(ident) != tid:
                    problems.append(f"prefill: item {ident} waited for as {tid}, pushed as {pushed.get(ident)}")
    return problems, judged


def run_setup(judge: Judge, mm: MmJudge, setup: EpdSetup, cases) -> tuple[int, int, int]:
    """(violations, cases, legs judged)."""
    failures = legs = 0
    placeholders = "--encode-placeholders" in setup.args
    for route, name, body in cases:
        label = f"{'nixl+Ep' if setup.push else 'nixl+E':8} {route:24} {name}"
        verdict, _ = judge.verdict(route, body)
        if verdict is not None:
            print(f"SETUP    {label}: vLLM refuses the client's body ({verdict})")
            failures += 1
            continue
        if setup.push:
            problems, judged = judge_push(judge, mm, PushJudge(), setup, route, body)
        else:
            problems, judged = judge_exchange(judge, mm, setup, route, body, placeholders)
        legs += judged
        failures += report(f"{label} ({judged} legs)", problems)
    return failures, len(cases), legs


def run(binary: str) -> int:
    judge = Judge()
    mm = MmJudge()
    failures = cases = legs = 0
    for args, batch, push in (([], CASES, False), (["--encode-placeholders"], PLACEHOLDER_CASES, False),
                              ([], CASES, True), (["--encode-placeholders"], PLACEHOLDER_CASES, True)):
        setup = EpdSetup(binary, args, push)
        try:
            f, c, n = run_setup(judge, mm, setup, batch)
        finally:
            setup.close()
        failures, cases, legs = failures + f, cases + c, legs + n
    print(f"\n{cases} cases, {legs} legs judged")
    print(f"{failures} violation(s)" if failures else "every E/P/D leg accepted by vLLM 0.33")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy", required=True, help="the disagg-proxy binary")
    args = ap.parse_args()
    return run(args.proxy)


if __name__ == "__main__":
    sys.exit(main())
