"""Tensor parallelism (Megatron-style sharding over torch.distributed, gloo on CPU) on stories260K.

stories260K has 8 attention heads and 4 KV heads: -tp 2 holds 4 + 2 per rank, -tp 4 holds 2 + 1.
KV-head replication (more ranks than KV heads) is checked on a dummy multi-query config (1 KV head).
The engine tests start real rank processes; they share a few engines per module to stay short.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import zmq
import zmq.asyncio
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS
from safetensors import safe_open
from safetensors.torch import save_file

from pagedkv.common import protocol
from pagedkv.common.config import EMBEDDED_HF_CONFIG, EngineConfig, ModelConfig
from pagedkv.scheduler.worker_client import WorkerClient, WorkerFailed
from pagedkv.worker.model_loader import checkpoint_tensors, load_model, shard_of
from pagedkv.worker.parallel import TensorParallel
from tp_ranks import fp8_rank, logits_rank, step_logits

MQA_HF_CONFIG = dict(EMBEDDED_HF_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the shard arithmetic ----------------------------------------------------------------------

def test_shard_splits_heads_and_mlp_and_replicates_kv_heads_beyond_their_count(stories260k):
    stories = ModelConfig.load(str(stories260k))
    assert [(s.num_attention_heads, s.num_key_value_heads, s.intermediate_size)
            for s in map(stories.shard, (1, 2, 4))] == [(8, 4, 172), (4, 2, 86), (2, 1, 43)]
    embedded = ModelConfig.load(None).shard(8)  # 8 heads, 4 KV heads: each KV head on 2 ranks
    assert (embedded.num_attention_heads, embedded.num_key_value_heads, embedded.intermediate_size) == (1, 1, 86)
    assert stories.shard(2).kv_bytes_per_token("float32") * 2 == stories.kv_bytes_per_token("float32")
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        stories.shard(3)
    with pytest.raises(ValueError, match="does not divide the model's intermediate_size 172"):
        stories.shard(8)
    odd = ModelConfig.from_hf_dict(dict(EMBEDDED_HF_CONFIG, num_attention_heads=12, head_dim=16), "odd", None)
    with pytest.raises(ValueError, match="neither divides the model's 4 KV heads nor is a multiple"):
        odd.shard(6)


@pytest.mark.parametrize("heads,kv_heads,world_size", [(8, 4, 2), (8, 4, 4), (8, 4, 8), (8, 2, 8), (4, 1, 4), (32, 8, 4)])
def test_every_rank_holds_the_kv_heads_its_query_heads_read(heads, kv_heads, world_size):
    config = ModelConfig.from_hf_dict(dict(EMBEDDED_HF_CONFIG, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                           intermediate_size=8 * world_size), "m", None)
    shard = config.shard(world_size)
    held_q = []
    for rank in range(world_size):
        tp = TensorParallel(rank, world_size)
        q, kv = tp.q_heads(config), tp.kv_heads(config)
        assert (len(q), len(kv)) == (shard.num_attention_heads, shard.num_key_value_heads)
        for local, head in enumerate(q):  # GQA: query head j reads KV head j // (heads / kv_heads)
            local_kv = local // (len(q) // len(kv))  # what the paged-attention kernel reads on this rank
            assert kv[local_kv] == head // (heads // kv_heads)
        held_q += list(q)
    assert held_q == list(range(heads))  # every query head on exactly one rank


def test_a_rank_loads_exactly_its_slices_of_the_checkpoint(stories260k):
    config = ModelConfig.load(str(stories260k))
    with safe_open(str(stories260k / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    engine_config = EngineConfig(model=str(stories260k))
    tp = TensorParallel(1, 4)  # loading needs no collective, so no process group either
    params = checkpoint_tensors(load_model(config, engine_config, torch.device("cpu"), torch.float32, tp))
    layer = "model.layers.3."
    expect = {  # rank 1 of 4: query heads 2-3, KV head 1, intermediate channels 43-85 (head_dim 8)
        "self_attn.q_proj.weight": full[layer + "self_attn.q_proj.weight"][16:32],
        "self_attn.k_proj.weight": full[layer + "self_attn.k_proj.weight"][8:16],
        "self_attn.v_proj.weight": full[layer + "self_attn.v_proj.weight"][8:16],
        "self_attn.o_proj.weight": full[layer + "self_attn.o_proj.weight"][:, 16:32],
        "mlp.gate_proj.weight": full[layer + "mlp.gate_proj.weight"][43:86],
        "mlp.up_proj.weight": full[layer + "mlp.up_proj.weight"][43:86],
        "mlp.down_proj.weight": full[layer + "mlp.down_proj.weight"][:, 43:86],
        "input_layernorm.weight": full[layer + "input_layernorm.weight"],
    }
    for name, tensor in expect.items():
        assert torch.equal(params[layer + name], tensor), name
    assert torch.equal(params["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # replicated
    assert shard_of("model.embed_tokens.weight", config, tp) is None and shard_of("lm_head.weight", config, tp) is None


# a GQA model small enough to write out: 4 heads, 2 KV heads, head_dim 4, 8 intermediate channels
TINY_HF_CONFIG = dict(EMBEDDED_HF_CONFIG, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=32)
# (world_size, rank, its q_proj rows, its k_proj / v_proj rows, its gate_proj / up_proj rows), by hand
TINY_SHARDS = [(1, 0, range(0, 16), range(0, 8), range(0, 8)), (2, 0, range(0, 8), range(0, 4), range(0, 4)),
               (2, 1, range(8, 16), range(4, 8), range(4, 8)),
               (4, 3, range(12, 16), range(4, 8), range(6, 8))]  # 4 ranks > 2 KV heads: KV head 1 replicated


def _fused(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    block = model.model.layers[layer]
    return block.self_attn.qkv_proj.weight, block.mlp.gate_up_proj.weight


@pytest.mark.parametrize("world_size,rank,q_rows,kv_rows,mlp_rows", TINY_SHARDS)
def test_each_checkpoint_projection_lands_in_its_rows_of_the_fused_weights(tmp_path, world_size, rank, q_rows,
                                                                           kv_rows, mlp_rows):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    config = ModelConfig.load(str(tmp_path))
    shapes = {"model.embed_tokens.weight": (32, 16), "model.norm.weight": (16,)}
    for i in range(2):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in [
            ("self_attn.q_proj.weight", (16, 16)), ("self_attn.k_proj.weight", (8, 16)),
            ("self_attn.v_proj.weight", (8, 16)), ("self_attn.o_proj.weight", (16, 16)),
            ("mlp.gate_proj.weight", (8, 16)), ("mlp.up_proj.weight", (8, 16)), ("mlp.down_proj.weight", (16, 8)),
            ("input_layernorm.weight", (16,)), ("post_attention_layernorm.weight", (16,))]})
    full, start = {}, 0
    for name, shape in shapes.items():  # every element of the checkpoint a different number
        full[name] = torch.arange(start, start + math.prod(shape), dtype=torch.float32).view(shape)
        start += math.prod(shape)
    save_file(full, str(tmp_path / "model.safetensors"))
    model = load_model(config, EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32,
                       TensorParallel(rank, world_size))
    for i in range(2):
        qkv, gate_up = _fused(model, i)
        layer = lambda name: full[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        assert torch.equal(qkv, torch.cat([layer("self_attn.q_proj")[q_rows.start:q_rows.stop],
                                           layer("self_attn.k_proj")[kv_rows.start:kv_rows.stop],
                                           layer("self_attn.v_proj")[kv_rows.start:kv_rows.stop]])), i
        assert torch.equal(gate_up, torch.cat([layer("mlp.gate_proj")[mlp_rows.start:mlp_rows.stop],
                                               layer("mlp.up_proj")[mlp_rows.start:mlp_rows.stop]])), i


@pytest.mark.parametrize("world_size,rank,q_rows,kv_rows,mlp_rows", TINY_SHARDS)
def test_dummy_fused_weights_hold_the_draws_of_the_separate_projections(tmp_path, world_size, rank, q_rows,
                                                                        kv_rows, mlp_rows):
    """Dummy weights are drawn one checkpoint tensor at a time in the checkpoint's order, as before the
    projections were fused: the same seed gives the same model."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    config = ModelConfig.load(str(tmp_path))
    model = load_model(config, EngineConfig(model=str(tmp_path), load_format="dummy", seed=5), torch.device("cpu"),
                       torch.float32, TensorParallel(rank, world_size))
    gen = torch.Generator().manual_seed(5)
    draw = lambda *shape: torch.empty(shape).normal_(0.0, 0.02, generator=gen)  # noqa: E731
    assert torch.equal(model.model.embed_tokens.weight, draw(32, 16))
    for i in range(2):
        # q, k, v, o, gate, up, down (the norms are ones, drawn from nothing)
        q, k, v, _, gate, up, _ = (draw(*shape) for shape in [(16, 16), (8, 16), (8, 16), (16, 16), (8, 16), (8, 16),
                                                              (16, 8)])
        qkv, gate_up = _fused(model, i)
        assert torch.equal(qkv, torch.cat([q[q_rows.start:q_rows.stop], k[kv_rows.start:kv_rows.stop],
                                           v[kv_rows.start:kv_rows.stop]])), i
        assert torch.equal(gate_up, torch.cat([gate[mlp_rows.start:mlp_rows.stop], up[mlp_rows.start:mlp_rows.stop]])), i


