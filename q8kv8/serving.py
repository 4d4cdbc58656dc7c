"""The paged serving path: a paged FP8 KV cache in, one sparse-prefill layer call out.

``SparsePrefill.forward`` with the FP8 backend takes one of two paths ("auto" picks by the batch's shape, see
``PAGED_ROWS_PER_TILE_SLOT``). Paged: one launch maps the batch's top-k rows to the cache's token slots
through ``page_table`` and counts each query's valid slots (``q8kv8.kernels.launch_paged_indices``), a
second runs ``sparse_mla_q8kv8_paged_fwd`` on the bfloat16 Q (which the kernel quantises per row) with the
cache's own block scales: no workspace, no prefix copy. Workspace (the bf16 backend's only path):
``q8kv8.paged_gather`` gathers the ``page_table`` rows into a reusable
``q8kv8.workspace.SparsePrefillWorkspace``, then ``sparse_mla_q8kv8_prefill_fwd`` attends them.
``forward_merged`` attends rows that live in several caches as one softmax (``q8kv8.merge``). The cache
layouts are described in ``q8kv8.kv_layout``.

Nothing here syncs with the GPU: arguments are checked on shapes, dtypes, strides and devices only, so a
forward can be captured in a CUDA graph once the kernels are built (they build on first use, then come from
the disk cache: call ``q8kv8.kernels.load_serving_variants()`` or run one forward before capturing).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from q8kv8 import kernels
from q8kv8.api import attend, attend_paged, sparse_mla_q8kv8_paged_fwd
from q8kv8.arguments import require_int
from q8kv8.checks import cache_geometry
from q8kv8.contract import check_ranges_enabled
from q8kv8.kv_layout import PAGED_ATTENTION_LAYOUTS, RECORDS_FROM, RECORDS_LAYOUT, KvCacheLayout
from q8kv8.merge import merge_attention
from q8kv8.metadata import D_V, LOGITS_IN_FLOAT32, PRECISIONS, TOPK_ALIGNMENT, topk_length_from_seqlens
from q8kv8.paged import page_size_read_directly
from q8kv8.paged_gather import gather_dequant_paged, slot_words
from q8kv8.prefill_call import PagedCall, PrefillCall, new_call
from q8kv8.workspace import SparsePrefillWorkspace, _ReusableBuffer, indexed_device

BACKENDS = ("auto", "bf16", "fp8")
BACKEND_ENV = "Q8KV8_PREFILL_BACKEND"
PRECISION_ENV = "Q8KV8_PRECISION"
PATHS = ("auto", "paged", "workspace")
COMPRESS_RATIOS = (0, 4, 128)
PAGED_ROWS_PER_TILE_SLOT = 0.4
"""The "auto" path's rule: straight from the cache when the workspace would gather more rows than this many
per (tile of 64 heads, top-k slot) of the batch. Measured on an H200: the gather takes about 0.5 ns a row,
and the paged kernel about 0.2 ns a tile-slot more than the kernel on gathered rows, so decode steps (a few
queries over long prefixes) run paged and prefill chunks gather (``docs/perf-notes.md``, "Paged cache")."""


class PrefillKernels(NamedTuple):
    """The device kernels ``SparsePrefill`` calls (injectable: the tests run the pipeline on CPU with
    ``reference_kernels()``).

    - ``slot_indices(indices, page_table, seqlens, compress_ratio, topk_pad) -> (slots, topk_length)``:
      ``slots`` [s_q, 1, topk_pad] int32 token slots (``page_table[indices]`` for the entries in
      ``[0, len(page_table))`` before ``topk_length``, else -1), ``topk_length`` [s_q] int32
      (``topk_length_for``);
    - ``attention_paged(q, cache, slots, sm_scale, attn_sink, topk_length, precision, extra=None) -> (out,
      max_logits, lse)``: the ``sparse_mla_q8kv8_paged_fwd`` contract on a bfloat16 q; ``extra``: None, or
      ``(extra_cache, extra_slots, extra_topk_length)``, a second cache attended in the same softmax;
    - ``gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out) -> out``;
    - ``attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length, precision)
      -> (out, max_logits, lse)``: the ``sparse_mla_q8kv8_prefill_fwd`` contract; ``SparsePrefill`` passes a
      bfloat16 q with ``q_scale=None`` (quantised per row by the kernel);
    - ``attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length) -> (out, max_logits, lse)``: q
      [s_q, h, d_qk] and kv [s_kv, 1, d_qk] bfloat16, the same semantics without scales.
    """

    slot_indices: Callable
    attention_paged: Callable
    gather: Callable
    attention_fp8: Callable
    attention_bf16: Callable


def _cuda_slot_indices(indices, page_table, seqlens, compress_ratio, topk_pad):
    """The slot-index kernel (``q8kv8.kernels.launch_paged_indices``), into new outputs."""
    s_q = indices.shape[0]
    slots = torch.empty((s_q, 1, topk_pad), dtype=torch.int32, device=indices.device)
    topk_length = torch.empty((s_q,), dtype=torch.int32, device=indices.device)
    if s_q:
        kernels.launch_paged_indices(
            indices, slot_words(page_table), slot_words(seqlens), slots, topk_length, compress_ratio
        )
    return slots, topk_length


def _cuda_attention_paged(q, cache, slots, sm_scale, attn_sink, topk_length, precision, extra=None):
    """``sparse_mla_q8kv8_paged_fwd`` on the call as ``q8kv8.api`` gathers it (``api.attend_paged``; with
    ``extra``, the public call with its extra cache)."""
    if extra is not None:
        extra_cache, extra_slots, extra_topk_length = extra
        return sparse_mla_q8kv8_paged_fwd(
            q, cache, slots, sm_scale, None, D_V, attn_sink, topk_length, precision=precision,
            extra_cache=extra_cache, extra_indices=extra_slots, extra_topk_length=extra_topk_length,
        )  # fmt: skip
    return attend_paged(
        new_call(
            PagedCall,
            (q, cache, slots, sm_scale, None, D_V, attn_sink, topk_length, None, None, None, precision),
        )
    )


def _cuda_attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length, precision):
    """``sparse_mla_q8kv8_prefill_fwd`` on the call as ``q8kv8.api`` gathers it (``api.attend``)."""
    fields = (q, kv, indices, sm_scale, q_scale, kv_scale, D_V, attn_sink, topk_length, None, None, None)
    return attend(new_call(PrefillCall, (*fields, precision)))


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
    """The GPU kernels: the slot-index kernel, the paged FP8 attention, the CuTe DSL gather, the FP8 attention
    on gathered rows and the bf16 attention."""
    return PrefillKernels(
        _cuda_slot_indices,
        _cuda_attention_paged,
        gather_dequant_paged,
        _cuda_attention_fp8,
        _cuda_attention_bf16,
    )


def resolve_backend(backend: str = "auto") -> str:
    """The backend a ``SparsePrefill`` runs: ``$Q8KV8_PREFILL_BACKEND`` when set, else ``backend``;
    "auto" resolves to "fp8" (the SM90 FP8 kernel)."""
    requested = os.environ.get(BACKEND_ENV) or backend
    if requested not in BACKENDS:
        source = f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "backend"
        raise ValueError(f"{source}: expected one of {BACKENDS}, got {requested!r}")
    return "fp8" if requested == "auto" else requested


def resolve_precision(precision: str = "default") -> str:
    """The precision a ``SparsePrefill`` runs: ``$Q8KV8_PRECISION`` when set, else ``precision``."""
    requested = os.environ.get(PRECISION_ENV) or precision
    if requested not in PRECISIONS:
        source = f"${PRECISION_ENV}" if os.environ.get(PRECISION_ENV) else "precision"
        raise ValueError(f"{source}: expected one of {PRECISIONS}, got {requested!r}")
    return requested


def paged_cache_geometry(cache: torch.Tensor) -> tuple[KvCacheLayout, int]:
    """``(layout, page_size)`` of a cache given as ``[num_pages, page_size, 1, bytes_per_token]``
    (bytes_per_token 656: V3.2, 584: MODEL1, 528: V4.1, 288: V4.1 FP4; ``q8kv8.checks.cache_geometry``)."""
    layout, shape = cache_geometry(cache)
    page_size = shape[1]
    if page_size < 1:
        raise ValueError(f"cache: expected page_size = cache.shape[1] >= 1, got {page_size}")
    return layout, page_size


def topk_length_for(seqlens: torch.Tensor, compress_ratio: int, topk: int) -> torch.Tensor:
    """Valid leading index slots per query: ``min(visible rows, topk)`` where a query whose request
    holds ``seqlens[i]`` tokens up to and including itself (its absolute position + 1) sees
    ``seqlens[i]`` rows of the uncompressed cache (ratio 0) or ``seqlens[i] // r`` compressed rows
    (ratio r: row c summarises tokens [c r, (c + 1) r), complete once token (c + 1) r - 1 exists)."""
    if compress_ratio not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio: expected one of {COMPRESS_RATIOS}, got {compress_ratio!r}")
    visible = seqlens if compress_ratio == 0 else torch.div(seqlens, compress_ratio, rounding_mode="floor")
    return topk_length_from_seqlens(visible, topk)


class CacheRows(NamedTuple):
    """The rows of one cache that a ``SparsePrefill.forward_merged`` call attends: ``forward``'s arguments of
    the same names."""

    cache: torch.Tensor
    page_table: torch.Tensor
    indices: torch.Tensor
    seqlens: torch.Tensor
    compress_ratio: int


class _Part(NamedTuple):
    """One cache's rows as ``SparsePrefill`` runs them (``_prepare``): checked, indices 2-D."""

    rows: CacheRows
    layout: KvCacheLayout
    page_size: int
    d_qk: int
    topk_pad: int  # the top-k padded to a multiple of TOPK_ALIGNMENT
    path: str  # "paged" or "workspace"


