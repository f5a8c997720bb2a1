"""The ``pagedkv`` command: ``serve``, ``generate``, ``worker``, ``bench`` and ``capacity``.

Flags use vLLM's names and meanings and map one to one onto `common.config.EngineConfig`. Every
user error is one line on stderr naming the flag or the file, before anything heavy starts: a bad
flag value or checkpoint exits with status 2, a port already in use or a worker that fails with 1
(``--log-level debug`` adds the traceback). `serve` binds its port before it reads the model.
Logs go to stderr; `generate` prints completions on stdout. Nothing here imports torch: `pagedkv
worker` imports the worker package inside its handler.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import socket
import sys
import traceback

# Nothing heavy at module level (not even msgspec): `serve` binds its port first (`main`).


def configure_logging(fmt: str, level: str) -> None:
    # structlog loads in ~0.4 s on a busy machine: not before `serve` holds its port
    from pagedkv.common.log import configure_logging

    configure_logging(fmt, level)


# ---- argument types: each names its flag in the error ---------------------------------------

def _int_in(lo: int | None = None, hi: int | None = None, power_of_two: bool = False):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {v}")
        if power_of_two and v & (v - 1):
            raise argparse.ArgumentTypeError(f"must be a power of two, got {v}")
        return v
    return parse


def _float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}") from None
        if v != v or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            low = f"> {lo}" if lo_open else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {low}" + (f" and <= {hi}" if hi is not None else "")
                                             + f", got {s}")
        if v == float("inf"):  # --swap-space inf crashed in int(); --k-scale inf scaled every value to inf
            raise argparse.ArgumentTypeError(f"must be finite, got {s}")
        return v
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except None (the help says what happens then) and where the
    help already says what the default is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Version(argparse.Action):
    """--version, reading the installed version only when asked (importlib.metadata is slow to load)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from pagedkv import __version__

        print(f"pagedkv {__version__}")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``pagedkv serve: error: argument --port: ...``.

    The usage block is printed only for a mistyped flag or a missing argument, where it helps.
    """

    def error(self, message: str):
        if message.startswith(("unrecognized arguments", "the following arguments are required")):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _check_checkpoint(path: str, load_format: str, chat_template: str | None,
                      flag: str = "--model") -> tuple[ModelConfig, str | None]:
    """Read what the control plane needs and check what the worker will: config.json, the
    weights (unless dummy), tokenizer.json, the chat template. Returns the model config and the
    template text. Raises ValueError or FileNotFoundError naming the file or flag (``flag``: how the
    path was given, ``--model`` or the positional ``MODEL``)."""
    from pagedkv.common.config import ModelConfig, weight_files
    from pagedkv.scheduler.tokenizer import Tokenizer, load_chat_template

    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such directory")
        if not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: not a directory (give the Hugging Face checkpoint directory)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{flag} {path}: not a Hugging Face checkpoint directory (no config.json)")
    model = ModelConfig.load(path)
    if path is not None and load_format == "auto":
        weight_files(model.path)
    template = None
    if chat_template is not None:
        try:
            template = load_chat_template(chat_template)
        except ValueError as e:
            raise ValueError(f"--chat-template: {e}") from None
    Tokenizer.load(model, template)
    return model, template


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.common.config import KV_CACHE_DTYPES, EngineConfig

    d = EngineConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", type=lambda s: s or None, default=None, metavar="PATH",  # `--model=`: embedded
                   help="Hugging Face Llama-family checkpoint directory (config.json, *.safetensors, tokenizer.json); "
                        "default (or empty): a built-in small model with random weights and a byte-level tokenizer")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the API answers to; the first is reported in responses (default: the "
                        "checkpoint directory's name)")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_STRING",
                   help="jinja2 chat template (a file, or the template itself) replacing or supplying the "
                        "checkpoint's; /v1/chat/completions needs one")
    g.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format,
                   help="dummy: seeded random weights for the checkpoint's config (benchmarks)")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=d.dtype,
                   help="weights and activations. auto: float32 on CPU; on CUDA the checkpoint's dtype, a "
                        "float32 checkpoint as bfloat16. On a CPU with AMX (lscpu flag amx_bf16), bfloat16 "
                        "makes prefill and batched decode of 100M+ parameter models several times faster")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="auto: CUDA when torch sees a GPU, else CPU")
    g.add_argument("--block-size", type=_int_in(1, 256, power_of_two=True), default=d.block_size,
                   help="tokens per KV block (power of two, 1..256)")
    g.add_argument("--num-gpu-blocks", type=_int_in(1), default=None,
                   help="KV pool size in blocks; default: sized from free memory")
    g.add_argument("--gpu-memory-utilization", type=_float_in(0.0, 1.0, lo_open=True),
                   default=d.gpu_memory_utilization,
                   help="CUDA: fraction of device memory for weights, activations and the KV pool")
    g.add_argument("--cpu-kv-cache-space", type=_float_in(0.0, lo_open=True), default=d.cpu_kv_cache_space,
                   metavar="GIB", help="CPU: KV pool budget in GiB, per rank (-tp N uses N times this)")
    g.add_argument("--swap-space", type=_float_in(0.0), default=d.swap_space, metavar="GIB",
                   help="host memory for swapped-out KV blocks, GiB per rank (-tp N uses N times this)")
    g.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default=d.preemption_mode,
                   help="how a request gives up its KV blocks when the pool runs dry: recompute them later, "
                        "swap them to host memory, or auto: per victim, whichever the cost model says is cheaper")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="fcfs: arrival order; priority: lower request `priority` first, the lowest-priority "
                        "latest arrival is preempted first")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (a span per request, one per preemption) over OTLP/HTTP "
                        "to URL (e.g. http://localhost:4318); OTEL_TRACES_EXPORTER=console|otlp|none also works")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of identical prompt prefixes (full blocks only)")
    g.add_argument("--prefix-caching-hash-algo", choices=["sha256", "xxhash"], default=d.prefix_caching_hash_algo,
                   help="hash naming cached blocks; sha256 (default) resists collisions between tenants")
    g.add_argument("--max-num-seqs", type=_int_in(1), default=d.max_num_seqs,
                   help="requests in the running batch at most")
    g.add_argument("--max-num-batched-tokens", type=_int_in(1), default=d.max_num_batched_tokens,
                   help="tokens computed in one engine step at most")
    g.add_argument("--max-model-len", type=_int_in(1), default=None,
                   help="context limit (prompt + output tokens); default: the model's max_position_embeddings")
    g.add_argument("--max-n", type=_int_in(1), default=d.max_n, help="largest n (completions per prompt) accepted")
    g.add_argument("--max-choices", type=_int_in(1), default=d.max_choices,
                   help="most choices (n x prompts) one API request may ask for (OpenAI's bound on n)")
    g.add_argument("--max-stop", type=_int_in(0), default=d.max_stop,
                   help="most stop strings per request (OpenAI's bound)")
    g.add_argument("--max-logprobs", type=_int_in(0), default=d.max_logprobs,
                   help="largest logprobs / top_logprobs accepted")
    g.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=d.seed,
                   help="seed of dummy weights and of requests without a seed")
    g.add_argument("--attention-backend", choices=["cpu", "torch", "triton"], default=None,
                   help="paged-attention implementation; default: triton on CUDA, cpu (fused in C up to 2,048 new "
                        "tokens a sequence, longer prefill batched in PyTorch) elsewhere; torch: batched PyTorch only")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule and send step N + 1 while the worker computes step N, and apply step N's "
                        "tokens (detokenize, stream) while it computes N + 1; a step that would preempt, or "
                        "beam search's next token, waits for the step in flight")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--tensor-parallel-size", "-tp", type=_int_in(1), default=d.tensor_parallel_size, metavar="N",
                   help="worker ranks the model is sharded over (Megatron-style: heads and MLP split, one "
                        "all-reduce after attention and one after the MLP per layer); must divide the attention "
                        "heads and intermediate_size, and divide or be a multiple of the KV heads")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV pool element type: auto (the model's dtype) or fp8 (= fp8_e4m3) / fp8_e5m2: one byte "
                        "per element with per-layer scales, 4x the blocks of float32 and 2x those of bfloat16 in "
                        "the same memory")
    g.add_argument("--k-scale", type=_float_in(0.0, lo_open=True), default=None, metavar="SCALE",
                   help="fp8: the K scale of every layer (dequantized = stored x scale); default: the checkpoint's "
                        "k_scale, else computed from the first prefill")
    g.add_argument("--v-scale", type=_float_in(0.0, lo_open=True), default=None, metavar="SCALE",
                   help="fp8: the V scale of every layer (see --k-scale)")
    g.add_argument("--worker-timeout", type=_float_in(0.0, lo_open=True), default=d.worker_timeout,
                   metavar="SECONDS", help="a worker that does not answer a step within this is declared failed")
    g.add_argument("--max-worker-restarts", type=_int_in(0), default=d.max_worker_restarts, metavar="N",
                   help="a worker that dies or misses --worker-timeout is killed and restarted (backoff 0, 1, 2, 4 ... 30 s) "
                        "and every request in flight is recomputed; after N consecutive restarts the server exits "
                        "non-zero (0: exit at the first failure)")
    g.add_argument("--worker-address", default=None, metavar="ADDR",
                   help="ZeroMQ address the control plane binds for its worker (ipc://PATH or tcp://HOST:PORT); "
                        "default: an ipc:// socket in the temp dir")
    g.add_argument("--external-worker", action="store_true",
                   help="do not spawn a worker: wait for `pagedkv worker --connect ADDR` (needs --worker-address "
                        "and a shared secret)")
    g.add_argument("--worker-secret-file", metavar="PATH", default=None,
                   help="file holding the secret that authenticates every worker-channel message (HMAC-SHA256), "
                        "shared with the external worker; also $PAGEDKV_WORKER_SECRET; default for a spawned "
                        "worker: a fresh random secret per start")
    _add_log_args(g)


def _add_log_args(g) -> None:
    g.add_argument("--log-format", choices=["console", "json"], default="console",
                   help="console: for people; json: one object per line")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="debug adds a line per request and per engine step, and the traceback of a failure")


def _engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """EngineConfig from the flags, with the checkpoint checked (`_check_checkpoint`); a flag whose
    value the model rules out, or a checkpoint that cannot load, is a one-line error naming it."""
    from pagedkv.common.config import EngineConfig, resolve_max_model_len

    if args.external_worker and not args.worker_address:
        parser.error("--external-worker needs --worker-address (the address the worker will connect to)")
    if args.worker_address and not args.worker_address.startswith(("ipc://", "tcp://")):
        parser.error(f"--worker-address must start with ipc:// or tcp://, got {args.worker_address!r}")
    if (args.k_scale or args.v_scale) and not args.kv_cache_dtype.startswith("fp8"):
        parser.error("--k-scale/--v-scale need --kv-cache-dtype fp8, fp8_e4m3 or fp8_e5m2")
    args.worker_secret = _worker_secret(args.worker_secret_file, parser, "--worker-secret-file")
    if args.external_worker and args.worker_secret is None:
        parser.error(f"--external-worker needs the worker-channel secret: --worker-secret-file PATH or "
                     f"{SECRET_ENV} (the worker reads the same; e.g. `openssl rand -hex 32`)")
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        parser.error(f"the model is given twice: {positional!r} and --model {args.model!r}")
    path = positional or args.model or None  # `--model=` (`--model=${MODEL:-}` in compose): the embedded model
    try:
        model, template = _check_checkpoint(path, args.load_format, args.chat_template,
                                            "MODEL" if positional is not None else "--model")
        resolve_max_model_len(model, args.max_model_len)
    except (ValueError, FileNotFoundError) as e:
        if args.log_level == "debug":
            traceback.print_exc()
        parser.error(str(e))
    try:
        model.shard(args.tensor_parallel_size)
    except ValueError as e:
        parser.error(f"--tensor-parallel-size: {e}")
    return EngineConfig(
        model=model.path, served_model_name=list(args.served_model_name or []), chat_template=template,
        load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_space=args.cpu_kv_cache_space,
        swap_space=args.swap_space, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, max_n=args.max_n,
        max_choices=args.max_choices, max_stop=args.max_stop, max_logprobs=args.max_logprobs,
        worker_timeout=args.worker_timeout, max_worker_restarts=args.max_worker_restarts,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        stream_interval=getattr(args, "stream_interval", 1),  # a serve flag: generate and bench do not stream
        enable_prefix_caching=args.enable_prefix_caching, prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
        otlp_traces_endpoint=args.otlp_traces_endpoint, tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        k_scale=args.k_scale, v_scale=args.v_scale)


SECRET_ENV = "PAGEDKV_WORKER_SECRET"  # `common.protocol.SECRET_ENV`, without importing msgspec before the port is bound


def _worker_secret(path: str | None, parser: argparse.ArgumentParser, flag: str) -> bytes | None:
    from pagedkv.common.protocol import load_secret

    try:
        return load_secret(path)
    except (OSError, ValueError) as e:
        parser.error(f"{flag}: {e}")


def _run(coro) -> int:
    """Run on uvloop (the design's event loop); plain asyncio where uvloop is not installed."""
    import asyncio  # not at module level: `serve` binds its port before the slow imports
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


# ---- serve ----------------------------------------------------------------------------------

# Connections the kernel completes while the server is busy (a step, a burst of requests). asyncio's
# create_server listens again with its own default, 128, unless told: a burst of 200 clients then
# overflowed the queue, and the dropped handshakes came back after TCP's 1 s retransmission timeout.
LISTEN_BACKLOG = 1024


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, bound before anything else starts, so a port in use is
    found in milliseconds, not after the model loads. Raises OSError naming the address."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        return socket.create_server(addr[:2], family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno and e.errno > 0 else (e.strerror or str(e))  # not bind's decoration
        raise OSError(f"--host {host} --port {port}: cannot listen: {why}") from None


async def _serve(args: argparse.Namespace, config: EngineConfig, sock: socket.socket, api_keys) -> int:
    from aiohttp import web

    import asyncio

    from pagedkv.common.log import get_logger
    from pagedkv.scheduler.api import build_app
    from pagedkv.scheduler.engine import Engine

    log = get_logger("pagedkv.cli")
    engine = await Engine.start(config, worker_address=args.worker_address, external_worker=args.external_worker,
                                worker_secret=args.worker_secret)
    runner = web.AppRunner(build_app(engine, api_keys=api_keys, max_request_bytes=args.max_request_bytes),
                           handler_cancellation=True, access_log=None)
    gc.freeze()  # start-up's objects live as long as the process: the collector need not walk them every step
    stop = asyncio.Event()
    signals = []  # a first SIGTERM/SIGINT drains, a second one stops at once
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        if len(signals) == 2:  # said once: a supervisor may keep signalling
            log.warning("second signal: aborting the requests in flight", signal=sig.name)
        if len(signals) > 1:
            engine.abort_all()
        stop.set()

    watch = None
    try:
        await runner.setup()
        site = web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)
        await site.start()
        port = sock.getsockname()[1]  # the real port when --port 0 asked for any free one
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        snap = engine.kv_cache_snapshot()
        if engine.random_weights:
            log.warning("model weights are RANDOM: outputs are noise", model=engine.model_config.name)
        log.info("serving", model=engine.served_model_names[0], path=engine.model_config.path or "(embedded)",
                 random_weights=engine.random_weights, num_gpu_blocks=snap["num_gpu_blocks"],
                 block_size=snap["block_size"], kv_cache_dtype=snap["kv_cache_dtype"], max_model_len=engine.max_model_len,
                 url=f"http://{args.host}:{port}", api_keys=api_keys.enabled,
                 prefix_cache_isolation=api_keys.prefix_cache_isolation)
        if not api_keys.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving without API keys on a non-loopback address: anyone who reaches it can "
                        "use it and read /kv_cache (set --api-key or PAGEDKV_API_KEY)", host=args.host)
        watch = asyncio.ensure_future(_watch_open_files(log))
        failed = asyncio.ensure_future(engine.failed.wait())
        await asyncio.wait([failed, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if engine.failed.is_set():  # the engine cannot serve: exit non-zero so a supervisor restarts us
            log.error("engine failed; exiting", error=engine.health()[1])
            return 1
        failed.cancel()
        log.info("shutting down", signal=signals[0].name if signals else None, shutdown_timeout=args.shutdown_timeout)
        await engine.drain(args.shutdown_timeout)
        return 0
    finally:  # a signal during teardown still lands in on_signal: the exit status stays this one
        if watch is not None:
            watch.cancel()
        await runner.cleanup()
        await engine.shutdown()
        for sig in (signal.SIGINT, signal.SIGTERM):  # and ignored from here until the process exits
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        log.info("stopped")  # the last line: the listener is closed and the workers are gone


def _api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from pagedkv.scheduler.api_keys import APIKeys, keys_from_env

    try:
        return APIKeys((args.api_key or []) + keys_from_env("PAGEDKV_API_KEY"),
                       (args.admin_api_key or []) + keys_from_env("PAGEDKV_ADMIN_API_KEY"),
                       args.prefix_cache_isolation)
    except ValueError as e:
        parser.error(str(e))


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one (every connection holds a descriptor; at the
    common default of 1,024 a burst of connections is reset). Returns (old soft, new soft)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard or hard == resource.RLIM_INFINITY and soft < 1 << 20:
        new = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            return soft, new
        except (ValueError, OSError):
            pass  # kept as it is; `serve` logs the limit it runs with
    return soft, soft


async def _watch_open_files(log, every: float = 1.0, share: float = 0.9) -> None:
    """Log when open descriptors near the soft limit: past it the event loop (libuv) accepts and
    closes new connections to shed load, which clients see as resets and nothing else would log."""
    import asyncio
    import resource

    last = 0.0
    while True:
        await asyncio.sleep(every)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        try:
            n = len(os.listdir("/proc/self/fd"))
        except FileNotFoundError:  # not Linux
            return
        except OSError:  # EMFILE: not even one descriptor left to list them
            n = soft
        now = asyncio.get_running_loop().time()
        if soft != resource.RLIM_INFINITY and n >= share * soft and now - last >= 10:
            last = now
            log.error("open files near the limit: new connections are being reset", open_files=n, limit=soft)


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sock = args.listen_socket or _listen(args.host, args.port)
    try:
        config = _engine_config(args, parser)
        api_keys = _api_keys(args, parser)
        configure_logging(args.log_format, args.log_level)
        old, new = raise_open_files_limit()
        from pagedkv.common.log import get_logger

        get_logger("pagedkv.cli").info("open-files limit", soft=new, was=old)
        return _run(_serve(args, config, sock, api_keys))
    finally:
        sock.close()


# ---- generate -------------------------------------------------------------------------------

_GENERATE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "n")  # generate's flags


async def _generate(args: argparse.Namespace, config: EngineConfig, prompts: list[str]) -> int:
    import asyncio

    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.scheduler.engine import Engine

    engine = await Engine.start(config, worker_address=args.worker_address, external_worker=args.external_worker,
                                worker_secret=args.worker_secret)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or [],
                                ignore_eos=args.ignore_eos, n=args.n)
        try:
            params.validate(max_logprobs=config.max_logprobs, max_n=config.max_n, max_stop=config.max_stop)
            streams = [engine.add_request(engine.tokenizer.encode(p), params) for p in prompts]
        except ValueError as e:
            # a field of SamplingParams is named as the flag that set it (max_tokens: -> --max-tokens:)
            field, sep, why = str(e).partition(": ")
            flag = f"--{field.replace('_', '-')}" if sep and field in _GENERATE_FIELDS else field
            print(f"pagedkv generate: error: {flag}{sep}{why}", file=sys.stderr)
            return 2

        async def collect(stream) -> dict[int, dict]:
            outs: dict[int, dict] = {}
            async for o in stream:
                c = outs.setdefault(o.index, {"text": [], "finish_reason": None, "error": None, "tokens": 0})
                c["text"].append(o.text)
                c["tokens"] = o.num_output_tokens
                if o.finish_reason is not None:
                    c["finish_reason"], c["error"] = o.finish_reason, o.error
            return outs

        results = await asyncio.gather(*(collect(s) for s in streams))
        status = 0
        for prompt, outs in zip(prompts, results):
            for index in sorted(outs):
                c = outs[index]
                text = "".join(c["text"])
                if c["finish_reason"] == "error":
                    print(f"pagedkv generate: error: {c['error']}", file=sys.stderr)
                    status = 1
                    continue
                if args.output_format == "jsonl":
                    print(json.dumps({"prompt": prompt, "index": index, "completion": text,
                                      "finish_reason": c["finish_reason"], "completion_tokens": c["tokens"]},
                                     ensure_ascii=False))
                else:
                    print(prompt + text)
        sys.stdout.flush()
        return status
    finally:
        await engine.shutdown()


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8-sig") as f:  # -sig: a BOM is not part of the first prompt
                prompts += [line.rstrip("\r\n") for line in f if line.strip()]
        except OSError as e:
            parser.error(f"--prompts-file: {e}")
    if not prompts:
        parser.error("give prompts as arguments or with --prompts-file")
    if any(not p for p in prompts):
        parser.error("prompts must not be empty")
    config = _engine_config(args, parser)
    configure_logging(args.log_format, args.log_level)
    return _run(_generate(args, config, prompts))


