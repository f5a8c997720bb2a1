"""The worker process: a ZeroMQ DEALER that loads the model, holds the KV pools and executes plans.

Message sequence (see `common.protocol`): Register -> LoadModel -> WorkerHello -> InitCache ->
WorkerReady -> StepPlan/StepResult ... -> Shutdown. The worker decides nothing; it exits when told,
when the control plane's socket disconnects (over tcp://, also when it is silent for 5 s after a
heartbeat: its host vanished), or when the process named by ``PAGEDKV_PARENT_PID`` dies.

Under tensor parallelism each rank is one such process: all ranks connect to the same control
plane, receive the same plans and join one torch.distributed group at LoadModel (`worker.parallel`).
A rank whose step fails in a group exits after reporting it: its peers may be inside a collective it
will never join, so the group cannot run another step (they fail theirs at the collective timeout,
or at once when gloo sees the connection drop).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import msgspec
import structlog
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.common.protocol import (HEARTBEAT_MS, PROTOCOL_VERSION, SECRET_ENV, Channel, InitCache, LoadModel,
                                     Register, SampledToken, Shutdown, StepPlan, StepResult, Unauthenticated,
                                     UndecodablePlan, WorkerError, WorkerHello, WorkerReady)
from pagedkv.kernels import cpu_kernels
from pagedkv.worker.cache_engine import measure_swap_bandwidth
from pagedkv.worker.host_memory import (MMAP_THRESHOLD_MAX, huge_pages_off, release_freed_host_memory,
                                         reuse_freed_host_memory)
from pagedkv.worker.model_loader import torch_dtype
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.parallel import destroy_group, init_group

log = logging.getLogger("pagedkv.worker")
POLL_MS = 1000  # how often to check that the control plane is still there
UNANSWERED_SECONDS = 30.0  # connected this long with no word from the control plane: say why that may be


def select_device(config: EngineConfig, rank: int) -> torch.device:
    """``auto``: CUDA (GPU ``rank``) when available, else CPU. Raises ValueError for cuda without a GPU."""
    kind = config.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda", rank % torch.cuda.device_count())
    if kind != "cpu":
        raise ValueError(f"--device must be auto, cpu or cuda, got {kind!r}")
    return torch.device("cpu")


def select_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: on CUDA the checkpoint's torch_dtype, except float32 which serves as bfloat16 (half the
    bytes per weight and KV token, tensor cores); float32 on CPU. Otherwise the named dtype."""
    if config.dtype != "auto":
        return torch_dtype(config.dtype)
    if device.type != "cuda":
        return torch.float32
    dtype = torch_dtype(model.torch_dtype)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def cpu_compute_threads(world_size: int = 1) -> int:
    """Intra-op threads a CPU worker computes with: torch's own reading of ``$OMP_NUM_THREADS`` when it
    is set; else this host's cores but one, left to the control plane, shared among its ranks
    (``$LOCAL_WORLD_SIZE``, else world_size): OpenMP threads spinning against each other slowed
    steps by 100x."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, ((os.cpu_count() or 2) - 1) // local_ranks)


def bfloat16_hint(config: EngineConfig, model: ModelConfig, device: torch.device, flags: set[str]) -> str | None:
    """The start-up line that points a CPU with AMX-BF16 (``flags``: `cpu_flags`) at ``--dtype bfloat16``,
    or None: only where the dtype was left to auto and the model has 100M parameters or more. A ~200M
    Llama's decode steps ran 2.6x and its prefill 4x faster in bfloat16; stories260K's ran slower,
    its steps are not matrix work (docs/benchmarks.md, twelfth session)."""
    if (device.type != "cpu" or config.dtype != "auto" or "amx_bf16" not in flags
            or model.weight_bytes("float32") < 400_000_000):
        return None
    return ("cpu: this CPU has AMX-BF16 matrix units: --dtype bfloat16 computes prefill and batched decode of a "
            "model of this size several times faster; float32 is the CPU default (results as a float32 reference's)")


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def max_num_gpu_blocks(runner: ModelRunner) -> int:
    """Blocks the KV budget holds. CUDA: total x gpu_memory_utilization minus the profiled peak of one
    ``max_num_batched_tokens`` forward and other processes' use; CPU: cpu_kv_cache_space GiB."""
    cfg = runner.engine_config
    if runner.device.type != "cuda":
        return int(cfg.cpu_kv_cache_space * (1 << 30)) // runner.kv_bytes_per_block
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    profile_cache_bytes = runner.profile_run()
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - profile_cache_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    non_torch = total - free - torch.cuda.memory_reserved(runner.device)  # CUDA context, other processes
    budget = total * cfg.gpu_memory_utilization - peak - non_torch
    return max(0, int(budget) // runner.kv_bytes_per_block)


def load(msg: LoadModel, rank: int = 0, world_size: int = 1, init_method: str | None = None,
         ) -> tuple[ModelRunner, WorkerHello]:
    """Load the model for a LoadModel message and measure what this worker can hold.

    rank, world_size, init_method: how this process was started (``--rank``, ``--world-size``,
    ``--dist-init-method``); they must agree with the control plane's message. With world_size > 1
    the rank first joins the process group, then loads only its shard. Raises ValueError on a mismatch.
    """
    cfg = msg.config
    if (msg.rank, msg.world_size) != (rank, world_size) or world_size != cfg.tensor_parallel_size:
        raise ValueError(f"this worker was started as rank {rank} of {world_size}, but the control plane "
                         f"assigns rank {msg.rank} of {msg.world_size} (--tensor-parallel-size "
                         f"{cfg.tensor_parallel_size}): start every rank with the same --world-size")
    if world_size > 1 and not init_method:
        raise ValueError("a rank of a group needs --dist-init-method tcp://HOST:PORT (or MASTER_ADDR/MASTER_PORT)")
    model_config = ModelConfig.load(cfg.model)
    model_config.shard(world_size)  # an indivisible model fails here, before the group forms
    device = select_device(cfg, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":  # Triton launches, CUDA events and graph capture use the current device's stream
        torch.cuda.set_device(device)  # (cuda:1 under LOCAL_RANK=1 with one rank; init_group sets it for -tp > 1)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_compute_threads(world_size))
    if device.type == "cpu":
        off = huge_pages_off()
        log.info("cpu: compute threads %d; %s; %s", torch.get_num_threads(),
                 f"glibc malloc reuses freed blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB"
                 if reuse_freed_host_memory() else "malloc thresholds left as they are",
                 f"no transparent huge pages ({off})" if off else "tensors of 2 MiB and up on transparent huge pages")
    dtype = select_dtype(cfg, model_config, device)
    if hint := bfloat16_hint(cfg, model_config, device, cpu_flags()):
        log.info(hint)
    log.info("loading weights: %s on %s, %s (rank %d of %d)", model_config.path or "embedded (random)", device, dtype,
             rank, world_size)
    start = time.monotonic()
    tp = init_group(rank, world_size, init_method or "", device, cfg.worker_timeout)
    runner = ModelRunner(cfg, device, dtype, model_config, tp)
    shard = runner.model_config
    log.info("weights loaded in %.1f s; profiling memory", time.monotonic() - start)
    num_blocks = max_num_gpu_blocks(runner)
    log.info("KV budget: %d blocks of %d tokens; measuring swap bandwidth", num_blocks, cfg.block_size)
    kernels = runner.model.kernels
    if kernels is cpu_kernels:  # builds the C kernel now (about a second, once per machine)
        if kernels.fused_available(runner.kv_dtype):
            log.info("attention: cpu backend, fused in C up to %d new tokens a sequence (%s KV cache)",
                     kernels.FUSED_MAX_QUERY_LEN, str(runner.kv_dtype).removeprefix("torch."))
        elif not kernels.fused_available():
            log.warning("attention, RMSNorm, RoPE and the KV write run in PyTorch (slower): no C compiler could "
                        "build the CPU kernels (set CC)")
        else:
            log.warning("attention: runs on the batched PyTorch path (slower): the fused kernel does not read a %s "
                        "KV cache", str(runner.kv_dtype).removeprefix("torch."))
    else:
        log.info("attention: %s backend", kernels.__name__.rsplit(".", 1)[-1].removesuffix("_kernels"))
    start = time.monotonic()
    tokens = runner.warm_up()  # CUDA: compile the Triton kernels now; CPU: grow the heap to a prefill's activations
    seqs = -(-tokens // runner.max_model_len)
    log.info("warmed up in %.2f s%s", time.monotonic() - start,
             f" (one prefill step of {tokens} tokens in {seqs} sequence{'s' if seqs > 1 else ''})" if tokens else "")
    hello = WorkerHello(rank=rank, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        kv_bytes_per_block=runner.kv_bytes_per_block, max_num_gpu_blocks=num_blocks,
                        kv_cache_dtype=runner.kv_cache_dtype,
                        swap_bandwidth=measure_swap_bandwidth(
                            device, (cfg.block_size, shard.num_key_value_heads, shard.head_dim),
                            runner.kv_dtype))
    return runner, hello


def _parent_alive(parent_pid: int | None) -> bool:
    if parent_pid is None:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # a dead parent can linger as a zombie; being re-parented away from it tells the truth
    return os.getppid() == parent_pid or parent_pid != _original_ppid


_original_ppid = os.getppid()


def run(address: str, secret: bytes, rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """Serve the control plane at ``address`` (``ipc://...`` or ``tcp://host:port``) until Shutdown.

    rank, world_size: this process's place in a tensor-parallel group; init_method: the group's
    rendezvous (``tcp://HOST:PORT`` where rank 0 listens). secret: the worker-channel secret shared
    with the control plane (`common.protocol.Channel`); frames that do not carry its MAC are dropped
    and logged, never decoded; a StepPlan that carries it but does not decode is answered with a
    failed StepResult (`UndecodablePlan`). Exits the process with status 1 after a
    failed LoadModel/InitCache (a WorkerError is sent first) or, in a group, a failed step (its
    StepResult error is sent first); returns when told to shut down or when the control plane is gone.
    """
    structlog.contextvars.bind_contextvars(rank=rank)  # every line of this process says which rank wrote it
    channel = Channel(secret)
    parent = os.environ.get("PAGEDKV_PARENT_PID")
    parent_pid = int(parent) if parent else None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://"):  # a control plane on a host that vanishes sends no FIN: close the silence
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_MS[1])
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    runner: ModelRunner | None = None
    linger_ms = 0
    release_when_idle = False  # a CPU worker that has stepped since it last gave freed memory back
    connected_at: float | None = None  # while no message from the control plane has been verified yet
    try:
        sock.send(channel.seal_from_worker(Register(protocol_version=PROTOCOL_VERSION, pid=os.getpid(), rank=rank,
                                  world_size=world_size)))
        while True:
            events = dict(poller.poll(POLL_MS))
            if monitor in events:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    log.warning("control plane at %s disconnected; exiting", address)
                    return
                if event == zmq.EVENT_CONNECTED and runner is None:
                    connected_at = time.monotonic()
            # the control plane drops frames it cannot verify without a word back (it cannot seal one
            # to a peer without the secret): without this line such a worker waited silently forever
            if connected_at is not None and time.monotonic() - connected_at >= UNANSWERED_SECONDS:
                log.warning("the control plane at %s has not answered this worker's Register in %.0f s: does it "
                            "have the same worker secret (%s, --secret-file)? (it also waits for every rank of "
                            "a group, and takes one worker per rank)", address, UNANSWERED_SECONDS, SECRET_ENV)
                connected_at = None
            if not _parent_alive(parent_pid):
                log.warning("parent process %s is gone; exiting", parent_pid)
                return
            if sock not in events:
                if release_when_idle:  # no plan for POLL_MS: hand the last steps' freed memory back
                    release_freed_host_memory()
                    release_when_idle = False
                continue
            frame = sock.recv()
            try:
                msg = channel.open_to_worker(frame)
            except UndecodablePlan as e:  # nothing ran, so even a group's ranks stay in step
                sock.send(channel.seal_from_worker(StepResult(step_id=e.step_id, error=str(e))))
                log.error("%s", e)
                continue
            except (Unauthenticated, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("dropped a message from %s: %s", address, e)
                continue
            connected_at = None
            if isinstance(msg, StepPlan):
                try:
                    if runner is None:
                        raise RuntimeError("step plan before LoadModel")
                    reply = runner.execute(msg)
                    if rank != 0:  # every rank sampled the same tokens: rank 0 reports them, the others
                        # only their ids, so the control plane can check that the ranks' mirrors agree
                        reply = StepResult(step_id=reply.step_id, forward_seconds=reply.forward_seconds,
                                           sampled=[SampledToken(t.request_id, t.token_id) for t in reply.sampled])
                except Exception as e:  # the step fails; a single worker keeps serving, a group cannot
                    # tell the control plane first: rendering a traceback can take longer than its deadline
                    sock.send(channel.seal_from_worker(StepResult(step_id=msg.step_id, error=f"rank {rank}: {_one_line(e)}"
                                                if world_size > 1 else _one_line(e))))
                    log.exception("step %d failed", msg.step_id)
                    if world_size > 1:
                        linger_ms = 2000  # let the error reach the control plane before the socket closes
                        sys.exit(1)
                    continue
                sock.send(channel.seal_from_worker(reply))
                release_when_idle = runner.device.type == "cpu"
            elif isinstance(msg, (LoadModel, InitCache)):
                try:
                    if isinstance(msg, LoadModel):
                        runner, hello = load(msg, rank, world_size, init_method)
                        sock.send(channel.seal_from_worker(hello))
                    else:
                        if runner is None:
                            raise RuntimeError("InitCache before LoadModel")
                        runner.init_cache(msg.num_gpu_blocks, msg.num_cpu_blocks)
                        # torch's and the model's objects live as long as the process: without this the
                        # collector walks them all in each full collection (~10% of a CPU decode step)
                        gc.freeze()
                        sock.send(channel.seal_from_worker(WorkerReady(rank=rank)))
                except Exception as e:  # the control plane reports it in one line; the trace is for debugging
                    log.debug("worker start-up failed", exc_info=True)
                    sock.send(channel.seal_from_worker(WorkerError(message=_one_line(e))))
                    linger_ms = 2000  # let the error reach the control plane before the socket closes
                    sys.exit(1)
            elif isinstance(msg, Shutdown):  # its stop, or another worker took this one's rank
                log.info("the control plane at %s told this worker to shut down; exiting", address)
                destroy_group()
                return
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(linger_ms)
        ctx.term()


def exit_now(code: int = 0) -> None:
    """End the worker process with ``code`` once `run` has returned, skipping the interpreter's teardown.

    run's ``finally`` has already closed the sockets and left the process group; what is left is
    unloading torch and freeing the pools, which takes 1-3 s of CPU on a small machine and holds up
    every engine shutdown (and each test that starts one). Logs are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
