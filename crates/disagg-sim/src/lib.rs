//! Simulated LLM engines that behave, on the wire, like a vLLM OpenAI server
//! running the NIXL, Mooncake or LMCache connector, or an SGLang server in
//! disaggregation mode, for the `disagg` demo, integration tests and
//! benchmarks.
//!
//! A [`SimEngine`] serves `POST /v1/chat/completions` and
//! `POST /v1/completions` (streamed or not, chunk for chunk as vLLM 0.33
//! streams them: a role-only first chat chunk, then content chunks, with
//! every field vLLM sets), `POST /tokenize`, `GET /health`, `GET /v1/models`
//! and `GET /stats` over real HTTP/1.1 on a loopback port, and the rest of
//! the surface a proxy passes through (see [Other routes](#other-routes)). Its "model" is a deterministic function of the prompt (see
//! [`generate`]), so a prompt gets the same answer whether it is served in
//! one piece or disaggregated.
//!
//! # Tokens
//!
//! The engine's tokenizer ([`tokenize`]) makes one token per
//! whitespace-separated word, whose id is a stable hash of the word (below
//! [`VOCAB_SIZE`]; [`EOS_TOKEN_ID`] is the end-of-sequence token). The
//! answer is seeded from the prompt's token ids, so a completion request
//! whose `prompt` is a list of ids is answered exactly like the text that
//! tokenizes to them, and a chat request exactly like a completion request
//! whose prompt is the tokenized conversation ([`generate_from_ids`] predicts
//! either). Generated words have ids too: their tokenization. Ids outside the
//! vocabulary are rejected with 400, like vLLM.
//!
//! Each token is drawn from the whole sequence before it (the prompt's ids and the ids
//! generated so far), not from the prompt and a position: a prompt that is an earlier
//! prompt followed by the ids generated for it goes on with exactly the tokens the
//! unbroken answer had next, which is what a proxy's mid-stream migration needs to be
//! checked against. With `return_token_ids: true` a stream carries each chunk's new id
//! in its choice's `token_ids` (the EOS id too), and the prompt's ids on each choice's
//! first chunk (chat: top-level `prompt_token_ids` on every role chunk; completions: the
//! choice's), as vLLM 0.33 writes
//! them (`vllm/entrypoints/openai/chat_completion/serving.py`,
//! `vllm/entrypoints/openai/completion/serving.py`).
//!
//! `POST /tokenize` answers, in every mode and whatever the [`Faults`] (but
//! [`Faults::hang_tokenize`]),
//! `{"count": n, "max_model_len": M, "tokens": [ids..], "token_strs": null}`
//! for a body `{"model"?, "prompt": "text"}` or `{"model"?, "messages":
//! [..], "add_generation_prompt"?: bool}`. The chat template, shared with
//! the chat route, is the text of every message's content followed by a
//! newline (roles are not rendered and there is no assistant header, so
//! `add_generation_prompt` adds nothing). Bad input is a vLLM-style 400, an
//! unknown model a 404.
//!
//! # Other routes
//!
//! As vLLM 0.33 answers them, in every mode and whatever the [`Faults`]
//! (except where said):
//!
//! * `GET /v1/models`: the model card with every field vLLM writes (`id`,
//!   `object`, `created`, `owned_by`, `root`, `parent`, `max_model_len`,
//!   `permission`), then one card per loaded LoRA adapter (`root` its path,
//!   `parent` the base model). vLLM has no `GET /v1/models/{id}`: 404.
//! * `POST /detokenize` `{"tokens": [ids]}`: `{"prompt": text}`, the words
//!   joined by spaces. A token id is a hash of its word, so the engine gives
//!   back the words it knows: its generation vocabulary and the words it
//!   tokenized (`POST /tokenize`) since it started, at most 65,536 of them;
//!   another id comes back as `<|ID|>`. An id outside the vocabulary is a 400.
//! * `GET /version`: `{"version": "0.33.0"}`, the vLLM release followed
//!   ([`SimConfig::version`] to model another build).
//! * `GET /metrics`: the engine's counters in the Prometheus text format, named
//!   as vLLM 0.33 names them (`vllm:prompt_tokens_by_source_total` by `source`,
//!   `vllm:nixl_num_failed_transfers_total`, `vllm:nixl_num_kv_expired_reqs_total`,
//!   `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc`) or, in the SGLang modes, as SGLang 0.5.23 does
//!   (`sglang:realtime_tokens_total` by `mode`, `sglang:num_transfer_failed_reqs_total`,
//!   `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`). The
//!   prompt-token split is true: a decode that pulled its KV counts the prompt as
//!   `external_kv_transfer`, one that computed it as `local_compute`; so are the
//!   request counts: waiting are the requests queued for their rank's prefill slot
//!   ([`SimConfig::serial_prefill`]) or for a place among the engine's running
//!   requests ([`SimConfig::max_num_seqs`]) ([`Stats::waiting_requests`]), running
//!   every other request in progress.
//!   [`Faults::lose_handoff`], [`Faults::fail_transfers`] and a short
//!   [`SimConfig::kv_lease`] make a decode recompute, transfers fail and a
//!   prefill's KV expire unclaimed; [`Faults::metrics`] makes the answer huge, slow
//!   or garbage. Counted in [`Stats::metrics_requests`].
//! * `POST /v1/embeddings`: one deterministic unit vector of 8 dimensions per
//!   input (a string, a list of strings, token ids or lists of them), as
//!   floats or `"encoding_format": "base64"`, in vLLM's `EmbeddingResponse`.
//! * `POST /v1/responses`: the Responses API over the same generation as a
//!   completion of the `instructions` and `input` text; streamed, the event
//!   sequence vLLM emits for a text answer (`response.created`,
//!   `response.in_progress`, `response.output_item.added`,
//!   `response.content_part.added`, one `response.output_text.delta` per token,
//!   `response.output_text.done`, `response.content_part.done`,
//!   `response.output_item.done`, `response.completed` or
//!   `response.incomplete`), each as `event: TYPE` and `data: {...}` with its
//!   `sequence_number`. [`Faults::stall_after_chunks`] stalls the stream.
//!   It takes part in the engine's KV protocol as chat does (a prefill answers
//!   the top-level `kv_transfer_params`, a decode pulls the KV it names), and so
//!   do vLLM's `POST /inference/v1/generate` (token-in, token-out) and
//!   `POST /v1/messages` (Anthropic's API) and `POST /cohere/v2/chat` (Cohere's),
//!   each with its answers, stream and error shape:
//!   the `gen_apis` module's facts in the source.
//! * Admin routes: `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`,
//!   `load_inplace`; vLLM's checks and answers) and
//!   `POST /v1/unload_lora_adapter` keep the engine's adapters
//!   ([`SimEngine::lora_adapters`]); a request whose `model` names a loaded adapter
//!   is served as one naming the base model, its answer naming the adapter as its
//!   `model`, as vLLM's does; `POST /reset_prefix_cache` empties the
//!   prefix cache. [`Faults::admin_status`] makes them fail, changing nothing.
//! * SGLang engines ([`KvMode::Sglang`], both roles): `POST /generate`,
//!   SGLang's native API, with the same bootstrap fields, rooms, ranks and
//!   checks as the completion routes (a `text` list or an `input_ids` list of
//!   lists is a batch, sampled `sampling_params.n` times, one room per
//!   prompt and sample); see the `native` module's
//!   facts in the source. A vLLM engine answers 404.
//!
//! # Request validation
//!
//! A completion request is refused with 400, in vLLM's error shape, exactly
//! where the engine of the [`KvMode`] refuses it, before any KV work.
//!
//! * **Types**, in every mode: fields are coerced like pydantic v2's lax mode,
//!   which both engines' request models use. A boolean may be `true`,
//!   `false`, `0`, `1`, `0.0`, `1.0` or one of the strings `"1"`, `"on"`,
//!   `"t"`, `"true"`, `"y"`, `"yes"`, `"0"`, `"off"`, `"f"`, `"false"`,
//!   `"n"`, `"no"` (any case), so `"stream": "yes"` streams and
//!   `"stream": "off"` does not, while `"stream": "maybe"` or `2` is a 400.
//!   An integer may be a JSON integer, a boolean, a float without fraction
//!   (`2.0`) or a numeric string (`"2"`, `" 2 "`, `"+3"`, `"1_000"`,
//!   `"2.0"`), but not `1.5`, `"2.5"`, `"abc"` or `"1e3"`. A string is only
//!   a string (`"stop": 5` is refused); `stop_token_ids` must be a list of
//!   integers. `null` is "not given". These rules were checked against
//!   pydantic 2.13 itself.
//! * **vLLM** ([`KvMode::Nixl`], [`KvMode::NixlPush`], [`KvMode::Mooncake`],
//!   [`KvMode::Lmcache`]), as vLLM 0.33 refuses (its request models'
//!   `mode="before"` validators in
//!   `vllm/entrypoints/openai/chat_completion/protocol.py` and
//!   `.../completion/protocol.py`, which read the raw body with Python
//!   truthiness, then `SamplingParams._verify_args` in
//!   `vllm/sampling_params.py`, then the engine's `--max-logprobs`):
//!   - chat `logprob_token_ids` needs a truthy `logprobs` (and no beam
//!     search, and is not empty); chat `top_logprobs` is at least 0 (or -1)
//!     and, when not 0, needs a truthy `logprobs`;
//!   - `stream_options` (unless an empty object) needs a truthy `stream`;
//!     `prompt_logprobs` above 0 (or -1) is refused with a truthy `stream`;
//!     completions' `logprobs` is at least 0;
//!   - `max_tokens` / `max_completion_tokens` at least 1; `n` at least 1 (at
//!     most 128), and `n > 1` with a `temperature` below 1e-5 (greedy) is
//!     refused; `temperature` finite and within `[0, 2]`; no empty string in
//!     `stop`; `min_tokens` from 0 to `max_tokens`;
//!   - more logprobs per token than [`SimConfig::max_logprobs`] (default 20,
//!     `-1` counting as the whole vocabulary), for generated tokens
//!     (`top_logprobs` with `logprobs: true`, completions' `logprobs`) or
//!     prompt tokens (`prompt_logprobs`);
//!   - a `response_format` of type `json_schema` without its `json_schema`,
//!     of an unknown type, or `structured_outputs` with more than one of
//!     `json`, `regex`, `choice`.
//!
//!   With `use_beam_search: true` vLLM builds beam-search parameters, which
//!   skip the temperature and greedy rules.
//! * **SGLang** ([`KvMode::Sglang`]), as SGLang 0.5.23 is laxer: it serves
//!   `max_tokens: 0` (an answer without tokens), `n: 0` (one choice),
//!   `temperature: 3`, and `top_logprobs: 50` with or without `logprobs`. It
//!   keeps the `stream_options`, `min_tokens` and negative-value checks.
//! * **Size**, in every mode and on every generation route (SGLang's `/generate` and
//!   vLLM's `/inference/v1/generate` included): the simulator builds every choice of
//!   a request before it answers, so it refuses, with a 400, a request of more than
//!   1024 choices (prompts × `n`; a list of more than 1024 prompts before it is
//!   tokenized) or of more than 2^22 (4,194,304) tokens to generate (choices × the
//!   completion's token limit). The engines have no such ceilings; no real client
//!   comes near them.
//!
//! # Beam search and structured output (vLLM)
//!
//! A vLLM engine serves `use_beam_search: true` with beam-search
//! parameters, which carry no `kv_transfer_params` (`to_beam_search_params`
//! in vLLM's request models): neither role reads them. A NIXL or NIXL push
//! prefill then keeps no KV and answers `"kv_transfer_params": null`; a
//! NIXL decode computes its prompt locally (a local prefill, not invalid
//! parameters) and pulls nothing; a Mooncake prefill needs no `transfer_id`
//! and holds nothing; a Mooncake decode needs no parameters; an LMCache
//! prefill ignores its `disagg_spec` (an LMCache decode reads no parameters
//! anyway). Such requests are counted in [`Stats::beam_search_requests`].
//!
//! A vLLM engine compiles a grammar for a request with structured output: a
//! `response_format` of type `json_object`, `json_schema` or
//! `structural_tag`, `structured_outputs`, or one of the older
//! `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields.
//! Each accepted such request is counted in [`Stats::grammars_compiled`] of
//! the engine that got it, so a test can tell which leg carried it.
//!
//! # Data-parallel ranks
//!
//! An engine has [`SimConfig::dp_size`] ranks and places each completion
//! request on one, counted in [`Stats::requests_per_dp_rank`].
//!
//! * **vLLM.** The `X-data-parallel-rank` header pins the rank (not a
//!   number, or out of range: 400). Without it, the engine's own balancer
//!   picks: the rank with the fewest requests in flight, ties broken round
//!   robin starting after the rank it chose last, as if rank 0 had just
//!   been chosen at start. vLLM's DP client also sends an unpinned request to
//!   the least loaded rank, but its counts come from the DP coordinator every
//!   100 ms; the simulator's deterministic choice makes consecutive unpinned
//!   requests land on different ranks and never favours rank 0, so that a
//!   proxy that does not pin a request it must pin fails at once. Each rank is an
//!   engine core of its own, named `"{engine_id}_dp{rank}"` when there are several
//!   ([`SimEngine::engine_ids`]; `vllm/v1/engine/core.py` `run_engine_core`). A NIXL
//!   (pull or push) engine gives each rank its own side channel, on consecutive ports
//!   (`VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`, `…/nixl/base_scheduler.py`;
//!   [`SimEngine::side_channel_addrs`]), holding only the KV computed on that rank;
//!   a prefill's handoff names the rank it ran on (its engine id and port), and a
//!   pull, release or push registration addressed to another rank fails (another
//!   engine id: the handshake is refused; the right id on the wrong rank's port:
//!   likewise; rank 0 for KV of rank 1: unknown request id). A Mooncake
//!   prefill holds the KV under the engine id of the rank the request ran
//!   on; a decode told another rank's engine id
//!   waits for the transfer until its [`SimConfig::bootstrap_timeout`] and
//!   fails with 500 `"KV transfer failed: ..."`.
//! * **SGLang** (`python/sglang/srt/entrypoints` request headers,
//!   `managers/io_struct.py`, `managers/data_parallel_controller.py`,
//!   `disaggregation/common/conn.py`). The rank of a request is the
//!   `X-Data-Parallel-Rank` header (not an integer: 400), else the body's
//!   `routed_dp_rank`, else its deprecated alias `data_parallel_rank`, else
//!   the engine's balancer: a prefill follows the bootstrap room (rank =
//!   `bootstrap_room % dp_size`), a decode takes its ranks in turn from rank
//!   0. A rank out of range is a 400. `data_parallel_rank_decode` means
//!   nothing. Each element of a batch is placed (and counted) on its own.
//!   - A prefill registers each room under its rank on its bootstrap server.
//!     With several ranks, a request pinned to a rank other than
//!     `room % dp_size` is refused at once with 500 `"KV transfer failed:
//!     follow_bootstrap_room conflict: dispatched to dp_rank R but
//!     bootstrap_room N implies dp_rank K. ..."` (SGLang's prefill-side
//!     check, counted in [`Stats::dp_rank_conflicts`]), unless the request
//!     names `disagg_prefill_dp_rank`: then the router told the decode where
//!     to look.
//!   - A decode looks for its room on the prefill rank its request names in
//!     `disagg_prefill_dp_rank` (overridden by the
//!     `x-override-disagg-prefill-dp-rank` header), else on `room %
//!     dp_size` of the prefill (`follow_bootstrap_room`). A room registered
//!     on another rank never reaches it: it waits until the prefill's
//!     bootstrap server gives up ([`SimConfig::bootstrap_timeout`]) and
//!     fails with 500 `"KV transfer failed: ... room N was not registered on
//!     dp rank K ..."`. A rank the prefill does not have fails at once
//!     (`could not fetch bootstrap info`), as SGLang's bootstrap query does.
//!
//! # Recorded requests
//!
//! [`SimEngine::requests`] keeps the last completion requests as received:
//! path, every header (e.g. `x-request-id`, `x-data-parallel-rank`,
//! `traceparent`, in order, see [`RecordedRequest::header`]) and the JSON
//! body, so a test can assert what each leg carried.
//! [`SimEngine::received`] keeps the head (method, path as it came, query,
//! headers) of every request on every route but `GET /stats` and `GET /metrics`: health checks,
//! model lists, `/tokenize`, the Responses API, unknown paths.
//!
//! Routes are matched on the percent-decoded path, as uvicorn hands it to
//! Starlette: `/%72eset_prefix_cache` is `/reset_prefix_cache`.
//!
//! # Prefill/decode disaggregation
//!
//! An engine speaks one of five P/D KV protocols, chosen by
//! [`SimConfig::kv_mode`]. In each, the KV really travels over loopback
//! sockets, so a wrong host, port, room, transfer id or engine id fails
//! where it would fail between real engines (a wrong host too, when each engine
//! listens on a loopback address of its own, [`SimConfig::bind_host`]). Every
//! completion request first
//! waits [`SimConfig::request_delay`] (scheduling), then prefills (locally,
//! [`SimConfig::prefill_delay_per_token`] per prompt token, or from remote
//! KV). A decode whose KV cannot be fetched fails with a 500
//! `"KV transfer failed: ..."` in vLLM's error shape (`InternalServerError`). In the
//! vLLM modes this is vLLM 0.33 with `kv_load_failure_policy="fail"`: the request
//! finishes with finish reason `error`, which vLLM answers with that 500 when not
//! streamed; streamed, after its 200 head, a chat answer is its role chunks, one
//! `data: {"error": {...}}` event and `data: [DONE]`, and a completions answer has
//! no chunk of the answer at all (vLLM's generator skips an output without text
//! before it reads its finish reason): only its usage chunk, if asked for, then
//! `data: [DONE]` (with `echo`, the error event then `data: [DONE]`; with
//! `"max_tokens": null`, whose assertion vLLM's generator makes first, that error's
//! event then `data: [DONE]`, no usage chunk). vLLM's
//! message is `"Internal server error"`; the simulator's says why. Streamed, a
//! `/v1/messages` or `/cohere/v2/chat` decode ends with its route's error event, and a
//! `/v1/responses` one is cut off after its opening events, as vLLM's converters of
//! those routes make them (the `kv_load_failure` module's facts in the source). A
//! decode on vLLM's `/inference/v1/generate` (its stream's failure is not modelled)
//! answers the 500 before any response head. An SGLang decode fails as SGLang 0.5.23
//! does (see [SGLang](#sglang-kvmodesglang-concurrent-by-bootstrap-room)). As vLLM's, the
//! 200 head of a streamed vLLM decode on any other of these routes that may fetch KV (a
//! NIXL pull or push decode, a Mooncake decode named a transfer, and any LMCache
//! decode, one that then prefills itself included) goes out before the fetch is tried,
//! once the request was read and checked (a bad field is still refused in its head), a
//! Responses stream's `response.created` and `response.in_progress` with it: the
//! fetch's wait is the body's, and its outcome (the answer, or the failure's stream)
//! follows in it; a client that leaves meanwhile drops the fetch. Not modelled: the
//! chunks vLLM writes after the role chunks for a chat's `echo`; and what completions'
//! `echo` with `logprobs` makes of the failed output (the simulator sends the error
//! event as for `echo` alone).
//!
//! ## vLLM NIXL ([`KvMode::Nixl`], the default): sequential
//!
//! The engine plays both roles of vLLM's NIXL pull mode:
//!
//! * **Prefill.** A request with `"kv_transfer_params":
//!   {"do_remote_decode": true}` keeps its prompt's KV blocks (one per
//!   [`SimConfig::block_size`] prompt tokens) for [`SimConfig::kv_lease`], however
//!   it finished (`"length"` or `"stop"`: vLLM 0.33's `request_finished` keeps both),
//!   and answers with a top-level `kv_transfer_params` naming them, key for key and
//!   in order as vLLM 0.33's pull scheduler writes them
//!   (`…/nixl/pull_scheduler.py`): `do_remote_prefill`, `do_remote_decode`,
//!   `remote_block_ids` (one list per KV-cache group, `[[0, 1, 2]]`: the model has
//!   one group), `remote_engine_id` (its data-parallel rank's, see
//!   [Data-parallel ranks](#data-parallel-ranks)), `remote_request_id`,
//!   `remote_host`, `remote_port` (the side channel of the rank), `tp_size`,
//!   `dcp_size`, `pp_size`, `remote_num_tokens` (the prompt's tokens),
//!   `remote_blocks_expiry_time: null` and `transfer_mode: "pull"`.
//! * **Decode.** A request carrying such parameters connects to
//!   `remote_host:remote_port`, pulls the blocks and checks them against the
//!   KV it would have computed for its own prompt. Any failure (nobody
//!   listening, wrong engine id, unknown request id, wrong block ids, block ids
//!   not given as one list per KV-cache group (vLLM 0.33's worker reads them group
//!   by group: a flat list of ids cannot be read), KV of another prompt, expired
//!   lease) fails the request like vLLM with `kv_load_failure_policy="fail"`:
//!   a 500 `"KV transfer failed: ..."`, or, streamed, the failure after the 200
//!   head (see [above](#prefilldecode-disaggregation)). Partial parameters with
//!   `do_remote_prefill` do what they do to vLLM 0.33
//!   (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`
//!   `update_state_after_alloc`): without `remote_block_ids` (or with an empty
//!   list) an assertion kills the engine core, so this request and every
//!   later one answer 500 `"The server had an error while processing your
//!   request."` and `GET /health` 503 ([`Stats::engine_core_deaths`]); with
//!   block ids but without `remote_engine_id`, `remote_request_id`,
//!   `remote_host` or `remote_port` the request waits for KV nobody sends,
//!   until its client leaves ([`Stats::stuck_kv_waits`]; streamed, after its 200
//!   head).
//!   With [`SimConfig::decode_handoff`] a decode answers with a
//!   `kv_transfer_params` of its own (`do_remote_decode: true`, its engine id,
//!   host, side-channel port and block ids), as vLLM 0.33's bidirectional
//!   NIXL does: in a whole answer, on each choice's terminal stream chunk and
//!   in a Responses answer's final `response`; it holds those blocks for
//!   [`SimConfig::decoder_kv_blocks_ttl`], and a prefill given that dict pulls
//!   them over the decode's side channel when `remote_num_tokens` reaches
//!   [`SimConfig::kv_recompute_threshold`], computing the prompt itself when
//!   the pull fails ([`Stats::bidi_pulls`], [`Stats::bidi_pull_failures`]).
//!
//! ## SGLang ([`KvMode::Sglang`]): concurrent, by bootstrap room
//!
//! The router sends the same body to a prefill and a decode at once, with
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (a `u63`). The
//! engine expands a request as SGLang 0.5.23 does
//! (`srt/managers/io_struct.py`, `normalize_batch_and_arguments` and
//! `_normalize_bootstrap_params`): B prompts (a completion request's `prompt`
//! or a `/generate` request's `text` or `input_ids` given as a list of
//! prompts; one otherwise) times `n` samples (chat and completions `n`,
//! `/generate` `sampling_params.n`). One prompt with one sample is a single
//! request, whose three fields are scalars (a list is a 400); anything else
//! is B·n elements, element `i` being prompt `i mod B`, and each field
//! becomes one value per element: null for each, a scalar for each (a room
//! `R` giving `R`, `R + 1`, ...), or a list repeated once per sample of
//! which the first B·n entries are used (too short a list is a 400). Two
//! elements with one room would collide: the request is refused (400,
//! "appears twice"). Each element's KV is that of its prompt.
//!
//! SGLang 0.5.23's own tokenizer manager then sends each prompt's samples
//! (and a `max_new_tokens: 0` warm-up) with the room of the prompt's first
//! element (`managers/tokenizer_manager.py` `_handle_batch_request`), so
//! with `n > 1` a prompt's room is taken several times and its KV transfer
//! fails whatever rooms the request carried: the simulator answers such a
//! request 500 ("Duplicate or cancelled bootstrap room"), on both sides.
//!
//! * **Prefill** (`--disaggregation-mode prefill`, with a bootstrap server at
//!   [`SimEngine::bootstrap_addr`]). `bootstrap_room` is required. After the
//!   prefill, the KV of each element is registered under its room (a room
//!   already registered by another request: 409) and the request waits until
//!   decodes took every room, at most [`SimConfig::bootstrap_timeout`] (then
//!   500 `"KV transfer failed: no decode took room R within ..."`, in SGLang's
//!   `{"object":"error",...}` body). It then
//!   answers like a plain engine, but with only the first token of each
//!   choice. Its rooms are withdrawn whenever it ends, client gone included.
//! * **Decode** (`--disaggregation-mode decode`). `bootstrap_host` and
//!   `bootstrap_room` are required, a null `bootstrap_port` means 8998
//!   (SGLang's default). It takes the KV of every element's room from
//!   `bootstrap_host:bootstrap_port`, all at once, within its own
//!   [`SimConfig::bootstrap_timeout`], checks it against its own prompt and
//!   generates normally. A failed transfer (nobody at the address, not a bootstrap
//!   server, no such room within the timeout, KV of another prompt) aborts the
//!   request as SGLang 0.5.23's decode does (finish reason `{"type": "abort",
//!   "message": "KV transfer failed: ...", "status_code": 500, "err_type": null}`):
//!   not streamed, a 500 in SGLang's `ErrorResponse` shape,
//!   `{"object":"error","message":...,"type":"500","param":null,"code":500}`; a
//!   streamed `/generate` gets its 200 head before the fetch, then one event per
//!   element with that finish reason in `meta_info` (no text, no token) and
//!   `data: [DONE]`; a streamed chat or completions request gets its 200 head with the
//!   failure, one `data: {"error": {...}}` event (`"type": "INTERNAL_SERVER_ERROR"`,
//!   `"code": 500`), the usage chunk if asked for, then `data: [DONE]`. A client
//!   relaying such a stream must not count it served for its `200` or its `[DONE]`.
//!
//! ## vLLM Mooncake ([`KvMode::Mooncake`]): concurrent, by transfer id
//!
//! The proxy sends both legs at once, correlated by a `transfer_id` it
//! chose.
//!
//! * **Prefill** (`kv_producer`). The request's `kv_transfer_params` carry
//!   `do_remote_decode: true` and a string `transfer_id` (without them the
//!   request is served and nothing is held, as vLLM only warns); the
//!   `X-data-parallel-rank` header picks one of the [`SimConfig::dp_size`]
//!   ranks, each with its own engine id ([`SimEngine::engine_ids`]), and
//!   without the header the engine's balancer picks one (see
//!   [Data-parallel ranks](#data-parallel-ranks)). After the prefill, the KV is held under
//!   (engine id of the rank, transfer id) for [`SimConfig::kv_lease`] (a
//!   transfer id already held: 400), however the leg finished (vLLM's
//!   `request_finished` keeps it only for a length-capped finish: not
//!   modelled), and the answer is a plain completion with
//!   `"kv_transfer_params": null`. A client that leaves before its
//!   answer is complete gets nothing held. The bootstrap HTTP server at
//!   [`SimEngine::bootstrap_addr`] answers `GET /query` with every rank:
//!   `{"0":{"engine_id":"<id>","worker_addr":{"0":{"0":"<host>:<side channel port>"}}},..}`.
//! * **Decode** (`kv_consumer`). The request's `kv_transfer_params` carry
//!   `do_remote_prefill: true`, `remote_bootstrap_addr`
//!   (`"http://HOST:PORT"`), `remote_engine_id` and `transfer_id` (none, or
//!   no `do_remote_prefill`: the request is served from its prompt; the flag
//!   without the three keys: it waits for KV nobody sends, as vLLM's "Got
//!   invalid KVTransferParams" leaves it, streamed after its 200 head). The
//!   decode asks `GET {remote_bootstrap_addr}/query` for the worker address
//!   of `remote_engine_id`, pulls the transfer from that side channel (see
//!   below), checks the KV against its own prompt and generates normally,
//!   all of it within its own [`SimConfig::bootstrap_timeout`].
//!
//! ## vLLM NIXL push ([`KvMode::NixlPush`]): by request id
//!
//! vLLM's `NixlPushConnector` (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py`
//! and `push_worker.py`): the prefill writes the KV into the decode's blocks
//! instead of the decode reading it. The legs may be sent one after the
//! other or at once. Every request gets an internal id, its `X-Request-Id`
//! (or a random id) followed by `-` and 8 hex digits, as vLLM's
//! `assign_request_id` makes it.
//!
//! * **Prefill** (`"kv_transfer_params": {"do_remote_decode": true}`). After
//!   the prefill, however it finished, the KV is held under the request's
//!   internal id for [`SimConfig::kv_lease`], and the answer's
//!   `kv_transfer_params` are those vLLM 0.33's push scheduler writes: the pull
//!   mode's keys (`remote_request_id` being the internal id) but `dcp_size` and
//!   `remote_blocks_expiry_time`, with `transfer_mode: "push"`.
//! * **Decode** (`do_remote_prefill: true` with `remote_engine_id`,
//!   `remote_host`, `remote_port` and `tp_size`, the prefill's coordinates a
//!   proxy knows before the prefill answered; `remote_block_ids` and
//!   `remote_request_id` are not needed). It registers over the prefill's
//!   side channel under its **own** internal id (a [`SideChannelRegister`])
//!   and waits, up to its [`SimConfig::bootstrap_timeout`], for the KV the
//!   prefill pairs with it: the KV held under exactly that id, else the
//!   oldest held under an id with the same base (both ids minus their
//!   suffix), as vLLM's `get_base_request_id` pairs them. So both legs need
//!   the same `X-Request-Id`, and it must be unique among requests in
//!   flight: legs with different ids (or none) never pair (500 `"KV transfer
//!   failed: ..."` after the wait), and two requests in flight with the same
//!   id pair the wrong ways (the decode finds KV of another prompt and fails
//!   with 500, as vLLM would compute on the wrong KV). Another engine id is
//!   refused at once; parameters without one of the four keys kill the engine
//!   core (vLLM 0.33's push scheduler indexes them: a `KeyError`, see
//!   [`Stats::engine_core_deaths`]), and parameters with a key of the wrong
//!   type are ignored (local prefill, [`Stats::invalid_kv_params`]). The KV is
//!   freed when taken, when
//!   the lease runs out, or when a decode whose parameters name the blocks
//!   (`remote_request_id`, `remote_block_ids`, as a sequential proxy passes
//!   the prefill's answer on) is aborted before its KV arrived
//!   ([`SideChannelRelease`], as in pull mode).
//!
//! ## LMCache ([`KvMode::Lmcache`]): sequential, pushed, notified over ZMQ
//!
//! vLLM with `LMCacheConnectorV1` and LMCache's P/D mode. The proxy
//! tokenizes the prompt (`POST /tokenize`), sends the ids to the prefill,
//! waits for one ZMQ notification per decode rank, then sends the decode the
//! ids followed by the prefill's first token.
//!
//! * **Prefill** (`kv_producer`, LMCache's `pd_role: sender`). A completion
//!   request whose `kv_transfer_params` has a `disagg_spec`
//!   (`{"req_id": "<str>", "receiver_host": "..", "receiver_init_port":
//!   [p0, ..], "receiver_alloc_port": [a0, ..]}`, one port of each per
//!   decode TP rank, other keys ignored; anything else malformed is a 400)
//!   takes one prompt. After the prefill, each of its TP ranks `r` (as many
//!   as the ports, unless [`SimConfig::lmcache_prefill_tp_size`] says
//!   otherwise) pushes its KV at once, at `receiver_host` on
//!   `receiver_init_port[r]` and `receiver_alloc_port[r]` (see [LMCache receiver
//!   protocol](#lmcache-receiver-protocol)); once rank `r` acknowledged it,
//!   the proxy at [`SimConfig::lmcache_proxy`] gets one notification, the
//!   msgpack map `{"type": "ProxyNotif", "req_id": "<req_id>"}` in a single
//!   frame, from a ZMQ `PUSH` socket the engine connects on first use and
//!   keeps (every send within 1 s, so a missing proxy costs at most that and
//!   never hangs the engine; counted in [`Stats::notification_failures`]).
//!   With [`Faults::notify_delay`] zero, the notifications are handed to the
//!   socket before the HTTP answer is written; otherwise a task sends them
//!   after the delay and the answer goes out at once. [`Faults::notify_loss`]
//!   and [`Faults::notify_duplicates`] lose or repeat them. The answer is a
//!   plain completion (`max_tokens: 1` gives the first token as
//!   `choices[0].text`) with `"kv_transfer_params": {"first_tok": <id>}`
//!   whenever the request carries `ret_first_tok`, whatever its value
//!   (`false` too). A push that fails (nobody listening, wrong port, wrong
//!   host, refused by the receiver, timed out)
//!   makes the request answer 500 `"KV transfer failed: rank R (..): .."`,
//!   and that rank is not notified (ranks whose push succeeded are). A
//!   `disagg_spec` on an engine without [`SimConfig::lmcache_proxy`] is a
//!   500; a request without `disagg_spec` is served like by a plain engine.
//!   A prefill whose TP size differs from the number of receiver ports
//!   ([`SimConfig::lmcache_prefill_tp_size`]) is the mismatch LMCache cannot
//!   handle: with fewer ranks, the ports beyond them get no KV and no
//!   notification (a proxy waiting for one per port never completes, the
//!   decode misses that rank's KV); with more, the extra ranks index the port
//!   lists out of range and the request answers 500 `"KV transfer failed:
//!   rank R (..): .. (list index out of range)"` after the other ranks
//!   pushed and notified.
//! * **Decode** (`kv_consumer`, `pd_role: receiver`). It listens on the
//!   init and alloc port of each rank of [`SimConfig::lmcache_receiver`]
//!   ([`SimEngine::lmcache_init_ports`], [`SimEngine::lmcache_alloc_ports`])
//!   and keeps the KV received, per rank, by prompt, for
//!   [`SimConfig::kv_lease`] (counted in [`Stats::blocks_held`]; expired KV
//!   in [`Stats::kv_expired`]). An alloc port allocates at most the blocks of a
//!   prompt of [`SimConfig::max_model_len`] tokens: a `num_blocks` of 0 or beyond is
//!   refused (`{"ok": false}`), whatever the sender claims. A completion request (no
//!   `kv_transfer_params` needed) whose prompt is `ids + [first_tok]` takes
//!   the KV of `ids` from every rank and generates what a direct run on
//!   `ids` generates from its second token on; `max_tokens` and
//!   `min_tokens` count its own output, and `usage.prompt_tokens` is the
//!   length of the prompt it got. If the KV of `ids` is on no rank (never
//!   pushed, expired, already taken, or a request served without a
//!   prefill), LMCache's lookup misses and the engine computes the prompt
//!   itself, as vLLM does (a local prefill). If it is on some ranks only
//!   (a prefill of another TP size, a wrong port), it takes nothing and the
//!   load fails as any failed load does (vLLM's LMCache connector forwards its
//!   engine's load errors, so `kv_load_failure_policy="fail"` applies): a 500
//!   `"KV cache for this request has not arrived (..)"`, or, streamed, that
//!   failure after the 200 head (see [above](#prefilldecode-disaggregation)),
//!   counted in [`Stats::kv_missing`] (not in [`Stats::kv_pull_failures`]).
//!
//! # Side channel protocol
//!
//! The side channel is the simulator's own, line-based stand-in for NIXL:
//! the decode connects to the prefill's side-channel TCP port and sends one
//! JSON line, a [`SideChannelRequest`]:
//!
//! ```text
//! {"engine_id":"<remote_engine_id>","request_id":"<remote_request_id>","block_ids":[0,1,2]}
//! ```
//!
//! The prefill answers one JSON line, a [`SideChannelResponse`] (the
//! connection stays open for further lines, as a decode reuses it):
//! `{"ok":true,"blocks":["<digest>",..],"prompt_digest":"<digest>"}` on
//! success (the blocks are then freed, like vLLM's "read done"
//! notification), or `{"ok":false,"error":"..."}`. Each block's "KV" is a
//! digest of the model name and the block's tokens, chained to the previous
//! block's digest.
//!
//! A decode that will never pull the blocks it was given (its request was
//! aborted first, see [KV block lifetime](#kv-block-lifetime)) sends a
//! [`SideChannelRelease`] instead, the same fields nested under `release`:
//!
//! ```text
//! {"release":{"engine_id":"<remote_engine_id>","request_id":"<remote_request_id>","block_ids":[0,1,2]}}
//! ```
//!
//! The prefill frees the blocks if all three match blocks it holds and
//! answers `{"ok":true}`, or frees nothing and answers
//! `{"ok":false,"error":"..."}`.
//!
//! A vLLM NIXL push decode registers instead, a [`SideChannelRegister`]
//! naming the decode's own internal request id:
//!
//! ```text
//! {"register":{"engine_id":"<remote_engine_id>","request_id":"<request id>-<8 hex digits>"}}
//! ```
//!
//! The prefill waits, up to its [`SimConfig::bootstrap_timeout`], for KV it
//! pairs with that id (see [vLLM NIXL push](#vllm-nixl-push-kvmodenixlpush-by-request-id)),
//! and answers a [`BootstrapResponse`] (below): the KV, then freed; a
//! timeout; or a refusal (another engine id, not a push prefill).
//!
//! A Mooncake pull is a line with a `transfer_id` instead, a
//! [`MooncakePullRequest`]:
//!
//! ```text
//! {"engine_id":"<remote_engine_id>","transfer_id":"<transfer_id>"}
//! ```
//!
//! The prefill waits, up to its [`SimConfig::bootstrap_timeout`], for the
//! transfer to be held under that engine id (its own prefill may still be
//! running), then answers a [`BootstrapResponse`]:
//! `{"ok":true,"prompt_digest":"..","blocks":[..]}` (the KV is then freed),
//! `{"ok":false,"error":"..","timed_out":true}` when the wait ran out, or
//! `{"ok":false,"error":".."}` (unknown engine id, not a Mooncake prefill).
//! A decode that closes the connection while waiting takes nothing.
//!
//! # LMCache receiver protocol
//!
//! The simulator's own stand-in for LMCache's NIXL transfer channel, one
//! JSON line each way per step, on the decode's receiver ports of rank `r`:
//!
//! 1. The prefill connects to the **init port** and sends
//!    `{"type":"init","rank":r,"sender":"<engine id>"}`; the receiver answers
//!    `{"ok":true,"session":"<token>"}`, a session valid once, for a while,
//!    on the alloc port of the same rank only.
//! 2. It connects to the **alloc port** and sends
//!    `{"type":"alloc","session":"<token>","rank":r,"req_id":"..","prompt_digest":"..","num_blocks":n}`;
//!    the receiver answers `{"ok":true,"block_ids":[..]}`.
//! 3. On the same connection it sends
//!    `{"type":"write","block_ids":[..],"prompt_digest":"..","blocks":["<digest>",..]}`;
//!    the receiver keeps the KV and answers `{"ok":true}`, the
//!    acknowledgement after which the rank is notified.
//!
//! Any refusal is `{"ok":false,"error":".."}`: a line sent to the wrong kind
//! of port, a rank that is not the port's, a session unknown to the port's
//! rank (the init port of one rank and the alloc port of another), a write
//! that does not match the allocation. So a wrong host or either wrong port
//! fails the push, as between real engines.
//!
//! # SGLang bootstrap protocol
//!
//! The simulator's own stand-in for SGLang's bootstrap server and KV
//! transfer: the decode connects to `bootstrap_host:bootstrap_port` and
//! sends one JSON line per room, a [`BootstrapRequest`]:
//! `{"room":123}`, or `{"room":123,"dp_rank":1}` when its request named the
//! prefill's rank (`disagg_prefill_dp_rank`); without it, the server looks
//! on rank `room % dp_size` of the prefill. The server waits, up to the prefill's
//! [`SimConfig::bootstrap_timeout`], for a request to register that room on that rank,
//! takes it (a room is taken once; a second taker waits like for an unknown
//! room) and answers one [`BootstrapResponse`] line, as above. The
//! connection stays open for further rooms; a decode that closes it while
//! waiting takes nothing.
//!
//! # Faults
//!
//! [`Faults`] make the completion routes answer an error status, hang until
//! the client leaves (before the response head, or mid-answer with
//! [`Faults::stall_after_chunks`]), abort the connection mid-answer, or make
//! a vLLM NIXL prefill answer unusable `kv_transfer_params`
//! ([`Faults::malformed_kv_params`]) or a partial handoff
//! ([`Faults::partial_kv_params`]); they can be changed at run time with
//! [`SimEngine::set_faults`]. The status and hang faults apply in every
//! [`KvMode`], before any KV work: an SGLang prefill with an error status
//! answers it at once, without registering its rooms. The [`Faults`]
//! documentation says which wins when several are set and maps each fault
//! of a proxy's fault matrix to a knob.
//!
//! # Cancellation
//!
//! A request whose client leaves before its answer is complete is counted in
//! [`Stats::cancelled`] and dropped at once, whatever it was waiting for:
//! an SGLang prefill's rooms are withdrawn, a Mooncake prefill's KV is
//! freed, and a decode waiting for its peer closes its connection, which
//! makes the peer's bootstrap server or side channel stop waiting for it
//! (and take nothing). Rooms and transfers not yet taken are counted in
//! [`Stats::kv_transfers_pending`]. What a cancelled request leaves behind
//! on its peer is the subject of the next section.
//!
//! # KV block lifetime
//!
//! How long a prefill keeps the KV it computed for a decode, as the real
//! engines do. Every block held is counted in [`Stats::blocks_held`],
//! whatever the protocol, so `blocks_held == 0` on every prefill proves that
//! nothing is stranded; SGLang rooms and Mooncake transfers are also
//! counted in [`Stats::kv_transfers_pending`]. In LMCache mode the KV is held
//! by the decode instead.
//!
//! * **vLLM NIXL.** A prefill holds its blocks when it answers (however it
//!   finished). They are freed when a decode pulls them, when the lease
//!   ([`SimConfig::kv_lease`]) runs out, or when a decode is aborted before
//!   its pull: a decode request with valid remote-prefill
//!   `kv_transfer_params` whose client leaves (or that is otherwise
//!   dropped) before the pull completed, whether it was waiting in
//!   [`SimConfig::request_delay`] or in the pull itself, sends the prefill a
//!   [`SideChannelRelease`] at once, as vLLM's decode worker notifies the
//!   prefill of a request aborted before its KV was loaded. The prefill
//!   frees the blocks ([`Stats::kv_released_on_abort`]; the decode counts
//!   [`Stats::kv_releases_sent`]). Once the pull is over, successful or
//!   not, nothing is sent: a pulled prefill already freed its blocks, and a
//!   request that completes, with or without an error, never sends one. So
//!   a proxy can free a prefill's blocks early by sending the decode leg and
//!   aborting it right away. Neither a decode rejected before its pull (a
//!   validation error, a [`Faults::status`]) or hung by [`Faults::hang`],
//!   nor a prefill whose client leaves
//!   after its blocks were held (while its answer is being written) frees
//!   anything: those blocks wait for the lease, like vLLM's. A prefill
//!   cancelled before it finished holds nothing.
//! * **vLLM NIXL push.** A prefill holds its blocks when it answers (however
//!   it finished); they are freed when a registration takes them, when the
//!   lease runs out, or on a release notice from a decode aborted before its
//!   KV arrived, as in pull mode. A decode aborted while waiting for its
//!   registration closes the connection: the prefill stops waiting and takes
//!   nothing.
//! * **SGLang.** A prefill's rooms live as long as its request: they are
//!   withdrawn when a decode took them, when the request is cancelled, or
//!   when no decode took them within [`SimConfig::bootstrap_timeout`] (the
//!   prefill then answers 500). A decode aborted before it took its room
//!   tells nobody: the room stays until the prefill's request ends.
//! * **vLLM Mooncake.** A prefill holds its transfer from its answer until a
//!   decode pulls it or the lease runs out ([`SimConfig::kv_lease`], the
//!   stand-in for `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`); a prefill whose
//!   client leaves before its answer holds nothing. A decode aborted before
//!   it pulled tells nobody: the transfer stays until the lease runs out.
//! * **LMCache.** A prefill keeps nothing. A decode holds each rank's KV from
//!   the push until a request takes it (from every rank at once) or the lease
//!   ([`SimConfig::kv_lease`]) runs out; KV that reached only some ranks
//!   waits for its lease.
//!
//! # Prefix cache and KV events
//!
//! With [`SimConfig::prefix_cache_blocks`] above 0, each data-parallel rank keeps the
//! KV blocks of the prompts it computed in a prefix cache of that many blocks of
//! [`SimConfig::block_size`] tokens, least recently used evicted first (a request
//! touches its blocks from the last to the first, so a chain's tail goes before its
//! head, as in vLLM's block pool). Blocks are keyed by a hash chained over the tokens,
//! as vLLM's are. A local prefill looks its prompt up first and computes (waits
//! [`SimConfig::prefill_delay_per_token`] for) only the tokens after the cached prefix;
//! like vLLM it never hits the last token, so at most all but one block of a prompt
//! that ends on a block boundary. The answer carries
//! `usage.prompt_tokens_details.cached_tokens` (streamed answers too, in their usage
//! chunk), as vLLM does with `--enable-prompt-tokens-details`; a decode that received
//! its KV from a prefill caches it as well and counts the whole prompt as cached (vLLM
//! counts externally computed tokens as cached). [`Stats`] counts the tokens looked up
//! and hit, the blocks held and evicted; [`SimEngine::cached_prefix_tokens`] reads a
//! rank's cache without touching it (ground truth for tests and benchmarks). Without a
//! cache (the default), answers and timings are as before and `prompt_tokens_details`
//! stays `null`. [`SimConfig::serial_prefill`] makes a rank prefill one request at a
//! time, so that queued prefills add to the time to first token.
//!
//! With [`SimConfig::kv_events`] as well, each rank publishes its cache's changes as
//! vLLM 0.33 does (`vllm/distributed/kv_events.py`): a ZMQ `PUB` socket on the
//! configured port plus the rank ([`SimEngine::kv_events_endpoint`] for rank 0) sends
//! `[topic, seq (u64 big-endian), payload]` per batch, the payload being msgpack
//! `[ts, events, data_parallel_rank]` with map-tagged events: `BlockRemoved` for the
//! blocks a prefill evicted, then `BlockStored` for the blocks it added
//! (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
//! `medium: "GPU"`, `lora_name`, `group_idx: 0`), and `AllBlocksCleared` on
//! [`SimEngine::reset_prefix_cache`]; the bytes are those vLLM's own msgspec encoder
//! writes (a unit test compares them). The last [`KvEventsConfig::buffer_steps`]
//! batches are kept for the replay `ROUTER` socket
//! ([`SimEngine::kv_events_replay_endpoint`]): a `DEALER` sending `[empty, start seq]`
//! gets `[empty, topic, seq, payload]` for each kept batch from `start` on, then
//! `[empty, empty, -1, empty]`. [`SimEngine::lose_kv_events`] makes batches be numbered
//! and kept but not sent, as a `PUB` socket drops messages for a slow subscriber.
//!
//! # Example
//!
//! ```
//! use disagg_sim::{SimConfig, SimEngine, generate};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! let engine = SimEngine::start(SimConfig::default()).await?;
//!
//! let body = r#"{"model":"sim-model","prompt":"Hello world","max_tokens":3}"#;
//! let mut conn = tokio::net::TcpStream::connect(engine.addr()).await?;
//! let request = format!(
//!     "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
//!      content-length: {}\r\nconnection: close\r\n\r\n{body}",
//!     body.len()
//! );
//! conn.write_all(request.as_bytes()).await?;
//! let mut answer = String::new();
//! conn.read_to_string(&mut answer).await?;
//!
//! assert!(answer.starts_with("HTTP/1.1 200 OK"));
//! let text = generate("Hello world", 3, 0).concat();
//! assert!(answer.contains(&format!(r#""text":"{text}""#)));
//! assert_eq!(engine.stats().local_prefills, 1);
//! engine.shutdown().await;
//! # Ok(())
//! # }
//! ```

