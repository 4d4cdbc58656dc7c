"""The kernels q8kv8 builds: one table of variants, one loader, and the launchers.

Every variant of every kernel family has a key, and ``load(key)`` builds it for sm_90a (fake tensors, every
extent dynamic) or loads it from the disk cache (``q8kv8.build.build_or_load``), once per process:

- ``VariantKey``: the FP8 attention kernel (``cute_kernels/sm90/sparse_prefill.py``) by d_qk, precision,
  schedule kind, q's dtype, heads a tile and paged cache layout. The one-tile and persistent variants for an
  e4m3 q in the default and accurate precisions (``IMPORT_KEYS``) are loaded when ``q8kv8`` is imported,
  every other one on its first launch (a call with a sink runs "default" as "accurate_logits"); the sink and
  ``topk_length`` are runtime flags;
- the serving path's kernels (``SERVING_KEYS``, built on first use or by ``load_serving_variants()``):
  ``PagedGatherKey`` (the paged-cache gather, ``paged_kv.py``), ``QCastKey`` (the query cast,
  ``q_cast.py``), ``SlotIndicesKey`` (top-k rows to token slots, ``paged_indices.py``), ``MergeKey`` (two
  attentions merged into one softmax, ``attention_merge.py``) and ``Bf16AttentionKey`` (the bf16 attention
  kernel, ``sparse_prefill_bf16.py``).

A key names its variant (``name``, the cache entry's), says whether the family has it (``check``), gives the
kernel's configuration object (``kernel``) and compiles it (``compile``). ``LISTED_KEYS`` is every variant
(``python -m q8kv8.compile`` builds them, ``q8kv8.info()`` lists them). Each launcher calls a variant's
TVM-FFI function on torch tensors, on the caller's current CUDA stream.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from q8kv8.build import CacheStats, Variant, build_or_load, compile_for_tvm_ffi, import_dsl, ptxas_report
from q8kv8.kv_layout import LAYOUTS, PAGED_ATTENTION_LAYOUTS, RECORDS_FROM
from q8kv8.metadata import (
    D_V,
    HEAD_ALIGNMENT,
    KV_ROW_ALIGNMENT_BYTES,
    LOG2_E,
    LOGITS_IN_FLOAT32,
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
    SPLIT,
    small_head_tiles_per_cta,
    tiles_per_cta,
)

FP8 = torch.float8_e4m3fn
BF16_Q = torch.bfloat16
KERNEL_Q_DTYPES = {FP8: "e4m3", BF16_Q: "bf16"}
"""The FP8 kernel's ``q_dtype`` option for each dtype of q (``q8kv8.metadata.Q_DTYPES``)."""
CACHE_LAYOUTS = {layout.name: layout.d_qk for layout in PAGED_ATTENTION_LAYOUTS}
"""The paged cache layouts the attention kernel reads (``q8kv8.kv_layout``), with their d_qk; the gather
(``PagedGatherKey``) reads every one of ``LAYOUTS``."""
SCHEDULE_SUFFIXES = {ONE_TILE: "", PERSISTENT: "_persistent", SPLIT: "_split"}
GATHER_DTYPES = {FP8: "e4m3", torch.bfloat16: "bf16", torch.uint8: "v41"}
"""The gather's output dtypes, as its variant names spell them: e4m3 or bf16 rows, or (uint8, from a V4.1 FP4
cache only) records of V4.1's layout."""

cache_stats = CacheStats()
"""This process's disk-cache hits and misses, every family together."""


