"""The ``pagedkv`` command: ``serve``, ``generate``, ``worker``, ``bench`` and ``capacity``.

Flags use vLLM's names and meanings and map one to one onto `common.config.EngineConfig`. A bad
value is an argparse error naming the flag (exit status 2). Logs go to stderr; `generate` prints
completions on stdout. Nothing here imports torch: `pagedkv worker` imports the worker package
inside its handler.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import sys

from pagedkv.common import capacity
from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagedkv.common.log import configure_logging, get_logger

log = get_logger("pagedkv.cli")


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
        return v
    return parse


def _model_dir(s: str) -> str | None:
    if s == "":  # `--model=` (e.g. `--model=${MODEL:-}` in a compose file): the embedded model
        return None
    if not os.path.isfile(os.path.join(s, "config.json")):
        raise argparse.ArgumentTypeError(f"{s!r} is not a Hugging Face checkpoint directory (no config.json)")
    return os.path.abspath(s)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", type=_model_dir, default=None, metavar="PATH",
                   help="Hugging Face Llama-family checkpoint directory (config.json, *.safetensors, tokenizer.json); "
                        "default (or empty): a built-in small model with random weights and a byte-level tokenizer")
    g.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format,
                   help="dummy: seeded random weights for the checkpoint's config (benchmarks)")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=d.dtype)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--block-size", type=_int_in(1, 256, power_of_two=True), default=d.block_size,
                   help="tokens per KV block (power of two, 1..256)")
    g.add_argument("--num-gpu-blocks", type=_int_in(1), default=None,
                   help="KV pool size in blocks; default: sized from free memory")
    g.add_argument("--gpu-memory-utilization", type=_float_in(0.0, 1.0, lo_open=True),
                   default=d.gpu_memory_utilization,
                   help="CUDA: fraction of device memory for weights, activations and the KV pool")
    g.add_argument("--cpu-kv-cache-space", type=_float_in(0.0, lo_open=True), default=d.cpu_kv_cache_space,
                   metavar="GIB", help="CPU: KV pool budget in GiB")
    g.add_argument("--swap-space", type=_float_in(0.0), default=d.swap_space, metavar="GIB",
                   help="host memory for swapped-out KV blocks, GiB")
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
    g.add_argument("--max-logprobs", type=_int_in(0), default=d.max_logprobs,
                   help="largest logprobs / top_logprobs accepted")
    g.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=d.seed,
                   help="seed of dummy weights and of requests without a seed")
    g.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="paged-attention implementation; default: triton on CUDA, torch on CPU")
    g.add_argument("--kv-allocator", choices=["paged", "contiguous"], default=d.kv_allocator,
                   help="paged: PagedAttention blocks (default); contiguous: one run per request reserved "
                        "for its maximum length at admission, the pre-paging baseline (no sharing, n = 1)")
    g.add_argument("--worker-timeout", type=_float_in(0.0, lo_open=True), default=d.worker_timeout,
                   metavar="SECONDS", help="a worker that does not answer a step within this is declared failed")
    g.add_argument("--worker-address", default=None, metavar="ADDR",
                   help="ZeroMQ address the control plane binds for its worker (ipc://PATH or tcp://HOST:PORT); "
                        "default: an ipc:// socket in the temp dir")
    g.add_argument("--external-worker", action="store_true",
                   help="do not spawn a worker: wait for `pagedkv worker --connect ADDR` (needs --worker-address)")
    g.add_argument("--log-format", choices=["console", "json"], default="console")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def _engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """EngineConfig from the flags; a flag whose value the model rules out is an argparse error."""
    if args.external_worker and not args.worker_address:
        parser.error("--external-worker needs --worker-address (the address the worker will connect to)")
    if args.worker_address and not args.worker_address.startswith(("ipc://", "tcp://")):
        parser.error(f"--worker-address must start with ipc:// or tcp://, got {args.worker_address!r}")
    try:
        model = ModelConfig.load(args.model)
        resolve_max_model_len(model, args.max_model_len)
    except ValueError as e:
        parser.error(str(e))
    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_space=args.cpu_kv_cache_space,
        swap_space=args.swap_space, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, max_n=args.max_n,
        max_logprobs=args.max_logprobs, worker_timeout=args.worker_timeout,
        attention_backend=args.attention_backend, kv_allocator=args.kv_allocator,
        enable_prefix_caching=args.enable_prefix_caching, prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
        otlp_traces_endpoint=args.otlp_traces_endpoint)


def _run(coro) -> int:
    """Run on uvloop (the design's event loop); plain asyncio where uvloop is not installed."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


# ---- serve ----------------------------------------------------------------------------------

async def _serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from aiohttp import web

    from pagedkv.scheduler.api import build_app
    from pagedkv.scheduler.engine import Engine

    engine = await Engine.start(config, worker_address=args.worker_address, external_worker=args.external_worker)
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]  # the real port when --port 0 asked for any free one
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        snap = engine.kv_cache_snapshot()
        if engine.random_weights:
            log.warning("model weights are RANDOM: outputs are noise", model=engine.model_config.name)
        log.info("serving", model=engine.model_config.name, path=engine.model_config.path,
                 random_weights=engine.random_weights, num_gpu_blocks=snap["num_gpu_blocks"],
                 block_size=snap["block_size"], max_model_len=engine.max_model_len,
                 url=f"http://{args.host}:{port}")
        await stop.wait()
        log.info("shutting down")
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await engine.shutdown()


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _engine_config(args, parser)
    configure_logging(args.log_format, args.log_level)
    return _run(_serve(args, config))


