"""Output processing: sampled token ids in, streamed `RequestOutput` deltas out.

For each user request the engine keeps one `RequestStream`: its output queue (`OutputQueue`: a
delta its consumer has not taken yet absorbs the next one of the same choice), the sibling
sequences serving its ``n`` choices (n > 1 or beam search), a detokenizer per choice and its
clocks. `OutputProcessor` turns one step's sampled tokens into deltas: it appends each token,
detokenizes it (`scheduler.detokenizer`), checks the stop conditions (EOS, stop token ids, stop
strings, max_tokens, max_model_len), attaches logprobs, and drives beam search (`scheduler.
beam_search`): forking surviving beams and dropping the others through the scheduler, and
reporting the best hypotheses once the search ends. Metrics, tracing and the request log stay
with the engine, which closes a stream when this module says it is done.
"""

from __future__ import annotations

import asyncio

import msgspec

from pagedkv.common.protocol import PromptLogprobs, SampledToken
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.beam_search import BeamSearch
from pagedkv.scheduler.detokenizer import IncrementalDetokenizer, NoDetokenizer
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.scheduler import Scheduler
from pagedkv.scheduler.tokenizer import Tokenizer


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index`` of a seeded n > 1 request; choice 0 keeps the request's own seed."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


class TokenLogprob(msgspec.Struct):
    """A token's log-probability (natural log), the top alternatives (id, text, logprob), and its
    1-based rank in the model's distribution (equal values by token id, as the alternatives)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]]
    rank: int | None = None


class RequestOutput(msgspec.Struct):
    """One streamed delta of one choice: the tokens and text new since the previous delta.

    finish_reason: None while running, then "stop" | "length" | "abort" | "error" (with ``error``).
    stop_reason: with finish_reason "stop", the stop string or stop token id that matched (None for EOS).
    prompt_logprobs: on each choice's first delta when ``prompt_logprobs`` was asked: one entry per
    prompt token, None for the first.
    cumulative_logprob: beam search, on each returned beam: the sum of its tokens' logprobs (natural log).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None


class OutputQueue:
    """A request's deltas waiting for its consumer, at most one per choice (vLLM V1's
    RequestOutputCollector): a delta for a choice whose previous one has not been taken yet merges
    into it (token ids, text and logprobs appended; finish and stop reasons, error, counts and a
    beam's cumulative logprob from the newer), so a consumer that reads slowly or not at all holds
    its output once, not an object per token, and gets fewer, larger deltas when it catches up, their
    concatenation unchanged.

    Deltas come out in the order their choices' first waiting delta went in. An error delta never
    merges into the one before it (the API sends an error delta's text nowhere): that one goes out
    first. A merged delta's text is kept in a few pieces of decreasing length, joined when taken: a
    long stall costs neither a copy of the whole text per token nor a string per token.
    """

    def __init__(self):
        self._waiting: dict[tuple[int, bool], RequestOutput] = {}  # (choice index, is an error) -> delta
        self._texts: dict[tuple[int, bool], list[str]] = {}  # a merged delta's text pieces
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        """The number of deltas waiting (at most two per choice: the last one an error)."""
        return len(self._waiting)

    def empty(self) -> bool:
        return not self._waiting

    def put(self, out: RequestOutput) -> None:
        """Queue one choice's delta, or merge it into the one of that choice still waiting."""
        key = (out.index, out.finish_reason == "error")
        waiting = self._waiting.get(key)
        if waiting is None:
            self._waiting[key] = out
            self._ready.set()
            return
        texts = self._texts.get(key)
        if texts is None:  # its first merge: its own lists, the sender's are never changed
            texts = self._texts[key] = [waiting.text]
            waiting = self._waiting[key] = msgspec.structs.replace(
                waiting, token_ids=list(waiting.token_ids),
                logprobs=None if waiting.logprobs is None else list(waiting.logprobs))
        texts.append(out.text)
        while len(texts) > 1 and len(texts[-2]) <= 2 * len(texts[-1]):  # each piece over twice the next:
            texts[-2:] = [texts[-2] + texts[-1]]  # O(log) pieces, each character copied O(log) times
        waiting.token_ids += out.token_ids
        if out.logprobs is not None:
            if waiting.logprobs is None:
                waiting.logprobs = []
            waiting.logprobs += out.logprobs
        waiting.finish_reason, waiting.stop_reason, waiting.error = out.finish_reason, out.stop_reason, out.error
        waiting.num_prompt_tokens, waiting.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        waiting.num_cached_tokens = out.num_cached_tokens
        if out.cumulative_logprob is not None:
            waiting.cumulative_logprob = out.cumulative_logprob
        if waiting.prompt_logprobs is None:
            waiting.prompt_logprobs = out.prompt_logprobs

    async def get(self) -> RequestOutput:
        """The oldest waiting delta, once there is one."""
        while not self._waiting:
            self._ready.clear()
            await self._ready.wait()
        key = next(iter(self._waiting))
        out = self._waiting.pop(key)
        if (texts := self._texts.pop(key, None)) is not None:
            out.text = "".join(texts)
        return out


