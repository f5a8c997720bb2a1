"""The engine with attention forced onto the Triton kernels (interpreted on CPU) is still golden.

The worker process inherits the environment: PAGEDKV_ATTENTION_BACKEND=triton makes `kernels`
dispatch paged_attention, write_kv_cache and copy_blocks to `kernels.triton_kernels`, and
TRITON_INTERPRET=1 lets those run on CPU tensors.
"""

import importlib.util

import pytest

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS
from scheduler.engine import Engine

# Only the worker process imports triton; importing it here (without TRITON_INTERPRET) would spoil
# test_kernels.py, which needs triton's own jit functions built for the interpreter.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


async def test_triton_backend_engine_reproduces_the_stories260k_golden(stories260k, monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu"))
    try:
        tokens, text = [], ""
        async for out in engine.add_request(GOLDEN_PROMPT_IDS,
                                            SamplingParams(temperature=0, max_tokens=60)):
            assert out.error is None
            tokens += out.token_ids
            text += out.text
    finally:
        await engine.shutdown()
    assert tokens == GOLDEN_OUTPUT_IDS
    assert text == GOLDEN_COMPLETION
