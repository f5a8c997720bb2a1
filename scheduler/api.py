"""The OpenAI-compatible HTTP API (aiohttp) in front of one `Engine`.

Routes (OpenAI API reference, vLLM's extra fields):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or Server-Sent Events when
  ``stream`` is true (WHATWG HTML "Server-sent events": one ``data: {json}`` event per chunk,
  each followed by a blank line, then ``data: [DONE]``);
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one served model, with ``random_weights``;
- ``GET /health`` (200 or 503), ``GET /metrics`` (Prometheus text), ``GET /kv_cache`` (the block
  pool and every live request's block table, `Engine.kv_cache_snapshot`).

Every invalid request gets an OpenAI-style error body naming the field::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

A client that disconnects aborts its requests: the engine's output iterators are closed, which
returns their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedkv.common.log import get_logger
from pagedkv.common.sampling_params import SamplingParams

log = get_logger("pagedkv.api")

ENGINE_KEY: web.AppKey = web.AppKey("engine", object)  # the app's engine, for startup/cleanup hooks

# Request bodies above this are refused by aiohttp with 413 (long prompts as token-id lists fit).
MAX_BODY_BYTES = 32 * 2**20


# ---- errors ---------------------------------------------------------------------------------

class APIError(Exception):
    """An error returned to the client as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

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
async def _errors(request: web.Request, handler):
    """Every error leaves as OpenAI-style JSON, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except APIError as e:
        if e.status < 500:
            log.info("request rejected", path=request.path, status=e.status, param=e.param, error=e.message)
        return _json(e.body(), e.status)
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

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct):
    """Fields shared by completions and chat completions. None means "the default"."""

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
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    cache_salt: str | None = None
    priority: int = 0


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists. ``logprobs``: how many top alternatives per token (0..max_logprobs).
    ``echo``: the prompt text comes first in each choice (prompt tokens get no logprobs)."""

    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) None: up to the
    context limit. ``logprobs`` bool, ``top_logprobs`` 0..max_logprobs alternatives per token."""

    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


async def _decode_body(request: web.Request, cls: type[msgspec.Struct]):
    raw = await request.read()
    try:
        # The stdlib parser accepts NaN/Infinity, so such a value reaches validation and gets
        # its field named instead of a bare "malformed JSON".
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as e:
        raise _from_validation_error(e) from None


# ---- shared request handling ----------------------------------------------------------------

def _sampling_params(req: _SamplingFields, engine, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Build and validate SamplingParams; raises APIError naming the first invalid field."""
    def pick(value, default):
        return default if value is None else value

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, -1),
        min_p=pick(req.min_p, 0.0), repetition_penalty=pick(req.repetition_penalty, 1.0),
        presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
        seed=req.seed, max_tokens=max_tokens, logprobs=logprobs, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens, n=req.n, use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty, early_stopping=req.early_stopping)
    try:
        params.validate(max_logprobs=engine.config.max_logprobs, max_n=engine.config.max_n)
    except ValueError as e:
        raise _from_value_error(e) from None
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise APIError(400, f"stop_token_ids: every id must be in [0, {vocab})", "stop_token_ids")
    return params


def _check_common(req: _SamplingFields, engine) -> None:
    if req.model is not None and req.model not in _model_names(engine):
        raise APIError(404, f"The model `{req.model}` does not exist.", "model", code="model_not_found")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")


def _model_names(engine) -> set[str]:
    names = {engine.model_config.name}
    if engine.config.model:
        names.add(engine.config.model)
    return names


