"""The paged serving path: a paged FP8 KV cache in, one sparse-prefill layer call out.

``SparsePrefill.forward`` = ``q8kv8.paged_gather`` (the rows a batch attends, from the paged cache into a
reusable ``q8kv8.workspace.SparsePrefillWorkspace``) + ``sparse_mla_q8kv8_prefill_fwd`` on the bfloat16 Q
(which the kernel quantises to e4m3 itself, one power-of-two scale per (token, head) row; any head count as
it is, copied into a reusable buffer only when it is not contiguous).
The cache layouts are described in ``q8kv8.kv_layout``.

Nothing here syncs with the GPU: arguments are checked on shapes, dtypes, strides and devices
only, so a forward can be captured in a CUDA graph once the kernels are built (the gather kernels and the
attention variants for a bfloat16 q build on first use, then come from the disk cache: call
``q8kv8.kernels.load_serving_variants()`` or run one forward before capturing).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from q8kv8 import kernels
from q8kv8.api import sparse_mla_q8kv8_prefill_fwd
from q8kv8.arguments import require_int
from q8kv8.kv_layout import LAYOUT_BY_BYTES_PER_TOKEN, KvCacheLayout
from q8kv8.metadata import D_V, pad_topk, topk_length_from_seqlens
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.workspace import SparsePrefillWorkspace, _ReusableBuffer

BACKENDS = ("auto", "bf16", "fp8")
BACKEND_ENV = "Q8KV8_PREFILL_BACKEND"
COMPRESS_RATIOS = (0, 4, 128)


class PrefillKernels(NamedTuple):
    """The device kernels ``SparsePrefill`` calls (injectable: the tests run the pipeline on CPU with
    ``reference_kernels()``).

    - ``gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out) -> out``
    - ``attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length)``
      -> ``(out, max_logits, lse)``: the ``sparse_mla_q8kv8_prefill_fwd`` contract; ``SparsePrefill``
      passes a bfloat16 q with ``q_scale=None`` (quantised per row by the kernel).
    - ``attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length) -> (out, max_logits, lse)``:
      q [s_q, h, d_qk] and kv [s_kv, 1, d_qk] bfloat16, the same semantics without scales.
    """

    gather: Callable
    attention_fp8: Callable
    attention_bf16: Callable


def _cuda_attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length):
    return sparse_mla_q8kv8_prefill_fwd(
        q, kv, indices, sm_scale, q_scale, kv_scale, D_V, attn_sink, topk_length
    )


def _cuda_attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length):
    """The bf16 kernel (``cute_kernels/sm90/sparse_prefill_bf16.py``) through
    ``q8kv8.kernels.launch_sparse_prefill_bf16(q, kv, indices, topk_length, attn_sink, sm_scale, out,
    max_logits, lse)``: q [s_q, h, d_qk] bf16 row-major (any h >= 1), kv [s_kv, 1, d_qk] bf16,
    indices [s_q, 1, topk] int32 (topk a multiple of 128), topk_length [s_q] int32 or None, attn_sink
    [h] float32 or None, out [s_q, h, 512] bf16, max_logits and lse [s_q, h] float32.
    """
    launch = kernels.launch_sparse_prefill_bf16
    s_q, h, _ = q.shape
    out = torch.empty((s_q, h, D_V), dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty((s_q, h), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h), dtype=torch.float32, device=q.device)
    if s_q:
        if kv.shape[0] == 0:
            out.zero_()
            max_logits.fill_(-math.inf)
            lse.fill_(math.inf)
        else:
            launch(q, kv, indices, topk_length, attn_sink, float(sm_scale), out, max_logits, lse)
    return out, max_logits, lse


def cuda_kernels() -> PrefillKernels:
    """The GPU kernels: the CuTe DSL gather and the FP8 (and, once it lands, bf16) attention."""
    return PrefillKernels(gather_dequant_paged, _cuda_attention_fp8, _cuda_attention_bf16)


def resolve_backend(backend: str = "auto") -> str:
    """The backend a ``SparsePrefill`` runs: ``$Q8KV8_PREFILL_BACKEND`` when set, else ``backend``;
    "auto" resolves to "fp8" (the SM90 FP8 kernel)."""
    requested = os.environ.get(BACKEND_ENV) or backend
    if requested not in BACKENDS:
        source = f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "backend"
        raise ValueError(f"{source}: expected one of {BACKENDS}, got {requested!r}")
    return "fp8" if requested == "auto" else requested


def paged_cache_geometry(cache: torch.Tensor) -> tuple[KvCacheLayout, int]:
    """``(layout, page_size)`` of a cache given as ``[num_pages, page_size, 1, bytes_per_token]``
    (bytes_per_token 656: V3.2, 584: MODEL1), the shape FlashMLA and SGLang use."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] not in LAYOUT_BY_BYTES_PER_TOKEN:
        raise ValueError(
            f"cache: expected shape [num_pages, page_size, 1, bytes_per_token] with bytes_per_token in "
            f"{sorted(LAYOUT_BY_BYTES_PER_TOKEN)} (584: MODEL1, 656: V3.2), got {list(cache.shape)}"
        )
    if cache.shape[1] < 1:
        raise ValueError(f"cache: expected page_size = cache.shape[1] >= 1, got {cache.shape[1]}")
    return LAYOUT_BY_BYTES_PER_TOKEN[cache.shape[3]], cache.shape[1]


