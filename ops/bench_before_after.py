"""This tree against another commit's tree, alternated in one run: step-time slope and HTTP throughput.

For each repeat (the order of the two trees alternates, so drift in the load of a shared machine
hits both alike):

- in-process ``pagedkv bench`` (saturated: every request at once), whose report holds a
  least-squares fit of engine step time against running requests (`step_time_fit`, sampled after
  every step), and its output tokens/s;
- ``pagedkv serve`` from that tree and this tree's ``pagedkv bench --url`` client replaying the same
  requests over HTTP (streamed /v1/completions): output tokens/s end to end.

Each tree is run with its own virtualenv (``TREE/.venv/bin/pagedkv``, PYTHONPATH dropped), this tree
without one by this Python; each is checked to import its own ``pagedkv``. Prints per-repeat values
and median ratios this / baseline.

    python ops/bench_before_after.py --baseline /work/wt/base --num-requests 200 --repeats 2
    python ops/bench_before_after.py --baseline /work/wt/base --model /tmp/llama-200m --load-format dummy \
        --num-requests 16 --repeats 1   # weights-bound (ops/weights_bound_model.py)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_args(args, out: str, name: str) -> list[str]:
    return ["bench", "--model", args.model, "--trace", args.trace, "--num-requests", str(args.num_requests),
            "--request-rate", "inf", "--max-tokens", args.max_tokens, "--no-plots", "--no-progress",
            "--output-dir", out, "--name", name, "--load-format", args.load_format]


def pagedkv_command(tree: Path) -> tuple[list[str], dict]:
    """How to run ``pagedkv`` from ``tree``, and with which environment: the tree's own venv entry point
    with PYTHONPATH dropped (one naming another checkout would shadow the tree's editable install, and the
    baseline would silently be this tree); this tree without a venv: this Python, environment as given.

    Raises RuntimeError when ``tree`` has no venv (and is not this tree) or ``pagedkv`` does not import
    from ``tree`` there."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    venv = tree / ".venv/bin"
    if (venv / "pagedkv").exists():
        env.pop("PYTHONPATH", None)
        python, command = str(venv / "python"), [str(venv / "pagedkv")]
    elif tree == HERE:
        python, command = sys.executable, [sys.executable, "-m", "pagedkv.scheduler.cli"]
    else:
        raise RuntimeError(f"{tree} has no .venv/bin/pagedkv")
    found = subprocess.run([python, "-c", "import pagedkv; print(next(iter(pagedkv.__path__)))"], env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    if Path(found).resolve() != tree.resolve():
        raise RuntimeError(f"pagedkv run for {tree} imports {found}")
    return command, env


def in_process(tree: Path, args, out: str, name: str) -> dict:
    command, env = pagedkv_command(tree)
    subprocess.run([*command, *_bench_args(args, out, name)], check=True, env=env,
                   cwd=tree, stdout=subprocess.DEVNULL, timeout=args.timeout)
    run = next(iter(json.loads((Path(out) / f"{name}.json").read_text())["runs"].values()))
    fit = run["step_time_fit"] or {}
    return {"tok_s": run["output_token_throughput"], "slope_ms": fit.get("per_running_request_ms"),
            "intercept_ms": fit.get("intercept_ms"), "mean_running": run["mean_running"],
            "errors": run["num_errors"]}


def over_http(tree: Path, args, out: str, name: str) -> dict:
    port = _free_port()
    command, env = pagedkv_command(tree)
    client, client_env = pagedkv_command(HERE)
    server = subprocess.Popen([*command, "serve", "--model", args.model, "--port", str(port),
                               "--log-level", "warning", "--load-format", args.load_format], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"server from {tree} did not start")
                time.sleep(1)
        subprocess.run([*client, *_bench_args(args, out, name), "--url", f"http://127.0.0.1:{port}",
                        "--poll-interval", "0.5"], check=True, cwd=HERE, env=client_env, stdout=subprocess.DEVNULL,
                       timeout=args.timeout)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    run = json.loads((Path(out) / f"{name}.json").read_text())["runs"]["server"]
    return {"tok_s": run["output_token_throughput"], "errors": run["num_errors"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="worktree of the commit to compare against (with .venv)")
    p.add_argument("--model", default=str(HERE.parent / "shared/models/stories260K"))
    p.add_argument("--trace", default="conv")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-tokens", default="trace", choices=["trace", "max-model-len"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--load-format", default="auto", help="dummy: random weights (a model directory without them, "
                   "e.g. ops/weights_bound_model.py's)")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    trees = {"baseline": Path(args.baseline).resolve(), "this": HERE}
    results: dict[str, list[dict]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.repeats):
            order = ["baseline", "this"] if r % 2 == 0 else ["this", "baseline"]
            for name in order:
                row = {"in_process": in_process(trees[name], args, out, f"{name}-{r}")}
                if not args.skip_http:
                    row["http"] = over_http(trees[name], args, out, f"{name}-{r}-http")
                results[name].append(row)
                print(name, r, json.dumps(row), flush=True)
    print(f"\n{args.trace}, {args.num_requests} requests at once, max_tokens {args.max_tokens}, {args.repeats} "
          "alternating repeats (shared machine: ratios only)")

    def ratios(path, key, invert=False):
        vals = []
        for b, t in zip(results["baseline"], results["this"]):
            x, y = b[path][key], t[path][key]
            if x and y:
                vals.append(x / y if invert else y / x)
        return vals

    for label, path, key, inv in (("in-process output tok/s, this/baseline", "in_process", "tok_s", False),
                                  ("step-time slope (ms per running request), baseline/this", "in_process",
                                   "slope_ms", True),
                                  ("HTTP output tok/s, this/baseline", "http", "tok_s", False)):
        if path == "http" and args.skip_http:
            continue
        vals = ratios(path, key, inv)
        if vals:
            print(f"{label}: median {statistics.median(vals):.1f}x  ({', '.join(f'{v:.1f}' for v in vals)})")
    for name in trees:
        fits = [(x["in_process"]["slope_ms"], x["in_process"]["intercept_ms"]) for x in results[name]]
        print(f"{name}: slope ms/request, intercept ms per repeat: "
              + ", ".join(f"({s:.4f}, {i:.2f})" if s is not None else "(none)" for s, i in fits))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
