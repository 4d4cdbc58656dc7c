"""q8kv8: FP8 sparse MLA attention (prefill and decode) for Hopper (SM90) GPUs, written in CuTe DSL, called
from PyTorch.

``sparse_mla_q8kv8_prefill_fwd`` is a drop-in for SGLang's function of that name, and
``sparse_mla_q8kv8_paged_fwd`` runs the same attention straight from a paged FP8 KV cache;
``padded_num_heads``, ``pad_topk`` and ``topk_length_from_seqlens`` help callers lay out their inputs.
``SparsePrefill`` (``q8kv8.serving``) runs one layer on a paged FP8 KV cache (DeepSeek V3.2 / V4 / V4.1
layouts). Under ``torch.compile`` the calls are custom ops (``torch.ops.q8kv8.sparse_mla_q8kv8_prefill`` and
``..._paged``, ``q8kv8.ops``). ``q8kv8.info()`` reports versions, GPU, kernel variants and cache;
``python -m q8kv8.compile`` pre-builds the kernels."""

import importlib
import os

from q8kv8.api import sparse_mla_q8kv8_paged_fwd, sparse_mla_q8kv8_prefill_fwd
from q8kv8.contract import InputTypeError
from q8kv8.metadata import __version__, pad_topk, padded_num_heads, topk_length_from_seqlens
from q8kv8.paged_gather import gather_dequant_requant_fp8_paged
from q8kv8.query import cast_q_fp8
from q8kv8.serving import SparsePrefill
from q8kv8.workspace import SparsePrefillWorkspace

__all__ = [
    "InputTypeError",
    "SparsePrefill",
    "SparsePrefillWorkspace",
    "__version__",
    "cast_q_fp8",
    "gather_dequant_requant_fp8_paged",
    "info",
    "pad_topk",
    "padded_num_heads",
    "sparse_mla_q8kv8_paged_fwd",
    "sparse_mla_q8kv8_prefill_fwd",
    "topk_length_from_seqlens",
]


def __getattr__(name: str):
    # q8kv8.info is imported on first use (so that `python -m q8kv8.info` runs it fresh); the module is
    # callable: q8kv8.info() is q8kv8.info.info().
    if name == "info":
        return importlib.import_module("q8kv8.info")
    raise AttributeError(f"module 'q8kv8' has no attribute {name!r}")


# Compile (or load from the disk cache) the import's kernel variants (q8kv8.kernels.IMPORT_KEYS) and the C++
# fast path now, so the first call pays no compile. Works without a GPU (the target is sm_90a);
# Q8KV8_COMPILE_AT_IMPORT=0 defers it to the first call.
if os.environ.get("Q8KV8_COMPILE_AT_IMPORT", "1") != "0":
    from q8kv8 import kernels as _kernels
    from q8kv8 import native as _native

    _kernels.load_variants()
    _native.load()
