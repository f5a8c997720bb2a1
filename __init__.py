"""pagedkv: an LLM serving engine built around a paged KV cache (PagedAttention, SOSP 2023).

The repository root is this package: ``pagedkv.common``, ``pagedkv.scheduler``,
``pagedkv.worker`` and ``pagedkv.kernels`` are the folders beside this file.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedkv")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
