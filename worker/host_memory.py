"""How a CPU worker treats host memory: transparent huge pages for large tensors, glibc's malloc
keeping freed activations for the next step, and handing them back when idle.

No torch import here: `use_huge_pages_for_tensors` must run before torch is first imported (the
worker's entry points call it first).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

# glibc's mallopt parameters (malloc.h), and DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where glibc's own
# dynamic mmap threshold stops rising (older glibc also refuses a larger one)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX = -1, -3, 32 << 20
# PyTorch's switch (c10/core/alloc_cpu.cpp): CPU tensors of 2 MiB and up get 2 MiB-aligned memory
# advised MADV_HUGEPAGE; read once, at the process's first allocation
THP_ENV = "THP_MEM_ALLOC_ENABLE"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``, from `THP_SETTING`);
    None where the file is missing (not Linux, or a kernel without THP)."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.find("[") + 1:text.find("]")] if "[" in text else None


def use_huge_pages_for_tensors() -> bool:
    """Have PyTorch put this process's CPU tensors of 2 MiB and up (weights, the KV pool, a prefill's
    activations) on 2 MiB transparent huge pages, where the kernel offers them.

    Why: one TLB entry then covers 512 times the memory, and a page fault brings 2 MiB. A weights-bound
    ~200M Llama decoded 5-7% faster per step (64 x 100, float32 and bfloat16, one thread); stories260K's
    served conv replay ran 3-5% faster, and its first replay after start 15-19% (docs/benchmarks.md,
    thirteenth session). Most kernels leave THP to ``madvise`` (Ubuntu, Debian), where a process must
    ask: this sets ``THP_MEM_ALLOC_ENABLE=1``, PyTorch's switch for that.

    Must run before torch is imported (PyTorch reads the variable once, at its first allocation).
    Changes nothing when the user set the variable (``0`` turns this off), when torch is already
    imported, or when the kernel's mode is ``never`` or unknown. Returns whether large tensors now go
    on huge pages (`huge_pages_off` is None). RSS does not grow measurably: only tensors of 2 MiB and
    up are advised, and they are touched whole.
    """
    if THP_ENV not in os.environ and "torch" not in sys.modules and transparent_huge_pages() in ("always", "madvise"):
        os.environ[THP_ENV] = "1"
    return huge_pages_off() is None


def huge_pages_off() -> str | None:
    """None when PyTorch in this process puts large CPU tensors on transparent huge pages; else why
    not, in the words of the worker's start-up log."""
    if os.environ.get(THP_ENV, "1") != "1":
        return f"{THP_ENV}={os.environ[THP_ENV]} is set"
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return f"the kernel's mode is {mode or 'unknown'} ({THP_SETTING})"
    if THP_ENV not in os.environ:
        return f"torch was imported before {THP_ENV} could be set"
    return None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (mallopt and malloc_trim are glibc's), else None."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows names no library for the process itself
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # musl, macOS: other allocators


def reuse_freed_host_memory() -> bool:
    """Have glibc's malloc keep a CPU forward's freed activations for the next step instead of
    returning them to the kernel.

    By default glibc serves blocks of 128 KiB and up with mmap and trims its heap once that much is
    free at its top; it raises both thresholds when it frees an mmapped block of up to 32 MiB, so
    how often depends on the run. Memory handed back comes back as fresh pages: a 2,048-token
    prefill of stories260K (``[2048, 344]`` float32 per layer's gate/up output, 2.8 MB) took up to
    1,600 minor page faults and a quarter of its time with them (one thread: 35-39 ms a step, 25-29
    without). This sets the mmap threshold to 32 MiB, the most glibc's dynamic rule reaches, and
    the trim threshold to twice that (the rule's ratio). Blocks up to 32 MiB then come from the heap
    and are reused; larger ones are still mapped and faulted afresh each step. The heap keeps its
    high-water mark: freed blocks below its top stay resident, so RSS does not fall after a large
    step until `release_freed_host_memory` (the worker calls it when idle).

    Returns True when glibc accepted both settings (also under an LD_PRELOADed jemalloc or
    tcmalloc, which they then do not govern); False when libc is not glibc, or when
    ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a ``GLIBC_TUNABLES`` naming either
    threshold is set: then nothing is changed and glibc keeps the user's settings (and, for the
    threshold not named, its static default).
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if ("MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
            or "mmap_threshold" in tunables or "trim_threshold" in tunables):
        return False
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                                     and libc.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX))


def release_freed_host_memory() -> None:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim(0)``; nothing elsewhere).

    A CPU worker calls it after ``worker.POLL_MS`` without a plan, so its RSS falls back once load
    goes away; the next step then takes its activations' pages afresh once.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