def test_dummy_weights_are_the_same_model_at_every_tensor_parallel_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MQA_HF_CONFIG))
    config = ModelConfig.load(str(tmp_path))
    engine_config = EngineConfig(model=str(tmp_path), load_format="dummy", seed=3)
    whole = checkpoint_tensors(load_model(config, engine_config, torch.device("cpu"), torch.float32))
    for rank in range(4):
        tp = TensorParallel(rank, 4)
        part = checkpoint_tensors(load_model(config, engine_config, torch.device("cpu"), torch.float32, tp))
        for name, p in part.items():
            shard = shard_of(name, config, tp)
            expected = whole[name] if shard is None else (
                whole[name][shard[1].start:shard[1].stop] if shard[0] == 0 else whole[name][:, shard[1].start:shard[1].stop])
            assert torch.equal(p, expected), (rank, name)


# ---- one step's logits across rank processes ----------------------------------------------------

def test_one_steps_logits_at_tp2_and_tp4_agree_with_tp1_within_1e_4(stories260k, tmp_path):
    stories = ModelConfig.load(str(stories260k))
    (tmp_path / "config.json").write_text(json.dumps(MQA_HF_CONFIG))
    mqa = ModelConfig.load(str(tmp_path))  # 1 KV head: replicated on every rank
    cases = [("stories", stories, "auto", GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[0], n) for n in (2, 4)]
    cases += [("mqa", mqa, "dummy", [3, 1, 4, 1, 5], 9, n) for n in (2, 4)]
    mp.spawn(logits_rank, args=(4, f"tcp://127.0.0.1:{_free_port()}", cases, str(tmp_path)), nprocs=4, join=True)
    for name, config, load_format, prompt, next_token, n in cases:
        expected = step_logits(config, load_format, prompt, next_token)
        got = torch.load(tmp_path / f"{name}-tp{n}.pt")
        assert got.shape == expected.shape == (len(prompt) + 1, config.vocab_size)
        assert (got - expected).abs().max().item() < 1e-4, (name, n)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), (name, n)
    assert expected_first_token(stories260k) == GOLDEN_OUTPUT_IDS[:2]


