"""The verdict of vLLM 0.33 and SGLang 0.5.23 on one request body, from their own code.

Each verdict walks a body through the same steps the engine's OpenAI server takes, as
far as they can run without a model or a GPU, and stops at the first one that refuses
it:

vLLM (``vllm/entrypoints/openai/{chat_completion,completion}/serving.py``):

  parse     the pydantic request model, ``ChatCompletionRequest`` /
            ``CompletionRequest`` ``model_validate`` (what FastAPI checks before the
            handler runs; its validators are in ``…/chat_completion/protocol.py`` and
            ``…/completion/protocol.py``)
  handler   ``OpenAIServingCompletion._create_completion``'s own check (stream with beam
            search) and ``OnlineRenderer.render_completion``'s (``renderers/
            online_renderer.py``: suffix, echo), run on stand-ins for the model
  render    ``build_tok_params``: ``TokenizeParams.__post_init__`` refuses a token limit
            above ``max_model_len`` (``renderers/params.py``)
  sampling  ``get_max_tokens`` (``entrypoints/serve/utils/api_utils.py``), then
            ``to_sampling_params`` or ``to_beam_search_params``: ``SamplingParams.
            _verify_args`` and ``BeamSearchParams.__post_init__`` (``sampling_params.py``)
  engine    ``InputProcessor._validate_params`` (``v1/engine/input_processor.py``), which
            calls ``SamplingParams.verify``: ``_validate_logprobs`` (``--max-logprobs``,
            vocabulary), ``_validate_stop_token_ids``, ``_validate_logit_bias``,
            ``_validate_allowed_token_ids``, ``_validate_structured_outputs`` (xgrammar);
            and ``process_inputs``' range check of the ``X-data-parallel-rank`` header.
            With beam search, the per-step ``SamplingParams`` that ``beam_search``
            (``entrypoints/generate/beam_search/online.py``) sends to the engine.

SGLang (``sglang/srt/entrypoints/openai/serving_{chat,completions}.py``):

  parse     ``ChatCompletionRequest`` / ``CompletionRequest`` ``model_validate``
            (``entrypoints/openai/protocol.py``; migrates ``data_parallel_rank`` to
            ``routed_dp_rank``)
  handler   ``_validate_request`` of the serving class
  sampling  ``ChatCompletionRequest.to_sampling_params`` /
            ``OpenAIServingCompletion._build_sampling_params``, then
            ``GenerateReqInput.normalize_batch_and_arguments`` (``managers/io_struct.py``),
            the ``X-Data-Parallel-Rank`` header read by ``extract_routed_dp_rank_from_header``
  engine    ``SamplingParams(**…).normalize(None)`` and ``.verify(vocab_size)``
            (``sampling/sampling_params.py``), as ``TokenizerManager.
            _create_tokenized_object`` does

The model stand-ins (``ModelShape``) carry only what those steps read: context length,
vocabulary size, ``--max-logprobs``, data-parallel size.

Only the standard library and the engines' own packages are used. Importing vLLM takes
about 15 s (it imports torch); each engine is imported once, when its class is built.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the engine's checks read of the served model and the server's flags."""

    # vLLM --max-model-len / SGLang context length. 8192 is a common small-model value.
    max_model_len: int = 8192
    # A Llama-2-sized vocabulary: token ids >= this are out of vocabulary.
    vocab_size: int = 32000
    # vLLM --max-logprobs (ModelConfig.max_logprobs, default 20 in vllm/config/model.py).
    max_logprobs: int = 20
    # Data-parallel ranks an engine runs; X-data-parallel-rank must be below it.
    dp_size: int = 4
    # Tokens the stand-in prompt counts for get_max_tokens (no tokenizer is loaded).
    prompt_len: int = 16


