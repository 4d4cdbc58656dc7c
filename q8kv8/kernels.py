"""The kernel families q8kv8 builds, and their launchers.

Each family is a table of variants built or loaded by ``q8kv8.build.build_or_load`` (compiled for sm_90a
with fake tensors, every extent dynamic) and a launcher that calls a variant's TVM-FFI function on torch
tensors (it launches on the caller's current CUDA stream):

- the FP8 attention kernel (``cute_kernels/sm90/sparse_prefill.py``), variants by ``(d_qk, precision)``,
  one-tile and persistent, all built when ``q8kv8`` is imported; the sink and ``topk_length`` are runtime
  flags. Its variants for a bfloat16 q (quantised per row in the kernel) are built on first use (or by
  ``load_bf16_q_variants()``), and so are its split variants (a short grid: each tile computed by a cluster
  of 2 or 4 CTAs, ``q8kv8.schedule.split_tokens``, which merge their results), and its small-head
  variants (8, 16 or 32 heads: S^T with the heads on the WGMMA's N side, a tile is a token's heads;
  persistent, ``q8kv8.schedule.small_head_tiles_per_cta`` tokens per CTA);
- the paged-cache gather, the query cast and the bf16 attention kernel of the serving path, built on first
  use (or by ``load_serving_variants()``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from q8kv8.build import CacheStats, Variant, build_or_load, compile_for_tvm_ffi, import_dsl, ptxas_report
from q8kv8.metadata import (
    D_V,
    HEAD_ALIGNMENT,
    KV_ROW_ALIGNMENT_BYTES,
    LOG2_E,
    OUT_ALIGNMENT_BYTES,
    PRECISIONS,
    Q_ALIGNMENT_BYTES,
    SINK_FLAG,
    SMALL_HEAD_COUNTS,
    SPLIT_TAIL_FLAG,
    TOPK_LENGTH_FLAG,
    head_groups,
    small_heads,
)
from q8kv8.metadata import SUPPORTED_D_QK as D_QK_VARIANTS
from q8kv8.schedule import (
    ONE_TILE,
    PERSISTENT,
    PERSISTENT_PRECISIONS,
    SPLIT,
    small_head_tiles_per_cta,
    tiles_per_cta,
)

EXPORTED_FUNCTION = "sparse_prefill"


FP8 = torch.float8_e4m3fn
BF16_Q = torch.bfloat16
KERNEL_Q_DTYPES = {FP8: "e4m3", BF16_Q: "bf16"}
"""The FP8 kernel's ``q_dtype`` option for each dtype of q (``q8kv8.metadata.Q_DTYPES``)."""

cache_stats = CacheStats()
_variants: dict[tuple[int, str], Variant] = {}
_persistent_variants: dict[tuple[int, str], Variant] = {}
_bf16_q_variants: dict[tuple[int, str, bool], Variant] = {}  # by (d_qk, precision, persistent)
_split_variants: dict[tuple[int, str, torch.dtype], Variant] = {}  # by (d_qk, precision, q dtype)
# by (d_qk, precision, heads, q dtype)
_small_head_variants: dict[tuple[int, str, int, torch.dtype], Variant] = {}


def variant_name(
    d_qk: int,
    precision: str = "default",
    persistent: bool = False,
    q_dtype: torch.dtype = FP8,
    split: bool = False,
    heads: int = HEAD_ALIGNMENT,
) -> str:
    suffix = "" if precision == "default" else f"_{precision}"
    q_suffix = "_bf16q" if q_dtype == BF16_Q else ""
    schedule_suffix = "_persistent" if persistent else "_split" if split else ""
    heads_suffix = "" if heads == HEAD_ALIGNMENT else f"_h{heads}"
    return f"sparse_prefill_sm90_d{d_qk}{heads_suffix}{q_suffix}{suffix}{schedule_suffix}"


def _kernel(d_qk: int, q_dtype: torch.dtype = FP8, **options):
    """The kernel's configuration object for a q of ``q_dtype`` (``options``: ``SparsePrefillSm90``'s
    ``precision``, ``persistent``, ``split``, ``heads``)."""
    import_dsl()
    from cute_kernels.sm90.sparse_prefill import SparsePrefillSm90

    return SparsePrefillSm90(d_qk, q_dtype=KERNEL_Q_DTYPES[q_dtype], **options)