class RequestStream:
    """Engine-side companion of one user request: its output queue, its choices and clocks.

    A request with n > 1 (or beam search) is served by several sibling `Request`s; each choice
    index gets its own detokenizer. The stream ends once all ``n`` choices have finished.
    Clocks are time.monotonic() seconds.
    """

    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.queue = OutputQueue()
        self.detoks: dict[int, IncrementalDetokenizer | NoDetokenizer] = {}
        self.finished: set[int] = set()  # choice indices
        self.members: list[Request] = []  # every sequence ever created for it
        self.beam: BeamSearch | None = None
        self.num_beam_output_tokens = 0  # beam search: the output tokens of the hypotheses returned
        self.next_beam = 1  # beam search: the next beam's id suffix (beam0 leads; ids are never reused)
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None  # time.monotonic() of its first scheduling (metrics)
        self.first_token_time: float | None = None
        self.last_token_time = arrival_time
        self.span = None  # its OpenTelemetry span, when tracing is on
        # per prompt position, filled as prefill chunks report them (a recompute refills the same values)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # sized by OutputProcessor.add
        self.prompt_logprobs_sent: set[int] = set()  # choice indices whose first delta carried them
        self.queued: list[Request] = []  # its sequences set aside while quarantined (Engine._step_failed)
        self.prompt_only = False  # its sampled tokens are dropped (echo with max_tokens 0): none count as output
        self.held: dict[int, RequestOutput] = {}  # per choice, the delta not yet sent (--stream-interval)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n