@dataclass
class Verdict:
    """One engine's answer to one body: accepted, or refused at a stage with a message."""

    engine: str
    ok: bool
    stage: str = ""
    message: str = ""
    param: str | None = None
    # The HTTP status the engine's server answers a refusal with.
    status: int = 200
    # The JSON body the engine's server answers a refusal with (its own error format).
    error_body: dict | None = None
    # Facts read from the request on the way (stream, effective DP ranks, rooms, ...).
    facts: dict = field(default_factory=dict)

    def short(self) -> str:
        """``ok`` or ``stage: message`` on one line, cut to a readable length."""
        if self.ok:
            return "ok"
        msg = " ".join(self.message.split())
        if len(msg) > 110:
            msg = msg[:107] + "..."
        return f"{self.stage}: {msg}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# Bodies are validated on a deep copy: the engines' "before" validators may mutate the
# dict they are given (vLLM's check_tool_usage sets tool_choice, SGLang migrates
# data_parallel_rank), and the caller's body must stay what was sent.
def _copy(body: Any) -> Any:
    return copy.deepcopy(body)


def _quiet() -> None:
    """Silence the engines' import-time chatter so the table stays readable."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


class Headers(dict):
    """A case-insensitive header map with the ``.get`` a Starlette request offers."""

    def __init__(self, items: dict | None = None):
        super().__init__({k.lower(): v for k, v in (items or {}).items()})

    def get(self, key, default=None):
        return super().get(key.lower(), default)


def _raw_request(headers: dict | None) -> Any:
    """The slice of a Starlette ``Request`` the engines' header readers use."""
    return types.SimpleNamespace(headers=Headers(headers))


# === vLLM ===