def topk_length_for(seqlens: torch.Tensor, compress_ratio: int, topk: int) -> torch.Tensor:
    """Valid leading index slots per query: ``min(visible rows, topk)`` where a query whose request
    holds ``seqlens[i]`` tokens up to and including itself (its absolute position + 1) sees
    ``seqlens[i]`` rows of the uncompressed cache (ratio 0) or ``seqlens[i] // r`` compressed rows
    (ratio r: row c summarises tokens [c r, (c + 1) r), complete once token (c + 1) r - 1 exists)."""
    if compress_ratio not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio: expected one of {COMPRESS_RATIOS}, got {compress_ratio!r}")
    visible = seqlens if compress_ratio == 0 else torch.div(seqlens, compress_ratio, rounding_mode="floor")
    return topk_length_from_seqlens(visible, topk)


class SparsePrefill:
    """One sparse MLA prefill layer call on a paged FP8 KV cache (DeepSeek V3.2 / V4 serving).

    ``backend``: "fp8" (the gathered KV in e4m3 and the bfloat16 Q, which the FP8 kernel quantises per
    row), "bf16" (Q and the gathered KV in bf16: dequantised nope rounded to bf16 + RoPE; the bf16
    kernel), or "auto" (fp8). The environment variable ``Q8KV8_PREFILL_BACKEND`` overrides it.
    ``extra_rows`` zero rows follow the gathered rows in the workspace (a landing zone); they are never
    attended. ``kernels`` replaces the GPU kernels (``reference_kernels()`` runs the pipeline in PyTorch).
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        extra_rows: int = 0,
        workspace: SparsePrefillWorkspace | None = None,
        kernels: PrefillKernels | None = None,
    ):
        self.backend = resolve_backend(backend)
        self.extra_rows = require_int("extra_rows", extra_rows, 0)
        self.workspace = workspace
        self.kernels = kernels if kernels is not None else cuda_kernels()
        self._q = _ReusableBuffer()
        self._ones: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        page_table: torch.Tensor,
        indices: torch.Tensor,
        seqlens: torch.Tensor,
        compress_ratio: int,
        sm_scale: float,
        attn_sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attend each query to the rows its ``indices`` select; returns ``(out, max_logits, lse)``.

        Args:
            q: [s_q, h, d_qk] bfloat16, the queries of every request of the batch, concatenated;
                d_qk 576 (V3.2) or 512 (MODEL1), matching the cache.
            cache: [num_pages, page_size, 1, bytes_per_token] uint8 or float8_e4m3fn paged cache
                (bytes_per_token 656: V3.2, 584: MODEL1; page stride = ``cache.stride(0)`` bytes, e.g.
                the 576-byte-padded MODEL1 page). For ``compress_ratio`` r > 0 this is the compressed
                cache (one entry per r tokens), with the same layout.
            page_table: [num_rows] int32/int64: the cache slots the batch may attend, in workspace
                order (SGLang's ``page_table_1_flattened``: each request's slots of its tokens, or of
                its compressed rows for r > 0, requests concatenated). Slot s is position
                ``s % page_size`` of page ``s // page_size``. They are gathered into workspace rows
                ``0 .. num_rows - 1``.
            indices: [s_q, topk] or [s_q, 1, topk] int32: workspace rows (indices into
                ``page_table``) each query attends, valid ones first (SGLang's "ragged" top-k, i.e.
                the request-local top-k index plus the request's first row). Entries outside
                ``[0, num_rows)`` (-1 padding) and slots past the query's ``topk_length`` are
                ignored. Any topk >= 1 (padded to a multiple of 128 with -1 here).
            seqlens: [s_q] integer: the number of tokens of the query's request up to and including
                the query, i.e. its absolute position + 1 (SGLang's ``seqlens_expanded``), in tokens
                for every compress ratio.
            compress_ratio: 0 (uncompressed cache), 4 or 128. The query sees
                ``seqlens // compress_ratio`` compressed rows (all of them for 0: ``seqlens``), and
                ``topk_length = min(that, topk)`` of its leading index slots count.
            sm_scale: softmax scale.
            attn_sink: optional [h] float32 per-head sink.

        Returns ``out`` [s_q, h, 512] bfloat16, ``max_logits`` and ``lse`` [s_q, h] float32 (the contract of
        ``sparse_mla_q8kv8_prefill_fwd``). The FP8 backend hands the kernel the bfloat16 Q, which it quantises
        to e4m3 itself with a power-of-two scale per (token, head) row (``q8kv8.reference.quantize_q_rows``),
        and the KV rows in e4m3 with scale 1.0 after dequantisation.
        """
        layout, page_size = paged_cache_geometry(cache)
        s_q, h, d_qk = self._check(q, cache, layout, page_table, indices, seqlens, sm_scale, attn_sink)
        if indices.dim() == 2:
            indices = indices.unsqueeze(1)
        indices = pad_topk(indices)
        topk_length = topk_length_for(seqlens, compress_ratio, indices.shape[2])
        num_rows = page_table.shape[0]
        kv_dtype = torch.float8_e4m3fn if self.backend == "fp8" else torch.bfloat16
        if self.workspace is None:
            self.workspace = SparsePrefillWorkspace(q.device, d_qk)
        kv = self.workspace.get(num_rows + self.extra_rows, kv_dtype, d_qk)
        self.kernels.gather(cache, page_table, page_size, layout, kv_dtype, self.extra_rows, kv)
        kv = kv[:num_rows]
        sink = None if attn_sink is None else attn_sink.contiguous()
        kernel_q = q  # the kernels read bfloat16 Q as it is, any head count
        if not q.is_contiguous():
            kernel_q = self._q.view((s_q, h, d_qk), torch.bfloat16, q.device)
            kernel_q.copy_(q)
        if self.backend == "fp8":
            out, max_logits, lse = self.kernels.attention_fp8(
                kernel_q, kv, indices, sm_scale, None, self._one(q.device), sink, topk_length
            )
        else:
            out, max_logits, lse = self.kernels.attention_bf16(
                kernel_q, kv, indices, sm_scale, sink, topk_length
            )
        return out, max_logits, lse

    __call__ = forward

    def _one(self, device: torch.device) -> torch.Tensor:
        if device not in self._ones:
            self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return self._ones[device]

    @staticmethod
    def _check(q, cache, layout, page_table, indices, seqlens, sm_scale, attn_sink) -> tuple[int, int, int]:
        for name, tensor in (
            ("q", q),
            ("page_table", page_table),
            ("indices", indices),
            ("seqlens", seqlens),
        ):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if q.dtype != torch.bfloat16:
            raise TypeError(f"q: expected dtype torch.bfloat16, got {q.dtype}")
        if q.dim() != 3:
            raise ValueError(f"q: expected a 3-D tensor [s_q, h, d_qk], got shape {list(q.shape)}")
        s_q, h, d_qk = q.shape
        if h < 1:
            raise ValueError(f"q: expected at least 1 head, got {h}")
        if d_qk != layout.d_qk:
            raise ValueError(f"q: expected d_qk = {layout.d_qk} (the {layout.name} cache's), got {d_qk}")
        if page_table.dtype not in (torch.int32, torch.int64) or page_table.dim() != 1:
            raise TypeError(
                f"page_table: expected a 1-D int32 or int64 tensor, got {page_table.dtype} "
                f"{list(page_table.shape)}"
            )
        if indices.dtype != torch.int32:
            raise TypeError(f"indices: expected dtype torch.int32, got {indices.dtype}")
        if (
            indices.dim() not in (2, 3)
            or indices.shape[0] != s_q
            or (indices.dim() == 3 and indices.shape[1] != 1)
        ):
            raise ValueError(
                f"indices: expected shape [s_q, topk] or [s_q, 1, topk] with s_q = {s_q}, "
                f"got {list(indices.shape)}"
            )
        if indices.shape[-1] < 1:
            raise ValueError("indices: expected topk >= 1")
        if seqlens.is_floating_point() or seqlens.is_complex() or seqlens.dtype == torch.bool:
            raise TypeError(f"seqlens: expected an integer tensor, got dtype {seqlens.dtype}")
        if tuple(seqlens.shape) != (s_q,):
            raise ValueError(f"seqlens: expected shape [s_q] = [{s_q}], got {list(seqlens.shape)}")
        if (
            isinstance(sm_scale, bool)
            or not isinstance(sm_scale, numbers.Real)
            or not math.isfinite(sm_scale)
        ):
            raise ValueError(f"sm_scale: expected a finite Python number, got {sm_scale!r}")
        if attn_sink is not None:
            if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32:
                raise TypeError("attn_sink: expected a float32 tensor [h]")
            if tuple(attn_sink.shape) != (h,):
                raise ValueError(f"attn_sink: expected shape [h] = [{h}], got {list(attn_sink.shape)}")
        for name, tensor in (
            ("cache", cache),
            ("page_table", page_table),
            ("indices", indices),
            ("seqlens", seqlens),
        ):
            if tensor.device != q.device:
                raise ValueError(
                    f"{name}: expected a tensor on {q.device} (the device of q), got {tensor.device}"
                )
        return s_q, h, d_qk
