"""The ``pagedkv`` command: flag validation, `generate` golden output, `serve` start/stop, external worker."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import GOLDEN_COMPLETION, GOLDEN_PROMPT

from pagedkv.scheduler.cli import _engine_config, build_parser, main

REPO = Path(__file__).resolve().parents[1]
PAGEDKV = [sys.executable, "-m", "pagedkv.scheduler.cli"]
SMALL_POOL = ["--num-gpu-blocks", "64", "--swap-space", "0.01", "--device", "cpu"]


def test_console_script_is_the_cli_main():
    [ep] = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "pagedkv"]
    assert ep.value == "pagedkv.scheduler.cli:main"


# ---- flag validation (in-process: argparse exits with status 2 and names the flag) ------------

BAD_FLAGS = [
    (["--block-size", "3"], "argument --block-size: must be a power of two, got 3"),
    (["--block-size", "512"], "argument --block-size: must be between 1 and 256, got 512"),
    (["--block-size", "x"], "argument --block-size: must be an integer, got 'x'"),
    (["--port", "70000"], "argument --port: must be between 0 and 65535, got 70000"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: must be > 0.0 and <= 1.0, got 0"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be > 0.0 and <= 1.0, got 1.5"),
    (["--cpu-kv-cache-space", "0"], "argument --cpu-kv-cache-space: must be > 0.0, got 0"),
    (["--swap-space", "-1"], "argument --swap-space: must be >= 0.0, got -1"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--num-gpu-blocks", "0"], "argument --num-gpu-blocks: must be >= 1, got 0"),
    (["--worker-timeout", "nan"], "argument --worker-timeout: must be > 0.0, got nan"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--model", "/"], "pagedkv serve: error: --model /: not a Hugging Face checkpoint directory (no config.json)"),
    (["--max-model-len", "100000"], "--max-model-len 100000 must be between 1 and the model's "
                                    "max_position_embeddings: 2048"),
    (["--external-worker"], "--external-worker needs --worker-address"),
    (["--worker-address", "localhost:5555"], "--worker-address must start with ipc:// or tcp://"),
    (["--external-worker", "--worker-address", "tcp://127.0.0.1:5555"],
     "--external-worker needs the worker-channel secret: --worker-secret-file PATH or PAGEDKV_WORKER_SECRET"),
    (["--worker-secret-file", "/nonexistent/secret"], "--worker-secret-file: [Errno 2]"),
    (["--api-key", ""], "--api-key: keys must not be empty"),
    (["--api-key", " k"], "--api-key: keys must not begin or end with whitespace"),  # could never match
    (["--max-choices", "0"], "argument --max-choices: must be >= 1, got 0"),
    (["--stream-interval", "0"], "argument --stream-interval: must be >= 1, got 0"),
    # inf passed the range checks: --swap-space inf was an OverflowError traceback (exit 1), --k-scale inf
    # scaled every cached value to inf
    (["--swap-space", "inf"], "argument --swap-space: must be finite, got inf"),
    (["--cpu-kv-cache-space", "inf"], "argument --cpu-kv-cache-space: must be finite, got inf"),
    (["--kv-cache-dtype", "fp8", "--k-scale", "inf"], "argument --k-scale: must be finite, got inf"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_serve_flag_is_an_error_naming_it(capsys, monkeypatch, flags, message):
    monkeypatch.delenv("PAGEDKV_WORKER_SECRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", *flags])  # port 0: never collide with a real server
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_needs_a_prompt(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate"])
    assert e.value.code == 2
    assert "give prompts as arguments or with --prompts-file" in capsys.readouterr().err


def test_flags_map_onto_engine_config(stories260k):
    from pagedkv.scheduler.cli import _engine_config
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", str(stories260k), "--block-size", "32", "--num-gpu-blocks", "100",
                              "--gpu-memory-utilization", "0.5", "--cpu-kv-cache-space", "2", "--swap-space", "1",
                              "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-model-len", "256",
                              "--max-n", "4", "--seed", "7", "--dtype", "float32", "--device", "cpu",
                              "--load-format", "dummy", "--worker-timeout", "30", "--attention-backend", "torch",
                              "--stream-interval", "4"])
    config = _engine_config(args, parser)
    assert (config.model, config.block_size, config.num_gpu_blocks, config.gpu_memory_utilization,
            config.cpu_kv_cache_space, config.swap_space, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len, config.max_n, config.seed, config.dtype, config.device, config.load_format,
            config.worker_timeout, config.attention_backend, config.stream_interval) == (
        str(stories260k), 32, 100, 0.5, 2.0, 1.0, 8, 512, 256, 4, 7, "float32", "cpu", "dummy", 30.0, "torch", 4)
    config.validate()  # Engine.start validates: what the flags accept must pass
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_every_subcommand_is_there():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert set(subcommands) == {"serve", "generate", "worker", "bench", "capacity"}


# ---- generate (subprocesses: the real engine and worker) --------------------------------------

def test_generate_prints_the_golden_text(stories260k):
    out = subprocess.run([*PAGEDKV, "generate", "--model", str(stories260k), *SMALL_POOL, "--temperature", "0",
                          "--max-tokens", "60", GOLDEN_PROMPT], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout == GOLDEN_PROMPT + GOLDEN_COMPLETION + "\n"
    assert "request finished" in out.stderr  # logs go to stderr, never into the completions


def test_generate_reads_a_prompts_file_and_writes_jsonl(stories260k, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"\ufeff{GOLDEN_PROMPT}\n\nOnce upon a\n")  # a BOM (Windows editors) is not the prompt's
    out = subprocess.run([*PAGEDKV, "generate", "--model", str(stories260k), *SMALL_POOL, "--max-tokens", "4",
                          "--prompts-file", str(prompts), "--output-format", "jsonl"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == [
        {"prompt": GOLDEN_PROMPT, "index": 0, "completion": ", there was a", "finish_reason": "length",
         "completion_tokens": 4},
        {"prompt": "Once upon a", "index": 0, "completion": " time, there was", "finish_reason": "length",
         "completion_tokens": 4},
    ]


def test_generate_rejects_an_invalid_request_with_status_2(stories260k):
    out = subprocess.run([*PAGEDKV, "generate", "--model", str(stories260k), *SMALL_POOL, "--max-tokens", "600",
                          GOLDEN_PROMPT], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2
    assert "pagedkv generate: error: --max-tokens: prompt (5 tokens) + max_tokens (600) exceeds max_model_len (512)" \
        in out.stderr


# ---- serve ------------------------------------------------------------------------------------

class Server:
    """`pagedkv serve --port 0 --log-format json` in a subprocess; reads its "serving" log line."""

    def __init__(self, *flags: str, cwd: Path = REPO):
        self.proc = subprocess.Popen([*PAGEDKV, "serve", "--port", "0", "--log-format", "json", *flags],
                                     stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.events: list[dict] = []
        self.other_lines: list[str] = []  # stderr lines that are not JSON events (tracebacks, a stray format)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError(f"serve exited with {self.proc.wait()} before serving: {self.events}")
            if not line.startswith("{"):
                self.other_lines.append(line)
            else:
                self.events.append(json.loads(line))
                if self.events[-1]["event"] == "serving":
                    self.url = self.events[-1]["url"]
                    return
        raise AssertionError("serve did not start within 300 s")

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def stop(self, sig: int) -> tuple[int, list[dict]]:
        self.proc.send_signal(sig)
        rest = self.proc.stderr.read()
        code = self.proc.wait(timeout=60)
        return code, self.events + [json.loads(x) for x in rest.splitlines() if x.startswith("{")]


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_serve_real_model_then_sigterm_shuts_down_cleanly(stories260k):
    server = Server("--model", str(stories260k), *SMALL_POOL)
    try:
        serving = server.events[-1]
        assert server.other_lines == []  # the spawned worker logs JSON too, each line tagged with its rank
        assert any(e["logger"] == "pagedkv.worker" and e["rank"] == 0 and e["event"].startswith("attention: cpu")
                   for e in server.events)
        assert serving["model"] == "stories260K"
        assert serving["path"] == str(stories260k)
        assert serving["random_weights"] is False
        assert serving["num_gpu_blocks"] == 64
        assert serving["url"].startswith("http://127.0.0.1:")
        body = server.post("/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0})
        assert body["choices"][0]["text"] == GOLDEN_COMPLETION
        assert not _torch_loaded(server.proc.pid)  # the control plane never loads torch
    finally:
        code, events = server.stop(signal.SIGTERM)
    assert code == 0
    assert "shutting down" in [e["event"] for e in events]
    assert events[-1]["event"] == "stopped"  # a log alone says the server finished cleanly


def test_serve_queues_a_burst_of_300_connections_while_it_is_busy(stories260k):
    """aiohttp's site listened again with asyncio's default backlog of 128: a burst of 200 clients
    (`pagedkv bench --request-rate inf`) overflowed the accept queue while a step ran, and the dropped
    handshakes came back after TCP's 1 s retransmission timeout (1 replay in 3 to 5 took 1.2-1.35 s
    instead of 0.47). With the server stopped (SIGSTOP), the kernel completes as many handshakes as
    the backlog holds: 129 before, all 300 now."""
    server = Server("--model", str(stories260k), *SMALL_POOL)
    address = urlparse(server.url)
    socks: list[socket.socket] = []
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((address.hostname, address.port))
            socks.append(s)
        deadline, connected = time.monotonic() + 0.8, set()
        while time.monotonic() < deadline and len(connected) < len(socks):  # under TCP's first 1 s retransmission
            _, writable, _ = select.select([], [s for s in socks if s not in connected], [], 0.1)
            connected |= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        for s in socks:
            s.close()
        code, _ = server.stop(signal.SIGTERM)
    assert code == 0
    assert len(connected) == 300


def test_serve_started_among_common_worker_kernels_scheduler_py_serves_the_golden(stories260k, tmp_path):
    # `python -m` puts the current directory first on sys.path, for the CLI and for the worker it spawns
    from test_packaging import write_shadows

    write_shadows(tmp_path)
    server = Server("--model", str(stories260k), *SMALL_POOL, cwd=tmp_path)
    try:
        body = server.post("/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0})
        assert body["choices"][0]["text"] == GOLDEN_COMPLETION
    finally:
        code, _ = server.stop(signal.SIGTERM)
    assert code == 0


def test_ctrl_c_in_a_terminal_stops_serve_and_its_spawned_worker_without_a_traceback():
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group, the spawned worker
    included: the worker ignores it (the control plane stops it), so no KeyboardInterrupt interrupts
    the drain. serve runs in its own group here, as a shell's foreground job does."""
    proc = subprocess.Popen([*PAGEDKV, "serve", "--port", "0", "--log-format", "json", *SMALL_POOL],
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    try:
        events = []
        while not events or events[-1]["event"] != "serving":
            line = proc.stderr.readline()
            assert line, f"serve exited with {proc.wait()} before serving"
            if line.startswith("{"):
                events.append(json.loads(line))
        worker_pid = next(e["pid"] for e in events if e["event"] == "worker process started")
        status = Path(f"/proc/{worker_pid}/status").read_text()
        ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
        assert not Path(f"/proc/{worker_pid}").exists() or "zombie" in Path(f"/proc/{worker_pid}/status").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_embedded_default_with_an_external_worker_says_weights_are_random(tmp_path):
    address = f"ipc://{tmp_path}/w.sock"
    serve = None
    secret = tmp_path / "worker-secret"
    secret.write_text("s3cret-" * 8 + "\n")
    worker = subprocess.Popen([*PAGEDKV, "worker", "--connect", address, "--secret-file", str(secret)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        serve = Server("--external-worker", "--worker-address", address, "--worker-secret-file", str(secret),
                       *SMALL_POOL)
        warning = next(e for e in serve.events if e["event"] == "model weights are RANDOM: outputs are noise")
        assert warning["level"] == "warning"
        assert serve.events[-1]["random_weights"] is True
        assert serve.events[-1]["model"] == "pagedkv-embedded-random"
        assert serve.events[-1]["path"] == "(embedded)"  # no checkpoint directory: said, not "None"
        body = serve.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
        assert body["usage"]["completion_tokens"] == 5
        code, _ = serve.stop(signal.SIGINT)
        assert code == 0
        assert worker.wait(timeout=60) == 0  # the worker leaves when told to shut down
    finally:
        for p in (worker, serve.proc if serve else None):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert not os.path.exists(address[len("ipc://"):])


def test_prefix_caching_flags_reach_the_engine_config():
    from pagedkv.scheduler.cli import _engine_config, build_parser

    parser = build_parser()
    on = _engine_config(parser.parse_args(["serve"]), parser)
    off = _engine_config(parser.parse_args(["serve", "--no-enable-prefix-caching",
                                            "--prefix-caching-hash-algo", "xxhash"]), parser)
    assert (on.enable_prefix_caching, on.prefix_caching_hash_algo) == (True, "sha256")
    assert (off.enable_prefix_caching, off.prefix_caching_hash_algo) == (False, "xxhash")


def test_a_mistyped_flag_is_reported_with_the_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", "--modle", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "usage: pagedkv serve" in err and "pagedkv serve: error: unrecognized arguments: --modle" in err


def test_empty_model_flag_is_the_embedded_model():
    # docker-compose.yml passes `--model=${MODEL:-}`: unset MODEL serves the embedded model
    args = build_parser().parse_args(["serve", "--model="])
    assert _engine_config(args, build_parser()).model is None


# ---- failing fast, in one line ------------------------------------------------------------------

def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"pagedkv {importlib.metadata.version('pagedkv')}\n"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--block-size BLOCK_SIZE tokens per KV block (power of two, 1..256) (default: 16)",
                 "(default: 127.0.0.1)", "(default: 8000)", "(default: 0.9)", "(default: auto)"):
        assert flag in out
    # never a default of None, nor a second default after the help's own
    assert "(default: None)" not in out
    assert "names the API answers to; the first is reported in responses (default: the checkpoint directory's name) " \
        "--chat-template" in out



def test_kv_pool_sizes_are_labelled_per_rank_with_the_host_total(capsys):
    # measured at -tp 2 on CPU: every rank allocated 0.25 GiB of KV (26,214 blocks of 10,240 B) and 0.125 GiB
    # of swap (13,107 blocks), 0.75 GiB of host memory in all, but the log said only 0.25 and 0.125
    from pagedkv.scheduler.engine import kv_cache_sizes
    assert kv_cache_sizes(26214, 13107, 10240, 2, "cpu") == {
        "kv_cache_gib": 0.25, "swap_space_gib": 0.125, "world_size": 2, "host_kv_gib_all_ranks": 0.75}
    # on CUDA only the swap pools are host memory: 4 ranks x 4 GiB
    assert kv_cache_sizes(27157, 32768, 131072, 4, "cuda:0") == {
        "kv_cache_gib": 3.315, "swap_space_gib": 4.0, "world_size": 4, "host_kv_gib_all_ranks": 16.0}
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "CPU: KV pool budget in GiB, per rank (-tp N uses N times this)" in out
    assert "host memory for swapped-out KV blocks, GiB per rank (-tp N uses N times this)" in out

def _bad_checkpoint(tmp_path: Path, stories260k: Path, kind: str) -> Path:
    d = tmp_path / kind.replace(":", "_").replace("=", "_")
    d.mkdir()
    if kind == "no_weights":
        for f in ("config.json", "tokenizer.json"):
            (d / f).write_bytes((stories260k / f).read_bytes())
    elif kind == "bad_json":
        (d / "config.json").write_text('{"hidden_size": 64,')
    elif kind.startswith("config:"):  # stories260K with one config.json field changed
        cfg = json.loads((stories260k / "config.json").read_text())
        key, value = kind.split(":")[1].split("=")
        if value == "drop":
            del cfg[key]
        else:
            cfg[key] = json.loads(value)
        (d / "config.json").write_text(json.dumps(cfg))
        for f in ("model.safetensors", "tokenizer.json"):
            (d / f).write_bytes((stories260k / f).read_bytes())
    elif kind == "no_tokenizer":
        for f in ("config.json", "model.safetensors"):
            (d / f).write_bytes((stories260k / f).read_bytes())
    return d


@pytest.mark.parametrize("kind,message", [
    ("missing", "pagedkv serve: error: MODEL {d}: no such directory"),
    ("no_weights", "pagedkv serve: error: {d}: no *.safetensors weights (use --load-format dummy for random weights)"),
    ("bad_json", "pagedkv serve: error: {d}/config.json: invalid JSON: Expecting property name enclosed in double "
                 "quotes: line 1 column 20 (char 19)"),
    ("no_tokenizer", "pagedkv serve: error: no tokenizer.json at '{d}/tokenizer.json': pagedkv needs the Hugging Face "
                     "fast-tokenizer file"),
    # these reached the worker: a ZeroDivisionError traceback, or a worker's shape or type error (exit 1)
    ("config:num_attention_heads=0", "pagedkv serve: error: {d}/config.json: num_attention_heads must be a positive "
                                     "integer, got 0"),
    ("config:hidden_size=\"64\"", "pagedkv serve: error: {d}/config.json: hidden_size must be a positive integer, "
                                  "got '64'"),
    ("config:vocab_size=-1", "pagedkv serve: error: {d}/config.json: vocab_size must be a positive integer, got -1"),
    ("config:num_attention_heads=null", "pagedkv serve: error: {d}/config.json: config.json is missing required "
                                        "field 'num_attention_heads'"),
    ("config:num_key_value_heads=3", "pagedkv serve: error: {d}/config.json: num_attention_heads 8 is not a multiple "
                                     "of num_key_value_heads 3"),
])
def test_a_bad_checkpoint_is_one_line_naming_the_problem_before_any_worker(tmp_path, stories260k, capsys,
                                                                           kind, message):
    d = tmp_path / kind if kind == "missing" else _bad_checkpoint(tmp_path, stories260k, kind)
    with pytest.raises(SystemExit) as e:
        main(["serve", str(d), "--port", "0"])  # the positional MODEL, as `vllm serve MODEL`
    assert e.value.code == 2
    assert capsys.readouterr().err == message.format(d=d) + "\n"  # one line, no traceback, no worker


def test_a_missing_checkpoint_given_by_flag_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"pagedkv serve: error: --model {tmp_path / 'missing'}: no such directory\n"


def test_a_bad_chat_template_is_one_line_naming_the_flag(stories260k, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(stories260k), "--port", "0", "--chat-template", "no/such/template.jinja"])
    assert capsys.readouterr().err == ("pagedkv serve: error: --chat-template: 'no/such/template.jinja' is neither a "
                                       "readable file (No such file or directory) nor a jinja2 template\n")
    with pytest.raises(SystemExit):
        main(["serve", str(stories260k), "--port", "0", "--chat-template", "{% for m in messages %}"])
    assert capsys.readouterr().err == ("pagedkv serve: error: --chat-template: invalid jinja2 template: Unexpected "
                                       "end of template. Jinja was looking for the following tags: 'endfor' or "
                                       "'else'. The innermost block that needs to be closed is 'for'. (line 1)\n")


def test_the_model_given_twice_differently_is_an_error(stories260k, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(stories260k), "--port", "0", "--model", "/elsewhere"])
    assert "the model is given twice" in capsys.readouterr().err


def test_a_port_in_use_exits_at_once_in_one_line_before_loading_anything(stories260k):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run([*PAGEDKV, "serve", str(stories260k), "--port", str(port)], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
        seconds = time.monotonic() - started
    assert out.returncode == 1
    assert out.stderr == f"pagedkv serve: error: --host 127.0.0.1 --port {port}: cannot listen: Address already " \
                         f"in use\n", out.stderr
    print(f"port in use: exit after {seconds:.2f} s")  # the model was never read: no worker line above


def test_a_bad_flag_is_named_even_when_the_port_is_in_use(capsys):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", str(busy.getsockname()[1]), "--kv-cache-dtype", "int8"])
    assert e.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