class Vllm:
    """vLLM 0.33's verdict on a chat or completions body (see the module docs)."""

    name = "vllm"

    def __init__(self, shape: ModelShape = ModelShape()):
        _quiet()
        self.shape = shape
        from pydantic import ValidationError
        from vllm.entrypoints.generate.base.serving import GenerateBaseServing
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
        from vllm.entrypoints.serve.exception_handling.handlers import validation
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.exceptions import VLLMError
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.sampling_params import BeamSearchParams, SamplingParams
        from vllm.v1.engine.input_processor import InputProcessor

        logging.disable(logging.WARNING)
        self.ValidationError = ValidationError
        # What vLLM's server turns into a 4xx: its own client errors (raised even from
        # "before" validators, where they escape pydantic) and the plain ValueError /
        # TypeError / OverflowError that create_error_response maps to 400.
        self.errors = (VLLMError, ValueError, TypeError, OverflowError)
        self.models = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
        self.get_max_tokens = get_max_tokens
        self.create_error_response = create_error_response
        self.validation = validation
        self.SamplingParams = SamplingParams
        self.BeamSearchParams = BeamSearchParams
        self.OnlineRenderer = OnlineRenderer
        self.InputProcessor = InputProcessor
        self.GenerateBaseServing = GenerateBaseServing
        self.processor = self._input_processor()
        self.renderer = self._online_renderer()

    # --- stand-ins ---

    def _model_config(self) -> Any:
        """The attributes of ``ModelConfig`` that ``SamplingParams.verify`` reads."""
        s = self.shape
        return types.SimpleNamespace(
            max_logprobs=s.max_logprobs,
            max_model_len=s.max_model_len,
            get_vocab_size=lambda: s.vocab_size,
            is_diffusion=False,
            return_sampling_mask=False,
            enable_trace_replay=False,
        )

    def _input_processor(self) -> Any:
        """An ``InputProcessor`` reduced to what ``_validate_params`` reads.

        Structured outputs are checked with the ``xgrammar`` backend (vLLM's default
        ``auto`` tries it first and needs no tokenizer for it); a truthy tokenizer
        stand-in passes the "requires a tokenizer" check.
        """
        stub = types.SimpleNamespace(
            model_config=self._model_config(),
            speculative_config=None,
            structured_outputs_config=types.SimpleNamespace(backend="xgrammar"),
            tokenizer=object(),
            vllm_config=types.SimpleNamespace(
                use_v2_model_runner=False,
                cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=False),
                reasoning_config=None,
                watermark_config=None,
            ),
            diffusion_config=None,
            # Custom logits processors are a server option; none are loaded here.
            validate_logits_processors_params=lambda params: None,
            # No watermarking on the stand-in engine.
            resolve_watermarking=lambda params: False,
        )
        return stub

    def _online_renderer(self) -> Any:
        """An ``OnlineRenderer`` whose model has no FIM rendering and no tokenizer."""

        async def preprocess_completion(request, **kwargs):
            return []

        stub = types.SimpleNamespace(
            renderer=types.SimpleNamespace(render_completion_suffix=lambda p, s: None),
            preprocess_completion=preprocess_completion,
        )
        stub.create_error_response = lambda *a, **k: self.OnlineRenderer.create_error_response(
            stub, *a, **k
        )
        return stub

    # --- the verdict ---

    def verdict(self, api: str, body: Any, headers: dict | None = None) -> Verdict:
        """Walk ``body`` through vLLM's request path for ``api`` ("chat"/"completions")."""
        v = Verdict(engine=self.name, ok=False)
        model = self.models[api]
        # parse: FastAPI validates the JSON body against the request model first.
        try:
            req = model.model_validate(_copy(body))
        except self.ValidationError as e:
            return self._parse_refusal(v, e)
        except self.errors as e:  # a vLLM error raised by a validator escapes pydantic
            return self._refusal(v, "parse", e)
        v.facts["stream"] = bool(req.stream)
        v.facts["use_beam_search"] = bool(req.use_beam_search)
        # handler: the completions handler's own checks, before rendering.
        if api == "completions":
            if req.stream and req.use_beam_search:
                # OpenAIServingCompletion._create_completion
                return self._refusal(
                    v, "handler", "Streaming is not currently supported with beam search"
                )
            err = asyncio.run(self.OnlineRenderer.render_completion(self.renderer, req))
            if not isinstance(err, list):
                return self._error_response(v, "handler", err)
        # render: the token-limit check of the tokenizer parameters.
        try:
            req.build_tok_params(self._model_config())
        except self.errors as e:
            return self._refusal(v, "render", e)
        # sampling: max-token resolution, then the request's sampling parameters.
        try:
            if api == "chat":
                limit = (
                    req.max_completion_tokens
                    if req.max_completion_tokens is not None
                    else req.max_tokens
                )
            else:
                limit = req.max_tokens
            max_tokens = self.get_max_tokens(
                self.shape.max_model_len,
                limit,
                self.shape.prompt_len,
                {},
                None,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
            if req.use_beam_search:
                params = req.to_beam_search_params(max_tokens, {})
            else:
                params = req.to_sampling_params(max_tokens, {})
        except self.errors as e:
            return self._refusal(v, "sampling", e)
        # engine: what AsyncLLM's input processor checks before queueing the request.
        try:
            if isinstance(params, self.BeamSearchParams):
                # beam_search() sends one-token requests asking 2 * beam_width logprobs.
                step = self.SamplingParams(
                    logprobs=2 * params.beam_width,
                    max_tokens=1,
                    temperature=params.temperature,
                    watermarking=False,
                    detokenize=False,
                )
                self.InputProcessor._validate_params(self.processor, step, ("generate",))
            else:
                self.InputProcessor._validate_params(self.processor, params, ("generate",))
            rank = self.GenerateBaseServing._get_data_parallel_rank(_raw_request(headers))
            v.facts["dp_rank"] = rank
            # InputProcessor.process_inputs: the header's rank must name a local rank.
            if rank is not None and not 0 <= rank < self.shape.dp_size:
                raise self._validation_error(
                    f"data_parallel_rank {rank} is out of range [0, {self.shape.dp_size})."
                )
        except self.errors as e:
            return self._refusal(v, "engine", e)
        v.ok = True
        v.facts["max_tokens"] = params.max_tokens
        v.facts["kv_transfer_params"] = req.kv_transfer_params
        return v

    def _validation_error(self, message: str) -> Exception:
        from vllm.exceptions import VLLMValidationError

        return VLLMValidationError(message)

    def _parse_refusal(self, v: Verdict, e: Exception) -> Verdict:
        """A request-model failure, answered as vLLM's validation_exception_handler does."""
        errors = e.errors()
        v.stage = "parse"
        v.status = 400
        first = errors[0] if errors else {}
        ctx = first.get("ctx", {}).get("error") if isinstance(first, dict) else None
        v.message = str(ctx) if ctx is not None else str(first.get("msg", e))
        v.param = getattr(ctx, "parameter", None)
        if v.param is None and first.get("loc"):
            v.param = self.validation.clean_loc_for_param(tuple(first["loc"]))
        label = "error" if len(errors) == 1 else "errors"
        text = f"{len(errors)} validation {label}:\n" + "".join(
            f"  {self.validation._format_error(err)}\n" for err in errors[:5]
        )
        v.error_body = {
            "error": {
                "message": text.rstrip(),
                "type": "Bad Request",
                "param": v.param,
                "code": 400,
            }
        }
        return v

    def _refusal(self, v: Verdict, stage: str, e: Exception | str) -> Verdict:
        """Any later refusal, answered through vLLM's own ``create_error_response``."""
        return self._error_response(v, stage, self.create_error_response(e))

    def _error_response(self, v: Verdict, stage: str, resp: Any) -> Verdict:
        body = resp.model_dump()
        v.stage = stage
        v.status = int(body["error"]["code"])
        v.message = body["error"]["message"]
        v.param = body["error"].get("param")
        v.error_body = body
        return v


# === SGLang ===


class _ByteTokenizer:
    """A tokenizer stand-in: one token per UTF-8 byte.

    ``SamplingParams.normalize`` only measures stop strings with it (and refuses stop
    strings and ``min_new_tokens`` without any tokenizer, the skip_tokenizer_init mode).
    """

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


class Sglang:
    """SGLang 0.5.23's verdict on a chat or completions body (see the module docs)."""

    name = "sglang"

    def __init__(self, shape: ModelShape = ModelShape()):
        _quiet()
        self.shape = shape
        from pydantic import ValidationError
        from sglang.srt.entrypoints.openai import protocol, serving_chat
        from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.entrypoints.openai.serving_completions import (
            OpenAIServingCompletion,
        )
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        logging.disable(logging.WARNING)
        self.ValidationError = ValidationError
        self.models = {
            "chat": protocol.ChatCompletionRequest,
            "completions": protocol.CompletionRequest,
        }
        # _validate_request reads the published server configuration; these stand-ins
        # publish the two values it needs (context length, no auto-truncation, no
        # request-supplied chat templates: the server defaults).
        serving_chat.get_model = lambda: types.SimpleNamespace(context_length=shape.max_model_len)
        serving_chat.get_serving = lambda: types.SimpleNamespace(
            trust_request_chat_template=False, allow_auto_truncate=False
        )
        self.Base = OpenAIServingBase
        self.Chat = OpenAIServingChat
        self.Completion = OpenAIServingCompletion
        self.GenerateReqInput = GenerateReqInput
        self.SamplingParams = SamplingParams
        chat = types.SimpleNamespace(
            is_minimax_m3=False,
            tokenizer_manager=types.SimpleNamespace(
                model_config=types.SimpleNamespace(is_multimodal=False)
            ),
        )
        chat._validate_media_content = lambda r: OpenAIServingChat._validate_media_content(chat, r)
        chat._effective_tools = lambda r: OpenAIServingChat._effective_tools(chat, r)
        self.chat = chat

    def verdict(self, api: str, body: Any, headers: dict | None = None) -> Verdict:
        """Walk ``body`` through SGLang's OpenAI request path for ``api``."""
        v = Verdict(engine=self.name, ok=False)
        try:
            req = self.models[api].model_validate(_copy(body))
        except self.ValidationError as e:
            errors = e.errors()
            first = errors[0] if errors else {}
            loc = ".".join(str(p) for p in first.get("loc", ()))
            msg = f"{loc}: {first.get('msg', e)}" if loc else str(first.get("msg", e))
            # FastAPI's default handler: 422 with pydantic's error list. SGLang's
            # http_server registers its own handler answering 400 in OpenAI's format.
            return self._refusal(v, "parse", msg)
        except (ValueError, TypeError) as e:
            return self._refusal(v, "parse", str(e))
        v.facts["stream"] = bool(req.stream)
        # handler: OpenAIServingBase.handle_request answers 400 with this message.
        try:
            if api == "chat":
                error = self.Chat._validate_request(self.chat, req)
            else:
                error = self.Completion._validate_request(None, req)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            return self._refusal(v, "handler", error)
        try:
            rank = self.Base.extract_routed_dp_rank_from_header(
                None, _raw_request(headers), req.routed_dp_rank
            )
        except Exception as e:  # fastapi.HTTPException: a non-integer header
            return self._refusal(v, "handler", getattr(e, "detail", str(e)))
        v.facts["routed_dp_rank"] = rank
        v.facts["disagg_prefill_dp_rank"] = req.disagg_prefill_dp_rank
        # sampling: the sampling dict and the internal request, as _convert_to_internal_request.
        try:
            if api == "chat":
                stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
                sampling = req.to_sampling_params(stop, {}, None)
                prompt = {"text": "stand-in prompt"}
                logprobs = dict(
                    return_logprob=req.logprobs,
                    top_logprobs_num=req.top_logprobs or 0,
                    logprob_start_len=-1,
                )
            else:
                sampling = self.Completion._build_sampling_params(None, req)
                p = req.prompt
                prompt = (
                    {"text": p}
                    if isinstance(p, str) or (isinstance(p, list) and isinstance(p[0], str))
                    else {"input_ids": p}
                )
                logprobs = dict(
                    return_logprob=req.logprobs is not None,
                    top_logprobs_num=req.logprobs if req.logprobs is not None else 0,
                    logprob_start_len=0 if req.echo and req.logprobs else -1,
                )
            gen = self.GenerateReqInput(
                **prompt,
                sampling_params=sampling,
                stream=req.stream,
                bootstrap_host=req.bootstrap_host,
                bootstrap_port=req.bootstrap_port,
                bootstrap_room=req.bootstrap_room,
                routed_dp_rank=rank,
                disagg_prefill_dp_rank=req.disagg_prefill_dp_rank,
                rid=req.rid,
                **logprobs,
            )
            gen.normalize_batch_and_arguments()
        except (ValueError, TypeError) as e:
            return self._refusal(v, "sampling", str(e))
        v.facts["bootstrap_room"] = gen.bootstrap_room
        v.facts["batch"] = 1 if gen.is_single else len(gen.rid)
        # engine: TokenizerManager._create_tokenized_object, per request of the batch.
        try:
            per_request = gen.sampling_params
            if isinstance(per_request, dict):
                per_request = [per_request]
            for sp in per_request:
                params = self.SamplingParams(**sp)
                params.normalize(_ByteTokenizer())
                params.verify(self.shape.vocab_size)
        except (ValueError, TypeError) as e:
            return self._refusal(v, "engine", str(e))
        v.ok = True
        return v

    def _refusal(self, v: Verdict, stage: str, message: str) -> Verdict:
        # OpenAIServingBase.create_error_response: {"object": "error", "message", "type",
        # "param", "code"} with status 400 for validation failures.
        v.stage = stage
        v.status = 400
        v.message = message
        v.error_body = {
            "object": "error",
            "message": message,
            "type": "BadRequest",
            "param": None,
            "code": 400,
        }
        return v


def engines_for(connector: str) -> str:
    """Which engine a connector's legs are sent to."""
    return "sglang" if connector == "sglang" else "vllm"


def dump(obj: Any) -> str:
    """Compact JSON for tables and logs."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=False, default=str)