def test_fp8_kv_scales_calibrated_at_tp2_are_tp1s_on_every_rank(stories260k, tmp_path):
    """The first prefill calibrates each layer's scale from the amax of all KV heads, not of a rank's own
    (each rank had its own scales, and -tp 2 decoded fp8 otherwise than -tp 1)."""
    stories = ModelConfig.load(str(stories260k))
    mp.spawn(fp8_rank, args=(2, f"tcp://127.0.0.1:{_free_port()}", stories, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[0],
                             str(tmp_path)), nprocs=2, join=True)
    scales: list = []
    expected = step_logits(stories, "auto", GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[0], kv_dtype=torch.float8_e4m3fn,
                           scales=scales)
    assert len(scales) == 5 and all(k is not None and v is not None for k, v in scales)
    for rank in range(2):
        logits, got = torch.load(tmp_path / f"fp8-rank{rank}.pt")
        # equal up to the float rounding of a sharded GEMM (before: k_scale 0.0745 on rank 0, 0.0927 at -tp 1)
        assert all(math.isclose(a, b, rel_tol=1e-6) for pair, ref in zip(got, scales, strict=True)
                   for a, b in zip(pair, ref, strict=True)), (rank, got, scales)
        assert (logits - expected).abs().max().item() < 1e-4, rank
        assert torch.equal(logits.argmax(-1), expected.argmax(-1)), rank


def expected_first_token(stories260k) -> list[int]:
    """The tp-1 reference's greedy tokens after the prompt and after the first golden token."""
    logits = step_logits(ModelConfig.load(str(stories260k)), "auto", GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[0])
    return logits[-2:].argmax(-1).tolist()


