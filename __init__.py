"""pagedkv: an LLM serving engine built around a paged KV cache (PagedAttention, SOSP 2023).

The repository root is this package: ``pagedkv.common``, ``pagedkv.scheduler``,
``pagedkv.worker`` and ``pagedkv.kernels`` are the folders beside this file.

The offline API, as vLLM's::

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint")
    outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20))

``import pagedkv`` stays light (no torch, no engine): these names load on first use.
"""

_LAZY = {
    "LLM": "pagedkv.scheduler.llm",
    "RequestOutput": "pagedkv.scheduler.llm",
    "CompletionOutput": "pagedkv.scheduler.llm",
    "SamplingParams": "pagedkv.common.sampling_params",
    "BeamSearchParams": "pagedkv.common.sampling_params",
    "BeamSearchOutput": "pagedkv.scheduler.llm",
    "BeamSearchSequence": "pagedkv.scheduler.llm",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pagedkv")
        except PackageNotFoundError:  # running from a source tree that was never installed
            return "0.0.0"
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
