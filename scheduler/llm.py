"""The offline Python API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``.

`LLM` starts the same `Engine` (control plane + worker process) that ``pagedkv serve`` runs, on an
event loop in a background thread, so it works from plain scripts and from notebooks that already
run a loop. `generate` and `chat` block until every request ends and return one `RequestOutput`
per prompt, in prompt order, with vLLM's attribute names::

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="../shared/models/stories260K", num_gpu_blocks=256)
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20))
    out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason
    llm.shutdown()  # or `with LLM(...) as llm:`; the worker also stops at interpreter exit
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from dataclasses import dataclass, field

import msgspec

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class Logprob:
    """One token's log-probability (natural log); ``rank`` its 1-based rank in the model's
    distribution (as vLLM: 1 + the tokens more likely; of equally likely ones, those of lower id
    rank first); ``decoded_token`` its text (None with ``detokenize=False``)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's ``CompletionOutput``).

    logprobs: with ``SamplingParams(logprobs=k)``, one dict per output token mapping token id to
    `Logprob`: the chosen token and the top k alternatives. cumulative_logprob: the sum of the output
    tokens' logprobs, with ``logprobs`` or beam search (a beam's), else None (as vLLM). finish_reason: "stop" | "length" |
    "abort" | "error". stop_reason: the stop string or stop token id that ended it, None for EOS
    or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything one prompt produced (vLLM's ``RequestOutput``).

    prompt_logprobs: with ``SamplingParams(prompt_logprobs=k)``, one entry per prompt token: None
    for the first (nothing precedes it), then a dict of `Logprob` (the prompt token and the top k).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = field(default=None, repr=False)


@dataclass
class BeamSearchSequence:
    """One beam `LLM.beam_search` returns (vLLM's ``BeamSearchSequence``).

    tokens: the prompt's ids then the beam's output ids, and text their decoding with special
    tokens kept (both as vLLM's); cum_logprob: the sum of the output tokens' logprobs (natural log);
    finish_reason "stop" (ended in EOS) | "length". logprobs: None, pagedkv's beam search keeps no
    per-step alternatives (vLLM lists the 2 x beam_width candidates of each step).
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first, at most beam_width (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


class LLM:
    """An engine for offline generation: ``LLM(model=PATH, **engine_args)``.

    engine_args are `EngineConfig` fields with vLLM's names (``max_model_len``, ``block_size``,
    ``num_gpu_blocks``, ``gpu_memory_utilization``, ``enable_prefix_caching``, ``seed``,
    ``dtype``, ``device``, ``chat_template`` as a file or the template itself, ...). model None
    runs the embedded random-weights model. Raises TypeError for an unknown argument,
    FileNotFoundError / ValueError for a bad checkpoint, and `WorkerFailed` when the worker cannot
    start.
    """

    def __init__(self, model: str | None = None, **engine_args):
        from pagedkv.scheduler.engine import Engine
        from pagedkv.scheduler.tokenizer import load_chat_template

        if engine_args.get("chat_template") is not None:
            engine_args["chat_template"] = load_chat_template(engine_args["chat_template"])
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        config = EngineConfig(model=model, **engine_args)
        config.validate()  # a bad value is named here, not hit by the worker (or hung on)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedkv-llm", daemon=True)
        self._thread.start()
        self._counter = 0
        try:
            self.engine = self._call(Engine.start(config))
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        # not atexit.register(self.shutdown): that reference kept every LLM alive, so one dropped
        # (`llm = LLM(...)` run again in a notebook, `del llm`) left its worker running until exit
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, [self.engine])

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def get_tokenizer(self):
        """The engine's `scheduler.tokenizer.Tokenizer` (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; returns one `RequestOutput` per prompt, in order.

        prompts: a string, a list of strings, or vLLM's prompt dicts ``{"prompt": str}`` and
        ``{"prompt_token_ids": [...]}`` (one or a list, mixed). SamplingParams ``max_tokens=None``:
        up to max_model_len; a prompt + max_tokens past max_model_len stops there with finish_reason
        "length" (as vLLM's offline LLM; the server refuses it). sampling_params: one for all
        prompts or one per prompt (default: ``SamplingParams()``, vLLM's defaults). Raises ValueError("<field>: <why>") for a request the
        engine cannot serve, before any prompt runs.
        """
        return self._run(self._prompt_items(prompts), sampling_params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: one `BeamSearchOutput` per prompt, in order.

        prompts as `generate` takes them. Runs the engine's beam search (``SamplingParams(n=beam_width,
        use_beam_search=True)``: forked block tables, one request per prompt), scored as `BeamSearchParams`
        says. Raises ValueError("<field>: <why>") for params it cannot run, before any prompt runs.
        """
        outs = self._run(self._prompt_items(prompts), params.sampling_params(self.engine.config.max_n), use_tqdm)
        decode = self.engine.tokenizer.decode
        results = []
        for out in outs:
            beams = []
            for c in out.outputs:
                tokens = out.prompt_token_ids + c.token_ids
                beams.append(BeamSearchSequence(tokens, None, c.cumulative_logprob,
                                                decode(tokens, skip_special_tokens=False), c.finish_reason, c.stop_reason))
            results.append(BeamSearchOutput(beams))
        return results

    def _prompt_items(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, self.engine.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                items.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and isinstance(p.get("prompt"), str):  # vLLM's TextPrompt
                items.append((p["prompt"], self.engine.tokenizer.encode(p["prompt"])))
            else:
                raise TypeError(f"prompts: expected a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                                f"got {p!r:.80}")
        return items

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or several (a list of them)
        with the chat template (the checkpoint's, or the ``chat_template`` engine argument).

        Raises ValueError("messages: ...") when there is no chat template or it rejects the messages.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        items = []
        for conv in conversations:
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            items.append((text, tok.encode(text, add_special_tokens=False)))  # the template writes BOS
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        return self._call(self._generate_all(items, params, use_tqdm))

    async def _generate_all(self, items, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        streams = []
        try:
            for (text, ids), p in zip(items, params):
                p = self._capped(p, len(ids))
                self._counter += 1
                rid = str(self._counter)
                streams.append((rid, text, ids, p, self.engine.add_request(ids, p, rid)))
        except BaseException:  # one prompt cannot be served: none runs
            for rid, *_ in streams:
                self.engine.abort(rid)
            raise
        bar = tqdm(total=len(streams), desc="generate", disable=not use_tqdm)

        async def one(rid, text, ids, p, stream) -> RequestOutput:
            out = await _collect(self.engine, rid, text, ids, p, stream)
            bar.update(1)
            return out

        try:
            return list(await asyncio.gather(*(one(*s) for s in streams)))
        finally:
            bar.close()

    def _capped(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """vLLM's offline LLM stops a prompt + max_tokens past max_model_len at max_model_len
        (finish_reason "length") instead of refusing it; the server keeps refusing it (HTTP 400)."""
        room = self.engine.max_model_len - prompt_len
        if not isinstance(params.max_tokens, int) or not isinstance(params.min_tokens, int) or room < 1 \
                or params.max_tokens <= room:  # the engine names a bad type; a prompt with no room stays an error
            return params
        return msgspec.structs.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def shutdown(self) -> None:
        """Stop the engine and its worker process (idempotent); also done when the LLM is garbage
        collected and at interpreter exit."""
        self.engine = None
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join(timeout=10)


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine_box: list) -> None:
    """Shut an `LLM`'s engine down and stop its loop; holds no reference to the LLM (weakref.finalize)."""
    engine, engine_box[0] = engine_box[0], None
    if engine is not None and loop.is_running():
        future = asyncio.run_coroutine_threadsafe(engine.shutdown(), loop)
        if threading.current_thread() is thread:  # collected on the loop's own thread: cannot wait here
            future.add_done_callback(lambda _: _stop_loop(loop, thread))
            return
        future.result()
    _stop_loop(loop, thread)


def _logprob_dict(tokenizer, lp, detokenize: bool) -> dict[int, Logprob]:
    """vLLM's per-position dict of a `TokenLogprob`: the token itself, first when it is not among
    the top alternatives, and those (ranked by their place); decoded tokens None without detokenize."""
    d = {t: Logprob(v, rank, s if detokenize else None) for rank, (t, s, v) in enumerate(lp.top_logprobs, start=1)}
    if lp.token_id not in d:
        text = tokenizer.token_to_str(lp.token_id) if detokenize else None
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, text), **d}
    return d


async def _collect(engine, rid: str, text: str | None, ids: list[int], params: SamplingParams,
                   stream) -> RequestOutput:
    n = params.n
    texts = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop: list = [None] * n
    beam_cum: list[float | None] = [None] * n  # beam search: the engine's sum for each returned beam
    error, cached, prompt_lps = None, 0, None
    async for out in stream:
        if out.prompt_logprobs is not None:
            prompt_lps = out.prompt_logprobs
        i = out.index
        texts[i].append(out.text)
        tokens[i].extend(out.token_ids)
        if out.logprobs:
            lps[i].extend(out.logprobs)
        cached = max(cached, out.num_cached_tokens)
        if out.cumulative_logprob is not None:
            beam_cum[i] = out.cumulative_logprob
        if out.finish_reason is not None:
            finish[i] = out.finish_reason
            stop[i] = out.stop_reason
            error = error or out.error
    tok = engine.tokenizer
    outputs = []
    for i in range(n):
        logprobs = None
        if params.logprobs is not None:
            logprobs = [_logprob_dict(tok, lp, params.detokenize) for lp in lps[i]]
        cumulative = sum(lp.logprob for lp in lps[i]) if params.logprobs is not None else beam_cum[i]
        outputs.append(CompletionOutput(i, "".join(texts[i]), tokens[i], cumulative, logprobs, finish[i], stop[i]))
    prompt_logprobs = None
    if params.prompt_logprobs is not None and prompt_lps is not None:
        def text(s: str) -> str | None:
            return s if params.detokenize else None

        prompt_logprobs = [None] + [
            {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token)),
             **{t: Logprob(v, r, text(s)) for r, (t, s, v) in enumerate(lp.top_logprobs, start=1) if t != lp.token_id}}
            for lp in prompt_lps[1:]]
    return RequestOutput(rid, text, ids, prompt_logprobs, outputs, True, cached, error)