class OutputProcessor:
    """Creates the sequences of each request and turns their sampled tokens into output deltas.

    Owns ``streams`` (user request id -> stream) and ``owner`` (sequence id -> its stream). Ends
    and forks sequences through ``scheduler`` (which frees their blocks).
    """

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, max_model_len: int, stream_interval: int = 1):
        """stream_interval: output tokens per delta after each choice's first (vLLM's ``--stream-interval``);
        a choice's last delta goes out at once. Raises ValueError when it is < 1."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval: must be at least 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        self.streams: dict[str, RequestStream] = {}
        self.owner: dict[str, RequestStream] = {}

    # ---- creating a request's sequences ------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
            priority: int = 0, cache_salt: str | None = None) -> tuple[RequestStream, list[Request]]:
        """Create the stream and the sequences of one request; returns it and the sequences to queue.

        n > 1: n siblings with derived seeds; beam search: one leader beam (greedy, top-k logprobs).
        With more than one sequence and a prompt longer than one token, only the leader is queued:
        the others fork from it at the prompt's last token (``pending_forks``).
        """
        stream = RequestStream(request_id, params, arrival_time)
        if params.prompt_logprobs is not None:
            stream.prompt_logprobs = [None] * len(prompt_token_ids)
        group: list[Request] = []

        def member(rid: str, sampling: SamplingParams, index: int) -> Request:
            width = params.n if params.use_beam_search else None
            req = Request(rid, prompt_token_ids, sampling, arrival_time, priority, cache_salt, group, index, width)
            self._register(stream, req)
            return req

        ids = self.sequence_ids(request_id, params)
        if params.use_beam_search:
            # as transformers: keep max(2, 1 + #eos) x width candidates, so width survive the EOS ones;
            # ignore_eos: EOS is an ordinary token (as vLLM's beam search), no beam ends on it
            eos = [] if params.ignore_eos else self.tokenizer.eos_token_ids
            keep = max(2, 1 + len(eos)) * params.n
            beam_params = SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=keep,
                                         use_beam_search=True, ignore_eos=True)
            leader = member(ids[0], beam_params, 0)
            stream.beam = BeamSearch(params.n, params.max_tokens, params.length_penalty, params.early_stopping,
                                     eos, len(prompt_token_ids), leader.request_id)
            members = [leader]
        else:
            members = [member(ids[i], msgspec.structs.replace(params, n=1, seed=child_seed(params.seed, i)), i)
                       for i in range(params.n)]
            for req in members:
                stream.detoks[req.index] = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, params.stop, params.skip_special_tokens,
                    min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output) \
                    if params.detokenize else NoDetokenizer()
        if len(members) > 1 and len(prompt_token_ids) > 1:  # siblings fork at the prompt's last token
            members[0].pending_forks = members[1:]
            members = members[:1]
        self.streams[request_id] = stream
        return stream, members

    @staticmethod
    def sequence_ids(request_id: str, params: SamplingParams) -> list[str]:
        """The ids of a request's first sequences: its own for n = 1, ``<id>-<i>`` for each of n > 1,
        ``<id>-beam0`` for beam search (later beams take the next free ``<id>-beam<k>``)."""
        if params.use_beam_search:
            return [f"{request_id}-beam0"]
        return [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]

    def _register(self, stream: RequestStream, req: Request) -> None:
        stream.members.append(req)
        self.owner[req.request_id] = stream

    # ---- sampled tokens ----------------------------------------------------------------------

    def process(self, stream: RequestStream, req: Request, sampled: SampledToken) -> RequestStatus | None:
        """Apply one sampled token of running sequence ``req``; returns a status once the stream is done."""
        if stream.beam is not None:
            return self._beam_report(stream, req, sampled.top_logprobs or [])
        return self._token(stream, req, sampled)

    def prompt_logprobs(self, reports: list[PromptLogprobs]) -> None:
        """Store the prompt tokens' logprobs a step reported, by prompt position."""
        tok = self.tokenizer.token_to_str
        for p in reports:
            req = self.scheduler.requests.get(p.request_id)
            stream = self.owner.get(p.request_id)
            if req is None or stream is None or stream.prompt_logprobs is None:
                continue
            for i, (lp, rank, top) in enumerate(zip(p.logprobs, p.ranks, p.top_logprobs)):
                token = req.prompt_token_ids[p.start + i]
                stream.prompt_logprobs[p.start + i] = TokenLogprob(token, tok(token), lp,
                                                                   [(t, tok(t), v) for t, v in top], rank)

    def _token(self, stream: RequestStream, req: Request, sampled: SampledToken) -> RequestStatus | None:
        """Append a sampled token to one sequence, detokenize, check its stop conditions, stream it."""
        params, token, detok = req.sampling, sampled.token_id, stream.detoks[req.index]
        req.token_ids.append(token)
        status, stop_reason = None, None
        if token in params.stop_token_ids:  # vLLM: stop_reason is the token id; its text only when asked
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
            text = (detok.append(token) if params.include_stop_str_in_output else "") + detok.flush()
        elif not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            status, text = RequestStatus.FINISHED_STOPPED, detok.flush()
        else:
            text = detok.append(token)
            if detok.stopped:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_reason
            elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
                text += detok.flush()
        logprobs = None
        if params.logprobs is not None and sampled.logprob is not None:
            tok = self.tokenizer.token_to_str
            logprobs = [TokenLogprob(token, tok(token), sampled.logprob,
                                     [(t, tok(t), lp) for t, lp in sampled.top_logprobs or []], sampled.rank)]
        self._send(stream, self._output(stream, req, req.index, [token], text, logprobs, status,
                                        stop_reason=stop_reason))
        if status is None:
            return None
        self.scheduler.finish(req, status)
        stream.finished.add(req.index)
        return status if stream.done else None

    def _beam_report(self, stream: RequestStream, req: Request,
                     top_logprobs: list[tuple[int, float]]) -> RequestStatus | None:
        """Collect one beam's candidates; once all beams reported, fork, extend and drop beams."""
        search = stream.beam
        if not search.report(req.request_id, top_logprobs):
            return None
        live = {rid: self.scheduler.requests[rid] for rid in search.cum_logprob}
        bases = {rid: list(r.token_ids) for rid, r in live.items()}
        chosen = search.step({rid: r.output_token_ids for rid, r in live.items()})
        kept: set[str] = set()
        for parent_id, token, cum in chosen:
            parent = live[parent_id]
            if parent_id not in kept:  # the first child continues in the parent's own blocks
                kept.add(parent_id)
                parent.token_ids.append(token)
                parent.unsent_token_ids.append(token)
                search.set_beam(parent_id, cum)
                continue
            while f"{stream.request_id}-beam{stream.next_beam}" in self.owner:  # another request's sequence
                stream.next_beam += 1
            child = Request(f"{stream.request_id}-beam{stream.next_beam}", parent.prompt_token_ids,
                            parent.sampling, stream.arrival_time, parent.priority, parent.cache_salt,
                            parent.group, len(stream.members), parent.group_width)
            child.token_ids = bases[parent_id] + [token]
            stream.next_beam += 1
            self._register(stream, child)
            self.scheduler.fork(parent, [child])
            search.set_beam(child.request_id, cum)
        for rid, beam in live.items():
            if rid not in kept:  # a beam without children gives its blocks back
                self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        if not search.done:
            return None
        results = search.results()
        stream.num_beam_output_tokens = sum(len(hyp.token_ids) for hyp in results)
        for i, hyp in enumerate(results):
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, [], stream.params.skip_special_tokens) \
                if stream.params.detokenize else NoDetokenizer()
            text = "".join(detok.append(t) for t in hyp.token_ids) + detok.flush()
            status = RequestStatus.FINISHED_STOPPED if hyp.ended_with_eos else RequestStatus.FINISHED_LENGTH
            self._send(stream, RequestOutput(stream.request_id, i, hyp.token_ids, text, None, status.finish_reason,
                                             None, req.num_prompt_tokens, len(hyp.token_ids), req.num_cached_tokens,
                                             cumulative_logprob=hyp.cum_logprob))
            stream.finished.add(i)
        self.end(stream, RequestStatus.FINISHED_LENGTH)
        return RequestStatus.FINISHED_LENGTH

    # ---- ending ------------------------------------------------------------------------------

    def end(self, stream: RequestStream, status: RequestStatus, error: str | None = None) -> None:
        """Finish every live sequence of a request; unfinished choices get a final delta with ``status``,
        carrying the text their detokenizer still held back (a possible stop string, a partial character)."""
        for req in stream.members:
            if req.request_id in self.scheduler.requests:
                self.scheduler.finish(req, status)
        first = stream.members[0]
        for index in range(stream.n):
            if index not in stream.finished:
                req = next((m for m in stream.members if m.index == index), first)
                text = stream.detoks[index].flush() if index in stream.detoks and \
                    status is not RequestStatus.FINISHED_ERROR else ""  # the API sends an error delta's text nowhere
                self._send(stream, self._output(stream, req, index, [], text, None, status, error))
                stream.finished.add(index)

    def _send(self, stream: RequestStream, out: RequestOutput) -> None:
        """Queue one choice's delta, merged into the one held back for it, or hold it back: a running
        choice's delta waits until it carries ``stream_interval`` tokens, except the choice's first
        (it carries all the choice's tokens so far)."""
        held = stream.held.pop(out.index, None)
        if held is not None and out.finish_reason == "error":  # the API sends an error delta's text nowhere
            stream.queue.put(held)
        elif held is not None:  # never a choice's first delta, so it carries no prompt_logprobs
            logprobs = None if held.logprobs is None and out.logprobs is None else \
                (held.logprobs or []) + (out.logprobs or [])
            out = msgspec.structs.replace(out, token_ids=held.token_ids + out.token_ids, text=held.text + out.text,
                                          logprobs=logprobs)
        n = len(out.token_ids)
        if out.finish_reason is None and n < self.stream_interval and n < out.num_output_tokens:
            stream.held[out.index] = out
            return
        stream.queue.put(out)

    def forget(self, stream: RequestStream) -> None:
        """Drop a finished request's stream and sequence ids."""
        self.streams.pop(stream.request_id, None)
        for req in stream.members:
            self.owner.pop(req.request_id, None)

    @staticmethod
    def _output(stream: RequestStream, req: Request, index: int, token_ids: list[int], text: str,
                logprobs: list[TokenLogprob] | None, status: RequestStatus | None,
                error: str | None = None, stop_reason: str | int | None = None) -> RequestOutput:
        prompt_logprobs = None  # each choice's first delta carries the prompt's logprobs
        if stream.prompt_logprobs is not None and index not in stream.prompt_logprobs_sent:
            stream.prompt_logprobs_sent.add(index)
            prompt_logprobs = stream.prompt_logprobs
        return RequestOutput(stream.request_id, index, token_ids, text, logprobs,
                             status.finish_reason if status else None, error, req.num_prompt_tokens,
                             req.num_output_tokens, req.num_cached_tokens, stop_reason, prompt_logprobs)