# ---- flags -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["generate", "-tp", "3", "x"], "--tensor-parallel-size: tensor parallel size 3 does not divide the model's 8 attention heads"),
    (["generate", "-tp", "8", "x"], "--tensor-parallel-size: tensor parallel size 8 does not divide the model's intermediate_size 172"),
    (["generate", "-tp", "0", "x"], "argument --tensor-parallel-size/-tp: must be >= 1"),
])
def test_a_tensor_parallel_size_the_model_cannot_split_is_a_cli_error_naming_the_flag(stories260k, argv, message, capsys):
    from pagedkv.scheduler.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv[:1] + ["--model", str(stories260k)] + argv[1:])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_offline_api_refuses_a_tensor_parallel_size_the_model_cannot_split_before_any_rank_starts(stories260k):
    from pagedkv import LLM

    with pytest.raises(ValueError, match="^tensor parallel size 3 does not divide the model's 8 attention heads$"):
        LLM(model=str(stories260k), tensor_parallel_size=3)


@pytest.mark.parametrize("flags,message", [
    (["--rank", "2", "--world-size", "2", "--dist-init-method", "tcp://h:1"], "--rank must be between 0 and"),
    (["--rank", "1", "--world-size", "2"], "--dist-init-method tcp://HOST:PORT (where rank 0 listens) is needed"),
    (["--world-size", "0"], "--world-size must be >= 1"),
])
def test_inconsistent_rank_flags_are_worker_cli_errors(flags, message, capsys, monkeypatch):
    from pagedkv.scheduler.cli import main

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        main(["worker", "--connect", "tcp://127.0.0.1:1"] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_worker_rank_flags_default_to_the_torchrun_environment(monkeypatch):
    from pagedkv.scheduler.cli import build_parser

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    args = build_parser().parse_args(["worker", "--connect", "tcp://cp:5555"])
    assert (args.rank, args.world_size, args.dist_init_method) == (3, 4, "env://")


# ---- the control plane's side of a group, against fake ranks (no torch) ---------------------------

SECRET = b"0123456789abcdef" * 4  # the worker-channel secret the fake ranks and the client share
CHANNEL = protocol.Channel(SECRET)


class FakeRank:
    """A DEALER socket speaking the (sealed) worker protocol by hand, as one rank of a group."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send(self, msg) -> None:
        await self.sock.send(CHANNEL.seal_from_worker(msg))

    async def recv(self):
        assert await self.sock.poll(10_000), f"rank {self.rank} got nothing"
        return CHANNEL.open_to_worker(await self.sock.recv())

    async def register(self) -> None:
        await self.send(protocol.Register(protocol.PROTOCOL_VERSION, os.getpid(), self.rank, self.world_size))


async def start_group(client: WorkerClient, hellos: dict[int, protocol.WorkerHello], register_order: list[int]):
    """Start ``client`` against fake ranks registering in ``register_order``; return (its hello or error, ranks)."""
    ctx = zmq.asyncio.Context.instance()
    ranks = {r: FakeRank(ctx, client.address, r, 2) for r in register_order}
    started = asyncio.create_task(client.start(register_timeout=10))
    for r in register_order:
        await ranks[r].register()
    loads = {r: await ranks[r].recv() for r in register_order}
    assert {r: (m.rank, m.world_size) for r, m in loads.items()} == {0: (0, 2), 1: (1, 2)}
    for r, hello in hellos.items():
        await ranks[r].send(hello)
    try:
        return await started, ranks
    except WorkerFailed as e:
        return e, ranks


def fake_group_client(tmp_path, world_size: int) -> WorkerClient:
    """A control plane for ``world_size`` ranks that it does not spawn (FakeRank plays them)."""
    return WorkerClient(EngineConfig(tensor_parallel_size=world_size, worker_timeout=10), f"ipc://{tmp_path}/w.sock",
                        spawn=False, secret=SECRET)


def hello(rank: int, blocks: int, bandwidth: float | None, dtype: str = "float32") -> protocol.WorkerHello:
    return protocol.WorkerHello(rank=rank, device=f"cuda:{rank}", dtype=dtype, kv_bytes_per_block=10240,
                                max_num_gpu_blocks=blocks, swap_bandwidth=bandwidth)


async def test_the_group_pool_is_the_smallest_ranks_and_each_plan_reaches_both_ranks(tmp_path):
    client = fake_group_client(tmp_path, 2)
    try:
        got, ranks = await start_group(client, {1: hello(1, 700, 2e9), 0: hello(0, 900, 5e9)}, [1, 0])
        assert (got.max_num_gpu_blocks, got.swap_bandwidth) == (700, 2e9)  # every rank must hold every block
        init = asyncio.create_task(client.init_cache(700, 8))
        for r in (0, 1):
            assert await ranks[r].recv() == protocol.InitCache(700, 8)
            await ranks[r].send(protocol.WorkerReady(rank=r))
        await init
        plan = protocol.StepPlan(step_id=5)
        step = asyncio.create_task(client.step(plan))
        assert [await ranks[r].recv() for r in (0, 1)] == [plan, plan]
        await ranks[1].send(protocol.StepResult(step_id=5, sampled=[protocol.SampledToken("a", 7)]))
        await ranks[0].send(protocol.StepResult(step_id=5, sampled=[protocol.SampledToken("a", 7, -0.5)]))
        assert (await step).sampled == [protocol.SampledToken("a", 7, -0.5)]  # rank 0's, with its logprob

        step = asyncio.create_task(client.step(protocol.StepPlan(step_id=6)))
        for r in (0, 1):
            await ranks[r].recv()
            await ranks[r].send(protocol.StepResult(step_id=6, sampled=[protocol.SampledToken("a", 8 + r)]))
        with pytest.raises(WorkerFailed, match="worker rank 1 sampled other tokens than rank 0 in step 6"):
            await step
    finally:
        await client.close()


async def test_ranks_that_disagree_on_dtype_fail_the_start(tmp_path):
    client = fake_group_client(tmp_path, 2)
    try:
        got, _ = await start_group(client, {0: hello(0, 900, None), 1: hello(1, 900, None, dtype="bfloat16")}, [0, 1])
        assert isinstance(got, WorkerFailed)
        assert str(got).startswith("ranks disagree on dtype or KV block size: rank 0 cuda:0 float32 10240 B, "
                                   "rank 1 cuda:1 bfloat16 10240 B")
    finally:
        await client.close()


@pytest.mark.parametrize("second", [(0, 2), (1, 4), (2, 2)])  # rank 0 again, another world size, no such rank
async def test_a_rank_that_does_not_complete_0_to_n_minus_1_once_each_is_refused(tmp_path, second):
    client = fake_group_client(tmp_path, 2)
    ctx = zmq.asyncio.Context.instance()
    try:
        started = asyncio.create_task(client.start(register_timeout=10))
        ranks = [FakeRank(ctx, client.address, 0, 2), FakeRank(ctx, client.address, *second)]
        for rank in ranks:
            await rank.register()
        with pytest.raises(WorkerFailed, match=rf"a worker registered as rank {second[0]} of {second[1]}; this "
                                               r"control plane needs ranks 0\.\.1 of 2 once each \(--tensor-parallel-size 2\)"):
            await started
    finally:
        await client.close()


async def test_spawned_ranks_get_their_own_local_rank_not_the_control_planes(tmp_path, monkeypatch):
    """A LOCAL_RANK=0 / LOCAL_WORLD_SIZE=1 in the control plane's environment reached every spawned rank:
    all of them took cuda:0 (`worker.select_device`) and all the host's CPU threads."""
    from pagedkv.scheduler import worker_client

    envs = []

    class Exited:  # a rank that exits at once: start() fails naming it, close() reaps it
        pid, returncode = 12345, 1

        def __init__(self, argv, env):
            envs.append(env)

        def poll(self):
            return 1

        def kill(self):
            pass

        def wait(self):
            return 1

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(worker_client.subprocess, "Popen", Exited)
    client = WorkerClient(EngineConfig(tensor_parallel_size=2, worker_timeout=10), f"ipc://{tmp_path}/w.sock")
    try:
        with pytest.raises(WorkerFailed, match="rank 0"):
            await client.start()
    finally:
        await client.close()
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2")]


async def test_a_rank_that_never_registers_is_named_at_the_deadline(tmp_path):
    client = fake_group_client(tmp_path, 3)
    try:
        rank1 = FakeRank(zmq.asyncio.Context.instance(), client.address, 1, 3)
        await rank1.register()
        with pytest.raises(WorkerFailed, match=r"^worker ranks \[0, 2\] did not answer within 1 s"):
            await client.start(register_timeout=1)
    finally:
        await client.close()
