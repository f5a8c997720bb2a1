"""Shared test fixtures: where the real test model lives.

Tests that need stories260K fail (never skip) when it is missing, as the CI contract requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest

# `python -m pytest` puts the repository root first on sys.path, where kernels/ shadows Hugging Face's
# `kernels` package, which transformers imports where it is installed (a dependency of transformers
# 5.25): "cannot import name 'CUDAProperties' from 'kernels'". pagedkv is imported as the installed
# package (`pip install -e .`), so the root is not needed there.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

# One OpenMP thread for in-process torch (set before any test module imports torch): on a small
# shared machine a second spinning thread makes tiny ops ~1000x slower. Workers use cores - 1 anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Greedy continuation of "Once upon a time" (60 tokens), from the model folder's PROVENANCE.md.
GOLDEN_PROMPT = "Once upon a time"
GOLDEN_PROMPT_IDS = [1, 403, 407, 261, 378]
GOLDEN_OUTPUT_IDS = [int(t) for t in """
432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292 411 322 265 282 295 433 426
385 328 432 358 394 261 370 432 352 266 268 388 426 338 391 266 267 337 335 312 432 398 312 286 267 414 270
333 415 426 13 438 310""".split()]
GOLDEN_COMPLETION = (", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
                     " a big, red ball. She wanted to play with it, but it was too high.\nLily")


def stories260k_path() -> Path:
    """The stories260K checkpoint: $PAGEDKV_STORIES260K, else ../shared/models/stories260K next to the repo.

    Fails the calling test (not a skip) when the folder or its config.json is missing.
    """
    env = os.environ.get("PAGEDKV_STORIES260K")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared/models/stories260K"
    if not (path / "config.json").is_file():
        pytest.fail(f"stories260K test model not found at {path} (set PAGEDKV_STORIES260K)")
    return path


@pytest.fixture(scope="session")
def stories260k() -> Path:
    """Path to the stories260K checkpoint directory (see `stories260k_path`)."""
    return stories260k_path()


@pytest.fixture(autouse=True)
def _restore_logging():
    """Undo what a test's CLI run did to logging (`bench` configures level warning), so none leaks into the next."""
    import logging

    import structlog

    config, root = structlog.get_config(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**config)
    root.handlers[:], root.level = handlers, level


# ---- shared helpers for engine tests ------------------------------------------------------------

@contextlib.asynccontextmanager
async def engine_starter(model: Path):
    """An async context giving ``start(**kw)``: an engine on ``model`` (keyword args: EngineConfig fields);
    every engine it started is shut down on exit.

    swap_space defaults to 0.01 GiB (524 host blocks) and num_gpu_blocks to 256 (unless
    cpu_kv_cache_space sizes the pool): enough for any test and cheap to allocate and to snapshot.
    """
    from pagedkv.common.config import EngineConfig
    from pagedkv.scheduler.engine import Engine

    engines = []

    async def _start(**kw):
        kw.setdefault("swap_space", 0.01)
        if "cpu_kv_cache_space" not in kw:
            kw.setdefault("num_gpu_blocks", 256)
        engine = await Engine.start(EngineConfig(model=str(model), **kw))
        engines.append(engine)
        return engine

    try:
        yield _start
    finally:
        for engine in engines:
            await engine.shutdown()


@pytest.fixture
async def start(stories260k):
    """Start engines on stories260K (see `engine_starter`); every one is shut down after the test."""
    async with engine_starter(stories260k) as _start:
        yield _start


def module_loop_fixtures():
    """``start`` and ``engine`` (one default engine shared by the module) in the module's event loop.

    For a module marked ``pytest.mark.asyncio(loop_scope="module")``: ``start, engine =
    module_loop_fixtures()`` at its top level overrides conftest's function-loop ``start``.
    """
    import pytest_asyncio

    @pytest_asyncio.fixture(loop_scope="module")
    async def start(stories260k):
        async with engine_starter(stories260k) as _start:
            yield _start

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def engine(stories260k):
        async with engine_starter(stories260k) as _start:
            yield await _start()

    return start, engine


async def collect(stream):
    """Drain one request's output stream: (token ids, text, the last delta)."""
    tokens, text, last = [], "", None
    async for out in stream:
        tokens += out.token_ids
        text += out.text
        last = out
    return tokens, text, last


def metric(engine, name, **labels) -> float:
    """A sample of the engine's Prometheus registry (0 when absent)."""
    return engine.metrics.registry.get_sample_value(name, {"model_name": engine.model_config.name, **labels}) or 0.0


def with_chat_template(checkpoint: Path, dest: Path, template: str) -> Path:
    """``dest`` made a copy of ``checkpoint`` (file links) whose tokenizer_config.json carries ``template``."""
    import json

    for f in checkpoint.iterdir():
        (dest / f.name).symlink_to(f)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").unlink()
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dest


def record_plans(engine) -> list:
    """The list every step plan the engine sends its worker is appended to, from now on."""
    plans = []
    submit = engine.client.submit

    async def recording(plan):
        plans.append(plan)
        return await submit(plan)

    engine.client.submit = recording
    return plans


class Violation(AssertionError):
    """A broken invariant of the engine's bookkeeping (the randomized scheduler tests)."""


async def run_engine_until_idle(engine, worker, last_due: int, arrive) -> None:
    """Run ``engine``'s loop (its ``_wake`` a `WatchedEvent`) over a fake ``worker`` counting ``steps``
    until the loop sleeps with no request left and no arrival due after step ``last_due``.
    ``arrive(step)`` lets a step's arrivals in: step 0's once the loop's task exists (in
    ``engine._task``), then each step that passes while the loop sleeps before ``last_due``. Raises
    Violation when the loop ends or fails, or sleeps with requests left."""
    engine._task = asyncio.create_task(engine._loop())
    arrive(0)
    while True:
        await asyncio.sleep(0)
        if engine._task.done():
            engine._task.result()
            raise Violation(f"engine loop ended: {engine._error}")
        if engine._error is not None:
            raise Violation(engine._error)
        if engine._wake.sleeping and not engine._wake.is_set():
            if engine.scheduler.requests:
                raise Violation(f"the loop sleeps with {sorted(engine.scheduler.requests)} left")
            if worker.steps >= last_due:
                return
            worker.steps += 1  # idle: let time pass for the next arrival
            arrive(worker.steps)


class WatchedEvent(asyncio.Event):
    """An engine loop's wake-up event (``engine._wake``) that records when the loop sleeps on it."""

    sleeping = False

    async def wait(self):
        self.sleeping = True
        try:
            return await super().wait()
        finally:
            self.sleeping = False


def assert_all_blocks_free(engine) -> None:
    """No live request; every device and host block free; the pool's invariants hold."""
    snap = engine.kv_cache_snapshot()
    assert snap["num_free_blocks"] == snap["num_gpu_blocks"] and snap["block_ref_counts"] == {}
    assert snap["num_free_cpu_blocks"] == snap["num_cpu_blocks"] and snap["num_requests_swapped"] == 0
    assert snap["usage"] == 0.0 and snap["requests"] == [] and snap["swapped_requests"] == []
    engine.kv.pool.check_invariants([])


def run_step(s, token=7, check=None):
    """Schedule one step and play the worker: every request that reaches its end samples ``token``.

    check(step) runs between scheduling and applying the step.
    """
    from pagedkv.scheduler.request import RequestStatus

    step = s.schedule()
    if check is not None:
        check(step)
    s.advance(step)
    for rid in step.num_scheduled_tokens:
        req = s.requests[rid]
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(token)
            if req.num_output_tokens >= req.sampling.max_tokens:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
    return step