// docs.rs builds with `--cfg docsrs` (package.metadata.docs.rs) on a nightly toolchain,
// where each feature-gated item is marked with the features it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod api;
mod body;
mod config;
mod dp;
mod ec;
mod ec_push;
mod gen_apis;
mod generate;
mod handoff;
mod kv;
mod kv_events;
mod kv_load_failure;
mod lax;
mod limits;
mod listen;
mod lmcache;
mod metrics;
mod mooncake;
mod native;
mod null_limit;
mod prefix_cache;
mod received;
mod rendezvous;
mod request_body;
mod reuse;
mod server;
mod sglang;
mod stats;
mod surface;
#[cfg(feature = "tls")]
mod tls;

pub use config::{
    Faults, KvMode, LmcacheReceiver, MetricsFault, PartialKv, SimConfig, SimRole, SimTls,
};
pub use ec::{EcConfig, EcRole};
pub use generate::{EOS_TOKEN_ID, VOCAB_SIZE, generate, generate_from_ids, tokenize};
pub use kv::{
    BootstrapResponse, MooncakePullRequest, PushRegistration, SideChannelRegister,
    SideChannelRelease, SideChannelRequest, SideChannelResponse,
};
pub use kv_events::KvEventsConfig;
pub use received::ReceivedRequest;
pub use server::{BoxError, RecordedRequest, SimEngine, SimService, SimServiceBody};
pub use sglang::BootstrapRequest;
pub use stats::Stats;
