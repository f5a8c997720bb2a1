"""Randomized differential test of the worker's persistent batch (`worker.input_batch`) through `ModelRunner`.

A small control plane (`_Plane`) drives a runner on stories260K through long random runs of step
plans: requests arrive with random prompts and sampling knobs (greedy; seeded and unseeded
temperature with top-k / top-p / min-p; repetition, presence and frequency penalties; logit bias;
min_tokens with stop token ids; logprobs and prompt logprobs; beam rows whose tokens the control
plane picks), share prefix blocks, fork (n > 1) with copy-on-write of a shared partial block, run
chunked prefills and decodes, skip steps (some steps compute nothing), finish, are aborted,
preempted by recompute (now and then resumed in the same plan without being listed as finished) or
swapped out and back in. After every step:

- the runner's rows equal an `InputBatch` rebuilt from scratch from the same logical requests
  (every per-row array, field by field: tokens, block table, counts, knobs, seeds, penalty
  statistics), and the rows are dense;
- the forward's inputs (token ids, positions, slot mapping, the block table the kernels read,
  sequence lengths) equal those built from the logical requests;
- each sampled row's logits equal a fresh runner's prefill of the same tokens on contiguous blocks
  (so every K/V the paged attention read was where the plan said), its prompt logprobs that
  prefill's, and its token, logprob and top logprobs exactly what a fresh `Sampler` gives from the
  logical requests (`SamplingBatch.from_params`, the reference path) on the same logits.

``device_table``: the batch keeps its device block table apart from the host one, as on CUDA, so
the staged writes (``_pending``, `InputBatch.flush_block_table`) run on the CPU. Capacity starts
at one row, so rows grow by doubling mid-step. ``graphs``: decode-only steps go through the CUDA
graphs' padded static buffers (run eagerly). ``warm_up``: the memory profile and warm-ups run first.
Each case runs 400 steps in about 5 s on one core.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from pagedkv.common.config import EngineConfig
from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.sampler import Sampler

CPU = torch.device("cpu")
VOCAB = 512
EOS = 2
MAX_LEN = 96  # tokens per request at most (max_model_len)
MAX_LIVE = 9  # requests alive at once, in any state


class _DeviceTable(InputBatch):
    """An `InputBatch` whose device block table is a tensor apart from the host one even on the CPU,
    as on CUDA: block-table writes are staged in ``_pending`` and sent by `flush_block_table`."""

    on_cpu = property(lambda self: False, lambda self, value: None)


class _Req:
    """One request as the control plane knows it.

    tokens: every known token (prompt + output); the last ``len(unsent)`` are beam tokens chosen
    here and not yet sent to the worker. blocks: device block table (``ceil(computed / bs)``
    blocks while in the worker). state: "new" (to be sent whole), "running" (mirrored by the
    worker), "swapped" (KV in ``host`` blocks), "waiting" (preempted by recompute).
    """

    def __init__(self, rid: str, tokens: list[int], num_prompt: int, sampling: SamplingParams):
        self.rid, self.tokens, self.num_prompt, self.sampling = rid, tokens, num_prompt, sampling
        self.blocks: list[int] = []
        self.host: list[int] = []
        self.unsent: list[int] = []
        self.computed = 0
        self.state = "new"
        self.finishing = False  # sampled its last token: dropped in the next plan
        self.idle_sent = False  # sent whole in a step that computed nothing

    @property
    def known(self) -> list[int]:
        """The tokens the worker's mirror holds."""
        return self.tokens[:len(self.tokens) - len(self.unsent)]

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.num_prompt:]


