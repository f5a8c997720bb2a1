"""Block sharing on the real model: prefix caching, parallel sampling, beam search, copy-on-write.

Tests whose checks hold whatever the prefix cache already holds share one default engine (``engine``,
module scope: each start spawns a torch process); those that count cache hits from an empty cache, or
need another config, start their own (``start``).
"""

import asyncio

import pytest

from pagedkv.common.sampling_params import SamplingParams
from conftest import (GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free, metric,
                      module_loop_fixtures, record_plans)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A prompt of 34 tokens: two full 16-token blocks and a partly filled third.
LONG_PROMPT = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun with her dog."


async def choices(engine, prompt_ids, params, on_output=None):
    """Run one request; returns {choice index: output token ids} and the last delta of each."""
    tokens, last = {}, {}
    async for out in engine.add_request(prompt_ids, params):
        tokens.setdefault(out.index, []).extend(out.token_ids)
        last[out.index] = out
        if on_output:
            on_output(out)
    return tokens, last


GREEDY = SamplingParams(temperature=0, max_tokens=24)


start, engine = module_loop_fixtures()  # the shared engine has the default config (prefix caching on)


async def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off(engine, start):
    on, off = engine, await start(enable_prefix_caching=False)
    hits = metric(on, "pagedkv:prefix_cache_hits_total")
    tok = on.tokenizer
    prompts = [LONG_PROMPT, LONG_PROMPT, LONG_PROMPT + " One day", LONG_PROMPT[:60], "Once upon a time"]
    for prompt in prompts:  # repeated and overlapping prompts, one after another
        ids = tok.encode(prompt)
        with_cache, _ = await choices(on, ids, GREEDY)
        without, _ = await choices(off, ids, GREEDY)
        assert with_cache == without
    assert metric(on, "pagedkv:prefix_cache_hits_total") > hits and metric(off, "pagedkv:prefix_cache_hits_total") == 0
    assert_all_blocks_free(on)


async def test_a_second_identical_request_reports_cached_tokens_and_prefills_only_the_rest(start):
    engine = await start()
    ids = engine.tokenizer.encode(LONG_PROMPT)
    assert len(ids) == 34
    first, last = await choices(engine, ids, GREEDY)
    assert last[0].num_cached_tokens == 0
    plans = record_plans(engine)
    second, last = await choices(engine, ids, GREEDY)
    assert second == first
    assert last[0].num_cached_tokens == 32  # two full blocks; the partial third is never cached
    new = plans[0].new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (32, 2)
    labels = {"model_name": "stories260K"}
    assert engine.metrics.registry.get_sample_value("pagedkv:prefix_cache_queries_total", labels) == 68
    assert engine.metrics.registry.get_sample_value("pagedkv:prefix_cache_hits_total", labels) == 32


async def test_freed_prompt_blocks_stay_cached_and_are_reported_apart_from_usage(start):
    engine = await start()
    await choices(engine, engine.tokenizer.encode(LONG_PROMPT), GREEDY)
    snap = engine.kv_cache_snapshot()
    assert snap["usage"] == 0.0 and snap["num_cached_free_blocks"] == 3  # 2 prompt + 1 full output block
    assert engine.metrics.registry.get_sample_value(
        "pagedkv:num_cached_free_blocks", {"model_name": "stories260K"}) == 3


async def test_different_cache_salts_share_no_block_and_equal_salts_do(engine):
    ids = engine.tokenizer.encode(LONG_PROMPT)
    outs = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        async for out in engine.add_request(ids, GREEDY, cache_salt=salt):
            pass
        outs.append(out.num_cached_tokens)
    assert outs == [0, 0, 32]


async def test_n3_seeded_sampling_shares_the_prompt_blocks_and_is_reproducible(start):
    engine = await start()
    ids = engine.tokenizer.encode(LONG_PROMPT)
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=20)
    seen_ref_counts = []

    def watch(out):
        if not seen_ref_counts:
            seen_ref_counts.append(engine.kv_cache_snapshot()["block_ref_counts"])

    plans = record_plans(engine)
    first, last = await choices(engine, ids, params, watch)
    assert sorted(first) == [0, 1, 2] and all(len(t) == 20 for t in first.values())
    assert len({tuple(t) for t in first.values()}) == 3  # three different samples
    # while it ran, the two full prompt blocks were held by all three block tables
    table = [r for r in plans[0].new_requests][0].block_ids
    assert [seen_ref_counts[0][str(b)] for b in table[:2]] == [3, 3]
    # the partly filled fork block was copied for two of the three sequences, and nothing else
    assert sum(len(p.blocks_to_copy) for p in plans) == 2
    assert_all_blocks_free(engine)

    again, _ = await choices(engine, ids, params)
    assert again == first
    # batched with other traffic and preempted on a tiny pool: still the same three outputs
    tight = await start(num_gpu_blocks=14, enable_prefix_caching=False)
    others = [choices(tight, ids, SamplingParams(seed=s, max_tokens=20)) for s in range(3)]
    batched, *_ = await asyncio.gather(choices(tight, ids, params), *others)
    assert tight.scheduler.num_preemptions > 0
    assert batched[0] == first
    assert_all_blocks_free(tight)


async def test_n_above_the_server_maximum_is_rejected(start):
    engine = await start(max_n=4)
    with pytest.raises(ValueError, match="^n: must be between 1 and 4"):
        engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(n=5))


async def test_beam_search_frees_dropped_beams_and_every_block_at_the_end(start):
    engine = await start(block_size=8)
    plans = record_plans(engine)
    out, last = await choices(engine, GOLDEN_PROMPT_IDS, SamplingParams(n=4, use_beam_search=True, max_tokens=30))
    assert sorted(out) == [0, 1, 2, 3] and all(len(t) == 30 for t in out.values())
    assert all(last[i].finish_reason == "length" for i in range(4))
    assert sum(len(p.finished_request_ids) for p in plans) > 4  # dropped beams left the worker
    assert any(p.blocks_to_copy for p in plans)  # forks wrote into shared blocks via copy-on-write
    assert_all_blocks_free(engine)


async def test_greedy_beam_width_1_equals_greedy_decoding(engine):
    out, _ = await choices(engine, GOLDEN_PROMPT_IDS, SamplingParams(n=1, use_beam_search=True, max_tokens=60))
    assert out[0] == GOLDEN_OUTPUT_IDS


@pytest.fixture(scope="module")
def hf_model(stories260k):
    """stories260K in transformers (float32), loaded once."""
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(str(stories260k), dtype=torch.float32)


@pytest.mark.parametrize("prompt", ["Once upon a time", "The little dog", "Tom and Sue went to the park"])
async def test_best_beam_equals_transformers_beam_search(engine, hf_model, prompt):
    import torch

    model = hf_model
    ids = engine.tokenizer.encode(prompt)
    for width, length_penalty in ((2, 1.0), (4, 0.5)):
        expected = model.generate(torch.tensor([ids]), num_beams=width, do_sample=False, max_new_tokens=40,
                                  length_penalty=length_penalty, early_stopping=False)[0, len(ids):].tolist()
        params = SamplingParams(n=width, use_beam_search=True, max_tokens=40, length_penalty=length_penalty)
        out, _ = await choices(engine, ids, params)
        assert out[0] == expected
    assert_all_blocks_free(engine)