# ---- generate -------------------------------------------------------------------------------

async def _generate(args: argparse.Namespace, config: EngineConfig, prompts: list[str]) -> int:
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.scheduler.engine import Engine

    engine = await Engine.start(config, worker_address=args.worker_address, external_worker=args.external_worker)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or [],
                                ignore_eos=args.ignore_eos, n=args.n)
        try:
            params.validate(max_logprobs=config.max_logprobs, max_n=config.max_n)
            streams = [engine.add_request(engine.tokenizer.encode(p), params) for p in prompts]
        except ValueError as e:
            print(f"pagedkv generate: error: {e}", file=sys.stderr)
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
            with open(args.prompts_file, encoding="utf-8") as f:
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
    from pagedkv.scheduler import bench

    bench.check_args(args, parser)
    config = _engine_config(args, parser)
    model = ModelConfig.load(args.model)
    configure_logging(args.log_format, args.log_level)
    try:
        return bench.main(args, config, resolve_max_model_len(model, args.max_model_len), model.vocab_size)
    except ValueError as e:  # a malformed trace file
        parser.error(f"--trace: {e}")


# ---- worker, capacity -----------------------------------------------------------------------

def _cmd_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(args.log_format, args.log_level)
    from pagedkv.worker.worker import run  # torch is imported here, in the worker process only

    run(args.connect)
    return 0


# ---- main -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="pagedkv", description="LLM serving with a paged KV cache (PagedAttention).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                           description="Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                                       "/v1/models, /health, /metrics, /kv_cache).")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_int_in(0, 65535), default=8000, help="TCP port (0: any free port)")
    serve.set_defaults(handler=_cmd_serve)

    gen = sub.add_parser("generate", help="complete prompts offline and print them",
                         description="Complete prompts with the engine (no HTTP) and print prompt + completion "
                                     "per line on stdout; logs go to stderr. Sampling defaults to greedy "
                                     "(--temperature 0) so the same command prints the same text.")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--prompts-file", metavar="FILE", help="one prompt per line (blank lines skipped)")
    _add_engine_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--temperature", type=_float_in(0.0), default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0)
    s.add_argument("--top-k", type=_int_in(-1), default=-1, help="-1 or 0: off")
    s.add_argument("--min-p", type=_float_in(0.0, 1.0), default=0.0)
    s.add_argument("--max-tokens", type=_int_in(1), default=16)
    s.add_argument("--n", type=_int_in(1), default=1, help="completions per prompt")
    s.add_argument("--stop", action="append", metavar="STRING", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--output-format", choices=["text", "jsonl"], default="text",
                     help="text: prompt + completion per output; jsonl: one JSON object per output")
    gen.set_defaults(handler=_cmd_generate)

    work = sub.add_parser("worker", help="run one worker process that joins a control plane",
                          description="Run a worker that connects to `pagedkv serve --external-worker "
                                      "--worker-address ADDR`.")
    work.add_argument("--connect", required=True, metavar="ADDR", help="the control plane's address (ipc:// or tcp://)")
    work.add_argument("--log-format", choices=["console", "json"], default="console")
    work.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    work.set_defaults(handler=_cmd_worker)

    bench = sub.add_parser("bench", help="replay a request trace; throughput, latency and KV memory efficiency",
                           description="Replay a trace (the Azure LLM inference traces 2023 or any CSV with "
                                       "TIMESTAMP, ContextTokens, GeneratedTokens) against an in-process engine or "
                                       "a running server (--url); write JSON, Markdown and PNG reports.")
    _add_engine_args(bench)
    importlib.import_module("pagedkv.scheduler.bench").add_arguments(bench)
    bench.set_defaults(handler=_cmd_bench, log_level="warning")

    cap = sub.add_parser("capacity", help="how many KV tokens, blocks and concurrent requests fit on one GPU",
                         description=(capacity.__doc__ or "").strip().splitlines()[0])
    capacity.add_arguments(cap)
    cap.set_defaults(handler=lambda args, _parser: capacity.main(args) or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedkv`` console script; returns the process exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the subcommand's usage, which lists the flags the user meant
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args, parser)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, RuntimeError) as e:  # a missing tokenizer.json, a worker that failed to start
        log.error("pagedkv failed", command=args.command, error=str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