class VariantKey(NamedTuple):
    """One variant of the FP8 attention kernel (``cute_kernels/sm90/sparse_prefill.py``)."""

    d_qk: int
    precision: str = "default"
    schedule: int = ONE_TILE  # ``q8kv8.schedule``'s kind: ONE_TILE, PERSISTENT or SPLIT
    q_dtype: torch.dtype = FP8
    heads: int = HEAD_ALIGNMENT  # 64 heads a tile, or one of SMALL_HEAD_COUNTS (persistent)
    cache: str | None = None  # a paged cache layout of CACHE_LAYOUTS, else None: kv rows in e4m3

    exported = "sparse_prefill"  # the TVM-FFI function's name in the object file

    @property
    def name(self) -> str:
        """The variant's name (its cache entry's): ``sparse_prefill_sm90_d{d_qk}`` and what sets it apart."""
        heads = "" if self.heads == HEAD_ALIGNMENT else f"_h{self.heads}"
        cache = "" if self.cache is None else f"_paged_{self.cache}"
        q = "_bf16q" if self.q_dtype == BF16_Q else ""
        precision = "" if self.precision == "default" else f"_{self.precision}"
        return (
            f"sparse_prefill_sm90_d{self.d_qk}{heads}{cache}{q}{precision}{SCHEDULE_SUFFIXES[self.schedule]}"
        )

    def check(self) -> None:
        """Raise ValueError unless the kernel has this variant."""
        small = self.heads != HEAD_ALIGNMENT
        if (
            self.d_qk not in D_QK_VARIANTS
            or self.precision not in PRECISIONS
            or self.schedule not in SCHEDULE_SUFFIXES
            or self.q_dtype not in KERNEL_Q_DTYPES
            or (small and (self.heads not in SMALL_HEAD_COUNTS or self.schedule != PERSISTENT))
            or (self.cache is not None and CACHE_LAYOUTS.get(self.cache) != self.d_qk)
        ):
            raise ValueError(f"no attention kernel variant {self}")

    def kernel(self):
        """The kernel's configuration object."""
        import_dsl()
        from cute_kernels.sm90.sparse_prefill import SparsePrefillSm90

        return SparsePrefillSm90(
            self.d_qk,
            precision=self.precision,
            persistent=self.schedule == PERSISTENT,
            q_dtype=KERNEL_Q_DTYPES[self.q_dtype],
            split=self.schedule == SPLIT,
            heads=self.heads,
            cache=self.cache,
        )

    def compile(self, dump_dir: Path):
        """Trace and compile the variant with fake tensors (dynamic extents); returns the JIT object.
        ``dump_dir`` receives the DSL's own copy of the PTX (``--keep-ptx`` writes one)."""
        cutlass, cute = import_dsl()
        from cutlass import BFloat16, Float8E4M3FN, Int32, Uint8

        q_type = BFloat16 if self.q_dtype == BF16_Q else Float8E4M3FN
        args = _fake_attention_args(cute, Float8E4M3FN, self.d_qk, with_scales=True, q_type=q_type)
        extra = args[1]  # a row-major kv: kv again, in the extra cache's place
        if self.cache is not None:
            # kv and the extra cache: each [num_pages, page_size, bytes per token], page stride dynamic
            kv, extra = (
                cute.runtime.make_fake_tensor(
                    Uint8,
                    (cute.sym_int(), cute.sym_int(), LAYOUTS[self.cache].bytes_per_token),
                    stride=(cute.sym_int64(divisibility=16), cute.sym_int64(), 1),
                    assumed_align=16,
                )
                for _ in range(2)
            )
            args = (args[0], kv, *args[2:])
        lse = _LAUNCH_TENSORS.index("lse")
        # the extra cache after lse; schedule_count (tiles per CTA, or parts) and extra_from before the stream
        args = (*args[: lse + 1], extra, *args[lse + 1 : -1], Int32(1), Int32(0), args[-1])
        return compile_for_tvm_ffi(self.kernel(), args, dump_dir)


