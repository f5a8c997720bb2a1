"""Shared test fixtures: where the real test model lives.

Tests that need stories260K fail (never skip) when it is missing, as the CI contract requires.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