# ---- bench ----------------------------------------------------------------------------------

def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pagedkv.bench import replay
    from pagedkv.common.config import ModelConfig, resolve_max_model_len

    replay.check_args(args, parser)
    config = _engine_config(args, parser)
    model = ModelConfig.load(config.model)
    configure_logging(args.log_format, args.log_level)
    try:
        return _run(replay.main(args, config, resolve_max_model_len(model, args.max_model_len), model.vocab_size))
    except ValueError as e:  # a malformed trace file
        parser.error(f"--trace: {e}")


# ---- worker, capacity -----------------------------------------------------------------------

def _cmd_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pagedkv.common.config import check_rank_arguments

    check_rank_arguments(args, parser)
    secret = _worker_secret(args.secret_file, parser, "--secret-file")
    if secret is None:
        parser.error(f"the worker-channel secret is required: --secret-file PATH or {SECRET_ENV} "
                     "(the same the control plane has)")
    configure_logging(args.log_format, args.log_level)
    from pagedkv.worker.host_memory import use_huge_pages_for_tensors

    use_huge_pages_for_tensors()  # before torch is imported
    from pagedkv.worker.worker import exit_now, run  # torch is imported here, in the worker process only

    run(args.connect, secret, args.rank, args.world_size, args.dist_init_method)
    exit_now(0)


