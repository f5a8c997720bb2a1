"""The OpenAI-compatible HTTP API (aiohttp) in front of one `Engine`.

Routes (OpenAI API reference, vLLM's extra fields):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or Server-Sent Events when
  ``stream`` is true (WHATWG HTML "Server-sent events": one ``data: {json}`` event per chunk,
  each followed by a blank line, then ``data: [DONE]``);
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one served model, with ``max_model_len``,
  ``supports_chat`` and ``random_weights``;
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, ``GET /version``: as vLLM serves them;
- ``GET /health`` (200 or 503), ``GET /metrics`` (Prometheus text), ``GET /kv_cache`` (the block
  pool and every live request's block table, `Engine.kv_cache_snapshot`, request ids hashed),
  ``GET /kv_cache/advice`` (tuning advice, `scheduler.advice`), ``GET /kv_cache/ui`` (the live
  block-pool page, ``kv_cache_ui.html``).

With API keys (`api_keys.APIKeys`) every route but /health, /metrics and /kv_cache/ui needs
``Authorization: Bearer KEY``; without one the answer is 401 in OpenAI's error format. The page at
/kv_cache/ui holds no data: it asks for the key and sends it with each of its own requests.

Every invalid request gets an OpenAI-style error body naming the field::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

A client that disconnects aborts its requests: the engine's output iterators are closed, which
returns their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedkv.common.log import get_logger
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.api_keys import APIKeys, fingerprint

log = get_logger("pagedkv.api")

_KV_CACHE_UI = (Path(__file__).parent / "kv_cache_ui.html").read_bytes()

ENGINE_KEY: web.AppKey = web.AppKey("engine", object)  # the app's engine, for startup/cleanup hooks
API_KEYS: web.AppKey = web.AppKey("api_keys", APIKeys)
MAX_BYTES: web.AppKey = web.AppKey("max_request_bytes", int)
TENANT: web.RequestKey = web.RequestKey("tenant", object)  # the caller's API-key fingerprint, None when keys are off
# orchestrators and Prometheus probe these without a key; a browser cannot send one for the (static) page
_OPEN_ROUTES = ("/health", "/metrics", "/kv_cache/ui")

# Request bodies above this are refused with 413 (`--max-request-bytes`; long token-id lists fit).
MAX_REQUEST_BYTES = 32 * 2**20
MAX_JSON_DEPTH = 32  # the deepest legal body (chat content parts) nests 5 levels
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Prompts longer than this many characters are tokenized in a thread (tokenizers releases the GIL
# in encode_batch), so one huge prompt does not freeze every stream and /health.
_TOKENIZE_INLINE_CHARS = 8192


# ---- errors ---------------------------------------------------------------------------------

class APIError(Exception):
    """An error returned to the client as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _from_value_error(e: ValueError) -> APIError:
    """Engine/SamplingParams/Tokenizer errors read "<field>: <why>"; the field becomes ``param``."""
    msg = str(e)
    field, sep, _ = msg.partition(": ")
    param = field if sep and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", field) else None
    return APIError(400, msg, param)