class _Choice:
    """What one choice accumulated: text, tokens, logprobs, finish reason."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "error", "num_output_tokens")

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_output_tokens = 0


class _Generation:
    """The engine requests of one HTTP request (one per prompt), merged into one output stream.

    Yields (choice index, RequestOutput) with choice index = prompt index * n + output index, as
    OpenAI numbers choices for a batch of prompts. `close` aborts whatever is still running.
    """

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams, base_id: str, extra: dict):
        self.engine = engine
        self.n = params.n
        self.request_ids: list[str] = []
        self.iterators: list[AsyncIterator] = []
        self.prompt_tokens = [len(p) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        self.choices = [_Choice() for _ in range(len(prompts) * params.n)]
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
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, it: AsyncIterator) -> None:
            try:
                async for out in it:
                    queue.put_nowait((i, out))
            finally:  # the consumer counts ends, whatever way this one ended
                queue.put_nowait((i, None))

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
        c.text.append(out.text)
        c.token_ids.extend(out.token_ids)
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        c.num_output_tokens = out.num_output_tokens
        if out.finish_reason is not None:
            c.finish_reason, c.error = out.finish_reason, out.error
        self.prompt_tokens[prompt_index] = out.num_prompt_tokens
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], out.num_cached_tokens)
        return idx

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_output_tokens for c in self.choices)
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


async def _start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


def _generation_error(choices: list[_Choice]) -> str | None:
    return next((c.error or "generation failed" for c in choices if c.finish_reason == "error"), None)


# ---- logprobs formats -----------------------------------------------------------------------

def _completion_logprobs(lps: list, text_offset: int) -> dict:
    """The legacy completions format: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        token_logprobs.append(lp.logprob)
        alternatives = {tok: val for _, tok, val in lp.top_logprobs}
        alternatives.setdefault(lp.token, lp.logprob)  # OpenAI: the chosen token is always listed
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


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

def _prompt_token_lists(req: CompletionRequest, tokenizer) -> tuple[list[list[int]], list[str | None]]:
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
            ids.append(tokenizer.encode(item))
            texts.append(item)
        else:
            ids.append(item)
            texts.append(None)
    return ids, texts


def _chunk_builder(request_id: str, obj: str, created: int, model: str, include_usage: bool):
    """Builds SSE chunk bodies; with ``stream_options.include_usage`` each carries ``usage`` (null until the last)."""

    def chunk(choices: list, usage: dict | None = None) -> dict:
        body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    return chunk


