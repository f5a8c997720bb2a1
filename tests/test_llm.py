"""The offline Python API (`from pagedkv import LLM, SamplingParams`) on the real engine and stories260K."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS

CHAT_TEMPLATE = Path(__file__).parent / "data" / "chat_template.jinja"


def test_import_pagedkv_is_light_and_loads_the_api_on_first_use():
    code = ("import sys, pagedkv; assert 'torch' not in sys.modules and 'pagedkv.scheduler' not in sys.modules; "
            "from pagedkv import LLM, SamplingParams; assert 'torch' not in sys.modules; print(LLM.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "pagedkv.scheduler.llm\n"


def test_a_script_that_never_calls_shutdown_exits_cleanly_and_leaves_no_worker(stories260k):
    # the engine then shuts down from atexit, where a thread pool can no longer be started
    code = ("from pagedkv import LLM, SamplingParams; import os; "
            f"llm = LLM(model={str(stories260k)!r}, num_gpu_blocks=64, swap_space=0.01); "
            "out = llm.generate(['Once upon a time'], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False); "
            "print(out[0].outputs[0].token_ids, llm.engine.client.processes[0].pid)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    ids, pid = out.stdout.rsplit("]", 1)
    assert ids + "]" == str(GOLDEN_OUTPUT_IDS[:5])
    assert not Path(f"/proc/{int(pid)}").exists()  # reaped, not left running or a zombie


@pytest.fixture(scope="module")
def llm(stories260k):
    from pagedkv import LLM

    with LLM(model=str(stories260k), device="cpu", num_gpu_blocks=64, swap_space=0.01,
             chat_template=str(CHAT_TEMPLATE)) as llm:
        yield llm


def test_generate_returns_vllm_shaped_outputs_with_the_golden_text(llm):
    from pagedkv import SamplingParams

    outs = llm.generate([GOLDEN_PROMPT, {"prompt_token_ids": GOLDEN_PROMPT_IDS}],
                        SamplingParams(temperature=0, max_tokens=60, logprobs=2), use_tqdm=False)
    assert [o.prompt for o in outs] == [GOLDEN_PROMPT, None]
    for out in outs:
        assert out.prompt_token_ids == GOLDEN_PROMPT_IDS and out.finished
        [c] = out.outputs
        assert (c.index, c.text, c.token_ids, c.finish_reason) == (0, GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, "length")
        assert len(c.logprobs) == 60
        for token, lps in zip(c.token_ids, c.logprobs):  # greedy: the chosen token ranks first
            assert lps[token].rank == 1 and len(lps) == 2
            assert lps[token].decoded_token == llm.get_tokenizer().token_to_str(token)
        assert c.cumulative_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs)))


def test_generate_takes_one_sampling_params_per_prompt_and_n(llm):
    from pagedkv import SamplingParams

    outs = llm.generate(["Once upon a", "Lily"], [SamplingParams(temperature=0, max_tokens=3),
                                                  SamplingParams(n=3, seed=1, max_tokens=4)], use_tqdm=False)
    assert outs[0].outputs[0].text == " time, there"
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.logprobs is None for c in outs[1].outputs)


def test_a_request_the_engine_cannot_serve_raises_before_anything_runs(llm):
    from pagedkv import SamplingParams

    with pytest.raises(ValueError, match=re.escape("prompt: 513 tokens is longer than max_model_len (512)")):
        llm.generate(["Once upon a", {"prompt_token_ids": [1] * 513}], use_tqdm=False)
    deadline = time.monotonic() + 10  # the abort of the first prompt applies at the engine's next turn
    while (snap := llm.engine.kv_cache_snapshot())["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snap["num_free_blocks"] == 64 and snap["requests"] == []


def test_a_prompt_plus_max_tokens_past_max_model_len_stops_there_with_length_as_vllm_offline(llm):
    # vLLM's offline LLM caps the output at max_model_len; pagedkv refused the whole batch
    # ("max_tokens: prompt (5 tokens) + max_tokens (600) exceeds max_model_len (512)")
    from pagedkv import SamplingParams

    long, short = llm.generate([GOLDEN_PROMPT, "Once upon a"],
                               [SamplingParams(temperature=0, max_tokens=600, min_tokens=550, ignore_eos=True),
                                SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    c = long.outputs[0]
    assert (len(c.token_ids), c.finish_reason) == (512 - len(GOLDEN_PROMPT_IDS), "length")
    assert c.token_ids[:60] == GOLDEN_OUTPUT_IDS
    assert (short.outputs[0].text, short.outputs[0].finish_reason) == (" time, there", "length")
    with pytest.raises(ValueError, match=re.escape("max_tokens: prompt (512 tokens) + max_tokens (1) exceeds")):
        llm.generate({"prompt_token_ids": [1] * 512}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.kv_cache_snapshot()["num_free_blocks"] == 64


def test_chat_renders_the_template_and_generates_like_the_rendered_prompt(llm):
    from pagedkv import SamplingParams

    messages = [{"role": "user", "content": "Tell me a story."}]
    params = SamplingParams(temperature=0, max_tokens=12)
    [chat] = llm.chat(messages, params, use_tqdm=False)
    assert chat.prompt == "<s>user: Tell me a story.\nassistant:"
    tok = llm.get_tokenizer()
    [plain] = llm.generate({"prompt_token_ids": tok.encode(chat.prompt, add_special_tokens=False)}, params,
                           use_tqdm=False)
    assert chat.prompt_token_ids[0] == tok.bos_token_id and chat.prompt_token_ids.count(tok.bos_token_id) == 1
    assert chat.outputs[0].text == plain.outputs[0].text and len(chat.outputs[0].token_ids) == 12


def test_an_unknown_engine_argument_is_a_type_error():
    from pagedkv import LLM

    with pytest.raises(TypeError, match="block_sise"):
        LLM(block_sise=16)


def test_prompt_logprobs_and_stop_reason_in_the_offline_outputs(llm):
    from pagedkv import SamplingParams

    prompt = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:10]
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=60, prompt_logprobs=2, stop=["Lily"]), use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 15
    for token, lps in zip(prompt[5:], out.prompt_logprobs[5:]):  # the golden tokens are the greedy ones
        assert lps[token].rank == 1 and len(lps) == 2
    [c] = out.outputs
    assert (c.finish_reason, c.stop_reason) == ("stop", "Lily")  # the second "Lily", at the golden's end
    assert c.text == GOLDEN_COMPLETION[len(", there was a little girl named Lily"):].removesuffix("Lily")


@pytest.mark.parametrize("engine_args,error,message", [
    # none of these was checked before the worker started: max_num_batched_tokens=0 and block_size="16"
    # hung generate() for ever, block_size=0 and max_num_seqs=0 were a WorkerFailed from a worker
    # traceback, block_size=3 (no kernel takes it), gpu_memory_utilization=2 and num_gpu_blocks=0
    # (silently "size from memory") were accepted
    ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens: must be >= 1, got 0"),
    ({"block_size": "16"}, TypeError, "block_size: Expected `int`, got `str`"),
    ({"block_size": 0}, ValueError, "block_size: must be a power of two between 1 and 256, got 0"),
    ({"block_size": 3}, ValueError, "block_size: must be a power of two between 1 and 256, got 3"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs: must be >= 1, got 0"),
    ({"gpu_memory_utilization": 2}, ValueError, "gpu_memory_utilization: must be > 0 and <= 1, got 2"),
    ({"num_gpu_blocks": 0}, ValueError, "num_gpu_blocks: must be None or >= 1, got 0"),
    ({"swap_space": -1}, ValueError, "swap_space: must be >= 0 (GiB) and finite, got -1"),
    ({"device": "tpu"}, ValueError, "device: must be one of auto, cpu, cuda, got 'tpu'"),
    ({"kv_cache_dtype": "int8"}, ValueError, "kv_cache_dtype: must be one of auto, fp8"),
    ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching: Expected `bool`, got `str`"),
])
def test_a_bad_engine_argument_is_named_before_any_worker_starts(stories260k, engine_args, error, message):
    import threading

    from pagedkv import LLM

    threads = threading.active_count()
    with pytest.raises(error, match=re.escape(message)):
        LLM(model=str(stories260k), **engine_args)
    assert threading.active_count() == threads  # no event-loop thread left behind


def test_the_model_may_be_a_path_object(stories260k):
    from pagedkv import LLM, SamplingParams

    with LLM(model=Path(stories260k), num_gpu_blocks=64, swap_space=0.01) as llm:  # was AttributeError: endswith
        [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out.outputs[0].token_ids == GOLDEN_OUTPUT_IDS[:5]


def test_an_llm_dropped_without_shutdown_stops_its_worker_when_collected(stories260k):
    # atexit.register(self.shutdown) held a reference: a dropped LLM's worker ran until interpreter exit
    import gc

    from pagedkv import LLM

    llm = LLM(model=str(stories260k), num_gpu_blocks=64, swap_space=0.01)
    worker = llm.engine.client.processes[0]
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{worker.pid}").exists()  # stopped and reaped


def test_vllm_spellings_of_stop_max_tokens_and_text_prompts(llm):
    # SamplingParams(stop="Lily") reached the worker as a str where it decodes a list: the step was
    # dropped and generate() hung (worker restarts every --worker-timeout); max_tokens=None was a
    # TypeError ('<' between NoneType and int); {"prompt": ...} (vLLM's TextPrompt) a TypeError
    from pagedkv import SamplingParams

    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=60, stop="Lily"), use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].stop_reason) == (", there was a little girl named ", "Lily")
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None) == SamplingParams()
    [out] = llm.generate({"prompt": GOLDEN_PROMPT}, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    assert out.prompt == GOLDEN_PROMPT and out.prompt_token_ids == GOLDEN_PROMPT_IDS
    c = out.outputs[0]
    assert (len(c.token_ids), c.finish_reason) == (512 - len(GOLDEN_PROMPT_IDS), "length")  # max_model_len 512
    assert c.token_ids[:60] == GOLDEN_OUTPUT_IDS
    with pytest.raises(ValueError, match=re.escape("stop_token_ids: Expected `array`, got `int`")):
        llm.generate("Once", SamplingParams(stop_token_ids=2), use_tqdm=False)
    assert llm.engine.kv_cache_snapshot()["num_free_blocks"] == 64


def test_vllm_dtype_aliases_are_accepted():
    # LLM(model, dtype="half") was "dtype: must be one of auto, float32, float16, bfloat16, got 'half'"
    from pagedkv.common.config import EngineConfig

    assert [EngineConfig(dtype=d).dtype for d in ("half", "float", "bfloat16", "auto")] == \
        ["float16", "float32", "bfloat16", "auto"]


def test_beam_outputs_carry_their_cumulative_logprob(llm):
    # a beam's cumulative logprob (what ranks it) was None: the engine summed it and dropped it
    from pagedkv import SamplingParams

    [out] = llm.generate(GOLDEN_PROMPT, SamplingParams(n=3, use_beam_search=True, max_tokens=8), use_tqdm=False)
    cums = [c.cumulative_logprob for c in out.outputs]
    assert all(c is not None for c in cums) and cums == sorted(cums, reverse=True)  # 8 tokens each: by sum
    for c, cum in zip(out.outputs, cums):  # the sum of the beam's tokens' logprobs, as the model scores them
        [scored] = llm.generate({"prompt_token_ids": GOLDEN_PROMPT_IDS + c.token_ids},
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        lps = [d[t].logprob for t, d in zip(c.token_ids, scored.prompt_logprobs[len(GOLDEN_PROMPT_IDS):])]
        assert len(c.token_ids) == 8 and cum == pytest.approx(sum(lps), abs=1e-4)


@pytest.fixture(scope="module")
def llm_period_eos(stories260k, tmp_path_factory):
    """stories260K whose generation_config.json adds "." (426) to the EOS ids: the model emits it
    often, its own EOS (2) almost never."""
    import json

    from pagedkv import LLM

    d = tmp_path_factory.mktemp("period_eos")
    for f in stories260k.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 426]}))
    with LLM(model=str(d), device="cpu", num_gpu_blocks=64, swap_space=0.01) as llm:
        yield llm


def test_beam_search_with_ignore_eos_runs_past_eos(llm_period_eos):
    # beam search ignored ignore_eos: a beam ending in EOS finished ("stop", 11 tokens) all the same
    from pagedkv import SamplingParams

    def beams(ignore_eos):
        [out] = llm_period_eos.generate(GOLDEN_PROMPT, SamplingParams(n=2, use_beam_search=True, max_tokens=12,
                                                                      ignore_eos=ignore_eos), use_tqdm=False)
        return [(c.token_ids, c.finish_reason) for c in out.outputs]

    assert llm_period_eos.get_tokenizer().eos_token_ids == [2, 426]
    assert beams(False)[0] == (GOLDEN_OUTPUT_IDS[:11], "stop")  # ", there was a little girl named Lily."
    best, second = beams(True)
    assert best == (GOLDEN_OUTPUT_IDS[:12], "length") and (len(second[0]), second[1]) == (12, "length")
    assert 426 in second[0][:-1]  # EOS inside a beam that went on


def test_beam_search_takes_vllm_beam_search_params_and_returns_its_output_shape(llm):
    # vLLM's LLM.beam_search(prompts, BeamSearchParams(...)) was an AttributeError
    from pagedkv import BeamSearchParams, SamplingParams

    outs = llm.beam_search([GOLDEN_PROMPT, {"prompt_token_ids": GOLDEN_PROMPT_IDS}],
                           BeamSearchParams(beam_width=3, max_tokens=8))
    [same] = llm.generate(GOLDEN_PROMPT, SamplingParams(n=3, use_beam_search=True, max_tokens=8), use_tqdm=False)
    for out in outs:
        seqs = out.sequences
        assert [s.tokens[:5] for s in seqs] == [GOLDEN_PROMPT_IDS] * 3  # the prompt's ids first, as vLLM's
        assert [s.tokens[5:] for s in seqs] == [c.token_ids for c in same.outputs]
        assert seqs[0].tokens[5:] == GOLDEN_OUTPUT_IDS[:8]
        assert [s.text for s in seqs] == ["<s> Once upon a time, there was a little girl",
                                          "<s> Once upon a time, there was a little boy",
                                          "<s> Once upon a time, there was a boy named"]
        assert [s.cum_logprob for s in seqs] == pytest.approx([c.cumulative_logprob for c in same.outputs], abs=1e-4)
        assert [(s.finish_reason, s.logprobs) for s in seqs] == [("length", None)] * 3
    [out] = llm.beam_search(GOLDEN_PROMPT, BeamSearchParams(beam_width=2, max_tokens=600))  # capped, as generate
    assert [len(s.tokens) for s in out.sequences] == [512, 512]
    with pytest.raises(ValueError, match=re.escape("beam_width: must be between 1 and max_n (16), got 17")):
        llm.beam_search([GOLDEN_PROMPT], BeamSearchParams(beam_width=17, max_tokens=8))
    with pytest.raises(ValueError, match=re.escape("temperature: beam search here keeps the most likely candidates")):
        llm.beam_search([GOLDEN_PROMPT], BeamSearchParams(beam_width=2, max_tokens=8, temperature=0.7))
    assert llm.engine.kv_cache_snapshot()["num_free_blocks"] == 64


def test_a_sampled_token_outside_the_top_logprobs_gets_its_rank(llm):
    # its Logprob.rank was None; vLLM ranks it in the whole distribution. The prompt pass over the
    # same tokens (checked against transformers in test_worker_model) ranks them the same
    from pagedkv import SamplingParams

    [out] = llm.generate(GOLDEN_PROMPT, SamplingParams(temperature=2.0, seed=5, max_tokens=30, logprobs=1),
                         use_tqdm=False)
    c = out.outputs[0]
    ranks = [lps[t].rank for t, lps in zip(c.token_ids, c.logprobs)]
    [scored] = llm.generate({"prompt_token_ids": GOLDEN_PROMPT_IDS + c.token_ids},
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert ranks == [d[t].rank for t, d in zip(c.token_ids, scored.prompt_logprobs[len(GOLDEN_PROMPT_IDS):])]
    assert sum(r > 1 for r in ranks) >= 10  # many lie outside the top 1


def test_detokenize_false_returns_token_ids_without_text_as_vllm(llm):
    # SamplingParams(detokenize=False), which vLLM V1 takes, was a TypeError (unexpected keyword)
    from pagedkv import SamplingParams

    [out] = llm.generate(GOLDEN_PROMPT, SamplingParams(temperature=0, max_tokens=60, logprobs=1, prompt_logprobs=1,
                                                       detokenize=False), use_tqdm=False)
    c = out.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == (GOLDEN_OUTPUT_IDS, "", "length")
    assert all(lp.decoded_token is None for d in c.logprobs for lp in d.values())
    assert all(lp.decoded_token is None for d in out.prompt_logprobs[1:] for lp in d.values())
    assert c.logprobs[0][432].rank == 1 and out.prompt_token_ids == GOLDEN_PROMPT_IDS
    [beams] = llm.generate(GOLDEN_PROMPT, SamplingParams(n=2, use_beam_search=True, max_tokens=8, detokenize=False),
                           use_tqdm=False)
    assert [(b.token_ids[:3], b.text) for b in beams.outputs] == [(GOLDEN_OUTPUT_IDS[:3], "")] * 2
    with pytest.raises(ValueError, match=re.escape("stop: stop strings are matched in the text, so they need "
                                                   "detokenize=True")):
        llm.generate(GOLDEN_PROMPT, SamplingParams(stop=["Lily"], detokenize=False), use_tqdm=False)
    with pytest.raises(TypeError, match="Unexpected keyword argument 'best_of'"):  # as vLLM V1, which removed it
        SamplingParams(n=2, best_of=3)