class _FamilyDefaults:
    """What the keys of the serving path's kernel families share unless they say otherwise: the default
    precision, no q dtype (a kernel without q), no cache layout, every key of the family valid."""

    __slots__ = ()
    precision = "default"
    q_dtype = None
    cache = None

    def check(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Bf16AttentionKey(_FamilyDefaults):
    """The bf16 attention kernel (``cute_kernels/sm90/sparse_prefill_bf16.py``) for one d_qk: the serving
    path's bf16 backend."""

    d_qk: int

    exported = "sparse_prefill_bf16"
    q_dtype = BF16_Q

    @property
    def name(self) -> str:
        return f"sparse_prefill_bf16_sm90_d{self.d_qk}"

    def check(self) -> None:
        if self.d_qk not in D_QK_VARIANTS:
            raise ValueError(f"d_qk: expected one of {D_QK_VARIANTS}, got {self.d_qk}")

    def kernel(self):
        import_dsl()
        from cute_kernels.sm90.sparse_prefill_bf16 import SparsePrefillBf16Sm90

        return SparsePrefillBf16Sm90(self.d_qk)

    def compile(self, dump_dir: Path):
        cutlass, cute = import_dsl()
        from cutlass import BFloat16

        args = _fake_attention_args(cute, BFloat16, self.d_qk, with_scales=False)
        return compile_for_tvm_ffi(self.kernel(), args, dump_dir)


@dataclass(frozen=True, slots=True)
class PagedGatherKey(_FamilyDefaults):
    """The paged-cache gather (``cute_kernels/sm90/paged_kv.py``) for one cache layout and output dtype:
    token slots into contiguous e4m3 (scale 1) or bf16 rows, or (uint8) a V4.1 FP4 cache's slots into
    records of V4.1's layout."""

    layout: str
    out_dtype: torch.dtype = FP8

    exported = "paged_kv_gather"

    @property
    def name(self) -> str:
        return f"paged_kv_gather_sm90_{self.layout}_{GATHER_DTYPES[self.out_dtype]}"

    @property
    def d_qk(self) -> int:
        return LAYOUTS[self.layout].d_qk

    @property
    def cache(self) -> str:
        return self.layout

    def check(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {tuple(LAYOUTS)}, got {self.layout!r}")
        if self.out_dtype not in GATHER_DTYPES:
            raise ValueError(f"out_dtype: expected one of {tuple(GATHER_DTYPES)}, got {self.out_dtype}")
        if self.out_dtype == torch.uint8 and self.layout != RECORDS_FROM:
            raise ValueError(f"out_dtype: uint8 (V4.1 records) from a {RECORDS_FROM} cache only")

    def kernel(self):
        import_dsl()
        from cute_kernels.sm90.paged_kv import PagedKvGatherSm90

        return PagedKvGatherSm90(self.layout, GATHER_DTYPES[self.out_dtype])

    def compile(self, dump_dir: Path):
        cutlass, cute = import_dsl()
        from cutlass import BFloat16, Float8E4M3FN, Int32, Uint8

        kernel = self.kernel()
        if self.out_dtype == torch.uint8:  # records [rows, 528], row-major
            out = cute.runtime.make_fake_compact_tensor(
                Uint8, (cute.sym_int(), kernel.out_row_bytes), stride_order=(1, 0), assumed_align=16
            )
        else:  # rows [rows, 1, d_qk], row-major
            out = cute.runtime.make_fake_compact_tensor(
                BFloat16 if self.out_dtype == torch.bfloat16 else Float8E4M3FN,
                (cute.sym_int(), 1, kernel.d_qk),
                stride_order=(2, 1, 0),
                assumed_align=16,
            )
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
            out,
            cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)  # records' rows
            if self.out_dtype == torch.uint8
            else None,
            Int32(1),  # page_size
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return compile_for_tvm_ffi(kernel, args, dump_dir)


@dataclass(frozen=True, slots=True)
class QCastKey(_FamilyDefaults):
    """The query cast (``cute_kernels/sm90/q_cast.py``) for head dim ``d``: bf16 Q to e4m3 in a head-padded
    buffer."""

    d: int

    exported = "cast_q_fp8"
    q_dtype = BF16_Q

    @property
    def name(self) -> str:
        return f"cast_q_fp8_sm90_d{self.d}"

    @property
    def d_qk(self) -> int:
        return self.d

    def check(self) -> None:
        if self.d not in D_QK_VARIANTS:
            raise ValueError(f"d: expected one of {D_QK_VARIANTS}, got {self.d}")

    def kernel(self):
        import_dsl()
        from cute_kernels.sm90.q_cast import CastQFp8Sm90

        return CastQFp8Sm90(self.d)

    def compile(self, dump_dir: Path):
        cutlass, cute = import_dsl()
        from cutlass import BFloat16, Float8E4M3FN, Float32

        args = (
            cute.runtime.make_fake_tensor(  # q [s_q, h, d]: row strides multiples of 8 elements (16 bytes)
                BFloat16,
                (cute.sym_int(), cute.sym_int(), self.d),
                stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
                assumed_align=16,
            ),
            cute.runtime.make_fake_compact_tensor(Float32, (1,), assumed_align=4),  # q_scale
            cute.runtime.make_fake_compact_tensor(  # out [s_q, h_pad, d], row-major
                Float8E4M3FN,
                (cute.sym_int(), cute.sym_int(), self.d),
                stride_order=(2, 1, 0),
                assumed_align=16,
            ),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return compile_for_tvm_ffi(self.kernel(), args, dump_dir)


@dataclass(frozen=True, slots=True)
class SlotIndicesKey(_FamilyDefaults):
    """The slot-index kernel (``cute_kernels/sm90/paged_indices.py``): a serving layer's top-k rows to
    token slots through its page table, and each query's valid count. One variant."""

    exported = "paged_indices"
    d_qk = 0

    @property
    def name(self) -> str:
        return "paged_indices_sm90"

    def kernel(self):
        import_dsl()
        from cute_kernels.sm90.paged_indices import PagedIndicesSm90

        return PagedIndicesSm90()

    def compile(self, dump_dir: Path):
        cutlass, cute = import_dsl()
        from cutlass import Int32

        def words(rows):  # [rows, 1 or 2] int32: an int32 tensor, or an int64 one's (lo, hi) words
            return cute.runtime.make_fake_tensor(
                Int32, (rows, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
            )

        s_q = cute.sym_int()
        args = (
            cute.runtime.make_fake_tensor(  # indices [s_q, topk], any row stride
                Int32, (s_q, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4
            ),
            words(cute.sym_int()),  # page table
            words(s_q),  # seqlens
            cute.runtime.make_fake_compact_tensor(  # slots [s_q, 1, topk_pad]
                Int32, (s_q, 1, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=4
            ),
            cute.runtime.make_fake_compact_tensor(Int32, (s_q,), assumed_align=4),  # topk_length
            Int32(0),  # compress ratio
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return compile_for_tvm_ffi(self.kernel(), args, dump_dir)


@dataclass(frozen=True, slots=True)
class MergeKey(_FamilyDefaults):
    """The merge of two attentions into one softmax (``cute_kernels/sm90/attention_merge.py``): an extra
    cache's part beside the main one, a serving layer's merged parts. One variant."""

    exported = "attention_merge"
    d_qk = 0

    @property
    def name(self) -> str:
        return "attention_merge_sm90"

    def kernel(self):
        import_dsl()
        from cute_kernels.sm90.attention_merge import AttentionMergeSm90

        return AttentionMergeSm90()

    def compile(self, dump_dir: Path):
        cutlass, cute = import_dsl()
        from cutlass import BFloat16, Float32, Int32

        rows = cute.sym_int()

        def out_rows():  # [rows, D_V] bf16, row-major
            return cute.runtime.make_fake_compact_tensor(
                BFloat16, (rows, D_V), stride_order=(1, 0), assumed_align=16
            )

        def stats():  # [rows] f32
            return cute.runtime.make_fake_compact_tensor(Float32, (rows,), assumed_align=4)

        args = (
            out_rows(), stats(), stats(),  # part 0
            out_rows(), stats(), stats(),  # part 1
            cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4),  # attn_sink
            out_rows(), stats(), stats(),  # out, max_logits, lse
            Int32(1),  # num_heads
            Int32(0),  # flags
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )  # fmt: skip
        return compile_for_tvm_ffi(self.kernel(), args, dump_dir)


KernelKey = VariantKey | Bf16AttentionKey | PagedGatherKey | QCastKey | SlotIndicesKey | MergeKey


def _attention_keys(**fixed) -> list[VariantKey]:
    """Every FP8 attention variant key whose fields equal ``fixed``'s, in a fixed order."""
    keys = []
    for d_qk in D_QK_VARIANTS:
        for precision in PRECISIONS:
            for q_dtype in KERNEL_Q_DTYPES:
                for heads in (HEAD_ALIGNMENT, *SMALL_HEAD_COUNTS):
                    for kind in SCHEDULE_SUFFIXES:
                        for cache in (None, *CACHE_LAYOUTS):
                            key = VariantKey(d_qk, precision, kind, q_dtype, heads, cache)
                            try:
                                key.check()
                            except ValueError:
                                continue
                            if all(getattr(key, field) == value for field, value in fixed.items()):
                                keys.append(key)
    return keys


IMPORT_PRECISIONS = ("default", "accurate")
IMPORT_KEYS = [
    key
    for key in _attention_keys(q_dtype=FP8, heads=HEAD_ALIGNMENT, cache=None)
    if key.schedule != SPLIT and key.precision in IMPORT_PRECISIONS
]
"""The variants loaded when ``q8kv8`` is imported: one-tile and persistent attention, for an e4m3 q, in the
``IMPORT_PRECISIONS`` (a precision buying one of the accurate mode's two parts builds on its first call)."""
SERVING_KEYS = [
    SlotIndicesKey(),
    MergeKey(),
    *(
        PagedGatherKey(layout, dtype)
        for layout in LAYOUTS
        for dtype in GATHER_DTYPES
        if dtype != torch.uint8 or layout == RECORDS_FROM
    ),
    *(QCastKey(d) for d in D_QK_VARIANTS),
    *_attention_keys(q_dtype=BF16_Q),
    *(Bf16AttentionKey(d_qk) for d_qk in D_QK_VARIANTS),
]
"""The serving path's variants (``load_serving_variants``): the slot-index kernel, the merge, the gathers,
the query casts, the FP8 attention variants for a bfloat16 q (paged and small-head ones included), the bf16
kernel."""
LISTED_KEYS = list(dict.fromkeys([*IMPORT_KEYS, *_attention_keys(), *SERVING_KEYS]))
"""Every variant of every family, as the listings show them: those of the import first."""
_variants: dict[KernelKey, Variant] = {}
_KEYS_BY_NAME = {key.name: key for key in LISTED_KEYS}


def load(key: KernelKey) -> Variant:
    """The variant of ``key``, built or loaded from the disk cache on its first use (idempotent; the build is
    serialised by ``q8kv8.build``'s locks). ValueError for a key its family does not have."""
    variant = _variants.get(key)
    if variant is None:
        key.check()
        variant = _variants[key] = build_or_load(
            key.name, key.d_qk, key.compile, key.exported, cache_stats, key.precision
        )
    return variant


def load_variants(keys=IMPORT_KEYS) -> list[Variant]:
    """Build or load the variants of ``keys`` (by default those of the import)."""
    return [load(key) for key in keys]


def listed_variants() -> list[Variant]:
    """Every variant, as the listings show them (``python -m q8kv8.compile``, ``q8kv8.info()``, ``make
    bench``), built or loaded."""
    return load_variants(LISTED_KEYS)


def load_serving_variants() -> dict[str, Variant]:
    """Build or load every kernel of the paged serving path (``SERVING_KEYS``), by name: call it before
    capturing a CUDA graph of ``SparsePrefill``."""
    return {variant.name: variant for variant in load_variants(SERVING_KEYS)}


def variant_loaders() -> list[functools.partial]:
    """One zero-argument loader per variant that ``listed_variants`` lists (each builds or loads it and
    returns it), picklable, so that several processes can build them (``python -m q8kv8.compile --jobs``)."""
    return [functools.partial(load, key) for key in LISTED_KEYS]


def key_of(variant: Variant) -> KernelKey:
    """The key of a listed variant."""
    return _KEYS_BY_NAME[variant.name]


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


def describe(variant: Variant) -> dict:
    """One listed variant as the listings show it (``python -m q8kv8.compile``, ``q8kv8.info()``, ``make
    bench``): name, d_qk, precision, q's dtype (None: a kernel without q), the paged cache layout it reads
    (None: none), where it came from and in how many seconds, registers and spill bytes from ``ptxas -v``
    (None without ptxas), dynamic shared memory per CTA, object file."""
    report = ptxas_report(variant)
    key = key_of(variant)
    return {
        "name": variant.name,
        "d_qk": variant.d_qk,
        "precision": variant.precision,
        "q_dtype": None if key.q_dtype is None else KERNEL_Q_DTYPES[key.q_dtype],
        "cache": key.cache,
        "source": variant.source,
        "seconds": variant.seconds,
        "registers": None if report is None else report.registers,
        "spill_bytes": None if report is None else report.spill_store_bytes + report.spill_load_bytes,
        "shared_memory_bytes": shared_memory_bytes(key),
        "object": str(variant.object_path),
    }


def shared_memory_bytes(key: KernelKey) -> int:
    """Dynamic shared memory per CTA of the variant of ``key`` (0 for the kernels without any)."""
    kernel = key.kernel()
    return kernel.shared_memory_bytes() if hasattr(kernel, "shared_memory_bytes") else 0


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


class AttentionLaunch(NamedTuple):
    """One launch of the FP8 attention kernel (``attention_plan``)."""

    key: VariantKey
    rows: slice | None  # the tokens it runs (None: all of them)
    # The arguments after the tensors: sm_scale * log2(e), the flags, the schedule count, the extra cache's
    # first index slot.
    scalars: tuple[float, int, int, int]


@functools.lru_cache(maxsize=1024)
def attention_plan(
    q_shape: tuple[int, int, int],
    q_dtype: torch.dtype,
    precision: str,
    sm_scale: float,
    has_q_scale: bool,
    has_topk_length: bool,
    has_sink: bool,
    tiles: int,
    splits: int = 1,
    split_from: int = 0,
    cache: str | None = None,
    extra_from: int = 0,
) -> tuple[tuple[tuple[str, torch.dtype | None, bool], ...], tuple[AttentionLaunch, ...]]:
    """What a call of ``launch_sparse_prefill``'s arguments launches: ``(arguments, launches)``, the one
    description that both the Python launcher and the C++ fast path (``q8kv8.native``) execute.

    ``arguments``: the kernel's tensor arguments in order, each ``(name, dtype, per_token)``: the
    ``PrefillCall`` field whose tensor it is, the dtype it is viewed as (None: its own) and whether a launch
    of some of the tokens passes only their rows. A bfloat16 q has no q_scale: the kernel does not read that
    argument, which gets kv_scale. An absent topk_length / attn_sink gets the placeholders of
    ``placeholders`` (a scale's bytes as int32, kv_scale), never read (the flags say absent). The last is a
    paged call's extra cache (``launch_sparse_prefill``'s ``extra_cache``); on kv rows, kv again, not read.

    ``launches``: the persistent variant (``tiles`` > 0, or small heads not split: the small-head variant);
    else the one-tile variant, the split one (``splits`` > 1), or both for a split tail: the one-tile kernel
    on the tokens before ``split_from``, then the split one on the others, with the split-tail flag (the two
    launches overlap). ``extra_from``: a paged call's first index slot of its extra cache (its top-k when it
    has none; 0 on kv rows, where the kernel does not read it). With a sink every launch runs ``precision``
    with S summed in float32 (``LOGITS_IN_FLOAT32``)."""
    s_q, h_q, d_qk = q_shape
    if has_sink:  # the sink weighs out by exp(lse): S summed in float32
        precision = LOGITS_IN_FLOAT32[precision]
    small = small_heads(h_q) and splits == 1  # small heads split: tiles of 64 heads (schedule.choose)
    key = VariantKey(d_qk, precision, ONE_TILE, q_dtype, h_q if small else HEAD_ALIGNMENT, cache)
    if small or tiles:
        kinds = [PERSISTENT]
    else:
        kinds = [ONE_TILE] if splits == 1 or split_from > 0 else []
        if splits > 1:
            kinds.append(SPLIT)
    flags = (TOPK_LENGTH_FLAG if has_topk_length else 0) | (SINK_FLAG if has_sink else 0)
    if len(kinds) > 1:
        flags |= SPLIT_TAIL_FLAG
    tokens = [None] if len(kinds) == 1 else [slice(None, split_from), slice(split_from, None)]
    logit_scale = sm_scale * LOG2_E
    launches = tuple(
        AttentionLaunch(
            key._replace(schedule=kind),
            rows,
            (logit_scale, flags, splits if kind == SPLIT else tiles or 1, extra_from),
        )
        for kind, rows in zip(kinds, tokens, strict=True)
    )
    return _attention_arguments(has_q_scale, has_topk_length, has_sink, cache is not None), launches


@functools.cache
def _attention_arguments(has_q_scale: bool, has_topk_length: bool, has_sink: bool, paged: bool) -> tuple:
    scale = "q_scale" if has_q_scale else "kv_scale"
    return (
        ("q", None, True),
        ("kv", None, False),
        ("indices", None, True),
        ("topk_length", None, True) if has_topk_length else (scale, torch.int32, False),
        ("attn_sink", None, False) if has_sink else ("kv_scale", None, False),
        (scale, None, False),
        ("kv_scale", None, False),
        ("out", None, True),
        ("max_logits", None, True),
        ("lse", None, True),
        ("extra_cache" if paged else "kv", None, False),
    )


def loaded(key: VariantKey) -> Variant | None:
    """The variant of ``key`` if this process has loaded it, else None (nothing is built)."""
    return _variants.get(key)


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
    cache: str | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_from: int | None = None,
) -> tuple[tuple[int, Variant], ...]:
    """Launch the kernel on validated tensors: q (e4m3 or bfloat16), out, max_logits, lse row-major with a
    head count (one of ``SMALL_HEAD_COUNTS`` and not split: the small-head variant, a persistent kernel; any
    other: tiles of 64 heads, a token's last one partly filled); kv and indices with a contiguous last
    dimension; one-element scales, ``q_scale`` None for a bfloat16 q. ``cache``: kv is a paged cache of that
    layout (``CACHE_LAYOUTS``) as [num_pages, page_size, bytes per token] uint8 (16-byte aligned base and page
    stride, page_size a power of two), indices its token slots, ``kv_scale`` a one-element 1.0 (its block
    scales apply instead); ``extra_cache``: None, or a second cache of that layout whose token slots are the
    index slots from ``extra_from`` on (the cache's those before it), attended in the same softmax.
    ``schedule``: ``tiles_per_cta``'s (small heads: ``small_head_tiles_per_cta``'s) answer when the caller has
    it (the contract memoises it), else computed here. ``ready``: the caller knows that q, kv and out meet the
    alignments of ``q8kv8.metadata`` (``contract.Problem.launch_ready``), so they are not checked again (else
    misaligned tensors are copied to aligned ones). ``splits`` > 1 and ``split_from``
    (``q8kv8.schedule.split_tokens``'s answer; only with the one-tile schedule): the split variant computes
    each tile of the tokens from ``split_from`` on with a cluster of ``splits`` CTAs, one per range of index
    slots, which merge their results; the tokens before it, if any, run one tile per CTA in a launch before.
    The launches are ``attention_plan``'s. Variants build on their first launch. Returns the launches'
    ``(schedule kind, variant)``, in order."""
    tiles = schedule
    small = small_heads(q.shape[1]) and splits == 1  # small heads split: tiles of 64 heads (schedule.choose)
    if tiles is None and small:
        tiles = small_head_tiles_per_cta(q.shape[0], q.get_device())
    elif tiles is None:
        tiles = tiles_per_cta(
            q.shape[0] * head_groups(q.shape[1]),
            indices.shape[2],
            topk_length is not None,
            q.get_device(),
        )
    if cache is not None and extra_from is None:
        extra_from = indices.shape[2]  # no extra cache
    arguments, launches = attention_plan(
        q.shape, q.dtype, precision, sm_scale, q_scale is not None, topk_length is not None,
        attn_sink is not None, tiles, splits, split_from, cache, extra_from or 0,
    )  # fmt: skip
    launched = [(launch.key.schedule, _variants.get(launch.key) or load(launch.key)) for launch in launches]
    kernel_out = out
    if not ready:
        if q.data_ptr() % Q_ALIGNMENT_BYTES:  # the Q tile is loaded by TMA
            q = q.clone()
        # kv rows are gathered with 16-byte copies (a cache's alignment is the contract's)
        if cache is None and (
            kv.data_ptr() % KV_ROW_ALIGNMENT_BYTES or kv.stride()[0] % KV_ROW_ALIGNMENT_BYTES
        ):
            kv = kv.clone(memory_format=torch.contiguous_format)
        if out.data_ptr() % OUT_ALIGNMENT_BYTES:
            kernel_out = torch.empty_like(out)
    names, retyped, per_token = _argument_layout(arguments)
    q_scale = q_scale if q_scale is None or q_scale.dim() == 1 else q_scale.reshape(1)
    kv_scale = kv_scale if kv_scale.dim() == 1 else kv_scale.reshape(1)
    if cache is not None and extra_cache is None:
        extra_cache = kv[:0]  # no extra cache: one of no pages
    tensors = names(
        (q, kv, indices, topk_length, attn_sink, q_scale, kv_scale, kernel_out, max_logits, lse, extra_cache)
    )
    if retyped:
        tensors = list(tensors)
        for index, dtype in retyped:
            tensors[index] = tensors[index].view(dtype)
    for launch, (_, variant) in zip(launches, launched, strict=True):
        rows, arguments = launch.rows, tensors
        if rows is not None:
            arguments = list(tensors)
            for index in per_token:
                arguments[index] = arguments[index][rows]
        _call_on_device_of(q, variant.function, *arguments, *launch.scalars)
    if kernel_out is not out:
        out.copy_(kernel_out)
    return tuple(launched)


_LAUNCH_TENSORS = tuple(
    "q kv indices topk_length attn_sink q_scale kv_scale out max_logits lse extra_cache".split()
)
"""The order in which ``launch_sparse_prefill`` hands its tensors to ``_argument_layout``'s getter."""


@functools.cache
def _argument_layout(arguments: tuple) -> tuple:
    """``attention_plan``'s arguments as the launcher applies them: a getter of their tensors from a tuple in
    ``_LAUNCH_TENSORS``'s order, the ``(position, dtype)`` of those viewed as another dtype, the positions of
    per-token ones."""
    names = [_LAUNCH_TENSORS.index(name) for name, _, _ in arguments]
    retyped = tuple((index, dtype) for index, (_, dtype, _) in enumerate(arguments) if dtype is not None)
    per_token = tuple(index for index, (_, _, rows) in enumerate(arguments) if rows)
    return operator.itemgetter(*names), retyped, per_token


def launch_paged_kv_gather(cache_pages, slot_words, out, page_size: int, layout: str, rows=None) -> None:
    """Launch the gather on validated tensors: ``cache_pages`` [num_pages, page_bytes] uint8 (base and
    page stride 16-byte aligned), ``slot_words`` [num_tokens, 1 or 2] int32 (last dim contiguous),
    ``out`` [rows, 1, d_qk] e4m3 or bf16 (or, from a V4.1 FP4 cache, [num_tokens, 528] uint8 V4.1 records,
    with ``rows`` [num_tokens] int32 contiguous: each slot's record, or -1), contiguous and 16-byte aligned,
    rows > 0."""
    key = PagedGatherKey(layout, out.dtype)
    variant = _variants.get(key) or load(key)
    _call_on_device_of(out, variant.function, cache_pages, slot_words, out, rows, page_size)


def launch_cast_q_fp8(q, q_scale, out) -> None:
    """Launch the query cast on validated tensors: ``q`` [s_q, h, d] bf16 (16-byte aligned, row strides
    multiples of 8 elements, last dim contiguous), ``q_scale`` [1] float32, ``out`` [s_q, h_pad, d] e4m3
    contiguous, 16-byte aligned, h_pad a multiple of 8 and >= h, s_q > 0."""
    key = QCastKey(q.shape[2])
    variant = _variants.get(key) or load(key)
    _call_on_device_of(out, variant.function, q, q_scale, out)


_SLOT_INDICES = SlotIndicesKey()


def launch_paged_indices(indices, table_words, seqlen_words, slots, topk_length, compress_ratio: int) -> None:
    """Launch the slot-index kernel on validated tensors: ``indices`` [s_q, topk] int32 (last dim
    contiguous), ``table_words`` [num_rows, 1 or 2] and ``seqlen_words`` [s_q, 1 or 2] int32 (int32 tensors,
    or int64 ones' words), ``slots`` [s_q, 1, topk_pad] and ``topk_length`` [s_q] int32 contiguous,
    s_q > 0."""
    variant = _variants.get(_SLOT_INDICES) or load(_SLOT_INDICES)
    _call_on_device_of(
        slots, variant.function, indices, table_words, seqlen_words, slots, topk_length, compress_ratio
    )


_MERGE = MergeKey()


def launch_attention_merge(part0, part1, attn_sink, out, max_logits, lse) -> None:
    """Launch the merge on validated tensors: each part ``(out [rows, D_V] bf16, max_logits [rows] float32,
    lse [rows] float32)``, ``attn_sink`` [h] float32 or None (rows of head ``row % h``), ``out`` [rows, D_V]
    bf16, ``max_logits`` and ``lse`` [rows] float32; every tensor contiguous, the bf16 ones 16-byte aligned,
    rows > 0."""
    variant = _variants.get(_MERGE) or load(_MERGE)
    sink = max_logits[:1] if attn_sink is None else attn_sink  # a placeholder that is not read
    num_heads = 1 if attn_sink is None else attn_sink.shape[0]
    flags = 0 if attn_sink is None else SINK_FLAG
    _call_on_device_of(out, variant.function, *part0, *part1, sink, out, max_logits, lse, num_heads, flags)


def launch_sparse_prefill_bf16(
    q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse
) -> None:
    """Launch the bf16 kernel on validated tensors (the hook ``serving._cuda_attention_bf16`` calls):
    q [s_q, h, d_qk] bf16 row-major (any h), kv [s_kv, 1, d_qk] bf16 (last dim
    contiguous), indices [s_q, 1, topk] int32 (last dim contiguous, topk a multiple of 128),
    topk_length [s_q] int32 or None, attn_sink [h] float32 or None, out [s_q, h, 512] bf16, max_logits
    and lse [s_q, h] float32, all row-major. Launches on the current stream; no host sync."""
    key = Bf16AttentionKey(q.shape[2])
    variant = _variants.get(key) or load(key)
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
