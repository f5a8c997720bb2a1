"""The engine with attention forced onto the Triton kernels (interpreted on CPU) is still golden.

``attention_backend="triton"`` (--attention-backend) makes the worker pick `kernels.triton_kernels`
once at model load for paged_attention, write_kv_cache and copy_blocks; the worker process inherits
TRITON_INTERPRET=1, which lets those run on CPU tensors.
"""

import importlib.util

import pytest

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS
from pagedkv.scheduler.engine import Engine

# Only the worker process imports triton; importing it here (without TRITON_INTERPRET) would spoil
# test_kernels.py, which needs triton's own jit functions built for the interpreter.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


async def test_triton_backend_engine_reproduces_the_stories260k_golden(stories260k, monkeypatch):
    """The golden's first 28 tokens: 33 in all, three 16-token blocks (two block boundaries crossed);
    every interpreted step costs seconds, so the other 32 would add nothing but time."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", attention_backend="triton",
                                             num_gpu_blocks=32, swap_space=0.01))
    try:
        tokens, text = [], ""
        async for out in engine.add_request(GOLDEN_PROMPT_IDS,
                                            SamplingParams(temperature=0, max_tokens=28)):
            assert out.error is None
            tokens += out.token_ids
            text += out.text
    finally:
        await engine.shutdown()
    assert tokens == GOLDEN_OUTPUT_IDS[:28]
    assert text == ", there was a little girl named Lily. She loved to play outside in the park. One"
    assert GOLDEN_COMPLETION.startswith(text)


async def test_attention_backend_triton_really_runs_triton(stories260k, monkeypatch):
    """Triton cannot run on CPU tensors without the interpreter: the step must fail, not fall back to torch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", attention_backend="triton",
                                             swap_space=0.01))
    try:
        outs = [o async for o in engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=2))]
    finally:
        await engine.shutdown()
    assert outs[-1].finish_reason == "error" and outs[-1].error.startswith("worker error: ")