def _random_sampling(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    p: dict = dict(max_tokens=rng.randint(1, 40))
    if kind < 0.3:
        p["temperature"] = 0.0
    else:
        p["temperature"] = rng.choice([0.6, 1.0, 1.4])
        p["seed"] = None if rng.random() < 0.25 else rng.choice([0, 7, rng.randrange(-2**63, 2**63)])
        p["top_k"] = rng.choice([-1, -1, 0, 1, 5, 40])
        p["top_p"] = rng.choice([1.0, 1.0, 0.9, 0.5])
        p["min_p"] = rng.choice([0.0, 0.0, 0.05, 0.2])
    if rng.random() < 0.4:
        p["repetition_penalty"] = rng.choice([1.0, 0.8, 1.3, 2.0])
        p["presence_penalty"] = rng.choice([0.0, -1.0, 0.5, 2.0])
        p["frequency_penalty"] = rng.choice([0.0, -0.5, 0.7, 2.0])
    if rng.random() < 0.15 and kind < 0.3:  # beam rows: greedy, the control plane picks among the top logprobs
        p.update(use_beam_search=True, logprobs=3)
        return SamplingParams(**p)
    if rng.random() < 0.25:
        p["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, -3.0, 2.5, 100.0])
                           for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.25:
        p["stop_token_ids"] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        p["min_tokens"] = rng.randint(0, p["max_tokens"])
        p["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.3:
        p["logprobs"] = rng.choice([0, 2, 5])
    if rng.random() < 0.2:
        p["prompt_logprobs"] = rng.choice([0, 3])
    params = SamplingParams(**p)
    params.validate()
    return params


class _Plane:
    """A random control plane: owns the block pools and the logical requests, builds each plan."""

    def __init__(self, model_path, rng: random.Random, block_size: int, device_table: bool, seed: int,
                 graphs: bool = False, warm_up: str | None = None):
        self.rng, self.bs = rng, block_size
        num_blocks, num_cpu_blocks = 5 * MAX_LEN // block_size, 3 * MAX_LEN // block_size  # short: steps wait
        cfg = EngineConfig(model=str(model_path), block_size=block_size, seed=seed, max_model_len=MAX_LEN,
                           max_num_seqs=16)
        self.runner = ModelRunner(cfg, CPU, torch.float32)
        self.runner.init_cache(num_blocks, num_cpu_blocks)
        eos = self.runner.model_config.eos_token_ids
        assert eos == [EOS]
        self.runner.batch = (_DeviceTable if device_table else InputBatch)(1, MAX_LEN, block_size, VOCAB, CPU, eos)
        if warm_up == "profile":  # the memory profile and the CPU warm-up run first, then serving
            self.runner.profile_run()
            self.runner.warm_up(host=True)
        elif warm_up == "cuda":  # CUDA's warm-up (a prefill, a decode, a copy on a temporary cache), on the CPU
            self.runner.warm_up(host=False)
        self.forwards = _record(self.runner.model)
        self.last_logits: dict[str, int | None] = {}  # rid -> row of the last forward's logits for its last token
        if graphs:  # decode-only steps through the padded static buffers of CUDA graphs, run eagerly
            self.runner.init_decode_graphs(capture=False)
            replay = self.runner.graphs.run

            def run(*args):
                self.stats["graphed"] += 1
                return replay(*args)

            self.runner.graphs.run = run
        # the reference: a fresh runner prefilling each sampled request's tokens from scratch
        self.ref = ModelRunner(cfg, CPU, torch.float32)
        self.ref_blocks = MAX_LIVE * 2 * -(-MAX_LEN // block_size)
        self.ref.init_cache(self.ref_blocks, 0)
        self.ref_forwards = _record(self.ref.model)
        self.ref_sampler = Sampler(seed, CPU, eos)  # in step with the runner's: same calls, same rows
        self.free = list(range(num_blocks))
        self.refs: dict[int, int] = {}  # device block -> block tables holding it
        self.host_free = list(range(num_cpu_blocks))
        self.live: dict[str, _Req] = {}
        self.count = 0
        self.step_id = 0
        self.prompt_lps: dict[str, dict[int, float]] = {}  # rid -> prompt position -> logprob the runner gave
        self.stats = dict(sampled=0, forks=0, prefix_hits=0, swaps=0, recomputes=0, aborts=0, cow=0, beam=0,
                          growths=0, skipped=0, idle=0, unlisted=0, graphed=0)

    # ---- blocks --------------------------------------------------------------------------------

    def _take(self) -> int:
        b = self.free.pop(self.rng.randrange(len(self.free)))
        self.refs[b] = 1
        return b

    def _share(self, blocks: list[int]) -> list[int]:
        for b in blocks:
            self.refs[b] += 1
        return list(blocks)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free.append(b)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        finished, swap_out, swap_in, copies, host_freed = [], [], [], [], []
        for r in list(self.live.values()):
            if r.finishing:  # finished by the last step's result
                finished.append(r.rid)
                self._release(r.blocks)
                del self.live[r.rid]
        # preemptions and aborts
        for r in list(self.live.values()):
            u = rng.random()
            if r.idle_sent:  # its block-table writes are still pending: drop it more often
                u, r.idle_sent = u / 4, False
            if r.state == "running":
                if u < 0.02:
                    finished.append(r.rid)
                    self._release(r.blocks)
                    del self.live[r.rid]
                    self.stats["aborts"] += 1
                elif u < 0.05:
                    self._release(r.blocks)
                    r.blocks, r.computed, r.unsent, r.state = [], 0, [], "waiting"
                    if rng.random() < 0.2:  # resumed in this plan, unlisted: the worker's add starts it afresh
                        r.state = "new"
                        self.stats["unlisted"] += 1
                    else:
                        finished.append(r.rid)
                    self.stats["recomputes"] += 1
                elif u < 0.08 and all(self.refs[b] == 1 for b in r.blocks) and len(self.host_free) >= len(r.blocks):
                    finished.append(r.rid)
                    r.host = [self.host_free.pop(rng.randrange(len(self.host_free))) for _ in r.blocks]
                    swap_out += list(zip(r.blocks, r.host))
                    self._release(r.blocks)  # reusable in this plan: swap-outs run first
                    r.blocks, r.unsent, r.state = [], [], "swapped"
                    self.stats["swaps"] += 1
            elif r.state == "swapped":
                if u < 0.03:
                    if rng.random() < 0.5:
                        finished.append(r.rid)  # unknown to the worker by now: ignored
                    host_freed += r.host
                    del self.live[r.rid]
                elif u < 0.08:  # give up the host copy: recompute
                    host_freed += r.host
                    r.host, r.computed, r.state = [], 0, "waiting"
                elif u < 0.4 and len(self.free) >= len(r.host):
                    r.blocks = [self._take() for _ in r.host]
                    swap_in += list(zip(r.host, r.blocks))
                    host_freed += r.host  # only after this plan: its swap-outs run before the swap-ins
                    r.host, r.state = [], "new"
            elif r.state == "waiting" and u < 0.3:
                r.state = "new"
        # arrivals: fresh prompts, prefix hits on a running request's blocks, forks
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):
            if len(self.live) < MAX_LIVE:
                self._arrive()
        # schedule
        new, cached, scheduled = [], [], {}
        order = [r for r in self.live.values() if r.state in ("new", "running") and not r.finishing]
        rng.shuffle(order)
        idle = rng.random() < 0.1  # nothing computed: the step's block-table writes stay pending into the next
        self.stats["idle"] += idle
        for r in order:
            left = len(r.tokens) - r.computed
            n = left if left <= 1 or rng.random() < 0.5 else rng.randint(1, left)
            if idle or rng.random() < 0.1:
                n = 0  # out of budget this step (a new request is still sent)
            need = -(-(r.computed + n) // self.bs) - len(r.blocks)
            cow = n > 0 and r.computed % self.bs and self.refs[r.blocks[r.computed // self.bs]] > 1
            if need + bool(cow) > len(self.free):
                n, need, cow = 0, 0, False
            if n == 0 and r.state == "running":
                self.stats["skipped"] += 1
                continue
            replaced = []
            if cow:  # the partial block this request writes next is shared: copy it first
                i = r.computed // self.bs
                b = self._take()
                copies.append((r.blocks[i], b))
                self._release([r.blocks[i]])
                r.blocks[i] = b
                replaced.append((i, b))
                self.stats["cow"] += 1
            fresh = [self._take() for _ in range(need)]
            r.blocks += fresh
            if r.state == "new":
                new.append(NewRequestData(r.rid, list(r.tokens), r.num_prompt, list(r.blocks), r.computed, n,
                                          r.sampling))
                r.state, r.idle_sent = "running", idle
            else:
                cached.append(CachedRequestData(r.rid, fresh, n, r.unsent, replaced))
            r.unsent = []
            r.computed += n
            scheduled[r.rid] = n
        rng.shuffle(new)
        rng.shuffle(cached)
        plan = StepPlan(self.step_id, new, cached, finished, swap_out, swap_in, copies)
        plan = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)  # as a worker receives it
        self.step_id += 1
        self.host_free += host_freed
        capacity = self.runner.batch.capacity
        self.forwards.clear()
        result = self.runner.execute(plan)
        self.stats["growths"] += self.runner.batch.capacity != capacity
        self._check_forward(scheduled)
        self._check_prompt_spans(result, scheduled)
        self._check_samples(result)
        self._apply(result)
        self._check_rows(scheduled)

    def _arrive(self) -> None:
        rng = self.rng
        self.count += 1
        rid = f"r{self.count}"
        donors = [r for r in self.live.values() if r.state == "running" and not r.finishing]
        u = rng.random()
        if u < 0.2 and (parents := [r for r in donors if not r.sampling.use_beam_search
                                    and r.computed == len(r.tokens) - 1]):
            # fork (n > 1, beam search): the child shares every block, the partial last one included
            parent = rng.choice(parents)
            seed = parent.sampling.seed
            sampling = msgspec.structs.replace(parent.sampling, seed=None if seed is None else seed ^ 1)
            r = _Req(rid, list(parent.tokens), parent.num_prompt, sampling)
            r.blocks, r.computed = self._share(parent.blocks), parent.computed
            self.stats["forks"] += 1
        elif u < 0.4 and (hosts := [r for r in donors if r.computed >= self.bs]):
            # a prefix-cache hit: the first full blocks of a running request, then a prompt of its own
            donor = rng.choice(hosts)
            k = rng.randint(1, min(donor.computed, MAX_LEN - 2) // self.bs)
            suffix = rng.randint(1, min(12, MAX_LEN - 1 - k * self.bs))
            prompt = donor.tokens[:k * self.bs] + [rng.randrange(VOCAB) for _ in range(suffix)]
            r = _Req(rid, prompt, len(prompt), _random_sampling(rng))
            r.blocks, r.computed = self._share(donor.blocks[:k]), k * self.bs
            self.stats["prefix_hits"] += 1
        else:
            prompt = [1] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 39))]
            r = _Req(rid, prompt, len(prompt), _random_sampling(rng))
        self.live[rid] = r

    # ---- results -------------------------------------------------------------------------------

    def _apply(self, result) -> None:
        rng = self.rng
        for s in result.sampled:
            r = self.live[s.request_id]
            p = r.sampling
            if p.use_beam_search:  # the control plane picks the beam's token; the worker gets it next step
                token = rng.choice(s.top_logprobs)[0]
                r.unsent.append(token)
                self.stats["beam"] += 1
            else:
                token = s.token_id
            r.tokens.append(token)
            stop = token in p.stop_token_ids or (token == EOS and not p.ignore_eos)
            if len(r.outputs) <= p.min_tokens:
                assert not stop or p.use_beam_search, (r.rid, token, "a stop token before min_tokens")
            if (len(r.outputs) >= p.max_tokens or len(r.tokens) >= MAX_LEN or stop or rng.random() < 0.03):
                r.finishing = True

    # ---- checks --------------------------------------------------------------------------------

    def _rows(self) -> list[_Req]:
        """The requests the worker mirrors, in the runner's row order; checks the rows are dense."""
        batch = self.runner.batch
        mirrored = {r.rid: r for r in self.live.values() if r.state == "running"}
        assert batch.num_rows == len(mirrored) and set(batch.row_of) == set(mirrored)
        assert sorted(batch.row_of.values()) == list(range(batch.num_rows))
        assert batch.request_ids[batch.num_rows:] == [None] * (batch.capacity - batch.num_rows)
        return [mirrored[rid] for rid in batch.request_ids[:batch.num_rows]]

    def _check_rows(self, scheduled: dict[str, int]) -> None:
        """Every per-row array of the runner's batch equals that of a batch rebuilt from scratch."""
        batch = self.runner.batch
        rows = self._rows()
        n = len(rows)
        fresh = InputBatch(max(n, 1), MAX_LEN, self.bs, VOCAB, CPU, [EOS])
        for r in rows:
            fresh.add(NewRequestData(r.rid, r.known, r.num_prompt, r.blocks, r.computed, scheduled.get(r.rid, 0),
                                     r.sampling))
        assert batch.request_ids[:n] == fresh.request_ids[:n] and batch.params[:n] == fresh.params[:n]
        for name in fresh._array_names():
            got, want = getattr(batch, name), getattr(fresh, name)
            for i, r in enumerate(rows):
                if name == "token_ids":
                    assert np.array_equal(got[i, :len(r.known)], want[i, :len(r.known)]), (r.rid, name)
                elif name == "block_table":
                    assert np.array_equal(got[i, :len(r.blocks)], want[i, :len(r.blocks)]), (r.rid, name)
                elif name in ("prompt_mask", "output_counts"):  # kept for rows with a penalty only
                    assert not fresh.penalized[i] or torch.equal(got[i], want[i]), (r.rid, name)
                else:
                    assert got[i] == want[i], (r.rid, name, got[i], want[i])
        if isinstance(batch, _DeviceTable) and not batch._pending:
            for i, r in enumerate(rows):
                assert batch.block_table_dev[i, :len(r.blocks)].tolist() == r.blocks, (r.rid, "device block table")

    def _check_forward(self, scheduled: dict[str, int]) -> None:
        """The forward's inputs are the scheduled tokens of each row, at the places the plan gave them."""
        if not any(scheduled.values()):
            assert not self.forwards
            return
        (input_ids, positions, meta, logits_indices, _), = self.forwards
        ids, pos, slots, lens, starts = [], [], [], [], [0]
        rows = self._rows()
        for i, r in enumerate(rows):
            q = scheduled.get(r.rid, 0)
            span = range(r.computed - q, r.computed)  # computed already counts this step's tokens
            ids += [r.tokens[p] for p in span]
            pos += list(span)
            slots += [r.blocks[p // self.bs] * self.bs + p % self.bs for p in span]
            lens.append(r.computed)
            starts.append(starts[-1] + q)
            assert meta.block_tables[i, :len(r.blocks)].tolist() == r.blocks, (r.rid, "block table read")
        n, t = len(rows), len(ids)
        assert input_ids[:t].tolist() == ids and positions[:t].tolist() == pos
        assert meta.slot_mapping[:t].tolist() == slots
        assert meta.seq_lens[:n].tolist() == lens and meta.query_start_loc[:n + 1].tolist() == starts
        if input_ids.shape[0] > t:  # a decode graph's padded size: the extra rows write nothing and attend to nothing
            assert t == n and (meta.slot_mapping[n:] == -1).all() and (meta.seq_lens[n:] == 0).all()
        # the logits row of each row's last token (a graph's forward gives every token's)
        at = {int(index): j for j, index in enumerate(logits_indices)}
        self.last_logits = {r.rid: at.get(starts[i + 1] - 1) for i, r in enumerate(rows)}

    def _check_samples(self, result) -> None:
        """Sampled rows: logits equal a from-scratch prefill's; tokens and logprobs the reference sampler's."""
        if not result.sampled:
            return
        self.stats["sampled"] += len(result.sampled)
        (*_, logits), = self.forwards
        logits = logits[[self.last_logits[s.request_id] for s in result.sampled]]
        reqs = [self.live[s.request_id] for s in result.sampled]
        # the reference sampler on the same logits, rows given as Python objects
        want = self.ref_sampler(logits, [r.sampling for r in reqs], [r.tokens[:r.num_prompt] for r in reqs],
                                [r.known[r.num_prompt:] for r in reqs])
        for s, r, token, lp, top in zip(result.sampled, reqs, want.token_ids, want.logprobs, want.top_logprobs):
            assert (s.token_id, s.logprob, s.top_logprobs) == (token, lp, top), r.rid
        # greedy and seeded rows draw alone what they draw in the batch, wherever their row is
        for i, (s, r) in enumerate(zip(result.sampled, reqs)):
            if r.sampling.greedy or r.sampling.seed is not None:
                alone = Sampler(12345, CPU, [EOS])(logits[i:i + 1], [r.sampling], [r.tokens[:r.num_prompt]],
                                                   [r.known[r.num_prompt:]])
                assert alone.token_ids == [s.token_id], (r.rid, "a seeded draw depends on the batch")
        # a fresh runner prefilling the same tokens on contiguous blocks
        news, first = [], 0
        for i, r in enumerate(reqs):
            nb = -(-len(r.known) // self.bs)
            news.append(NewRequestData(f"ref{i}", r.known, r.num_prompt, list(range(first, first + nb)), 0,
                                       len(r.known), SamplingParams(temperature=0.0,
                                                                    prompt_logprobs=r.sampling.prompt_logprobs)))
            first += nb
        assert first <= self.ref_blocks
        self.ref_forwards.clear()
        ref = self.ref.execute(StepPlan(-1, news))
        for new in news:
            self.ref.batch.remove(new.request_id)
        (*_, ref_logits), = self.ref_forwards
        ref_logits = ref_logits[-len(reqs):]
        for i, r in enumerate(reqs):
            diff = (logits[i] - ref_logits[i]).abs().max().item()
            assert diff < 1e-3, (r.rid, "logits differ from a from-scratch prefill", diff)
        # prompt logprobs the runner gave in any step since the request (re)started, against the prefill's
        for span in ref.prompt_logprobs:
            r = reqs[int(span.request_id[3:])]
            seen = self.prompt_lps.pop(r.rid, {})
            for pos, lp in seen.items():
                assert abs(lp - span.logprobs[pos - span.start]) < 1e-3, (r.rid, "prompt logprob", pos)
            assert len(seen) <= len(span.logprobs)

    def _check_prompt_spans(self, result, scheduled: dict[str, int]) -> None:
        """Each row asking for prompt logprobs gets those of the prompt tokens its chunk predicts; kept
        until the row samples (`_check_samples` compares them with the from-scratch prefill's)."""
        want = {}
        for r in self._rows():
            q, k = scheduled.get(r.rid, 0), r.sampling.prompt_logprobs
            start = r.computed - q  # the chunk's first position
            if k is not None and q and start < r.num_prompt - 1:
                want[r.rid] = (start + 1, min(r.computed, r.num_prompt - 1) - start)
        assert {s.request_id: (s.start, len(s.logprobs)) for s in result.prompt_logprobs} == want
        for span in result.prompt_logprobs:
            k = self.live[span.request_id].sampling.prompt_logprobs
            assert len(span.ranks) == len(span.top_logprobs) == len(span.logprobs)
            assert all(len(top) == min(k, VOCAB) for top in span.top_logprobs)
            for i, lp in enumerate(span.logprobs):
                self.prompt_lps.setdefault(span.request_id, {})[span.start + i] = lp


def _record(model) -> list:
    """Record every forward's (input_ids, positions, meta, logits_indices, logits) of ``model``."""
    calls = []
    real = model.forward

    def forward(input_ids, positions, meta, k_caches, v_caches, logits_indices=None):
        logits = real(input_ids, positions, meta, k_caches, v_caches, logits_indices)
        calls.append((input_ids, positions, meta, logits_indices, logits))
        return logits

    model.forward = forward
    return calls


def test_growing_the_rows_mid_step_keeps_the_pending_device_block_table_writes():
    # on CUDA a step's block-table writes wait in ``_pending`` until `flush_block_table`; growing the
    # rows in between (a second request added to a full batch) used to drop them, so the first
    # request's kernels read another table (zeros, or a previous occupant's blocks)
    batch = _DeviceTable(1, 64, 16, VOCAB, CPU)
    batch.add(NewRequestData("a", [1, 2, 3], 3, [7], 0, 3, SamplingParams()))
    batch.add(NewRequestData("b", [1, 5], 2, [3], 0, 2, SamplingParams()))
    batch.append_blocks(batch.row_of["b"], [9], [])
    batch.add(NewRequestData("c", [1], 1, [4], 0, 1, SamplingParams()))
    assert batch.capacity == 4
    batch.flush_block_table()
    assert batch.block_table_dev[:3, :2].tolist() == [[7, 0], [3, 9], [4, 0]]


class _FirstWins:
    """A device block table whose index_put keeps the first of repeated indices' values: one order CUDA's
    parallel stores may take (they guarantee none), where the CPU's loop keeps the last."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __setitem__(self, index, values):
        rows, cols = index
        for r, c, v in reversed(list(zip(rows.tolist(), cols.tolist(), values.tolist()))):
            self.table[r, c] = v


def test_a_column_written_twice_before_a_flush_gets_its_last_block_on_the_device():
    # a request sent whole in a step that computed nothing leaves its table pending; the next step replaces
    # a column (copy-on-write) before the flush: the device must get the replacement, whatever the order
    batch = _DeviceTable(2, 64, 16, VOCAB, CPU)
    batch.add(NewRequestData("a", list(range(1, 21)), 20, [7, 8], 20, 0, SamplingParams()))
    batch.append_blocks(batch.row_of["a"], [5], [(1, 9)])
    table = batch.block_table_dev
    batch.block_table_dev = _FirstWins(table)
    batch.flush_block_table()
    assert table[0, :3].tolist() == batch.block_table[0, :3].tolist() == [7, 9, 5]


@pytest.mark.parametrize("device_table,block_size,seed,graphs,warm_up", [
    (False, 4, 1, False, None), (True, 4, 2, True, "cuda"), (True, 8, 3, False, "profile")])
def test_persistent_batch_equals_a_rebuild_through_random_plans(stories260k, device_table, block_size, seed, graphs,
                                                               warm_up):
    plane = _Plane(stories260k, random.Random(seed), block_size, device_table, seed, graphs, warm_up)
    for _ in range(400):
        plane.step()
    s = plane.stats
    assert not graphs or s["graphed"] > 10, s
    # the run really went through every kind of event
    assert min(s[k] for k in ("forks", "prefix_hits", "swaps", "recomputes", "aborts", "cow", "beam", "skipped", "idle",
                                "unlisted")) > 0, s
    assert s["sampled"] > 1000 and s["growths"] >= (0 if warm_up == "profile" else 3), s  # the profile grows it first
