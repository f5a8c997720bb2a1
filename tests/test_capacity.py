"""The capacity planner's arithmetic, on the real Llama 3.1 8B config (exact values)."""

import json
import os
from pathlib import Path

import pytest

from pagedkv.common.capacity import plan
from pagedkv.common.config import ModelConfig
from pagedkv.scheduler.cli import main

# $PAGEDKV_MODEL_CONFIGS, else ../shared/model-configs next to the repository
LLAMA_8B = Path(os.environ.get("PAGEDKV_MODEL_CONFIGS")
                or Path(__file__).resolve().parents[2] / "shared/model-configs") / "llama-3.1-8b"


@pytest.fixture(scope="module")
def llama():
    if not (LLAMA_8B / "config.json").is_file():
        pytest.fail(f"Llama 3.1 8B config not found at {LLAMA_8B} (set PAGEDKV_MODEL_CONFIGS)")
    return ModelConfig.load(str(LLAMA_8B))


def test_llama_8b_kv_bytes_per_token_and_weights(llama):
    # 2 (K, V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16)
    assert llama.kv_bytes_per_token("bfloat16") == 131_072
    assert llama.kv_bytes_per_token("fp8") == 65_536
    assert llama.weight_bytes("bfloat16") == 16_060_522_496  # 8,030,261,248 parameters


def test_llama_8b_on_an_80_gib_h100_fits_about_420k_tokens(llama):
    c = plan(llama, 80, gpu_memory_utilization=0.9, activation_reserve_gib=4)
    assert c.budget_bytes == int(80 * 2**30 * 0.9)
    assert c.kv_cache_bytes == c.budget_bytes - c.weight_bytes - 4 * 2**30 == 56_953_921_536
    assert c.kv_tokens == 56_953_921_536 // 131_072 == 434_523
    assert 400_000 < c.kv_tokens < 440_000  # practitioners quote ~420K
    assert c.num_blocks == 434_523 // 16 == 27_157
    assert c.blocks_per_request == 131_072 // 16
    assert c.max_concurrent_requests == 3


def test_fp8_kv_cache_doubles_the_tokens_and_context_len_sets_concurrency(llama):
    bf16 = plan(llama, 80, activation_reserve_gib=4)
    fp8 = plan(llama, 80, activation_reserve_gib=4, kv_cache_dtype="fp8", context_len=8192)
    assert fp8.kv_tokens == 2 * bf16.kv_tokens + (bf16.kv_cache_bytes % 131_072 >= 65_536)
    assert fp8.max_concurrent_requests == fp8.num_blocks // 512


def test_tensor_parallel_figures_are_per_device_with_the_embedding_and_lm_head_replicated(llama):
    one, two = plan(llama, 24, activation_reserve_gib=4), plan(llama, 24, activation_reserve_gib=4, tensor_parallel_size=2)
    # per layer and device: q 2,048 + k, v 512 each of 4,096 inputs, o 2,048 x 4,096, MLP 3 x 4,096 x 7,168, 2 norms
    per_layer = 4096 * (2048 + 2 * 512) + 2048 * 4096 + 3 * 4096 * 7168 + 2 * 4096
    embed_and_head = 2 * 128_256 * 4096  # untied, whole on every device
    assert two.weight_bytes == 2 * (32 * per_layer + embed_and_head + 4096) == 9_081_200_640
    assert two.kv_bytes_per_token == 65_536 and two.tensor_parallel_size == 2  # 4 of the 8 KV heads
    assert two.kv_tokens == two.kv_cache_bytes // 65_536 > 4 * one.kv_tokens  # the weights no longer crowd the KV out
    assert plan(llama, 80, tensor_parallel_size=8).kv_bytes_per_token == 16_384  # one KV head each
    assert plan(llama, 80, tensor_parallel_size=16).kv_bytes_per_token == 16_384  # each KV head on 2 devices
    with pytest.raises(ValueError, match="does not divide the model's 32 attention heads"):
        plan(llama, 80, tensor_parallel_size=3)


def test_cli_capacity_takes_the_tensor_parallel_size(capsys):
    assert main(["capacity", "--model-config", str(LLAMA_8B), "--gpu-memory-gib", "24", "-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel = 2 devices" in out and "9,081,200,640 B" in out and "65,536 B" in out


def test_no_room_for_a_block_is_an_error(llama):
    with pytest.raises(ValueError, match="no room for a KV block"):
        plan(llama, 16)


def test_cli_prints_the_arithmetic_and_json(capsys):
    assert main(["capacity", "--model-config", str(LLAMA_8B), "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "131,072 B" in out and "434,523 tokens" in out and "27,157 blocks" in out
    assert main(["capacity", "--model-config", str(LLAMA_8B), "--gpu-memory-gib", "80", "--json",
                 "--context-len", "4096"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_tokens"] == 434_523 and got["max_concurrent_requests"] == 27_157 // 256


@pytest.mark.parametrize("flag,value", [("--gpu-memory-gib", "0"), ("--gpu-memory-utilization", "1.5"),
                                        ("--block-size", "x"), ("--activation-reserve-gib", "-1"),
                                        # inf was an OverflowError traceback; a block size serve refuses was planned
                                        ("--gpu-memory-gib", "inf"), ("--block-size", "3"), ("--block-size", "512")])
def test_bad_flags_are_argparse_errors_naming_the_flag(flag, value, capsys):
    argv = ["capacity", "--model-config", str(LLAMA_8B), "--gpu-memory-gib", "80", flag, value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err