class SparsePrefill:
    """One sparse MLA prefill layer call on a paged FP8 KV cache (DeepSeek V3.2 / V4 / V4.1 serving).

    ``backend``: "fp8" (the FP8 kernel on the bfloat16 Q, which it quantises per row, and the cache's e4m3
    rows), "bf16" (Q and the gathered KV in bf16: dequantised nope rounded to bf16 + RoPE; the bf16 kernel),
    or "auto" (fp8); ``$Q8KV8_PREFILL_BACKEND`` overrides it. ``precision``: the FP8 kernel's, one of
    ``q8kv8.metadata.PRECISIONS`` (``sparse_mla_q8kv8_prefill_fwd``); ``$Q8KV8_PRECISION`` overrides it. A
    call with a sink (in the kernel's plan), and the parts of ``forward_merged``, run it with S summed in
    float32 (``q8kv8.metadata.LOGITS_IN_FLOAT32``: "default" runs as "accurate_logits"), since their lse
    weighs the output.
    ``path``: for the FP8 backend, "paged" (attend straight from the cache), "workspace" (gather the rows
    the batch may attend into a workspace first), or "auto"
    (paged when the workspace would gather more than ``PAGED_ROWS_PER_TILE_SLOT`` rows per tile-slot of the
    batch, else the workspace; always the workspace for a V4.1 FP4 cache, which only the gather reads, and
    for pages of a size that is not a power of two, which the paged call does not take);
    ``last_path`` says which ran. ``extra_rows`` zero rows follow the gathered
    rows in the workspace (a landing zone); they are never attended. ``kernels`` replaces the GPU kernels
    (``reference_kernels()`` runs the pipeline in PyTorch).
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        precision: str = "default",
        path: str = "auto",
        extra_rows: int = 0,
        workspace: SparsePrefillWorkspace | None = None,
        kernels: PrefillKernels | None = None,
    ):
        self.backend = resolve_backend(backend)
        self.precision = resolve_precision(precision)
        if path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        self.path = path
        self.last_path: str | None = None
        self.extra_rows = require_int("extra_rows", extra_rows, 0)
        self.workspace = workspace
        self.kernels = kernels if kernels is not None else cuda_kernels()
        self._q = _ReusableBuffer()
        self._rows = _ReusableBuffer()  # 0, 1, 2, ...: the workspace's rows as a table of slots
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
                d_qk 576 (V3.2) or 512 (MODEL1, V4.1), matching the cache.
            cache: [num_pages, page_size, 1, bytes_per_token] uint8 or float8_e4m3fn paged cache
                (bytes_per_token 656: V3.2, 584: MODEL1, 528: V4.1, 288: V4.1 FP4, gathered only; page
                stride = ``cache.stride(0)`` bytes, e.g. the 576-byte-padded MODEL1 page; the paged path
                needs page_size a power of two). For ``compress_ratio`` r > 0 this is the compressed cache
                (one entry per r tokens), with the same layout.
            page_table: [num_rows] int32/int64: the cache slots the batch may attend (SGLang's
                ``page_table_1_flattened``: each request's slots of its tokens, or of its compressed rows for
                r > 0, requests concatenated). Slot s is position ``s % page_size`` of page
                ``s // page_size``.
            indices: [s_q, topk] or [s_q, 1, topk] int32: rows of ``page_table`` each query attends, valid
                ones first (SGLang's "ragged" top-k, i.e. the request-local top-k index plus the request's
                first row). Entries outside ``[0, num_rows)`` (-1 padding) and slots past the query's
                ``topk_length`` are ignored. Any topk >= 1 (padded to a multiple of 128 with -1 here).
            seqlens: [s_q] integer: the number of tokens of the query's request up to and including the
                query, i.e. its absolute position + 1 (SGLang's ``seqlens_expanded``), in tokens for every
                compress ratio.
            compress_ratio: 0 (uncompressed cache), 4 or 128. The query sees ``seqlens // compress_ratio``
                compressed rows (all of them for 0: ``seqlens``), and ``topk_length = min(that, topk)`` of
                its leading index slots count.
            sm_scale: softmax scale.
            attn_sink: optional [h] float32 per-head sink.

        Returns ``out`` [s_q, h, 512] bfloat16, ``max_logits`` and ``lse`` [s_q, h] float32 (the contract of
        ``sparse_mla_q8kv8_prefill_fwd``). The FP8 backend hands the kernel the bfloat16 Q, which it quantises
        to e4m3 itself with a power-of-two scale per (token, head) row (``q8kv8.reference.quantize_q_rows``);
        with a sink, S summed in float32 (``LOGITS_IN_FLOAT32``).
        """
        part = self._prepare(
            q, CacheRows(cache, page_table, indices, seqlens, compress_ratio), sm_scale, attn_sink
        )
        return self._forward(q, part, sm_scale, attn_sink)

    __call__ = forward

    def _prepare(self, q, rows: CacheRows, sm_scale, attn_sink) -> _Part:
        """One cache's rows checked (with q, ``sm_scale`` and ``attn_sink``), their indices 2-D, the top-k
        padded and the path the layer takes for them."""
        cache, page_table, indices, seqlens, compress_ratio = rows
        layout, page_size = paged_cache_geometry(cache)
        s_q, h, d_qk = self._check(q, cache, layout, page_table, indices, seqlens, sm_scale, attn_sink)
        if compress_ratio not in COMPRESS_RATIOS:
            raise ValueError(f"compress_ratio: expected one of {COMPRESS_RATIOS}, got {compress_ratio!r}")
        if indices.dim() == 3:
            indices = indices[:, 0]
        topk_pad = max(1, -(-indices.shape[1] // TOPK_ALIGNMENT)) * TOPK_ALIGNMENT
        path = self._choose_path(s_q, h, topk_pad, page_table.shape[0], layout, page_size)
        return _Part(rows._replace(indices=indices), layout, page_size, d_qk, topk_pad, path)

    def _paged_call_of_two(self, q, parts: list[_Part], sm_scale, attn_sink):
        """``forward_merged`` of two prepared parts as one paged call, the second cache its extra cache, where
        the paged call reads both in one launch: two parts on the paged path on caches of one layout, or a
        V4.1 part on the paged path and a V4.1 FP4 part of pages of a power-of-two size (in either order; the
        FP4 cache's selected slots gathered as V4.1 records, ``q8kv8.paged_extra``). None (nothing launched)
        for any other parts."""
        if len(parts) != 2:
            return None
        main, extra = parts
        if main.layout.name == RECORDS_FROM:
            main, extra = extra, main
        # (the paged call reads an extra cache of pages of a power-of-two size; the workspace path any)
        records = (main.layout.name, extra.layout.name) == (RECORDS_LAYOUT, RECORDS_FROM)
        records = records and page_size_read_directly(extra.page_size)
        same_layout = extra.path == "paged" and extra.layout == main.layout
        if main.path != "paged" or not (records or same_layout):
            return None
        # Each part's slots are -1 from its topk_length on (the slot-index kernel): the joined index row needs
        # no mask, so the call takes no topk_length (the joined row's kernel reads none either)
        slots, extra_slots = (self._slot_indices(part)[0] for part in (main, extra))
        sink = None if attn_sink is None else attn_sink.contiguous()
        self.last_path = "paged"
        return self.kernels.attention_paged(
            self._kernel_q(q), main.rows.cache, slots, sm_scale, sink, None, self.precision,
            extra=(extra.rows.cache, extra_slots, None),
        )  # fmt: skip

    def _slot_indices(self, part: _Part):
        """``(slots, topk_length)`` of a prepared part's rows (the slot-index kernel)."""
        rows = part.rows
        return self.kernels.slot_indices(
            rows.indices, rows.page_table, rows.seqlens, rows.compress_ratio, part.topk_pad
        )

    def _kernel_q(self, q: torch.Tensor) -> torch.Tensor:
        """q as the kernels read it: bfloat16 as it is, any head count; row-major (copied into a reused
        buffer when it is not)."""
        if q.is_contiguous():
            return q
        kernel_q = self._q.view(tuple(q.shape), torch.bfloat16, q.device)
        kernel_q.copy_(q)
        return kernel_q

    def _forward(self, q, part: _Part, sm_scale, attn_sink, lse_used=False):
        """``forward`` of a prepared part; ``lse_used``: S summed in float32 (the lse weighs the output
        afterwards, where a part is merged; a sink's call sums in float32 in the kernel's plan)."""
        precision = LOGITS_IN_FLOAT32[self.precision] if lse_used else self.precision
        (cache, page_table, indices, seqlens, compress_ratio), layout, page_size, d_qk, topk_pad, path = part
        sink = None if attn_sink is None else attn_sink.contiguous()
        kernel_q = self._kernel_q(q)
        num_rows = page_table.shape[0]
        self.last_path = path
        if path == "paged":
            slots, topk_length = self._slot_indices(part)
            return self.kernels.attention_paged(
                kernel_q, cache, slots, sm_scale, sink, topk_length, precision
            )
        # The workspace's rows are the indices themselves (the kernels ignore entries outside [0, num_rows)).
        # Already padded and row-major, they go as they are, with each query's valid count from seqlens (int32
        # seqlens of an uncompressed cache as they are: the kernels clamp topk_length to [0, topk], unless
        # Q8KV8_CHECK_RANGES=1 has them raise); else the slot-index kernel on the identity table pads them
        # and counts, in one launch.
        if indices.shape[1] == topk_pad and indices.stride(1) == 1:
            if compress_ratio == 0 and seqlens.dtype == torch.int32 and not check_ranges_enabled():
                topk_length = seqlens
            else:
                topk_length = topk_length_for(seqlens, compress_ratio, topk_pad)
            indices = indices.unsqueeze(1)
        else:
            identity = self._identity_rows(num_rows, indices.device)
            indices, topk_length = self.kernels.slot_indices(
                indices, identity, seqlens, compress_ratio, topk_pad
            )
        kv_dtype = torch.float8_e4m3fn if self.backend == "fp8" else torch.bfloat16
        if self.workspace is None:
            self.workspace = SparsePrefillWorkspace(q.device, d_qk)
        kv = self.workspace.get(num_rows + self.extra_rows, kv_dtype, d_qk)
        self.kernels.gather(cache, page_table, page_size, layout, kv_dtype, self.extra_rows, kv)
        kv = kv[:num_rows]
        if self.backend == "fp8":
            return self.kernels.attention_fp8(
                kernel_q, kv, indices, sm_scale, None, self._one(q.device), sink, topk_length, precision
            )
        return self.kernels.attention_bf16(kernel_q, kv, indices, sm_scale, sink, topk_length)

    def forward_merged(
        self,
        q: torch.Tensor,
        parts: Sequence[CacheRows],
        sm_scale: float,
        attn_sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attend each query to the rows of several caches as one softmax (DeepSeek V4: the compressed cache's
        top-k rows and the SWA cache's window): one ``forward`` per part without the sink, with S summed in
        float32 (``LOGITS_IN_FLOAT32``), merged exactly by their lse (``q8kv8.merge.merge_attention``), then
        the sink. Returns what ``forward`` returns; ``last_path`` is the parts' paths joined by "+". Two parts
        that would both take the paged path on caches of one layout, or a V4.1 part on the paged path and a
        V4.1 FP4 part of pages of a power-of-two size, are instead one paged call, the second cache its
        ``extra_cache`` (read in the same launch, one softmax, the layer's precision; ``last_path``
        "paged"). A part's
        weight is off by exp(its lse's absolute error); with the FP8 tensor cores' own sums that was, at
        dominant logits of 20-30, about 2% on the paged path and 5-25% on the workspace path
        (``docs/usage.md``, "Serving path"). Each part keeps its own page table, seqlens, compress ratio and
        path; every part is checked before anything is launched."""
        if len(parts) == 0:
            raise ValueError("parts: expected at least one CacheRows")
        prepared = [self._prepare(q, part, sm_scale, None) for part in parts]
        joined = self._paged_call_of_two(q, prepared, sm_scale, attn_sink)
        if joined is not None:
            return joined
        results, paths = [], []
        for part in prepared:
            results.append(self._forward(q, part, sm_scale, None, lse_used=True))
            paths.append(self.last_path)
        merged = merge_attention(results, attn_sink)
        self.last_path = "+".join(paths)
        return merged

    def info(self) -> dict:
        """What this layer runs: the backend, precision, path setting and the path of its last call (the
        merged call's parts joined by "+"), the "auto" path's rule, and the workspace it holds."""
        return {
            "backend": self.backend,
            "precision": self.precision,
            "path": self.path,
            "last_path": self.last_path,
            "paged_rows_per_tile_slot": PAGED_ROWS_PER_TILE_SLOT,
            "workspace_bytes": 0 if self.workspace is None else self.workspace.capacity_bytes,
        }

    def _choose_path(
        self, s_q: int, h: int, topk_pad: int, num_rows: int, layout: KvCacheLayout, page_size: int
    ) -> str:
        if self.backend != "fp8":
            return "workspace"
        if self.path != "auto":
            return self.path
        if layout not in PAGED_ATTENTION_LAYOUTS or not page_size_read_directly(page_size):
            return "workspace"  # the gather reads these
        tile_slots = s_q * -(-h // 64) * topk_pad
        return "paged" if num_rows > PAGED_ROWS_PER_TILE_SLOT * tile_slots else "workspace"

    def _identity_rows(self, num_rows: int, device) -> torch.Tensor:
        """``arange(num_rows)`` int32 on ``device``, a view of one reused buffer (made again only to grow)."""
        buffer = self._rows.buffer
        if buffer is None or buffer.numel() < num_rows or buffer.device != indexed_device(device):
            self._rows.buffer = torch.arange(max(num_rows, 1), dtype=torch.int32, device=device)
            self._rows.allocations += 1
        return self._rows.buffer[:num_rows]

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