class _API:
    """Route handlers bound to one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.created = int(time.time())  # the model card's "created": when serving began

    def _extra(self, req: _SamplingFields, request: web.Request) -> dict:
        extra = {"priority": req.priority, "cache_salt": req.cache_salt}
        if traceparent := request.headers.get("traceparent"):  # W3C Trace Context: continue the client's trace
            extra["traceparent"] = traceparent
        return extra

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (OpenAI "Create completion")."""
        engine = self.engine
        req = await _decode_body(request, CompletionRequest)
        _check_common(req, engine)
        prompts, prompt_texts = _prompt_token_lists(req, engine.tokenizer)
        if req.max_tokens is None:
            raise APIError(400, "max_tokens: must be an integer >= 1", "max_tokens")
        params = _sampling_params(req, engine, max_tokens=req.max_tokens, logprobs=req.logprobs)
        if req.echo:
            prompt_texts = [t if t is not None else engine.tokenizer.decode(ids) for t, ids in zip(prompt_texts, prompts)]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = _Generation(engine, prompts, params, request_id, self._extra(req, request))
        model = engine.model_config.name
        offsets = [len(prompt_texts[i // params.n]) if req.echo else 0 for i in range(len(gen.choices))]

        def logprobs_of(idx: int, lps) -> dict | None:
            if req.logprobs is None:
                return None
            out = _completion_logprobs(lps, offsets[idx])
            offsets[idx] += sum(len(lp.token) for lp in lps)
            return out

        if not req.stream:
            await gen.run_to_end()
            choices = [{"index": i,
                        "text": (prompt_texts[i // params.n] if req.echo else "") + "".join(c.text),
                        "logprobs": logprobs_of(i, c.logprobs), "finish_reason": c.finish_reason,
                        "stop_reason": None}
                       for i, c in enumerate(gen.choices)]
            return _json({"id": request_id, "object": "text_completion", "created": created, "model": model,
                          "choices": choices, "usage": gen.usage()})

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunk = _chunk_builder(request_id, "text_completion", created, model, include_usage)

        async def events() -> AsyncIterator[bytes]:
            if req.echo:
                for i in range(len(gen.choices)):
                    yield _sse(chunk([{"index": i, "text": prompt_texts[i // params.n], "logprobs": None,
                                       "finish_reason": None}]))
            async for idx, out in gen.outputs():
                if out.finish_reason == "error":
                    yield _sse(APIError(500, out.error or "generation failed", type="server_error").body())
                    return
                if out.text or out.logprobs or out.finish_reason:
                    yield _sse(chunk([{"index": idx, "text": out.text,
                                       "logprobs": logprobs_of(idx, out.logprobs or []),
                                       "finish_reason": out.finish_reason}]))
            if include_usage:
                yield _sse(chunk([], gen.usage()))

        return await _stream(request, gen, events())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (OpenAI "Create chat completion"), via the model's chat template."""
        engine = self.engine
        req = await _decode_body(request, ChatCompletionRequest)
        _check_common(req, engine)
        if not req.messages:
            raise APIError(400, "messages: must be a non-empty list", "messages")
        if engine.tokenizer.chat_template is None:
            raise APIError(400, f"messages: model {engine.model_config.name!r} has no chat template; "
                                "use /v1/completions", "messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" or p.text is None for p in content):
                    raise APIError(400, f"messages[{i}].content: only text content parts are supported",
                                   f"messages[{i}].content")
                content = "\n".join(p.text for p in content)
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise _from_value_error(e) from None
        # The template writes BOS itself when the model wants one (transformers does the same).
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        if not prompt:
            raise APIError(400, "messages: the rendered prompt is empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # OpenAI: up to the context limit; here also up to what the pool can hold
            snap = engine.kv_cache_snapshot()
            room = min(engine.max_model_len, snap["num_gpu_blocks"] * snap["block_size"]) - len(prompt)
            max_tokens = max(room, 1)
        params = _sampling_params(req, engine, max_tokens=max_tokens,
                                  logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = _Generation(engine, [prompt], params, request_id, self._extra(req, request))
        model = engine.model_config.name

        if not req.stream:
            await gen.run_to_end()
            choices = [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": _chat_logprobs(c.logprobs) if req.logprobs else None,
                        "finish_reason": c.finish_reason}
                       for i, c in enumerate(gen.choices)]
            return _json({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                          "choices": choices, "usage": gen.usage()})

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunk = _chunk_builder(request_id, "chat.completion.chunk", created, model, include_usage)

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
                                       "finish_reason": out.finish_reason}]))
            if include_usage:
                yield _sse(chunk([], gen.usage()))

        return await _stream(request, gen, events())

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
        e = self.engine
        card = {"id": e.model_config.name, "object": "model", "created": self.created, "owned_by": "pagedkv",
                "root": e.model_config.path, "max_model_len": e.max_model_len, "random_weights": e.random_weights}
        if e.random_weights:
            card["owned_by"] = "pagedkv (random weights)"
            card["description"] = ("This model runs on seeded random weights: its outputs are noise. "
                                   "Serve a real checkpoint with --model PATH for meaningful text.")
        return card

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while the engine serves, 503 once it has failed or stopped."""
        if self.engine.healthy:
            return _json({"status": "ok"})
        return _json({"status": "unhealthy"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: the Prometheus text exposition of the engine's registry."""
        return web.Response(body=generate_latest(self.engine.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def kv_cache(self, request: web.Request) -> web.Response:
        """GET /kv_cache: block_size, num_gpu_blocks, num_free_blocks, usage and each request's block table."""
        return _json(self.engine.kv_cache_snapshot())


async def _stream(request: web.Request, gen: _Generation, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Send ``events`` as SSE, then ``data: [DONE]``; a disconnected client aborts the generation."""
    try:
        resp = await _start_sse(request)
        try:
            async for event in events:
                await resp.write(event)
            await resp.write(_SSE_DONE)
        except ConnectionResetError:  # the client went away: closing the generation aborts it
            log.info("client disconnected", request_ids=gen.request_ids)
            return resp
        except asyncio.CancelledError:  # the same, noticed by aiohttp's handler cancellation
            log.info("client disconnected", request_ids=gen.request_ids)
            raise
        await resp.write_eof()
        return resp
    finally:
        await events.aclose()
        await gen.close()


def build_app(engine) -> web.Application:
    """The aiohttp application serving ``engine`` (see the module docstring for routes)."""
    api = _API(engine)
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{id}", api.model)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/kv_cache", api.kv_cache)
    return app