def _compile(d_qk: int, dump_dir: Path, q_dtype: torch.dtype = FP8, **kernel_options):
    """Trace and compile one variant with fake tensors (dynamic extents); returns the JIT object.

    ``dump_dir`` receives the DSL's own copy of the PTX (``--keep-ptx`` writes one)."""
    cutlass, cute = import_dsl()
    from cutlass import BFloat16, Float8E4M3FN, Int32

    q_type = BFloat16 if q_dtype == BF16_Q else Float8E4M3FN
    args = _fake_attention_args(cute, Float8E4M3FN, d_qk, with_scales=True, q_type=q_type)
    args = (*args[:-1], Int32(1), args[-1])  # schedule_count (tiles per CTA, or parts), before the stream
    return compile_for_tvm_ffi(_kernel(d_qk, q_dtype=q_dtype, **kernel_options), args, dump_dir)


def _fake_attention_args(cute, element_type, d_qk: int, with_scales: bool, q_type=None) -> tuple:
    """The launch arguments of an attention kernel (FP8 or bf16) as fake tensors with dynamic extents:
    q, kv, indices, topk_length, attn_sink, [q_scale, kv_scale,] out, max_logits, lse, the logit scale,
    the flags and the stream. ``q_type``: q's element type when it is not ``element_type`` (kv's)."""
    from cutlass import BFloat16, Float32, Int32

    fake = cute.runtime.make_fake_compact_tensor
    s_q, heads, s_kv, topk = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    row_major = (2, 1, 0)
    kv_stride_elements = 16 * 8 // element_type.width  # kv rows: any 16-byte multiple row stride
    scales = (
        (fake(Float32, (1,), assumed_align=4), fake(Float32, (1,), assumed_align=4)) if with_scales else ()
    )
    return (
        fake(q_type or element_type, (s_q, heads, d_qk), stride_order=row_major, assumed_align=16),  # q
        cute.runtime.make_fake_tensor(  # kv [s_kv, 1, d_qk]
            element_type,
            (s_kv, 1, d_qk),
            stride=(cute.sym_int64(divisibility=kv_stride_elements), cute.sym_int64(), 1),
            assumed_align=16,
        ),
        cute.runtime.make_fake_tensor(  # indices [s_q, 1, topk]: any row stride
            Int32, (s_q, 1, topk), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
        ),
        fake(Int32, (cute.sym_int(),), assumed_align=4),  # topk_length
        fake(Float32, (cute.sym_int(),), assumed_align=4),  # attn_sink
        *scales,  # q_scale, kv_scale (FP8 only)
        fake(BFloat16, (s_q, heads, D_V), stride_order=row_major, assumed_align=4),  # out
        fake(Float32, (s_q, heads), stride_order=(1, 0), assumed_align=4),  # max_logits
        fake(Float32, (s_q, heads), stride_order=(1, 0), assumed_align=4),  # lse
        Float32(1.0),  # sm_scale * log2(e)
        Int32(0),  # flags
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def _build_or_load(d_qk: int, precision: str, q_dtype: torch.dtype = FP8, **options) -> Variant:
    """The attention variant with ``d_qk``, ``precision``, a q of ``q_dtype`` and the kernel ``options``
    (``persistent``, ``split``, ``heads``), built or loaded."""
    return build_or_load(
        variant_name(d_qk, precision, q_dtype=q_dtype, **options),
        d_qk,
        lambda dump_dir: _compile(d_qk, dump_dir, q_dtype=q_dtype, precision=precision, **options),
        EXPORTED_FUNCTION,
        cache_stats,
        precision,
    )


def load_variants() -> dict[tuple[int, str], Variant]:
    """Compile or load every variant, the persistent ones included (idempotent); returns the one-tile
    variants keyed by (d_qk, precision) (``load_persistent_variants`` has the others)."""
    for d_qk in D_QK_VARIANTS:
        for precision in PRECISIONS:
            if (d_qk, precision) not in _variants:
                _variants[d_qk, precision] = _build_or_load(d_qk, precision)
    load_persistent_variants()
    return dict(_variants)


def load_persistent_variants() -> dict[tuple[int, str], Variant]:
    """The persistent variants (``PERSISTENT_PRECISIONS`` only), built or loaded; keyed by
    (d_qk, precision)."""
    for d_qk in D_QK_VARIANTS:
        for precision in PERSISTENT_PRECISIONS:
            if (d_qk, precision) not in _persistent_variants:
                _persistent_variants[d_qk, precision] = _build_or_load(d_qk, precision, persistent=True)
    return dict(_persistent_variants)


def all_variants() -> list[Variant]:
    """Every attention variant for an e4m3 q, one-tile and persistent (those built at import)."""
    load_variants()
    return [*_variants.values(), *_persistent_variants.values()]


def load_bf16_q_variant(d_qk: int, precision: str = "default", persistent: bool = False) -> Variant:
    """Build or load the attention variant for a bfloat16 q (quantised per row in the kernel) with
    ``d_qk``, ``precision`` and the schedule (idempotent)."""
    key = (d_qk, precision, bool(persistent))
    if key not in _bf16_q_variants:
        if d_qk not in D_QK_VARIANTS or precision not in PRECISIONS:
            raise ValueError(
                f"expected d_qk in {D_QK_VARIANTS} and precision in {PRECISIONS}, got {d_qk}, {precision!r}"
            )
        if persistent and precision not in PERSISTENT_PRECISIONS:
            raise ValueError(f"precision: no persistent variant for {precision!r}")
        _bf16_q_variants[key] = _build_or_load(d_qk, precision, BF16_Q, persistent=persistent)
    return _bf16_q_variants[key]


def load_bf16_q_variants() -> dict[tuple[int, str, bool], Variant]:
    """Build or load every attention variant for a bfloat16 q, one-tile and persistent; keyed by
    (d_qk, precision, persistent)."""
    for d_qk in D_QK_VARIANTS:
        for precision in PRECISIONS:
            load_bf16_q_variant(d_qk, precision)
        for precision in PERSISTENT_PRECISIONS:
            load_bf16_q_variant(d_qk, precision, persistent=True)
    return dict(_bf16_q_variants)


def load_small_head_variant(
    d_qk: int, precision: str = "default", heads: int = 16, q_dtype: torch.dtype = FP8
) -> Variant:
    """Build or load the small-head attention variant (a tile is all ``heads`` heads of a token; persistent:
    a CTA walks ``tiles_per_cta`` tiles, one or more) for ``d_qk``, ``precision`` and a q of ``q_dtype``
    (idempotent)."""
    key = (d_qk, precision, heads, q_dtype)
    if key not in _small_head_variants:
        if (
            d_qk not in D_QK_VARIANTS
            or precision not in PRECISIONS
            or heads not in SMALL_HEAD_COUNTS
            or q_dtype not in KERNEL_Q_DTYPES
        ):
            raise ValueError(
                f"expected d_qk in {D_QK_VARIANTS}, precision in {PRECISIONS}, heads in {SMALL_HEAD_COUNTS} "
                f"and q dtype in {list(KERNEL_Q_DTYPES)}, got {d_qk}, {precision!r}, {heads}, {q_dtype}"
            )
        _small_head_variants[key] = _build_or_load(d_qk, precision, q_dtype, heads=heads, persistent=True)
    return _small_head_variants[key]


def load_small_head_variants() -> dict[tuple[int, str, int, torch.dtype], Variant]:
    """Build or load every small-head variant; keyed by (d_qk, precision, heads, q dtype)."""
    for q_dtype in KERNEL_Q_DTYPES:
        for d_qk in D_QK_VARIANTS:
            for precision in PRECISIONS:
                for heads in SMALL_HEAD_COUNTS:
                    load_small_head_variant(d_qk, precision, heads, q_dtype)
    return dict(_small_head_variants)


def load_split_variant(d_qk: int, precision: str = "default", q_dtype: torch.dtype = FP8) -> Variant:
    """Build or load the split attention variant (a tile's ranges of index slots computed by the CTAs of a
    cluster, which merge their results) for ``d_qk``, ``precision`` and a q of ``q_dtype`` (idempotent)."""
    key = (d_qk, precision, q_dtype)
    if key not in _split_variants:
        if d_qk not in D_QK_VARIANTS or precision not in PRECISIONS or q_dtype not in KERNEL_Q_DTYPES:
            raise ValueError(
                f"expected d_qk in {D_QK_VARIANTS}, precision in {PRECISIONS} and q dtype in "
                f"{list(KERNEL_Q_DTYPES)}, got {d_qk}, {precision!r}, {q_dtype}"
            )
        _split_variants[key] = _build_or_load(d_qk, precision, q_dtype, split=True)
    return _split_variants[key]


def load_split_variants() -> dict[tuple[int, str, torch.dtype], Variant]:
    """Build or load every split attention variant; keyed by (d_qk, precision, q dtype)."""
    for d_qk in D_QK_VARIANTS:
        for precision in PRECISIONS:
            for q_dtype in KERNEL_Q_DTYPES:
                load_split_variant(d_qk, precision, q_dtype)
    return dict(_split_variants)


def listed_variants() -> list[Variant]:
    """Every attention variant, as the listings show them (``python -m q8kv8.compile``, ``q8kv8.info()``,
    ``make bench``): ``all_variants()``, then the bfloat16-q variants, the split variants and the small-head
    variants (built or loaded)."""
    return [
        *all_variants(),
        *load_bf16_q_variants().values(),
        *load_split_variants().values(),
        *load_small_head_variants().values(),
    ]


def variant_loaders() -> list[functools.partial]:
    """One zero-argument loader per variant that ``listed_variants`` lists (each builds or loads it and
    returns it), picklable, so that several processes can build them (``python -m q8kv8.compile --jobs``)."""
    partial = functools.partial
    loaders = []
    for d_qk in D_QK_VARIANTS:
        loaders += [partial(_build_or_load, d_qk, p) for p in PRECISIONS]
        loaders += [partial(_build_or_load, d_qk, p, persistent=True) for p in PERSISTENT_PRECISIONS]
        loaders += [partial(load_bf16_q_variant, d_qk, p) for p in PRECISIONS]
        loaders += [partial(load_bf16_q_variant, d_qk, p, True) for p in PERSISTENT_PRECISIONS]
        for precision in PRECISIONS:
            for q_dtype in KERNEL_Q_DTYPES:
                loaders.append(partial(load_split_variant, d_qk, precision, q_dtype))
                for heads in SMALL_HEAD_COUNTS:
                    loaders.append(partial(load_small_head_variant, d_qk, precision, heads, q_dtype))
    return loaders


def q_dtype_of(variant: Variant) -> torch.dtype:
    """The dtype of q that an attention variant takes."""
    if any(variant is v for v in _bf16_q_variants.values()):
        return BF16_Q
    keyed = [(key[2], v) for key, v in _split_variants.items()]
    keyed += [(key[3], v) for key, v in _small_head_variants.items()]
    return next((q_dtype for q_dtype, v in keyed if v is variant), FP8)


def describe(variant: Variant) -> dict:
    """One attention variant as the listings show it (``python -m q8kv8.compile``, ``q8kv8.info()``,
    ``make bench``): name, d_qk, precision, q's dtype, where it came from and in how many seconds, registers
    and spill bytes from ``ptxas -v`` (None without ptxas), shared memory per CTA, object file."""
    report = ptxas_report(variant)
    q_dtype = q_dtype_of(variant)
    return {
        "name": variant.name,
        "d_qk": variant.d_qk,
        "precision": variant.precision,
        "q_dtype": KERNEL_Q_DTYPES[q_dtype],
        "source": variant.source,
        "seconds": variant.seconds,
        "registers": None if report is None else report.registers,
        "spill_bytes": None if report is None else report.spill_store_bytes + report.spill_load_bytes,
        "shared_memory_bytes": shared_memory_bytes(variant.d_qk, variant.precision, q_dtype),
        "object": str(variant.object_path),
    }


def shared_memory_bytes(d_qk: int, precision: str = "default", q_dtype: torch.dtype = FP8) -> int:
    """Dynamic shared memory per CTA of the (d_qk, precision) variant for a q of ``q_dtype``."""
    return _kernel(d_qk, q_dtype, precision=precision).shared_memory_bytes()


def placeholders(int_source: torch.Tensor, float_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(no_topk_length, no_sink)``: what a launch passes for an absent topk_length / attn_sink (the
    kernel's flags say absent, so neither is read). Views of the call's own one-element float32 tensors
    (``int_source``'s bytes as int32, ``float_source`` itself): nothing is allocated, and nothing is kept
    between calls, so a launch recorded in a CUDA graph (``torch.compile(mode="reduce-overhead")``'s
    memory pool included) leaves no allocation of its own behind."""
    return int_source.view(torch.int32), float_source


_gpu_count: int | None = None  # visible GPUs, counted on the first launch


def _call_on_device_of(tensor: torch.Tensor, function, *args) -> None:
    """``function(*args)`` with ``tensor``'s GPU current (kernels launch on the current device). With one
    visible GPU the current device is not even queried: no host time on the common path."""
    global _gpu_count
    if _gpu_count is None:
        _gpu_count = torch.cuda.device_count()
    if _gpu_count > 1 and tensor.get_device() != torch.cuda.current_device():
        with torch.cuda.device(tensor.get_device()):
            function(*args)
    else:
        function(*args)


def launch_sparse_prefill(
    q,
    kv,
    indices,
    topk_length,
    attn_sink,
    q_scale,
    kv_scale,
    sm_scale,
    out,
    max_logits,
    lse,
    precision,
    schedule: int | None = None,
    ready: bool = False,
    splits: int = 1,
    split_from: int = 0,
) -> tuple[tuple[int, Variant], ...]:
    """Launch the kernel on validated tensors: q (e4m3 or bfloat16), out, max_logits, lse row-major with a
    head count (one of ``SMALL_HEAD_COUNTS``: the small-head variant, a persistent kernel; any other: tiles of
    64 heads, a token's last one partly filled); kv and indices with a contiguous last dimension; one-element
    scales, ``q_scale`` None for a bfloat16 q (the variant for a bfloat16 q is then built on its first
    launch). ``schedule``: ``tiles_per_cta``'s (small heads: ``small_head_tiles_per_cta``'s) answer when the
    caller has it (the contract memoises it), else computed here. ``ready``: the caller knows that q, kv and
    out meet the alignments of ``q8kv8.metadata`` (``contract.Problem.launch_ready``), so they are not checked
    again (else misaligned tensors are copied to aligned ones). ``splits`` > 1 and ``split_from``
    (``q8kv8.schedule.split_tokens``'s answer; only with the one-tile schedule): the split variant computes
    each tile of the tokens from ``split_from`` on with a cluster of ``splits`` CTAs, one per range of index
    slots, which merge their results; the tokens before it, if any, run one tile per CTA in a launch before.
    Returns the launches' ``(schedule kind, variant)``, in order."""
    tiles = schedule
    small = small_heads(q.shape[1])
    if small:
        splits = 1
    if tiles is None and small:
        tiles = small_head_tiles_per_cta(q.shape[0], q.get_device())
    elif tiles is None:
        tiles = tiles_per_cta(
            q.shape[0] * head_groups(q.shape[1]),
            indices.shape[2],
            topk_length is not None,
            precision,
            q.get_device(),
        )
    key = (q.shape[2], precision)
    if small:
        small_key = (*key, q.shape[1], q.dtype)
        launches = [(PERSISTENT, _small_head_variants.get(small_key) or load_small_head_variant(*small_key))]
    elif tiles:
        launches = [(PERSISTENT, _one_tile_or_persistent_variant(key, q.dtype, True))]
    else:
        launches = []
        if splits == 1 or split_from > 0:
            launches.append((ONE_TILE, _one_tile_or_persistent_variant(key, q.dtype, False)))
        if splits > 1:
            launches.append(
                (SPLIT, _split_variants.get((*key, q.dtype)) or load_split_variant(*key, q.dtype))
            )
    kernel_out = out
    if not ready:
        if q.data_ptr() % Q_ALIGNMENT_BYTES:  # the Q tile is loaded by TMA
            q = q.clone()
        # kv rows are gathered with 16-byte copies
        if kv.data_ptr() % KV_ROW_ALIGNMENT_BYTES or kv.stride()[0] % KV_ROW_ALIGNMENT_BYTES:
            kv = kv.clone(memory_format=torch.contiguous_format)
        if out.data_ptr() % OUT_ALIGNMENT_BYTES:
            kernel_out = torch.empty_like(out)
    kv_scale = kv_scale if kv_scale.dim() == 1 else kv_scale.reshape(1)
    # A bfloat16 q has no q_scale: the kernel does not read that argument, which gets kv_scale.
    q_scale = kv_scale if q_scale is None else q_scale if q_scale.dim() == 1 else q_scale.reshape(1)
    no_topk_length, no_sink = placeholders(q_scale, kv_scale)
    sink = no_sink if attn_sink is None else attn_sink
    flags = (TOPK_LENGTH_FLAG if topk_length is not None else 0) | (SINK_FLAG if attn_sink is not None else 0)
    if len(launches) > 1:
        flags |= SPLIT_TAIL_FLAG  # the two launches overlap
    # A split tail: the one-tile launch on the tokens before split_from, the split launch on the others.
    tokens = [None] if len(launches) == 1 else [slice(None, split_from), slice(split_from, None)]
    for (kind, variant), rows in zip(launches, tokens, strict=True):
        _call_on_device_of(
            q,
            variant.function,
            _rows(q, rows),
            kv,
            _rows(indices, rows),
            no_topk_length if topk_length is None else _rows(topk_length, rows),
            sink,
            q_scale,
            kv_scale,
            _rows(kernel_out, rows),
            _rows(max_logits, rows),
            _rows(lse, rows),
            sm_scale * LOG2_E,
            flags,
            splits if kind == SPLIT else tiles or 1,  # schedule_count
        )
    if kernel_out is not out:
        out.copy_(kernel_out)
    return tuple(launches)


def _rows(tensor: torch.Tensor, tokens: slice | None) -> torch.Tensor:
    """``tensor``'s rows of ``tokens`` (a view), or ``tensor`` itself for None."""
    return tensor if tokens is None else tensor[tokens]


def _one_tile_or_persistent_variant(key: tuple[int, str], q_dtype: torch.dtype, persistent: bool) -> Variant:
    """The one-tile or persistent attention variant of ``key`` (d_qk, precision) for a q of ``q_dtype``."""
    if q_dtype == BF16_Q:
        bf16_q_key = (*key, persistent)
        return _bf16_q_variants.get(bf16_q_key) or load_bf16_q_variant(*bf16_q_key)
    if persistent:
        return _persistent_variants.get(key) or load_persistent_variants()[key]
    return _variants.get(key) or load_variants()[key]


# ------------------------------------------------------------------------------------------------
# Paged KV gather (cute_kernels/sm90/paged_kv.py): paged FP8 cache -> contiguous e4m3 or bf16 rows.
# Four variants (layout x output dtype), each built on first use (lazily, not at import) and
# cached on disk next to the attention variants (same key, lock and integrity check).
# ------------------------------------------------------------------------------------------------
PAGED_KV_LAYOUTS = ("model1", "v32")
PAGED_KV_FUNCTION = "paged_kv_gather"
paged_kv_cache_stats = CacheStats()
_paged_kv_variants: dict[tuple[str, bool], Variant] = {}


def paged_kv_variant_name(layout: str, out_bf16: bool) -> str:
    return f"paged_kv_gather_sm90_{layout}_{'bf16' if out_bf16 else 'e4m3'}"


def _compile_paged_kv(layout: str, out_bf16: bool, dump_dir: Path):
    """Trace and compile one gather variant with fake tensors (every extent and stride dynamic)."""
    cutlass, cute = import_dsl()
    from cutlass import BFloat16, Float8E4M3FN, Int32, Uint8

    from cute_kernels.sm90.paged_kv import PagedKvGatherSm90

    kernel = PagedKvGatherSm90(layout, out_bf16)
    args = (
        cute.runtime.make_fake_tensor(  # cache [num_pages, page_bytes], page stride a multiple of 16
            Uint8,
            (cute.sym_int(), cute.sym_int()),
            stride=(cute.sym_int64(divisibility=16), 1),
            assumed_align=16,
        ),
        cute.runtime.make_fake_tensor(  # slots [num_tokens, 1 or 2 words]
            Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
        ),
        cute.runtime.make_fake_compact_tensor(  # out [rows, 1, d_qk], row-major
            BFloat16 if out_bf16 else Float8E4M3FN,
            (cute.sym_int(), 1, kernel.d_qk),
            stride_order=(2, 1, 0),
            assumed_align=16,
        ),
        Int32(1),  # page_size
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return compile_for_tvm_ffi(kernel, args, dump_dir)


def load_paged_kv_variant(layout: str, out_bf16: bool) -> Variant:
    """Build or load one gather variant (idempotent)."""
    key = (layout, bool(out_bf16))
    if key not in _paged_kv_variants:
        if layout not in PAGED_KV_LAYOUTS:
            raise ValueError(f"layout: expected one of {PAGED_KV_LAYOUTS}, got {layout!r}")
        d_qk = {"model1": 512, "v32": 576}[layout]
        _paged_kv_variants[key] = build_or_load(
            paged_kv_variant_name(layout, out_bf16),
            d_qk,
            lambda dump_dir: _compile_paged_kv(layout, out_bf16, dump_dir),
            PAGED_KV_FUNCTION,
            paged_kv_cache_stats,
        )
    return _paged_kv_variants[key]


def load_paged_kv_variants() -> dict[tuple[str, bool], Variant]:
    """Build or load all four gather variants, keyed by (layout, out_bf16)."""
    for layout in PAGED_KV_LAYOUTS:
        for out_bf16 in (False, True):
            load_paged_kv_variant(layout, out_bf16)
    return dict(_paged_kv_variants)


def launch_paged_kv_gather(cache_pages, slot_words, out, page_size: int, layout: str) -> None:
    """Launch the gather on validated tensors: ``cache_pages`` [num_pages, page_bytes] uint8 (base and
    page stride 16-byte aligned), ``slot_words`` [num_tokens, 1 or 2] int32 (last dim contiguous),
    ``out`` [rows, 1, d_qk] e4m3 or bf16, contiguous and 16-byte aligned, rows > 0."""
    out_bf16 = out.dtype == torch.bfloat16
    variant = _paged_kv_variants.get((layout, out_bf16)) or load_paged_kv_variant(layout, out_bf16)
    _call_on_device_of(out, variant.function, cache_pages, slot_words, out, page_size)


# Query cast (cute_kernels/sm90/q_cast.py): bf16 Q -> e4m3 in a head-padded buffer. Variants by head dim,
# built on first use and disk-cached like the gather.
Q_CAST_FUNCTION = "cast_q_fp8"
_q_cast_variants: dict[int, Variant] = {}


def q_cast_variant_name(d: int) -> str:
    return f"cast_q_fp8_sm90_d{d}"


def _compile_q_cast(d: int, dump_dir: Path):
    cutlass, cute = import_dsl()
    from cutlass import BFloat16, Float8E4M3FN, Float32

    from cute_kernels.sm90.q_cast import CastQFp8Sm90

    args = (
        cute.runtime.make_fake_tensor(  # q [s_q, h, d]: row strides multiples of 8 elements (16 bytes)
            BFloat16,
            (cute.sym_int(), cute.sym_int(), d),
            stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
            assumed_align=16,
        ),
        cute.runtime.make_fake_compact_tensor(Float32, (1,), assumed_align=4),  # q_scale
        cute.runtime.make_fake_compact_tensor(  # out [s_q, h_pad, d], row-major
            Float8E4M3FN, (cute.sym_int(), cute.sym_int(), d), stride_order=(2, 1, 0), assumed_align=16
        ),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return compile_for_tvm_ffi(CastQFp8Sm90(d), args, dump_dir)


def load_q_cast_variant(d: int) -> Variant:
    """Build or load the query-cast kernel for head dim ``d`` (idempotent)."""
    if d not in _q_cast_variants:
        _q_cast_variants[d] = build_or_load(
            q_cast_variant_name(d),
            d,
            lambda dump_dir: _compile_q_cast(d, dump_dir),
            Q_CAST_FUNCTION,
            paged_kv_cache_stats,
        )
    return _q_cast_variants[d]


def launch_cast_q_fp8(q, q_scale, out) -> None:
    """Launch the query cast on validated tensors: ``q`` [s_q, h, d] bf16 (16-byte aligned, row strides
    multiples of 8 elements, last dim contiguous), ``q_scale`` [1] float32, ``out`` [s_q, h_pad, d] e4m3
    contiguous, 16-byte aligned, h_pad a multiple of 8 and >= h, s_q > 0."""
    variant = _q_cast_variants.get(q.shape[2]) or load_q_cast_variant(q.shape[2])
    _call_on_device_of(out, variant.function, q, q_scale, out)


def load_serving_variants() -> dict[str, Variant]:
    """Build or load every kernel of the paged serving path (the four gathers, both query casts, the FP8
    attention variants for a bfloat16 q, the small-head ones included, and both bf16 attention variants)."""
    variants = {v.name: v for v in load_paged_kv_variants().values()}
    for d in (512, 576):
        variant = load_q_cast_variant(d)
        variants[variant.name] = variant
    variants.update({v.name: v for v in load_bf16_q_variants().values()})
    for d_qk in D_QK_VARIANTS:
        for precision in PRECISIONS:
            for heads in SMALL_HEAD_COUNTS:
                variant = load_small_head_variant(d_qk, precision, heads, BF16_Q)
                variants[variant.name] = variant
    variants.update({v.name: v for v in load_bf16_variants().values()})
    return variants


# ------------------------------------------------------------------------------------------------
# BF16 attention (cute_kernels/sm90/sparse_prefill_bf16.py): the bf16 instantiation of the sparse
# prefill kernel, variants by d_qk (512, 576), built on first use (or by load_bf16_variants()) and
# disk-cached next to the FP8 variants (same key, lock and integrity check).
# ------------------------------------------------------------------------------------------------
BF16_FUNCTION = "sparse_prefill_bf16"
bf16_cache_stats = CacheStats()
_bf16_variants: dict[int, Variant] = {}


def bf16_variant_name(d_qk: int) -> str:
    return f"sparse_prefill_bf16_sm90_d{d_qk}"


def _compile_bf16(d_qk: int, dump_dir: Path):
    """Trace and compile one bf16 attention variant with fake tensors (dynamic extents)."""
    cutlass, cute = import_dsl()
    from cutlass import BFloat16

    from cute_kernels.sm90.sparse_prefill_bf16 import SparsePrefillBf16Sm90

    return compile_for_tvm_ffi(
        SparsePrefillBf16Sm90(d_qk), _fake_attention_args(cute, BFloat16, d_qk, with_scales=False), dump_dir
    )


def load_bf16_variant(d_qk: int) -> Variant:
    """Build or load the bf16 attention kernel for ``d_qk`` (idempotent)."""
    if d_qk not in _bf16_variants:
        if d_qk not in D_QK_VARIANTS:
            raise ValueError(f"d_qk: expected one of {D_QK_VARIANTS}, got {d_qk}")
        _bf16_variants[d_qk] = build_or_load(
            bf16_variant_name(d_qk),
            d_qk,
            lambda dump_dir: _compile_bf16(d_qk, dump_dir),
            BF16_FUNCTION,
            bf16_cache_stats,
        )
    return _bf16_variants[d_qk]


def load_bf16_variants() -> dict[int, Variant]:
    """Build or load both bf16 attention variants, keyed by d_qk."""
    for d_qk in D_QK_VARIANTS:
        load_bf16_variant(d_qk)
    return dict(_bf16_variants)


def bf16_shared_memory_bytes(d_qk: int) -> int:
    """Dynamic shared memory per CTA of the bf16 variant for ``d_qk``."""
    import_dsl()
    from cute_kernels.sm90.sparse_prefill_bf16 import SparsePrefillBf16Sm90

    return SparsePrefillBf16Sm90(d_qk).shared_memory_bytes()


def launch_sparse_prefill_bf16(
    q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse
) -> None:
    """Launch the bf16 kernel on validated tensors (the hook ``serving._cuda_attention_bf16`` calls):
    q [s_q, h, d_qk] bf16 row-major (any h), kv [s_kv, 1, d_qk] bf16 (last dim
    contiguous), indices [s_q, 1, topk] int32 (last dim contiguous, topk a multiple of 128),
    topk_length [s_q] int32 or None, attn_sink [h] float32 or None, out [s_q, h, 512] bf16, max_logits
    and lse [s_q, h] float32, all row-major. Launches on the current stream; no host sync."""
    variant = _bf16_variants.get(q.shape[2]) or load_bf16_variant(q.shape[2])
    if q.data_ptr() % 16 or not q.is_contiguous():  # the Q tile is loaded by TMA
        q = q.contiguous() if not q.is_contiguous() else q.clone()
    if kv.data_ptr() % 16 or kv.stride(0) % 8 or kv.stride(2) != 1:  # rows gathered in 16-byte copies
        kv = kv.clone(memory_format=torch.contiguous_format)
    kernel_out = out if out.data_ptr() % 4 == 0 else torch.empty_like(out)
    first_max_logit = max_logits.view(-1)[:1]  # s_q > 0: one element
    no_topk_length, no_sink = placeholders(first_max_logit, first_max_logit)
    _call_on_device_of(
        q,
        variant.function,
        q,
        kv,
        indices,
        no_topk_length if topk_length is None else topk_length,
        no_sink if attn_sink is None else attn_sink,
        kernel_out,
        max_logits,
        lse,
        sm_scale * LOG2_E,
        (TOPK_LENGTH_FLAG if topk_length is not None else 0) | (SINK_FLAG if attn_sink is not None else 0),
    )
    if kernel_out is not out:
        out.copy_(kernel_out)