# ---- main -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` argument parser with all subcommands (``--help`` shows every default)."""
    parser = _Parser(prog="pagedkv", description="LLM serving with a paged KV cache (PagedAttention).")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", formatter_class=_HelpFormatter, help="serve the OpenAI-compatible HTTP API",
                           description="Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                                       "/v1/models, /tokenize, /detokenize, /tokenizer_info, /version, /health, "
                                       "/metrics, /kv_cache, /kv_cache/advice, /kv_cache/ui).")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory, as vLLM's `serve MODEL` (same as --model)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    serve.add_argument("--port", type=_int_in(0, 65535), default=8000, help="TCP port (0: any free port)")
    serve.add_argument("--stream-interval", type=_int_in(1), default=1, metavar="N",
                       help="output tokens per streamed delta: each choice's first token goes out at once, then its "
                            "tokens N at a time, and its last delta as soon as it ends; N > 1 cuts the server's "
                            "per-token work (events, JSON, socket writes) at high concurrency, for a burstier "
                            "stream (vLLM's --stream-interval)")
    sec = serve.add_argument_group("access and limits")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require `Authorization: Bearer KEY` on every route but /health, /metrics and /kv_cache/ui "
                          "(repeatable; also PAGEDKV_API_KEY, comma-separated)")
    sec.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                     help="the only keys /kv_cache accepts (repeatable; also PAGEDKV_ADMIN_API_KEY)")
    sec.add_argument("--prefix-cache-isolation", choices=["none", "api-key"], default=None,
                     help="api-key: each API key gets its own prefix cache (closes the timing and "
                          "cached_tokens side channel between tenants); default: api-key when keys are set")
    sec.add_argument("--shutdown-timeout", type=_float_in(0.0), default=30.0, metavar="SECONDS",
                     help="on SIGTERM/SIGINT: refuse new requests (503), let those in flight finish for up to "
                          "this long, then abort them and exit (a second signal aborts at once)")
    sec.add_argument("--max-request-bytes", type=_int_in(1), default=32 * 2**20, metavar="BYTES",
                     help="larger request bodies get 413")
    serve.set_defaults(handler=_cmd_serve)

    gen = sub.add_parser("generate", formatter_class=_HelpFormatter, help="complete prompts offline and print them",
                         description="Complete prompts with the engine (no HTTP) and print prompt + completion "
                                     "per line on stdout; logs go to stderr. Sampling defaults to greedy "
                                     "(--temperature 0) so the same command prints the same text.")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--prompts-file", metavar="FILE", help="one prompt per line (blank lines skipped)")
    _add_engine_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--temperature", type=_float_in(0.0), default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus sampling; 1: off")
    s.add_argument("--top-k", type=_int_in(-1), default=-1, help="-1 or 0: off")
    s.add_argument("--min-p", type=_float_in(0.0, 1.0), default=0.0, help="0: off")
    s.add_argument("--max-tokens", type=_int_in(1), default=16, help="output tokens per completion at most")
    s.add_argument("--n", type=_int_in(1), default=1, help="completions per prompt")
    s.add_argument("--stop", action="append", metavar="STRING", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's EOS")
    gen.add_argument("--output-format", choices=["text", "jsonl"], default="text",
                     help="text: prompt + completion per output; jsonl: one JSON object per output")
    gen.set_defaults(handler=_cmd_generate)

    from pagedkv.common.config import add_rank_arguments

    work = sub.add_parser("worker", formatter_class=_HelpFormatter,
                          help="run one worker process that joins a control plane",
                          description="Run a worker (one rank) that connects to `pagedkv serve --external-worker "
                                      "--worker-address ADDR [--tensor-parallel-size N]`.")
    work.add_argument("--connect", required=True, metavar="ADDR", help="the control plane's address (ipc:// or tcp://)")
    add_rank_arguments(work)
    work.add_argument("--secret-file", metavar="PATH", default=None,
                      help=f"the worker-channel secret shared with the control plane (default: ${SECRET_ENV})")
    _add_log_args(work)
    work.set_defaults(handler=_cmd_worker)

    bench = sub.add_parser("bench", formatter_class=_HelpFormatter,
                           help="replay a request trace; throughput, latency and KV memory efficiency",
                           description="Replay a trace (the Azure LLM inference traces 2023 or any CSV with "
                                       "TIMESTAMP, ContextTokens, GeneratedTokens) against an in-process engine or "
                                       "a running server (--url); write JSON, Markdown and PNG reports.")
    _add_engine_args(bench)
    importlib.import_module("pagedkv.bench.replay").add_arguments(bench)
    bench.set_defaults(handler=_cmd_bench, log_level="warning")

    from pagedkv.common import capacity

    cap = sub.add_parser("capacity", formatter_class=_HelpFormatter,
                         help="how many KV tokens, blocks and concurrent requests fit on one GPU (or on each of -tp N)",
                         description=(capacity.__doc__ or "").strip().splitlines()[0])
    capacity.add_arguments(cap)
    cap.set_defaults(handler=lambda args, _parser: capacity.main(args) or 0)
    return parser


def _listen_early(argv: list[str]) -> socket.socket | None:
    """For ``serve``: the listening socket, from --host/--port read before the full parser (and the
    imports it needs) exists; None when the flags are malformed (the full parser reports them).
    Raises OSError when the port cannot be had."""
    if not argv or argv[0] != "serve" or {"-h", "--help"} & set(argv):
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--host", default="127.0.0.1")
    pre.add_argument("--port", type=_int_in(0, 65535), default=8000)
    try:
        known, _ = pre.parse_known_args(argv[1:])
    except SystemExit:
        return None
    return _listen(known.host, known.port)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedkv`` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    sock, listen_error = None, None
    try:
        sock = _listen_early(argv)
    except OSError as e:  # reported after the flags are checked: a bad flag is named first
        listen_error = e
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.listen_socket = sock
    subparser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    if unknown:  # report it with the subcommand's usage, which lists the flags the user meant
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if listen_error is not None:
        print(f"pagedkv serve: error: {listen_error}", file=sys.stderr)
        return 1
    try:
        return args.handler(args, subparser)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, RuntimeError) as e:  # a port in use, a worker that failed to start
        if getattr(args, "log_level", None) == "debug":
            traceback.print_exc()
        print(f"pagedkv {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