def _from_validation_error(e: msgspec.ValidationError) -> APIError:
    """msgspec says "Expected `float | null`, got `str` - at `$.temperature`"; name the field."""
    msg = str(e)
    if unknown := re.match(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?(.*)`)?$", msg):
        field, at = unknown.group(1), unknown.group(2)
        param = f"{at}.{field}" if at else field
        return APIError(400, f"{param}: unrecognized request argument (not part of the API, or not supported by "
                             "pagedkv)", param)
    m = re.search(r" - at `\$\.?(.*)`$", msg)
    if m is None:  # the body itself: wrong top-level type, or a missing required field
        missing = re.search(r"missing required field `(\w+)`", msg)
        param = missing.group(1) if missing else None
        return APIError(400, f"{param}: {msg}" if param else f"request body: {msg}", param)
    param = m.group(1) or None
    why = msg[:m.start()]
    return APIError(400, f"{param}: {why[0].lower()}{why[1:]}" if param else f"request body: {why}", param)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


@web.middleware
async def _auth(request: web.Request, handler):
    """Bearer API keys on every route but `_OPEN_ROUTES`; 401 in OpenAI's format without one."""
    if request.path not in _OPEN_ROUTES:
        try:
            request[TENANT] = request.app[API_KEYS].check(request.headers.get("Authorization"),
                                                          admin_route=request.path.startswith("/kv_cache"))
        except PermissionError as e:  # RFC 9110 §15.5.2: a 401 must name the scheme it wants (RFC 6750)
            raise APIError(401, str(e), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}) from None
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error leaves as OpenAI-style JSON, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except APIError as e:
        if e.status < 500:
            log.info("request rejected", path=request.path, status=e.status, param=e.param, error=e.message)
        resp = _json(e.body(), e.status)
        resp.headers.update(e.headers)
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json(APIError(e.status, e.reason,
                              type="invalid_request_error" if e.status < 500 else "server_error").body(), e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error in request", path=request.path)
        return _json(APIError(500, f"internal error: {e!r}", type="server_error").body(), 500)


# ---- request bodies (OpenAI names; vLLM extras) ----------------------------------------------

class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``include_usage``: a last chunk with the usage; ``continuous_usage_stats`` (vLLM), with
    ``include_usage``: every chunk carries the usage so far; ``include_obfuscation`` (OpenAI's padding):
    only false."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True):
    """Fields shared by completions and chat completions. None means "the default".

    Every field is honoured or refused: a field this struct does not declare gets 400 naming it
    (OpenAI answers "Unrecognized request argument supplied" too), and a declared field pagedkv
    does not implement is accepted only at its neutral value (`_UNSUPPORTED`).
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # logged with the request id (OpenAI: an end-user id for abuse monitoring)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    cache_salt: str | None = None
    priority: int = 0


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists. ``logprobs``: how many top alternatives per token (0..max_logprobs).
    ``echo``: the prompt comes first in each choice, and with ``logprobs`` its tokens' logprobs
    too (None for the first); ``max_tokens`` 0 with echo scores the prompt only (as vLLM).
    ``prompt_logprobs`` (vLLM): the prompt tokens' logprobs with that many alternatives."""

    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    best_of: int | None = None  # only n: no server-side best-of selection
    suffix: str | None = None  # insertion (fill-in-the-middle) is not implemented


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # tool-calling history: declared so a set value is refused (`_render_chat`), not dropped unseen;
    # null / [] (what the openai SDK's message.model_dump() carries back) is accepted
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) None: up to the
    context limit. ``logprobs`` bool, ``top_logprobs`` 0..max_logprobs alternatives per token."""

    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    safety_identifier: str | None = None  # logged as ``user`` is
    # OpenAI fields for features pagedkv does not have: accepted only at their neutral value
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /tokenize (vLLM): ``prompt`` text, or chat ``messages`` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /detokenize (vLLM): token ids to text."""

    tokens: list[int]
    model: str | None = None


def _check_json(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuse what the engine cannot carry: nesting deeper than MAX_JSON_DEPTH, strings that are not
    valid Unicode (a lone UTF-16 surrogate such as ``"\\udfff"`` parses, then breaks UTF-8 encoding and
    block hashing), integers outside int64 (MessagePack and the worker's tensors hold no more).

    Raises APIError 400 naming the path (``stop[1]``, ``messages[0].content``).
    """
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise APIError(400, f"{path}: is not valid Unicode (lone UTF-16 surrogate)", path) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        if not _INT64_MIN <= value <= _INT64_MAX:  # written out unless very long (floats overflow at 309 digits)
            shown = str(value) if value.bit_length() <= 128 else f"of {len(str(abs(value)))} digits"
            raise APIError(400, f"{path}: integer {shown} is outside the 64-bit signed range", path)
    elif isinstance(value, list):
        if value and depth < MAX_JSON_DEPTH and all(type(item) is int for item in value) and \
                _INT64_MIN <= min(value) and max(value) <= _INT64_MAX:
            return  # token ids: one range check instead of a call per id (a long prompt is the common case)
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, path or "request body", depth + 1)
            _check_json(item, f"{path}.{key}" if path else key, depth + 1)


async def _decode_body(request: web.Request, cls: type[msgspec.Struct]):
    limit = request.app[MAX_BYTES]
    too_large = APIError(413, f"request body: larger than {limit} bytes (--max-request-bytes)")
    if request.content_length is not None and request.content_length > limit:
        raise too_large  # refused before reading it (aiohttp then drains what the client still sends)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    if len(raw) > limit:
        raise too_large
    try:
        # The stdlib parser accepts NaN/Infinity, so such a value reaches validation and gets
        # its field named instead of a bare "malformed JSON".
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except ValueError:  # Python's guard against quadratic-time int parsing (sys.get_int_max_str_digits)
        raise APIError(400, f"request body: an integer longer than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise APIError(400, f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json(obj)
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as e:
        raise _from_validation_error(e) from None


# ---- shared request handling ----------------------------------------------------------------

def _sampling_params(req: _SamplingFields, engine, *, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """Build and validate SamplingParams; raises APIError naming the first invalid field."""
    def pick(value, default):
        return default if value is None else value

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, -1),
        min_p=pick(req.min_p, 0.0), repetition_penalty=pick(req.repetition_penalty, 1.0),
        presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
        seed=req.seed, max_tokens=max_tokens, logprobs=logprobs, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=_logit_bias(req, engine.model_config.vocab_size), prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens, n=req.n, use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty, early_stopping=req.early_stopping)
    try:
        params.validate(max_logprobs=engine.config.max_logprobs, max_n=engine.config.max_n,
                        max_stop=engine.config.max_stop)
    except ValueError as e:
        raise _from_value_error(e) from None
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise APIError(400, f"stop_token_ids: every id must be in [0, {vocab})", "stop_token_ids")
    return params


# field -> (is this value neutral?, what pagedkv lacks). A neutral value is what the field means
# when absent, so accepting it honours the request; anything else is refused, never ignored.
_UNSUPPORTED = {
    "suffix": (lambda v, r: not v, "insertion (fill-in-the-middle) is not supported"),
    "best_of": (lambda v, r: v is None or v == r.n, "best_of other than n is not supported"),
    "tools": (lambda v, r: not v, "tool calling is not supported"),
    "tool_choice": (lambda v, r: v in (None, "none"), "tool calling is not supported"),
    "parallel_tool_calls": (lambda v, r: v is None, "tool calling is not supported"),
    "functions": (lambda v, r: not v, "function calling is not supported"),
    "function_call": (lambda v, r: v in (None, "none"), "function calling is not supported"),
    "response_format": (lambda v, r: v is None or v == {"type": "text"},
                        "only {\"type\": \"text\"} is supported (no JSON mode or structured outputs)"),
    "store": (lambda v, r: not v, "stored completions are not supported"),
    "metadata": (lambda v, r: not v, "metadata (for stored completions) is not supported"),
    "modalities": (lambda v, r: v in (None, ["text"]), "only the text modality is supported"),
    "audio": (lambda v, r: v is None, "audio output is not supported"),
    "prediction": (lambda v, r: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v, r: v is None, "this is not a reasoning model"),
    "service_tier": (lambda v, r: v in (None, "auto", "default"), "only the default service tier exists"),
    "web_search_options": (lambda v, r: v is None, "web search is not supported"),
    "verbosity": (lambda v, r: v is None, "verbosity is not supported"),
    "prompt_cache_key": (lambda v, r: v is None, "use cache_salt (pagedkv's prefix-cache isolation key)"),
    "prompt_cache_retention": (lambda v, r: v is None, "prefix-cache retention is not configurable per request"),
}


def _check_common(req: _SamplingFields, engine, request_id: str) -> None:
    """Model, stream_options, refusals of unsupported values; logs ``user`` / ``safety_identifier``."""
    _check_model(req.model, engine)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation: not supported (chunks are not padded)",
                       "stream_options.include_obfuscation")
    for field, (neutral, why) in _UNSUPPORTED.items():
        if hasattr(req, field) and not neutral(getattr(req, field), req):
            raise APIError(400, f"{field}: {why}", field)
    user = req.user or getattr(req, "safety_identifier", None)
    if user is not None:
        log.info("request from user", request_id=request_id, user=user)


def _logit_bias(req: _SamplingFields, vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) with int keys; raises APIError naming a bad key."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        # ASCII digits only (\d takes any script's); a key longer than any id is not converted (int()
        # refuses over 4,300 digits)
        if not re.fullmatch(r"[0-9]+", key) or len(key.lstrip("0")) > len(str(vocab)) or int(key) >= vocab:
            shown = repr(key) if len(key) <= 40 else f"of {len(key)} characters"
            raise APIError(400, f"logit_bias: key {shown} is not a token id in [0, {vocab})", "logit_bias")
        bias[int(key)] = value
    return bias


def _check_model(model: str | None, engine) -> None:
    if model is not None and model not in _model_names(engine):
        raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")


def _model_names(engine) -> set[str]:
    """Names a request's ``model`` may use: --served-model-name's, else the model's name and path."""
    if engine.config.served_model_name:
        return set(engine.config.served_model_name)
    names = {engine.model_config.name}
    if engine.config.model:
        names.add(engine.config.model)
    return names


class _Choice:
    """What one choice accumulated: its text and logprobs (for a whole response only: a stream's go out
    as they come), its finish reason and output token count."""

    __slots__ = ("text", "logprobs", "finish_reason", "stop_reason", "error", "num_output_tokens")

    def __init__(self):
        self.text: list[str] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_output_tokens = 0


class _Generation:
    """The engine requests of one HTTP request (one per prompt), merged into one output stream.

    Yields (choice index, RequestOutput) with choice index = prompt index * n + output index, as
    OpenAI numbers choices for a batch of prompts. `close` aborts whatever is still running.
    stream: the caller sends each delta as it comes, so the choices keep no copy of the text and
    logprobs (a stalled client would otherwise hold them all, sent or not).
    """

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams, base_id: str, extra: dict,
                 stream: bool):
        self.engine = engine
        self.n = params.n
        self.stream = stream
        self.request_ids: list[str] = []
        self.iterators: list[AsyncIterator] = []
        self.prompt_tokens = [len(p) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)  # per prompt, once its prefill ran
        self.choices = [_Choice() for _ in range(len(prompts) * params.n)]
        self._num_finished = 0  # choices with a finish reason (`finished`, read for every delta)
        self._pumps: list[asyncio.Task] = []
        try:
            for i, ids in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                self.iterators.append(engine.add_request(ids, params, rid, **extra))
                self.request_ids.append(rid)
        except ValueError as e:
            self._abort_all()
            raise _from_value_error(e) from None
        except RuntimeError as e:  # the engine has failed or is shutting down
            self._abort_all()
            raise APIError(503, f"engine unavailable: {e}", type="server_error") from None

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        if len(self.iterators) == 1:
            async for out in self.iterators[0]:
                yield self._record(0, out), out
            return
        # One slot: a pump holds a delta until the consumer takes the one before, so a slow client's
        # deltas wait in the engine's queues, merged (`OutputQueue`), not here one per token.
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)

        async def pump(i: int, it: AsyncIterator) -> None:
            try:
                async for out in it:
                    await queue.put((i, out))
            finally:  # the consumer counts ends, whatever way this one ended; once closed, none is left
                if not asyncio.current_task().cancelling():
                    await queue.put((i, None))

        self._pumps = [asyncio.create_task(pump(i, it)) for i, it in enumerate(self.iterators)]
        remaining = len(self._pumps)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
                continue
            yield self._record(i, out), out

    def _record(self, prompt_index: int, out) -> int:
        idx = prompt_index * self.n + out.index
        c = self.choices[idx]
        if not self.stream:
            c.text.append(out.text)
            if out.logprobs:
                c.logprobs.extend(out.logprobs)
        c.num_output_tokens = out.num_output_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        if out.finish_reason is not None:
            self._num_finished += c.finish_reason is None
            c.finish_reason, c.stop_reason, c.error = out.finish_reason, out.stop_reason, out.error
        self.prompt_tokens[prompt_index] = out.num_prompt_tokens
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], out.num_cached_tokens)
        return idx

    @property
    def finished(self) -> bool:
        """Whether every choice has its finish reason (the stream's last delta has been recorded)."""
        return self._num_finished == len(self.choices)

    def usage(self, count_completion: bool = True) -> dict:
        """OpenAI's usage; count_completion False: the outputs were not returned (echo, max_tokens 0)."""
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_output_tokens for c in self.choices) if count_completion else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    async def run_to_end(self) -> None:
        """Collect every choice (non-streamed responses). Raises APIError 500 when generation failed."""
        try:
            async for _ in self.outputs():
                pass
        finally:
            await self.close()
        if (err := _generation_error(self.choices)) is not None:
            raise APIError(500, err, type="server_error")

    async def close(self) -> None:
        """Stop every pump and close every iterator (the engine aborts unfinished requests)."""
        for t in self._pumps:
            t.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        for it in self.iterators:
            await it.aclose()
        self._abort_all()

    def _abort_all(self) -> None:
        # An iterator that never started has no finally to run; abort its request by id.
        for rid in self.request_ids:
            self.engine.abort(rid)


_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


def _generation_error(choices: list[_Choice]) -> str | None:
    return next((c.error or "generation failed" for c in choices if c.finish_reason == "error"), None)


# ---- logprobs formats -----------------------------------------------------------------------

def _legacy_entries(lps: list, k: int | None = None) -> list[tuple[str, float, dict]]:
    """(token, logprob, alternatives) per engine TokenLogprob; alternatives: the top k and the token
    itself (OpenAI always lists the chosen token)."""
    entries = []
    for lp in lps:
        alternatives = {tok: val for _, tok, val in lp.top_logprobs[:k]}
        alternatives.setdefault(lp.token, lp.logprob)
        entries.append((lp.token, lp.logprob, alternatives))
    return entries


def _echo_entries(prompt_ids: list[int], prompt_logprobs: list | None, k: int, tokenizer) -> list[tuple]:
    """The prompt's entries for echo: the first token has no logprob (nothing precedes it)."""
    if prompt_logprobs is None or None in prompt_logprobs[1:]:  # the request ended before its prefill did
        return []
    return [(tokenizer.token_to_str(prompt_ids[0]), None, None)] + _legacy_entries(prompt_logprobs[1:], k)


def _completion_logprobs(entries: list[tuple], text_offset: int) -> dict:
    """The legacy completions format: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, logprob, alternatives in entries:
        tokens.append(token)
        token_logprobs.append(logprob)
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _vllm_prompt_logprobs(prompt_logprobs: list | None, k: int) -> list | None:
    """vLLM's ``prompt_logprobs``: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top k."""
    if prompt_logprobs is None or None in prompt_logprobs[1:]:  # the request ended before its prefill did
        return None
    out: list = [None]
    for lp in prompt_logprobs[1:]:
        d = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
        for rank, (tid, tok, val) in enumerate(lp.top_logprobs[:k], start=1):
            d.setdefault(str(tid), {"logprob": val, "rank": rank, "decoded_token": tok})
        out.append(d)
    return out


def _token_bytes(token: str) -> list[int]:
    if token.startswith("bytes:"):  # a fragment of a UTF-8 character, as Tokenizer.token_to_str writes it
        return [int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token)]
    return list(token.encode())


def _chat_logprobs(lps: list) -> dict:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": _token_bytes(lp.token),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": _token_bytes(t)} for _, t, v in lp.top_logprobs]}
        for lp in lps]}


# ---- handlers -------------------------------------------------------------------------------

async def _tokenize(engine, text: str, field: str, add_special_tokens: bool = True, *,
                    must_fit: bool = True) -> list[int]:
    """Token ids of ``text``. With ``must_fit``, a text too long to fit max_model_len whatever its
    tokens is refused untokenized; a long one is tokenized in a thread. Raises APIError 400 naming ``field``."""
    tokenizer = engine.tokenizer
    if must_fit and len(text) > engine.max_model_len * tokenizer.max_token_chars:
        raise APIError(400, f"{field}: {len(text)} characters cannot fit max_model_len ({engine.max_model_len} "
                            f"tokens of at most {tokenizer.max_token_chars} characters)", field)
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


async def _prompt_token_lists(req: CompletionRequest, engine) -> tuple[list[list[int]], list[str | None]]:
    """The prompts of a completions request as token ids, and their text when given as text."""
    p = req.prompt
    if p is None:
        raise APIError(400, "prompt: is required", "prompt")
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]
    elif p and all(isinstance(x, (str, list)) for x in p):
        items = list(p)
    else:
        raise APIError(400, "prompt: must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists (not empty, not mixed)", "prompt")
    ids, texts = [], []
    for item in items:
        if not item:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if isinstance(item, str):
            ids.append(await _tokenize(engine, item, "prompt"))
            texts.append(item)
        else:
            ids.append(item)
            texts.append(None)
    return ids, texts


async def _render_chat(engine, messages: list[ChatMessage] | None, add_generation_prompt: bool,
                       add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template. Raises APIError 400 naming the field."""
    if not messages:
        raise APIError(400, "messages: must be a non-empty list", "messages")
    if engine.tokenizer.chat_template is None:
        raise APIError(400, f"messages: model {engine.served_model_names[0]!r} has no chat template; start the "
                            "server with --chat-template, or use /v1/completions", "messages")
    rendered = []
    for i, m in enumerate(messages):
        for field in ("tool_calls", "tool_call_id", "function_call"):
            if getattr(m, field):
                raise APIError(400, f"messages[{i}].{field}: tool calling is not supported", f"messages[{i}].{field}")
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise APIError(400, f"messages[{i}].content: only text content parts are supported",
                               f"messages[{i}].content")
            content = "\n".join(p.text for p in content)
        elif content is None:  # OpenAI allows it for an assistant turn (tool calls), nowhere else
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content: is required for role {m.role!r}",
                               f"messages[{i}].content")
            content = ""
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        rendered.append(msg)
    try:
        text = engine.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise _from_value_error(e) from None
    except Exception as e:  # a template that breaks on this input (a TypeError in jinja) is the input's fault
        raise APIError(400, f"messages: the chat template failed on these messages: {e!r:.200}", "messages") \
            from None
    # The template writes BOS itself when the model wants one (transformers does the same).
    prompt = await _tokenize(engine, text, "messages", add_special_tokens=add_special_tokens)
    if not prompt:
        raise APIError(400, "messages: the rendered prompt is empty", "messages")
    return prompt


def _chunk_builder(request_id: str, obj: str, created: int, model: str, options: StreamOptions | None, usage):
    """Builds SSE chunk bodies. ``stream_options.include_usage``: each carries ``usage``, null until the
    last, usage-only chunk; with ``continuous_usage_stats`` too, each carries the usage so far
    (``usage()``). As vLLM, ``continuous_usage_stats`` alone adds nothing."""
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options.continuous_usage_stats

    def chunk(choices: list, final_usage: dict | None = None) -> dict:
        body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
        if final_usage is not None or continuous:
            body["usage"] = final_usage or usage()
        elif include_usage:
            body["usage"] = None
        return body

    return chunk, include_usage


class _API:
    """Route handlers bound to one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.created = int(time.time())  # the model card's "created": when serving began

    def _extra(self, req: _SamplingFields, request: web.Request) -> dict:
        extra = {"priority": req.priority,
                 "cache_salt": request.app[API_KEYS].cache_salt(request.get(TENANT), req.cache_salt)}
        if traceparent := request.headers.get("traceparent"):  # W3C Trace Context: continue the client's trace
            extra["traceparent"] = traceparent
            # and its vendor entries, which the spec says a participant passes on with it
            extra["tracestate"] = request.headers.get("tracestate")
        return extra

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (OpenAI "Create completion"; vLLM's echo and prompt_logprobs)."""
        engine = self.engine
        req = await _decode_body(request, CompletionRequest)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        _check_common(req, engine, request_id)
        num_prompts = len(req.prompt) if isinstance(req.prompt, list) and req.prompt and \
            not isinstance(req.prompt[0], int) else 1
        if not 1 <= req.n <= engine.config.max_n:  # before --max-choices: the narrower bound names its flag
            raise APIError(400, f"n: must be between 1 and {engine.config.max_n} (--max-n), got {req.n}", "n")
        if num_prompts * req.n > engine.config.max_choices:  # refused before a prompt is tokenized
            param = "n" if req.n > 1 else "prompt"
            raise APIError(400, f"{param}: n ({req.n}) x prompts ({num_prompts}) exceeds {engine.config.max_choices} "
                                "choices per request (--max-choices)", param)
        prompts, prompt_texts = await _prompt_token_lists(req, engine)
        if req.max_tokens is None or req.max_tokens < (0 if req.echo else 1):
            raise APIError(400, "max_tokens: must be an integer >= 1 (0 only with echo, to score the prompt)",
                           "max_tokens")
        # echo with max_tokens 0 scores the prompt only: one token is generated and dropped, as vLLM does
        echo_only = req.echo and req.max_tokens == 0
        echo_logprobs = req.logprobs if req.echo else None
        wanted = [k for k in (req.prompt_logprobs, echo_logprobs) if k is not None]
        params = _sampling_params(req, engine, max_tokens=max(req.max_tokens, 1), logprobs=req.logprobs,
                                  prompt_logprobs=max(wanted) if wanted else None)
        if req.echo:
            prompt_texts = [t if t is not None else engine.tokenizer.decode(ids) for t, ids in zip(prompt_texts, prompts)]
        created = int(time.time())
        gen = _Generation(engine, prompts, params, request_id, self._extra(req, request) | {"prompt_only": echo_only},
                          req.stream)
        model = engine.served_model_names[0]
        offsets = [0] * len(gen.choices)

        def piece(idx: int, text: str, lps: list, first: bool, finish_reason, stop_reason) -> dict:
            """One choice's text, logprobs and finish; ``first``: the prompt goes first (echo)."""
            p = idx // params.n
            entries = [] if echo_only else _legacy_entries(lps)
            if echo_only:
                text, stop_reason = "", None
                finish_reason = "length" if finish_reason in ("stop", "length") else finish_reason
            if first and req.echo:
                text = prompt_texts[p] + text
                if echo_logprobs is not None:
                    entries = _echo_entries(prompts[p], gen.prompt_logprobs[p], echo_logprobs,
                                            engine.tokenizer) + entries
            logprobs = None
            if req.logprobs is not None:
                logprobs = _completion_logprobs(entries, offsets[idx])
                offsets[idx] += sum(len(e[0]) for e in entries)
            choice = {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            if first and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(gen.prompt_logprobs[p], req.prompt_logprobs)
            return choice

        if not req.stream:
            await gen.run_to_end()
            choices = [piece(i, "".join(c.text), c.logprobs, True, c.finish_reason, c.stop_reason)
                       for i, c in enumerate(gen.choices)]
            return _json({"id": request_id, "object": "text_completion", "created": created, "model": model,
                          "choices": choices, "usage": gen.usage(not echo_only)})

        chunk, include_usage = _chunk_builder(request_id, "text_completion", created, model, req.stream_options,
                                              lambda: gen.usage(not echo_only))

        async def events() -> AsyncIterator[bytes]:
            started: set[int] = set()
            async for idx, out in gen.outputs():
                if out.finish_reason == "error":
                    yield _sse(APIError(500, out.error or "generation failed", type="server_error").body())
                    return
                first = idx not in started
                started.add(idx)
                if first or out.text or out.logprobs or out.finish_reason:
                    yield _sse(chunk([piece(idx, out.text, out.logprobs or [], first, out.finish_reason,
                                            out.stop_reason)]))

        return await _stream(request, gen, events(),
                             lambda: _sse(chunk([], gen.usage(not echo_only))) if include_usage else b"")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (OpenAI "Create chat completion"), via the model's chat template."""
        engine = self.engine
        req = await _decode_body(request, ChatCompletionRequest)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        _check_common(req, engine, request_id)
        prompt = await _render_chat(engine, req.messages, req.add_generation_prompt)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        # None: OpenAI's up to the context limit, which Engine.add_request resolves (also within the pool)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        try:
            params = _sampling_params(req, engine, max_tokens=max_tokens,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
            gen = _Generation(engine, [prompt], params, request_id, self._extra(req, request), req.stream)
        except APIError as e:  # name the field the client sent
            sent = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else None,
                    "logprobs": "top_logprobs"}.get(e.param)  # chat's logprobs is a bool; the count is top_logprobs
            if sent is not None:
                e.message = re.sub(rf"\b{e.param}\b", sent, e.message)
                e.param = sent
            raise
        created = int(time.time())
        model = engine.served_model_names[0]

        if not req.stream:
            await gen.run_to_end()
            choices = [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": _chat_logprobs(c.logprobs) if req.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for i, c in enumerate(gen.choices)]
            return _json({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                          "choices": choices, "usage": gen.usage()})

        chunk, include_usage = _chunk_builder(request_id, "chat.completion.chunk", created, model,
                                              req.stream_options, gen.usage)

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(gen.choices)):  # OpenAI's first delta of each choice carries the role
                yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]))
            async for idx, out in gen.outputs():
                if out.finish_reason == "error":
                    yield _sse(APIError(500, out.error or "generation failed", type="server_error").body())
                    return
                if out.text or out.logprobs or out.finish_reason:
                    yield _sse(chunk([{"index": idx, "delta": {"content": out.text} if out.text else {},
                                       "logprobs": _chat_logprobs(out.logprobs or []) if req.logprobs else None,
                                       "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}]))

        return await _stream(request, gen, events(), lambda: _sse(chunk([], gen.usage())) if include_usage else b"")

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (vLLM): {count, max_model_len, tokens, token_strs}."""
        engine = self.engine
        req = await _decode_body(request, TokenizeRequest)
        _check_model(req.model, engine)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await _tokenize(engine, req.prompt, "prompt", add_special_tokens=add, must_fit=False)
        else:
            tokens = await _render_chat(engine, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
        strs = [engine.tokenizer.token_to_str(t) for t in tokens] if req.return_token_strs else None
        return _json({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                      "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize (vLLM): {prompt}, the text of ``tokens``."""
        engine = self.engine
        req = await _decode_body(request, DetokenizeRequest)
        _check_model(req.model, engine)
        vocab = engine.tokenizer.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return _json({"prompt": engine.tokenizer.decode(req.tokens)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint): special tokens and the chat template.

        lm-evaluation-harness's ``tokenizer_backend=remote`` reads it, then tokenizes through /tokenize.
        """
        tok = self.engine.tokenizer
        return _json({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                      "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
                      "eos_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else None,
                      "model_max_length": self.engine.max_model_len, "chat_template": tok.chat_template})

    async def version(self, request: web.Request) -> web.Response:
        """GET /version (vLLM): {version}."""
        from pagedkv import __version__

        return _json({"version": __version__})

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model; ``random_weights`` says whether its outputs are noise."""
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}."""
        if request.match_info["id"] not in _model_names(self.engine):
            raise APIError(404, f"The model `{request.match_info['id']}` does not exist.", "model",
                           code="model_not_found")
        return _json(self._model_card())

    def _model_card(self) -> dict:
        """vLLM's card (id, root, max_model_len) plus ``supports_chat`` (a chat template is loaded:
        /v1/chat/completions works) and ``random_weights``."""
        e = self.engine
        card = {"id": e.served_model_names[0], "object": "model", "created": self.created, "owned_by": "pagedkv",
                "root": e.model_config.path, "max_model_len": e.max_model_len,
                "supports_chat": e.tokenizer.chat_template is not None, "random_weights": e.random_weights}
        if e.random_weights:
            card["owned_by"] = "pagedkv (random weights)"
            card["description"] = ("This model runs on seeded random weights: its outputs are noise. " +
                                   ("Serve a real checkpoint with --model PATH for meaningful text."
                                    if e.model_config.path is None else
                                    "Serve without --load-format dummy for the checkpoint's own weights."))
        return card

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 {"status": "ok"} while the engine serves; 503 with the reason while its worker
        recovers ("recovering: ..."), while it drains for shutdown ("draining"), or once it failed."""
        ok, status = self.engine.health()
        if ok:
            return _json({"status": "ok"})
        state, _, reason = status.partition(": ")
        return _json({"status": state, "reason": reason or None}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: the Prometheus text exposition of the engine's registry."""
        return web.Response(body=generate_latest(self.engine.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def kv_cache(self, request: web.Request) -> web.Response:
        """GET /kv_cache: block_size, num_gpu_blocks, num_free_blocks, usage and each request's block table.

        Request ids are shown as their fingerprints (another tenant's id would let the caller abort
        or correlate it) unless ``?request_ids=raw`` asks for them.
        """
        snap = self.engine.kv_cache_snapshot()
        if request.query.get("request_ids") != "raw":
            for r in snap["requests"] + snap["swapped_requests"]:
                r["id"] = "sha256:" + fingerprint(r["id"])
        return _json(snap)

    async def kv_cache_advice(self, request: web.Request) -> web.Response:
        """GET /kv_cache/advice: tuning advice from the last minutes of metrics (`scheduler.advice`)."""
        return _json(self.engine.advisor.advice())

    async def kv_cache_ui(self, request: web.Request) -> web.Response:
        """GET /kv_cache/ui: the live block-pool page (one static HTML file; it polls /kv_cache)."""
        return web.Response(body=_KV_CACHE_UI, content_type="text/html", charset="utf-8")


async def _stream(request: web.Request, gen: _Generation, events: AsyncIterator[bytes],
                  usage_chunk: Callable[[], bytes]) -> web.StreamResponse:
    """Send ``events`` (SSE bytes, one per delta), then ``usage_chunk()`` unless the generation failed,
    then ``data: [DONE]``. The last delta is held back and goes out with those and the end of the
    chunked body in one write (`write_eof`): one send where there were four. A disconnected client
    aborts the generation, also one gone before the headers could be sent (a benchmark client cut
    off at its deadline): that is a client's choice, logged at info, not a server error."""
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    try:
        try:
            await resp.prepare(request)
            held = b""
            async for event in events:
                if held:
                    await resp.write(held)
                    held = b""
                if gen.finished:
                    held = event
                else:
                    await resp.write(event)
            usage = usage_chunk() if _generation_error(gen.choices) is None else b""
            await resp.write_eof(held + usage + _SSE_DONE)
        except ConnectionResetError:  # the client went away: closing the generation aborts it
            log.info("client disconnected", request_ids=gen.request_ids)
            return resp
        except asyncio.CancelledError:  # the same, noticed by aiohttp's handler cancellation
            log.info("client disconnected", request_ids=gen.request_ids)
            raise
        return resp
    finally:
        await events.aclose()
        await gen.close()


def build_app(engine, *, api_keys: APIKeys | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES) -> web.Application:
    """The aiohttp application serving ``engine`` (see the module docstring for routes).

    api_keys: who may call what (default: no keys, the API is open); max_request_bytes: larger
    bodies get 413.
    """
    api = _API(engine)
    app = web.Application(middlewares=[_errors, _auth], client_max_size=max_request_bytes)
    app[ENGINE_KEY] = engine
    app[API_KEYS] = api_keys or APIKeys()
    app[MAX_BYTES] = max_request_bytes
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{id}", api.model)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/tokenizer_info", api.tokenizer_info)
    app.router.add_get("/version", api.version)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/kv_cache", api.kv_cache)
    app.router.add_get("/kv_cache/advice", api.kv_cache_advice)
    app.router.add_get("/kv_cache/ui", api.kv_cache_ui)
    return app
