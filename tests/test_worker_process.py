"""The worker as its own OS process: handshake, a step, errors, and exit paths, against a ROUTER stub."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from conftest import GOLDEN_PROMPT_IDS

from pagedkv.common.config import EngineConfig
from pagedkv.common.protocol import (PROTOCOL_VERSION, SECRET_ENV, CachedRequestData, Channel, InitCache, LoadModel,
                                     NewRequestData, Register, Shutdown, StepPlan, StepResult, WorkerError,
                                     WorkerHello, WorkerReady, encode)
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker import host_memory
from pagedkv.worker.host_memory import reuse_freed_host_memory

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_MS = 60_000
SECRET = b"test-secret-0123456789abcdef"


class Stub:
    """The control plane's ROUTER, reduced to send/recv with a deadline."""

    def __init__(self, tmp_path: Path, env: dict | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{tmp_path}/worker.sock"
        self.sock.bind(self.address)
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedkv.worker", "--connect", self.address], cwd=REPO,
                                     env=dict(os.environ, **{SECRET_ENV: SECRET.decode(), **(env or {})}),
                                     stderr=subprocess.PIPE, text=True)
        self.channel = Channel(SECRET)
        self.identity = None

    def recv(self):
        if not self.sock.poll(TIMEOUT_MS):
            raise AssertionError(f"worker sent nothing within {TIMEOUT_MS} ms; stderr: {self.stderr()}")
        self.identity, payload = self.sock.recv_multipart()
        return self.channel.open_from_worker(payload)

    def send(self, msg) -> None:
        self.sock.send_multipart([self.identity, self.channel.seal_to_worker(msg)])

    def stderr(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate()[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def stub(tmp_path):
    s = Stub(tmp_path)
    yield s
    s.close()


def start(stub: Stub, config: EngineConfig, num_gpu_blocks: int | None = 16) -> WorkerHello:
    """Register, load and init a 16-block cache (None: the worker's whole KV budget)."""
    reg = stub.recv()
    assert isinstance(reg, Register) and reg.protocol_version == PROTOCOL_VERSION and reg.pid == stub.proc.pid
    stub.send(LoadModel(config=config))
    hello = stub.recv()
    assert isinstance(hello, WorkerHello), hello
    stub.send(InitCache(num_gpu_blocks=num_gpu_blocks or hello.max_num_gpu_blocks, num_cpu_blocks=4))
    assert isinstance(stub.recv(), WorkerReady)
    return hello


def test_worker_process_handshake_step_and_shutdown(stub, stories260k):
    hello = start(stub, EngineConfig(model=str(stories260k), device="cpu", block_size=8, cpu_kv_cache_space=0.01))
    assert hello.device == "cpu" and hello.dtype == "float32"
    assert hello.kv_bytes_per_block == 2 * 5 * 8 * 4 * 8 * 4  # 2 x layers x block x kv heads x head_dim x fp32
    assert hello.max_num_gpu_blocks == int(0.01 * 2**30) // hello.kv_bytes_per_block
    assert hello.swap_bandwidth > 0
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    stub.send(StepPlan(step_id=0, new_requests=[NewRequestData("r", GOLDEN_PROMPT_IDS, 5, [3], 0, 5, greedy)]))
    result = stub.recv()
    assert isinstance(result, StepResult) and result.error is None and result.step_id == 0
    assert [(s.request_id, s.token_id) for s in result.sampled] == [("r", 432)]
    assert result.sampled[0].top_logprobs[0][0] == 432
    stub.send(Shutdown())
    assert stub.proc.wait(timeout=30) == 0


def test_a_failed_step_reports_an_error_and_the_worker_keeps_serving(stub, stories260k):
    start(stub, EngineConfig(model=str(stories260k), device="cpu"))
    stub.send(StepPlan(step_id=4, cached_requests=[CachedRequestData("ghost", [], 1)]))
    result = stub.recv()
    assert result.step_id == 4 and result.sampled == []
    assert result.error == "ValueError: cached request 'ghost' is not known to this worker"
    greedy = SamplingParams(temperature=0.0)
    stub.send(StepPlan(step_id=5, new_requests=[NewRequestData("r", GOLDEN_PROMPT_IDS, 5, [0], 0, 5, greedy)]))
    assert stub.recv().sampled[0].token_id == 432
    stub.send(Shutdown())
    assert stub.proc.wait(timeout=30) == 0


def test_a_plan_that_does_not_decode_is_answered_with_an_error_and_the_worker_keeps_serving(stub, stories260k):
    """Authenticated, but a field has the wrong type: the step fails (so the control plane can fail
    its cause) instead of being dropped unanswered until the step's deadline restarts the worker."""
    start(stub, EngineConfig(model=str(stories260k), device="cpu"))
    greedy = SamplingParams(temperature=0.0)
    stub.send(StepPlan(step_id=6, new_requests=[NewRequestData("r", ["one", "two"], 2, [0], 0, 2, greedy)]))
    result = stub.recv()
    assert isinstance(result, StepResult) and result.step_id == 6 and result.sampled == []
    assert result.error.startswith("could not decode step plan 6: Expected `int`, got `str`"), result.error
    stub.sock.send_multipart([stub.identity, stub.channel.seal_to_worker(Shutdown())[:32] + b"\xc1"])
    stub.send(StepPlan(step_id=7, new_requests=[NewRequestData("r", GOLDEN_PROMPT_IDS, 5, [0], 0, 5, greedy)]))
    result = stub.recv()  # the junk frame above (bad MAC) was dropped unanswered, as before
    assert result.step_id == 7 and result.error is None and result.sampled[0].token_id == 432
    stub.send(Shutdown())
    assert stub.proc.wait(timeout=30) == 0


def test_a_failed_load_sends_worker_error_and_exits_nonzero(stub, tmp_path):
    assert isinstance(stub.recv(), Register)
    stub.send(LoadModel(config=EngineConfig(model=str(tmp_path / "nowhere"), device="cpu")))
    err = stub.recv()
    assert isinstance(err, WorkerError)
    assert err.message.startswith("FileNotFoundError: no config.json at") and "nowhere" in err.message
    assert stub.proc.wait(timeout=30) == 1


def test_worker_exits_when_the_control_plane_socket_closes(stub):
    assert isinstance(stub.recv(), Register)
    stub.sock.close(0)
    assert stub.proc.wait(timeout=30) == 0


def test_worker_exits_when_its_parent_process_is_gone(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait()
    s = Stub(tmp_path, env={"PAGEDKV_PARENT_PID": str(parent.pid)})
    try:
        # the bound covers start-up too (importing torch took 19 s on the loaded shared machine, and
        # 30 s failed under heavier load); a worker that never checks its parent still fails it
        assert s.proc.wait(timeout=120) == 0
    finally:
        s.close()


def test_missing_connect_flag_is_named():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.worker"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--connect" in proc.stderr


def test_worker_drops_unsealed_forged_and_junk_frames_and_keeps_serving(stub, stories260k):
    """Only frames sealed with the shared secret are decoded: a plan sent bare, one sealed with another
    secret, and random bytes change nothing; the next genuine plan is served."""
    start(stub, EngineConfig(model=str(stories260k), device="cpu"))
    greedy = SamplingParams(temperature=0.0)
    forged = StepPlan(step_id=9, new_requests=[NewRequestData("evil", GOLDEN_PROMPT_IDS, 5, [0], 0, 5, greedy)])
    stub.sock.send_multipart([stub.identity, encode(forged)])
    stub.sock.send_multipart([stub.identity, Channel(b"another-secret-0123456789").seal_to_worker(forged)])
    stub.sock.send_multipart([stub.identity, os.urandom(200)])
    stub.sock.send_multipart([stub.identity, stub.channel.seal_from_worker(StepResult(step_id=9))])  # reflected
    stub.send(StepPlan(step_id=10, new_requests=[NewRequestData("r", GOLDEN_PROMPT_IDS, 5, [0], 0, 5, greedy)]))
    result = stub.recv()
    assert result.step_id == 10 and [(s.request_id, s.token_id) for s in result.sampled] == [("r", 432)]
    stub.send(Shutdown())
    assert stub.proc.wait(timeout=30) == 0
    assert stub.proc.communicate()[1].count("dropped a message") == 4


def test_worker_without_a_secret_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.run([sys.executable, "-m", "pagedkv.worker", "--connect", "ipc:///nowhere"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and SECRET_ENV in proc.stderr


_FAULTS = """
import ctypes, os, resource, sys, torch
from pagedkv.worker.host_memory import release_freed_host_memory, reuse_freed_host_memory

def faults():  # minor page faults over 10 steps' worth of prefill-sized activations (4 x 2.8 MB live at once)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        held = [torch.ones(2048, 344) for _ in range(4)]
        del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

libc = ctypes.CDLL(None)
libc.mallopt(-3, 128 << 10), libc.mallopt(-1, 128 << 10)  # glibc's static defaults, not its drifting dynamic ones
before, applied = faults(), reuse_freed_host_memory()
faults()  # the first steps after it grow the heap once
after = faults()
# 40 MiB in 4 MiB blocks, now from the heap; with the steps' 11 MB freed at its top, less than the
# 64 MiB free there that would trim it
blocks = [torch.ones(1 << 20) for _ in range(10)]
base = rss_mib()
del blocks
kept = rss_mib()
release_freed_host_memory()
print(before, applied, after, base - kept, kept - rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_trim are glibc's")
def test_the_cpu_worker_reuses_freed_activation_memory_and_gives_it_back_when_told():
    """Under glibc's static default thresholds every step's activations come back as fresh pages;
    after `reuse_freed_host_memory`, once the heap has grown to a step's peak, none do. Freed blocks
    below the heap's top stay resident until `release_freed_host_memory`. A threshold the user set wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    before, applied, after, freed, released = subprocess.run(
        [sys.executable, "-c", _FAULTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        check=True).stdout.split()
    # at least one fault per block per step before (more than 600 a block without huge pages), none after
    assert int(before) >= 10 * 4 and applied == "True" and int(after) == 0
    assert abs(int(freed)) <= 2 and int(released) >= 36  # 40 MiB kept by free(), returned by the release
    before, applied, after, *_ = subprocess.run(
        [sys.executable, "-c", _FAULTS], cwd=REPO, env=dict(env, MALLOC_TRIM_THRESHOLD_="131072"),
        capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert applied == "False" and int(after) >= 10 * 4


def _anon_huge_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(host_memory.transparent_huge_pages() not in ("always", "madvise"),
                    reason="the kernel offers no transparent huge pages")
@pytest.mark.parametrize("user_setting", [None, "0"])
def test_the_worker_puts_its_kv_pool_on_transparent_huge_pages_unless_the_user_says_0(tmp_path, stories260k,
                                                                                          user_setting, monkeypatch):
    """The spawned worker sets THP_MEM_ALLOC_ENABLE=1 before torch is imported: its KV pool (ten
    tensors of 5 MiB here) lies on 2 MiB pages. A user's 0 wins; where the kernel's mode is
    ``madvise`` nothing is then on huge pages (under ``always`` the kernel may still use them)."""
    if user_setting is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # a developer's shell may export it
    stub = Stub(tmp_path, env={"THP_MEM_ALLOC_ENABLE": user_setting} if user_setting else None)
    try:
        start(stub, EngineConfig(model=str(stories260k), device="cpu", cpu_kv_cache_space=0.05), num_gpu_blocks=None)
        huge = _anon_huge_kib(stub.proc.pid)
        stub.send(Shutdown())
        assert stub.proc.wait(timeout=30) == 0
        log = stub.stderr()
    finally:
        stub.close()
    if user_setting is None:
        assert huge >= 2048 and "tensors of 2 MiB and up on transparent huge pages" in log
    else:
        assert "no transparent huge pages (THP_MEM_ALLOC_ENABLE=0 is set)" in log
        if host_memory.transparent_huge_pages() == "madvise":
            assert huge == 0


_CLI_WORKER = """
import os, sys
from pagedkv.worker import host_memory
real = host_memory.use_huge_pages_for_tensors

def probe():
    print("torch imported before:", "torch" in sys.modules, "huge pages:", real(), flush=True)
    return True

host_memory.use_huge_pages_for_tensors = probe
from pagedkv.scheduler.cli import main
main(["worker", "--connect", sys.argv[1]])
"""


@pytest.mark.skipif(host_memory.transparent_huge_pages() not in ("always", "madvise"),
                    reason="the kernel offers no transparent huge pages")
def test_pagedkv_worker_asks_for_huge_pages_before_anything_imports_torch(tmp_path):
    """`pagedkv worker` (the CLI, whose parser builds every subcommand): its parent is gone, so it
    exits at its first check, after the probe has run."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env.update({SECRET_ENV: SECRET.decode(), "PAGEDKV_PARENT_PID": str(gone.pid)})
    out = subprocess.run([sys.executable, "-c", _CLI_WORKER, f"ipc://{tmp_path}/nobody.sock"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert "torch imported before: False huge pages: True" in out.stdout, out.stderr[-2000:]


_THP = """
import os, sys
from pagedkv.worker import host_memory
if sys.argv[1] == "late":
    import torch
print(host_memory.use_huge_pages_for_tensors(), os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""


@pytest.mark.parametrize("mode, env, when, expected", [
    ("always [madvise] never", None, "early", "True 1"), ("[always] madvise never", None, "early", "True 1"),
    ("always madvise [never]", None, "early", "False None"), (None, None, "early", "False None"),
    ("always [madvise] never", "0", "early", "False 0"), ("always [madvise] never", None, "late", "False None")])
def test_huge_pages_are_asked_for_only_before_torch_where_the_kernel_offers_them_and_the_user_did_not_say(
        tmp_path, mode, env, when, expected):
    setting = tmp_path / "enabled"
    if mode is not None:
        setting.write_text(mode + "\n")
    code = f"from pagedkv.worker import host_memory\nhost_memory.THP_SETTING = {str(setting)!r}\n" + _THP
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env is not None:
        environ["THP_MEM_ALLOC_ENABLE"] = env
    out = subprocess.run([sys.executable, "-c", code, when], cwd=REPO, env=environ, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert " ".join(out) == expected


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "131072"), ("MALLOC_TRIM_THRESHOLD_", "0"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.check=0:glibc.malloc.trim_threshold=0")])
def test_a_malloc_threshold_in_the_environment_is_left_to_glibc(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert reuse_freed_host_memory() is False


@pytest.mark.parametrize("flags, dtype, device, hinted", [
    ({"avx512f", "amx_bf16"}, "auto", "cpu", True), ({"avx512f"}, "auto", "cpu", False),
    ({"amx_bf16"}, "float32", "cpu", False), ({"amx_bf16"}, "bfloat16", "cpu", False),
    ({"amx_bf16"}, "auto", "cuda", False)])
def test_a_cpu_with_amx_bf16_hints_at_bfloat16_for_a_large_model_when_the_dtype_was_left_to_auto(
        stories260k, flags, dtype, device, hinted):
    from pagedkv.common.config import ModelConfig
    from pagedkv.worker.worker import bfloat16_hint

    config = EngineConfig(model=str(stories260k), dtype=dtype)
    large = msgspec.structs.replace(ModelConfig.load(str(stories260k)), hidden_size=1024, intermediate_size=2816,
                                    num_hidden_layers=16)  # ~200M parameters
    hint = bfloat16_hint(config, large, torch.device(device), flags)
    assert (hint is not None and "--dtype bfloat16" in hint) == hinted
    assert bfloat16_hint(config, ModelConfig.load(str(stories260k)), torch.device(device), flags) is None  # 260K


def test_cpu_compute_threads_leave_a_core_to_the_control_plane_unless_omp_num_threads_says(monkeypatch):
    from pagedkv.worker.worker import cpu_compute_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_compute_threads() == 15 and cpu_compute_threads(world_size=2) == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_compute_threads(world_size=8) == 3  # this host's ranks, not the group's
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert cpu_compute_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torch read it at import: its own count stands
    assert cpu_compute_threads() == torch.get_num_threads()
