"""SM90 FP8 sparse MLA prefill: out = softmax(q . kv[idx]^T) . kv[idx, :512] (e4m3 TMA + WGMMA).

A CTA computes 64 heads of one token. Its producer warpgroup gathers the token's KV rows in blocks of
64 (two blocks a pair) with cp.async; the two consumer warpgroups own alternate blocks (S, and P
under a lazy running max chained from one consumer to the other) and each accumulates O^T for half
of d_v over every block, V^T read from the gathered tiles by ldmatrix.trans (RS WGMMA).
``precision="accurate"`` sums S in float32 per 2 k-steps and stores P as two e4m3 terms ("accurate_logits"
and "accurate_out" do one of the two); ``persistent``
walks several tiles per CTA;
``q_dtype="bf16"`` takes bf16 q and quantises each Q tile in the consumers (from rows the producer stages in
the KV ring's pair slot before the tile's first pair), a power-of-two scale per row folded into that row's
logit scale; ``split`` computes each tile as a cluster of 2, 4 or 8 CTAs, one per
range of index slots, which merge their results through distributed shared memory (``split_merge``).
``heads`` = 8, 16 or 32 (small heads: a tile is one token's n heads) computes
the transposed S^T = K . Q^T, the block's slots on the WGMMA's M side and the heads on N, the per-head
softmax a reduction over M, and P^T stored [head][slot] in the slot order of the V^T fragments. Design:
docs/kernel.md.

``SparsePrefillSm90`` holds the configuration, the shared storage, the launch, the prologue and the
consumers' tile loop; it inherits the rest from its parts, one concern each: ``producer``, ``qk_products``,
``softmax_p``, ``pv_product``, ``tile_epilogue`` and ``split_merge`` (the tile geometry and the ``Consumer``
bundle they share: ``fp8_tile``).

Constraints: h >= 1 (a token's last tile of 64 heads may be partly filled; small heads: h = heads),
topk % 128 == 0, d_qk in {512, 576}, d_v = 512; q, out, max_logits, lse row-major; q and kv rows 16-byte
aligned; topk_length clamped to [0, topk].
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint16, Uint32, Uint64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from cute_kernels import ptx
from cute_kernels.interface import (
    PRECISIONS,
    SMALL_HEAD_COUNTS,
    SPLIT_TAIL_FLAG,
)
from cute_kernels.sm90.cta import (
    B_H,
    CONSUMER_THREADS,
    PRODUCER_WARPS,
    THREADS_PER_WG,
    WARPS_PER_WG,
    AttentionKernel,
    consumer_index,
    init_cta,
    launch_cta,
)
from cute_kernels.sm90.fp8_tile import (
    B_TOPK,
    D_TILES_PER_CONSUMER,
    NUM_KV_TILES,
    NUM_STAGES,
    TILE_RING,
    Consumer,
    QkChunks,
)
from cute_kernels.sm90.mask import (
    mask_and_column_max,
    mask_and_row_max,
    row_valid_bits,
    shifted_row_max,
    slot_valid_bits,
)
from cute_kernels.sm90.named_barrier import NamedBarrierFp8
from cute_kernels.sm90.paged_rows import (
    RAW_SCALE_ENTRY_BYTES,
    BlockScaleTables,
    cache_geometry,
    slot_bounds,
)
from cute_kernels.sm90.producer import Producer, ProducerInputs
from cute_kernels.sm90.pv_product import PvProduct
from cute_kernels.sm90.qk_products import (
    PAGED_ACCURATE_CHUNK_KSTEPS,
    QK_PROMOTION_KSTEPS,
    ROW_SCALED_PROMOTION_KSTEPS,
    QkProducts,
)
from cute_kernels.sm90.ring import Ring
from cute_kernels.sm90.row_views import (
    Q_THREADS_PER_ROW,
    quantize_q_tile,
    quantize_staged_q_tile,
)
from cute_kernels.sm90.shared_storage import allocate_shared_storage, tile_layouts, tile_region, tile_tensor
from cute_kernels.sm90.softmax_p import SoftmaxP
from cute_kernels.sm90.split_merge import SplitMerge
from cute_kernels.sm90.tile_epilogue import TileEpilogue
from cute_kernels.sm90.tile_scheduler import TileScheduler

PRODUCER_REGS = 24
CONSUMER_REGS = 240
# The small-head kernel's producer spills at 24 with an e4m3 q (its Q TMA beside that consumer code), and the
# paged kernel's (its page and scale addressing; small heads with a bf16 q 8-16 B), except where the 64-head
# paged consumers need the 240: with a bf16 q on the persistent schedule (they spill 12-28 B at 240, 24-28 B
# at 232). (With an e4m3 q on the split schedule the consumers spill 4 B at 232, a scheduler value kept from
# the prologue to the epilogue, where the producer at 24 would spill 8 B reloaded every pair.) 40 + 2 x 232 =
# 3 x 168, the launch's registers per thread (setmaxregister only moves registers between the CTA's warps:
# more waits forever).
WIDE_PRODUCER_REGS = 40
WIDE_PRODUCER_CONSUMER_REGS = 232
Q_DTYPES = ("e4m3", "bf16")


def consumer_steps(num_blocks, consumer):
    """Loop steps of consumer ``consumer`` (0 or 1) over a tile of ``num_blocks`` >= 1 blocks.

    Step i handles the consumer's own block 2i + consumer when it is < num_blocks (S, softmax,
    P) and accumulates O over blocks 2i + consumer - 1 and 2i + consumer, those in
    [0, num_blocks): every block exactly once, in order. Works on Python ints and DSL Int32
    (both operands are >= 0, so the division rounds the same way)."""
    return (num_blocks - consumer) // 2 + 1


class ConsumerInputs(NamedTuple):
    """What the kernel hands its consumer warpgroups (``SparsePrefillSm90.consume``): the CTA's shared tiles,
    tables and barriers, the launch's tensors and values, and the CTA's tiles."""

    sQ: cute.Tensor
    sK: cute.Tensor
    sP: cute.Tensor
    sLo: cute.Tensor  # paged: the RoPE staging tiles (None otherwise)
    smem_stats: tuple  # max_used, alpha, moved, row_sum, out_scale, max_true, max_own (see Consumer)
    s_valid_words: cute.Tensor  # small heads: the gathered slots' validity (None otherwise)
    mIdx: cute.Tensor
    mKV: cute.Tensor
    mExtraCache: cute.Tensor  # paged: the extra cache (0 pages when there is none); None otherwise
    extra_from: Int32  # paged: the extra cache's first index slot; None otherwise
    mSink: cute.Tensor
    mQ: cute.Tensor  # bf16 q: the q row view
    q_row_scale: cute.Tensor  # bf16 q: the Q tile's row scales
    mQScale: cute.Tensor
    mKVScale: cute.Tensor
    mOut: cute.Tensor
    mMaxLogits: cute.Tensor
    mLse: cute.Tensor
    mbar_q: cute.Pointer
    mbar_q_empty: cute.Pointer
    mbar_kv_full: cute.Pointer
    mbar_kv_empty: cute.Pointer
    mbar_p_full: cute.Pointer
    handover: tuple  # persistent: mbar_stats_full, mbar_tile_done (else None, None)
    merge_barriers: tuple  # split: mbar_merge_full, mbar_peers_free (else None, None)
    sm_scale_log2: Float32
    flags: Int32
    tiles: object  # the CTA's tiles (TileScheduler.cta_tiles)
    small_tables: tuple  # small heads: column_max, head_sum, column_max_shifted (else empty)
    tables: BlockScaleTables  # paged: the block tiles' scale tables (None otherwise)


class SparsePrefillSm90(Producer, QkProducts, SoftmaxP, PvProduct, TileEpilogue, SplitMerge, AttentionKernel):
    """Compile-time configuration of the kernel: ``d_qk`` (512 or 576)."""

    SMEM_ATOM_KIND = warpgroup.SmemLayoutAtomKind.K_SW64
    ELEMENT_TYPE = Float8E4M3FN

    def __init__(
        self,
        d_qk: int,
        precision: str = "default",
        persistent: bool = False,
        q_dtype: str = "e4m3",
        split: bool = False,
        heads: int = B_H,
        cache: str | None = None,
    ):
        """``precision`` (``PRECISIONS``): "default" rounds P to one e4m3 term and takes S from one WGMMA
        group; "accurate_out" splits P into two terms (hi = e4m3(p), lo = e4m3(p - hi)) and runs the PV
        product once per term; "accurate_logits" sums S in float32 from WGMMA groups of a few k-steps
        (``qk_promoted``); "accurate" does both.
        ``persistent``: each CTA walks ``tiles_per_cta`` tiles (launch argument; tiles bid,
        bid + grid, ...), its producer loading the next tile's Q and first rows while the consumers
        finish the current one, whose out stores then drain during the next tile's math.
        ``q_dtype``: "e4m3" (q in e4m3, scaled by ``q_scale``, loaded by TMA) or "bf16" (q in bf16,
        ``q_scale`` not read: the consumers quantise each tile, see ``load_q_bf16``).
        ``split`` (not with ``persistent``): CTA (t, p) of a [tiles, splits] grid (``splits`` in {2, 4, 8},
        the launch's ``schedule_count``) computes tile t over the p-th of ``splits`` equal ranges of whole
        pairs of index slots (see ``tile_scheduler``); the ``splits`` CTAs of a tile form a cluster and merge
        their results through shared memory (``merge_parts``).
        ``heads``: 64 (a tile is 64 heads of a token, h a multiple), or one of ``SMALL_HEAD_COUNTS`` (the
        small-head kernel: a tile is all h = ``heads`` heads of a token; not with ``split``).
        ``cache``: None (kv is a [s_kv, 1, d_qk] e4m3 tensor with a per-tensor scale) or a paged cache layout,
        "v32", "model1" or "v41" (kv is the cache, [num_pages, page_size, bytes per token] uint8, indices are
        its token slots, and its block scales apply: ``paged_rows``); the launch's extra cache, of the same
        layout, holds the token slots of the index slots from ``extra_from`` on (attended in the same
        softmax)."""
        if d_qk not in (512, 576):
            raise ValueError(f"d_qk must be 512 or 576, got {d_qk}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        if q_dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype must be one of {Q_DTYPES}, got {q_dtype!r}")
        if split and persistent:
            raise ValueError("split: one part of a tile per CTA, not persistent")
        if heads != B_H and heads not in SMALL_HEAD_COUNTS:
            raise ValueError(f"heads must be {B_H} or one of {SMALL_HEAD_COUNTS}, got {heads}")
        if heads != B_H and split:
            raise ValueError("small heads: not split")
        self.cache = None if cache is None else cache_geometry(cache)
        if self.cache is not None and self.cache.d_qk != d_qk:
            raise ValueError(f"cache {cache!r}: d_qk {self.cache.d_qk}, got {d_qk}")
        self.b_h = heads  # heads per tile: the M side of S (64), or the N side of S^T and O^T (small heads)
        self.small = heads != B_H
        # Pair p uses the KV tiles 2 (p % 2) and 2 (p % 2) + 1; block g its KV tile, P buffer and their
        # barriers g % 4. The small-head kernel indexes them by mask (2-3% faster); the 64-head persistent
        # variants spill with it (see ring.py).
        self.pair_ring = Ring(NUM_STAGES, index_by_mask=self.small)
        self.kv_ring = Ring(NUM_KV_TILES, index_by_mask=self.small)
        self.rows_per_thread = heads // 4 if self.small else 2  # softmax rows (heads) a consumer thread holds
        self.d_qk = d_qk
        self.precision = precision
        self.q_bf16 = q_dtype == "bf16"
        self.promote_qk = PRECISIONS[precision].qk_in_float32  # S summed in float32 per chunk (qk_promoted)
        # Paged V4 and V4.1: their UE8M0 scales are powers of two, so each block row is rescaled to one
        # power-of-two scale (paged_rows.convert_row) and S is one WGMMA chain (qk_row_scaled; S promoted:
        # summed in float32 in chunks, qk_promoted); V3.2, whose float32 scales need not be powers of two,
        # sums S per scale group in float32 with the exact scales (qk_paged).
        self.row_scaled = self.cache is not None and self.cache.scale_bytes == 1  # UE8M0 scales
        self.bf16_rope = self.cache is not None and self.cache.rope_column is not None
        self.promotion_ksteps = ROW_SCALED_PROMOTION_KSTEPS if self.row_scaled else QK_PROMOTION_KSTEPS
        self.registers = (PRODUCER_REGS, CONSUMER_REGS)  # per thread of the producer, of a consumer
        paged_consumers_need_240 = not self.small and self.q_bf16 and persistent and not self.row_scaled
        if (self.small and not self.q_bf16) or (self.cache is not None and not paged_consumers_need_240):
            self.registers = (WIDE_PRODUCER_REGS, WIDE_PRODUCER_CONSUMER_REGS)
        self.p_terms = PRECISIONS[precision].p_terms  # e4m3 terms P is stored as
        # S summed in float32 per group of k-steps: the promoted chunks, or a paged cache's scale groups
        # (promoted: at most PAGED_ACCURATE_CHUNK_KSTEPS k-steps of one)
        self.qk_in_groups = self.promote_qk or (self.cache is not None and not self.row_scaled)
        # Paged: V is read at one power-of-two scale 2^E per row, and P carries each slot's 2^E (the softmax's
        # running max and P on y = x + E_s, its row sums on x). With the rows rescaled before the QK product
        # V's bytes are so in place; otherwise the PV products scale V's fragments by sigma_g 2^-E
        # (paged_rows.scale_v_fragment, the same bytes).
        self.p_carries_row_scale = self.cache is not None
        self.v_fragment_factors = self.cache is not None and not self.row_scaled
        if self.cache is not None:
            self.paged_chunk_ksteps = self.cache.group_ksteps
            if self.promote_qk:
                self.paged_chunk_ksteps = min(self.paged_chunk_ksteps, PAGED_ACCURATE_CHUNK_KSTEPS)
        # PV WGMMA groups (d tiles) in flight, each with its V^T fragment live: two; one for the persistent
        # small-head kernel with a bf16 q (which spills 40-56 B with two at 24 / 240 / 240 registers), and
        # for the 64-head kernel with its QK promoted or a paged cache (with two, its chunk accumulator or the
        # paged tables serialise every WGMMA at 232 registers: C7512; at 240 the consumers spill 36-112 B in
        # the loop).
        self.pv_groups_in_flight = 2
        if (self.small and self.q_bf16 and persistent) or (
            (self.promote_qk or self.cache is not None) and not self.small
        ):
            self.pv_groups_in_flight = 1
        self.persistent = persistent
        self.split = split
        # bf16 q (64 heads): a tile's bf16 rows take the ring's pair slot before its first pair (a [64, d_qk]
        # bf16 tile is the size of two e4m3 block tiles), copied there by the producer (``stage_q_rows``) and
        # quantised from there by the consumers; ``q_pairs``: the ring's pair positions a tile's Q takes.
        self.stage_q = self.q_bf16 and not self.small
        self.q_pairs = 1 if self.stage_q else 0
        # kv_full of a block tile: the 64 threads that gather it (their cp.async); small heads, also lane 0 of
        # each of their two warps once it has written the warp's valid word (the consumers' masks read them).
        self.kv_full_arrivals = 2 * 32 + (2 if self.small else 0)
        self.scheduler = TileScheduler(persistent, B_TOPK, split, heads, whole_token=self.small)
        self.k_tile_bytes = B_TOPK * d_qk  # one gathered block in shared memory
        self.q_tile_bytes = heads * d_qk
        self.q_shape = (heads, d_qk)
        self.k_shape = (B_TOPK, d_qk, NUM_KV_TILES)
        # [term][buffer] P tiles; paged, 64 heads: always two terms' room, the second the RoPE staging tiles
        # (paged_rows), which small heads keep in a region of their own (a P tile of theirs is smaller)
        self.lo_in_p = self.cache is not None and not self.small
        self.p_shape = (heads, B_TOPK, NUM_KV_TILES * (2 if self.lo_in_p else self.p_terms))
        self.p_term_bytes = NUM_KV_TILES * heads * B_TOPK  # from a term's P tile to the next term's
        self.lo_shape = (B_TOPK, B_TOPK, NUM_KV_TILES)  # the RoPE staging tiles: a K tile's RoPE column each

    def shared_storage(self):
        """The CTA's shared memory: barriers and row statistics, then the Q, KV block and P tiles."""

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, 1]
            mbar_q_empty: cute.struct.MemRange[Int64, 1]  # persistent: both consumers' QKs are done
            mbar_kv_full: cute.struct.MemRange[Int64, NUM_KV_TILES]
            mbar_kv_empty: cute.struct.MemRange[Int64, NUM_KV_TILES]
            mbar_p_full: cute.struct.MemRange[Int64, NUM_KV_TILES]
            max_used: cute.struct.MemRange[Float32, NUM_KV_TILES * B_H]  # [buffer, row]
            alpha: cute.struct.MemRange[Float32, NUM_KV_TILES * B_H]  # [buffer, row]
            row_sum: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            max_true: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            max_own: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            moved: cute.struct.MemRange[Int32, NUM_KV_TILES]  # [buffer]
            out_scale: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            # Persistent only (after every member the one-tile kernel uses, inside the padding before sQ):
            mbar_stats_full: cute.struct.MemRange[Int64, 2]  # [consumer]: its row statistics are published
            mbar_tile_done: cute.struct.MemRange[Int64, 1]  # consumer 1 finished a tile
            q_row_scale: cute.struct.MemRange[Float32, B_H]  # bf16 q: the Q tile's row scales
            if self.split:
                mbar_merge_full: cute.struct.MemRange[Int64, 1]  # the other parts' fragments have landed
                mbar_peers_free: cute.struct.MemRange[Int64, 1]  # the other parts' KV tiles are free
            if self.cache is not None:  # see paged_rows.BlockScaleTables
                scale_raw: cute.struct.Align[
                    cute.struct.MemRange[Uint8, NUM_KV_TILES * B_TOPK * RAW_SCALE_ENTRY_BYTES], 16
                ]
                rope_scale: cute.struct.MemRange[Float32, NUM_KV_TILES * B_TOPK]
                row_scale: cute.struct.MemRange[Float32, NUM_KV_TILES * B_TOPK]
                row_exponent: cute.struct.MemRange[Float32, NUM_KV_TILES * B_TOPK]
                if self.v_fragment_factors:  # [tile][V group][row] f16
                    v_factors: cute.struct.MemRange[Uint16, NUM_KV_TILES * self.cache.groups * B_TOPK]
            if self.small:
                valid_words: cute.struct.MemRange[Uint32, NUM_KV_TILES * 2]  # [block tile, word]
                column_max: cute.struct.MemRange[Float32, 2 * 2 * WARPS_PER_WG * self.b_h]
                if self.p_carries_row_scale:  # the maxima of y = x + E_s (softmax_own)
                    column_max_shifted: cute.struct.MemRange[Float32, 2 * 2 * WARPS_PER_WG * self.b_h]
                head_sum: cute.struct.MemRange[Float32, self.b_h * 2 * WARPS_PER_WG]
            sQ: tile_region(Float8E4M3FN, self.q_shape)
            sK: tile_region(Float8E4M3FN, self.k_shape)
            sP: tile_region(Float8E4M3FN, self.p_shape)
            if self.cache is not None and not self.lo_in_p:
                sLo: tile_region(Float8E4M3FN, self.lo_shape)

        return SharedStorage

    # ------------------------------------------------------------------------------------
    # Host side: layouts, TMA atom, shared storage, launch
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h, d_qk] e4m3, row-major
        mKV: cute.Tensor,  # [s_kv, 1, d_qk] e4m3, row stride a multiple of 16 bytes; paged: the cache
        mIdx: cute.Tensor,  # [s_q, 1, topk] int32, row stride dynamic
        mTopkLen: cute.Tensor,  # [s_q] int32 (read when flags & 1)
        mSink: cute.Tensor,  # [h] f32 (read when flags & 2)
        mQScale: cute.Tensor,  # [1] f32
        mKVScale: cute.Tensor,  # [1] f32
        mOut: cute.Tensor,  # [s_q, h, 512] bf16, row-major
        mMaxLogits: cute.Tensor,  # [s_q, h] f32, row-major
        mLse: cute.Tensor,  # [s_q, h] f32, row-major
        mExtraCache: cute.Tensor,  # paged: an extra cache of the same layout (0 pages when there is none); a
        # row-major kv: kv again, not read
        sm_scale_log2: Float32,  # sm_scale * log2(e)
        flags: Int32,  # bit 0: topk_length given, bit 1: attn_sink given, bit 2: a split tail's launch
        schedule_count: Int32,  # persistent: tiles per CTA (the grid is ceil(tiles / it)); split: parts
        extra_from: Int32,  # paged: the index slots from this one on are the extra cache's; kv rows: not read
        stream,
    ):
        views, layouts, tma_atom_q, tma_tensor_q = self.host_setup(
            mQ, mKV, mIdx, mMaxLogits, mLse, q_by_tma=not self.q_bf16
        )
        sQ_layout, sK_layout, sP_layout = layouts
        (sLo_layout,) = tile_layouts(self.SMEM_ATOM_KIND, self.ELEMENT_TYPE, (self.lo_shape,))
        launch_cta(
            self.kernel(
                tma_atom_q,
                tma_tensor_q,
                views.kv if const_expr(self.cache is None) else mKV,
                views.indices,
                mTopkLen,
                mSink,
                mQScale,
                mKVScale,
                mOut,
                views.max_logits,
                views.lse,
                None if const_expr(self.cache is None) else mExtraCache,
                sm_scale_log2,
                flags,
                schedule_count,
                None if const_expr(self.cache is None) else extra_from,
                sQ_layout,
                sK_layout,
                sP_layout,
                sLo_layout,
                self.shared_storage(),
            ),
            self.scheduler.grid(
                self.scheduler.num_tiles(cute.size(mQ, mode=[0]), cute.size(mQ, mode=[1])),
                schedule_count,
                schedule_count,
            ),
            stream,
            cluster=[1, schedule_count] if const_expr(self.split) else None,
            use_pdl=Int32((flags & SPLIT_TAIL_FLAG) != 0) if const_expr(self.split) else False,
        )

    # ------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,  # None for bf16 q
        mQ_tma: cute.Tensor,  # bf16 q: the q row view
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mSink: cute.Tensor,
        mQScale: cute.Tensor,
        mKVScale: cute.Tensor,
        mOut: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        mExtraCache: cute.Tensor,  # paged: the extra cache (0 pages when there is none); else None
        sm_scale_log2: Float32,
        flags: Int32,
        schedule_count: Int32,
        extra_from,  # paged: the extra cache's first index slot (Int32); else None
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sLo_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bid, _, _ = cute.arch.block_idx()
        if const_expr(not self.split):
            if (flags & SPLIT_TAIL_FLAG) != 0:  # the split tail's launch may start on the SMs this one frees
                cute.arch.griddepcontrol_launch_dependents()

        storage = allocate_shared_storage(SharedStorage)
        mbar_q = storage.mbar_q.data_ptr()
        mbar_q_empty = storage.mbar_q_empty.data_ptr()
        mbar_kv_full = storage.mbar_kv_full.data_ptr()
        mbar_kv_empty = storage.mbar_kv_empty.data_ptr()
        mbar_p_full = storage.mbar_p_full.data_ptr()
        s_moved = storage.moved.get_tensor(cute.make_layout(NUM_KV_TILES))
        s_valid_words = None  # small heads: the gathered slots' validity, see produce_tile
        if const_expr(self.small):
            s_valid_words = storage.valid_words.get_tensor(cute.make_layout((NUM_KV_TILES, 2), stride=(2, 1)))
        sQ = tile_tensor(storage.sQ, sQ_layout)
        sK = tile_tensor(storage.sK, sK_layout)
        sP = tile_tensor(storage.sP, sP_layout)
        tables = None
        sLo = None  # paged: the RoPE staging tiles (their lo terms, see paged_rows)
        if const_expr(self.cache is not None):
            if const_expr(self.lo_in_p):
                sLo = cute.local_tile(sP, self.lo_shape, (0, 0, 1))
            else:
                sLo = tile_tensor(storage.sLo, sLo_layout)
            tables = BlockScaleTables(
                raw=storage.scale_raw.data_ptr().toint(),
                rope=storage.rope_scale.data_ptr().toint(),
                lo=sLo.iterator.toint(),
                row_scale=storage.row_scale.data_ptr().toint(),
                exponent=storage.row_exponent.data_ptr().toint(),
                v_factors=storage.v_factors.data_ptr().toint()
                if const_expr(self.v_fragment_factors)
                else None,
            )
        handover = (None, None)  # persistent: mbar_stats_full, mbar_tile_done
        if const_expr(self.persistent):
            handover = (storage.mbar_stats_full.data_ptr(), storage.mbar_tile_done.data_ptr())
        merge_barriers = (None, None)  # split: mbar_merge_full, mbar_peers_free
        if const_expr(self.split):
            merge_barriers = (storage.mbar_merge_full.data_ptr(), storage.mbar_peers_free.data_ptr())
        barriers = (mbar_q, mbar_q_empty, mbar_kv_full, mbar_kv_empty, mbar_p_full, s_moved, *handover)
        init_cta(warp_idx, tma_atom_q, functools.partial(self.init_barriers, *barriers, *merge_barriers))
        if const_expr(self.split):  # the cluster's barriers are initialised before any CTA signals another's
            cute.arch.cluster_arrive_relaxed()

        heads = cute.size(mOut, mode=[1])
        tiles = self.scheduler.cta_tiles(bid, mIdx, mTopkLen, heads, flags, schedule_count)

        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(self.registers[0])
            self.produce(
                ProducerInputs(
                    tma_atom_q=tma_atom_q,
                    mQ_tma=mQ_tma,
                    sQ=sQ,
                    sK=sK,
                    s_valid_words=s_valid_words,
                    mKV=mKV,
                    mExtraCache=mExtraCache,
                    extra_from=extra_from,
                    mIdx=mIdx,
                    mbar_q=mbar_q,
                    mbar_q_empty=mbar_q_empty,
                    mbar_kv_full=mbar_kv_full,
                    mbar_kv_empty=mbar_kv_empty,
                    tiles=tiles,
                    tables=tables,
                )
            )
        else:
            cute.arch.setmaxregister_increase(self.registers[1])
            consumer = consumer_index(warp_idx)
            smem_stats = (
                storage.max_used.get_tensor(cute.make_layout((NUM_KV_TILES, B_H), stride=(B_H, 1))),
                storage.alpha.get_tensor(cute.make_layout((NUM_KV_TILES, B_H), stride=(B_H, 1))),
                s_moved,
                storage.row_sum.get_tensor(cute.make_layout((B_H, 2))),
                storage.out_scale.get_tensor(cute.make_layout((B_H, 2))),
                storage.max_true.get_tensor(cute.make_layout((B_H, 2))),
                storage.max_own.get_tensor(cute.make_layout((B_H, 2))),
            )
            small_tables = ()
            if const_expr(self.small):
                column_max_layout = cute.make_layout(
                    (2, 2, WARPS_PER_WG, self.b_h),
                    stride=(2 * WARPS_PER_WG * self.b_h, WARPS_PER_WG * self.b_h, self.b_h, 1),
                )
                small_tables = (
                    storage.column_max.get_tensor(column_max_layout),
                    storage.head_sum.get_tensor(
                        cute.make_layout((self.b_h, 2 * WARPS_PER_WG), stride=(2 * WARPS_PER_WG, 1))
                    ),
                    storage.column_max_shifted.get_tensor(column_max_layout)
                    if const_expr(self.p_carries_row_scale)
                    else None,
                )
            self.consume(
                consumer,
                ConsumerInputs(
                    sQ=sQ,
                    sK=sK,
                    sP=sP,
                    sLo=sLo,
                    smem_stats=smem_stats,
                    s_valid_words=s_valid_words,
                    mIdx=mIdx,
                    mKV=mKV,
                    mExtraCache=mExtraCache,
                    extra_from=extra_from,
                    mSink=mSink,
                    mQ=mQ_tma,
                    q_row_scale=storage.q_row_scale.get_tensor(cute.make_layout(B_H)),
                    mQScale=mQScale,
                    mKVScale=mKVScale,
                    mOut=mOut,
                    mMaxLogits=mMaxLogits,
                    mLse=mLse,
                    mbar_q=mbar_q,
                    mbar_q_empty=mbar_q_empty,
                    mbar_kv_full=mbar_kv_full,
                    mbar_kv_empty=mbar_kv_empty,
                    mbar_p_full=mbar_p_full,
                    handover=handover,
                    merge_barriers=merge_barriers,
                    sm_scale_log2=sm_scale_log2,
                    flags=flags,
                    tiles=tiles,
                    small_tables=small_tables,
                    tables=tables,
                ),
            )
            # A split tail ends after the one-tile launch before it. (Here, not after the branches: the
            # producer's warps run on fewer registers than the code after the join would use.)
            if const_expr(self.split):
                if (flags & SPLIT_TAIL_FLAG) != 0:
                    cute.arch.griddepcontrol_wait()

    @cute.jit
    def init_barriers(
        self,
        mbar_q,
        mbar_q_empty,
        mbar_kv_full,
        mbar_kv_empty,
        mbar_p_full,
        s_moved,
        mbar_stats_full,
        mbar_tile_done,
        mbar_merge_full,
        mbar_peers_free,
    ):
        """(One thread.) q_full: the TMA (bf16 q: every consumer thread, after quantising its part);
        q_empty: both consumers; per block tile, kv_full: the 64 threads gathering it (cp.async arrivals;
        staged bf16 rows: bulk copies, see ``stage_q_rows``; small heads: and their warps' lanes 0, see
        ``kv_full_arrivals``), kv_empty: both consumers, p_full: its owner's warpgroup; no block has moved
        the max yet. Persistent: stats_full[c]: consumer c's warpgroup; tile_done: consumer 1's warpgroup.
        Split: merge_full: one arrival (with the bytes expected) and the other parts' stores; peers_free:
        one arrival from each other part."""
        cute.arch.mbarrier_init(mbar_q, CONSUMER_THREADS if const_expr(self.q_bf16) else 1)
        cute.arch.mbarrier_init(mbar_q_empty, CONSUMER_THREADS)
        for i in cutlass.range_constexpr(NUM_KV_TILES):
            cute.arch.mbarrier_init(mbar_kv_full + i, self.kv_full_arrivals)
            cute.arch.mbarrier_init(mbar_kv_empty + i, CONSUMER_THREADS)
            cute.arch.mbarrier_init(mbar_p_full + i, THREADS_PER_WG)
            s_moved[i] = -1
        if const_expr(self.persistent):
            for consumer in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(mbar_stats_full + consumer, THREADS_PER_WG)
            cute.arch.mbarrier_init(mbar_tile_done, THREADS_PER_WG)
        if const_expr(self.split):
            cute.arch.mbarrier_init(mbar_merge_full, 1)
            cute.arch.mbarrier_init(mbar_peers_free, cute.arch.grid_dim()[1] - 1)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, consumer, cta: ConsumerInputs):
        """WG1/WG2: S and P of own blocks c, c + 2, ..., O^T for half c of d_v over every block (bf16 q:
        first the tile's Q, see ``load_q_bf16``; small heads: S^T and P^T)."""
        e4m3 = cta.sQ.element_type
        wtid = cute.arch.thread_idx()[0] % THREADS_PER_WG  # thread index inside the warpgroup
        lane = cute.arch.lane_idx()

        # S: the first k-step overwrites (no zeroing pass), the others accumulate. Two MMA
        # objects with fixed flags: a flag set inside a staged branch would escape it.
        # Small heads: S^T = K . Q^T, the block tile as A.
        s_tile = (B_TOPK, self.b_h) if const_expr(self.small) else (B_H, B_TOPK)
        tiled_mma_qk, tiled_mma_qk_first = [
            sm90_utils.make_trivial_tiled_mma(
                e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), s_tile
            )
            for _ in range(2)
        ]
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_qk_first.set(warpgroup.Field.ACCUMULATE, False)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            e4m3,
            e4m3,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (64, self.b_h),
            warpgroup.OperandSource.RMEM,
        )
        # O^T always accumulates (zeroed once below).
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma_qk = tiled_mma_qk.get_slice(wtid)
        thr_mma_pv = tiled_mma_pv.get_slice(wtid)
        if const_expr(self.small):
            tSrK = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(cta.sK))  # (MMA, 1, d_qk/32, tile)
            tSrQ = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(cta.sQ))  # (MMA, 1, d_qk/32)
        else:
            tSrQ = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(cta.sQ))  # (MMA, 1, d_qk/32)
            tSrK = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(cta.sK))  # (MMA, 1, d_qk/32, tile)
        tOrP = tiled_mma_pv.make_fragment_B(thr_mma_pv.partition_B(cta.sP))  # (MMA, 1, 2, term * 4 + buffer)
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C(s_tile), Float32)
        rope_lo = None
        if const_expr(self.row_scaled and self.bf16_rope):  # S whole: the RoPE lo terms (small heads A, or B)
            if const_expr(self.small):
                rope_lo = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(cta.sLo))
            else:
                rope_lo = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(cta.sLo))
        qk_chunks = None
        if const_expr(self.qk_in_groups):
            if const_expr(self.small):  # S^T is small: a chunk accumulator its shape
                lo_fragments = None
                if const_expr(self.bf16_rope):  # the RoPE lo terms (A operands, as the block tiles)
                    lo_fragments = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(cta.sLo))
                qk_chunks = QkChunks(
                    part=cute.make_rmem_tensor(thr_mma_qk.partition_shape_C(s_tile), Float32),
                    rope_lo=lo_fragments,
                )
            else:  # S in two N = 32 halves: one [64 x 32] chunk accumulator (16 registers)
                half = (B_H, B_TOPK // 2)
                half_mmas = [
                    sm90_utils.make_trivial_tiled_mma(
                        e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), half
                    )
                    for _ in range(2)
                ]
                half_mmas[0].set(warpgroup.Field.ACCUMULATE, True)
                half_mmas[1].set(warpgroup.Field.ACCUMULATE, False)
                thr_half = half_mmas[0].get_slice(wtid)
                k_half_tile = (B_TOPK // 2, self.d_qk, NUM_KV_TILES)
                k_halves = [cute.local_tile(cta.sK, k_half_tile, (h, 0, 0)) for h in range(2)]
                lo_fragments = None
                if const_expr(self.bf16_rope):  # the RoPE lo terms, in the P tiles of the second term
                    lo_halves = [
                        cute.local_tile(cta.sLo, (B_TOPK // 2, B_TOPK, NUM_KV_TILES), (h, 0, 0))
                        for h in range(2)
                    ]
                    lo_fragments = [
                        half_mmas[0].make_fragment_B(thr_half.partition_B(lo)) for lo in lo_halves
                    ]
                qk_chunks = QkChunks(
                    part=cute.make_rmem_tensor(thr_half.partition_shape_C(half), Float32),
                    mmas=half_mmas,
                    k_halves=[half_mmas[0].make_fragment_B(thr_half.partition_B(k)) for k in k_halves],
                    rope_lo=lo_fragments,
                )
        acc_o = [
            cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((64, self.b_h)), Float32)
            for _ in range(D_TILES_PER_CONSUMER)
        ]
        # Per-row softmax state for rows 16*cwarp + quad_row + 8r, r = 0, 1 (exp2 domain); small heads: for
        # heads 8j + 2*quad_lane + e as entry 2j + e.
        row_max_own = cute.make_rmem_tensor((self.rows_per_thread,), Float32)
        row_max_true = cute.make_rmem_tensor((self.rows_per_thread,), Float32)
        row_sum = cute.make_rmem_tensor((self.rows_per_thread,), Float32)
        tile_state = (acc_o, row_max_own, row_max_true, row_sum)
        if const_expr(not self.persistent and not self.q_bf16):
            self.reset_tile_state(*tile_state)

        s_max_used, s_alpha, s_moved, s_row_sum, s_out_scale, s_max_true, s_max_own = cta.smem_stats
        c = Consumer(
            index=consumer,
            warp=wtid // 32,
            lane=lane,
            quad_row=lane // 4,
            quad_lane=lane % 4,
            work=None,  # set per tile
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_qk_first=tiled_mma_qk_first,
            tiled_mma_pv=tiled_mma_pv,
            tSrQ=tSrQ,
            tSrK=tSrK,
            tOrP=tOrP,
            acc_s=acc_s,
            acc_o=acc_o,
            thr_mma_pv=thr_mma_pv,
            row_max_own=row_max_own,
            row_max_true=row_max_true,
            row_sum=row_sum,
            s_max_used=s_max_used,
            s_alpha=s_alpha,
            s_moved=s_moved,
            s_max_true=s_max_true,
            s_row_sum=s_row_sum,
            s_max_own=s_max_own,
            s_out_scale=s_out_scale,
            sK_base=cta.sK.iterator.toint(),
            sP_base=cta.sP.iterator.toint(),
            mbar_kv_full=cta.mbar_kv_full,
            mbar_kv_empty=cta.mbar_kv_empty,
            mbar_p_full=cta.mbar_p_full,
            mbar_stats_full=cta.handover[0],
            mbar_tile_done=cta.handover[1],
            mbar_merge_full=cta.merge_barriers[0],
            mbar_peers_free=cta.merge_barriers[1],
            mIdx=cta.mIdx,
            # the rows a valid index is below; paged: the caches' token slots
            s_kv=cute.size(cta.mKV, mode=[0])
            if const_expr(self.cache is None)
            else slot_bounds(cta.mKV, cta.mExtraCache, cta.extra_from),
            s_valid_slots=cute.recast_tensor(cta.s_valid_words, Uint64) if const_expr(self.small) else None,
            # bf16 q: the rows' own scales join in consume_tile
            scale_log2=(cta.mKVScale[0] if const_expr(self.q_bf16) else cta.mQScale[0] * cta.mKVScale[0])
            * cta.sm_scale_log2,
            s_column_max=cta.small_tables[0] if const_expr(self.small) else None,
            s_head_sum=cta.small_tables[1] if const_expr(self.small) else None,
            s_column_max_shifted=cta.small_tables[2] if const_expr(self.small) else None,
            qk_chunks=qk_chunks,
            rope_lo=rope_lo,
            tables=cta.tables,
        )

        tile_barriers = (cta.mbar_q, cta.mbar_q_empty)
        epilogue_args = (cta.mSink, cta.mKVScale, cta.mOut, cta.mMaxLogits, cta.mLse, cta.flags)
        q_source = (cta.mQ, cta.sQ.iterator.toint(), cta.q_row_scale) if const_expr(self.q_bf16) else None
        if const_expr(self.persistent):
            pair_base = Int32(0)  # pairs of the CTA's earlier tiles (the producer counts the same)
            for tile_iter in cutlass.range(cta.tiles.count, unroll=1):
                work = self.scheduler.work(cta.tiles, tile_iter, 2 * (pair_base + self.q_pairs))
                if const_expr(self.q_bf16):
                    self.load_q_bf16(
                        c, work, cta.tiles.heads, tile_iter, q_source, cta.mbar_q, cta.mbar_q_empty
                    )
                self.reset_tile_state(*tile_state)
                self.consume_tile(c._replace(work=work), tile_iter, *tile_barriers, epilogue_args, q_source)
                pair_base += work.num_pairs + self.q_pairs
        else:
            work = self.scheduler.work(cta.tiles, 0, 2 * self.q_pairs)
            if const_expr(self.q_bf16):
                self.load_q_bf16(c, work, cta.tiles.heads, 0, q_source, cta.mbar_q, cta.mbar_q_empty)
                self.reset_tile_state(*tile_state)
            self.consume_tile(c._replace(work=work), 0, *tile_barriers, epilogue_args, q_source)

    @cute.jit
    def load_q_bf16(self, c: Consumer, work, heads, tile_iter, q_source, mbar_q, mbar_q_empty):
        """bf16 q, both consumers: the tile's Q rows, quantised into the shared Q tile with their scales
        (this thread's part of row 32 c + 4 w + g / 4 ...), then an arrival on ``q_full`` (all 256 threads:
        the tile is complete when it completes). Persistent: first wait until both consumers' QKs of the
        previous tile are done (``q_empty``).

        ``stage_q``: the rows staged in the pair slot before the tile's first block (``stage_q_rows``),
        released once read: ``kv_empty`` of both its tiles, and each consumer completes the ``p_full``
        phase of one of them (the other consumer waits for it), so that every ring position keeps one
        phase per use. Small heads: the rows loaded from global memory (``quantize_q_tile``; persistent:
        the next tile's rows prefetched into L2)."""
        mQ, sQ_base, q_row_scale = q_source
        if const_expr(self.persistent):
            if const_expr(not self.stage_q):
                if c.index == 0:
                    if c.warp == 0:
                        self.prefetch_next_q(mQ, work.tile, heads)
            TILE_RING.wait_empty(mbar_q_empty, tile_iter)
        thread = c.index * THREADS_PER_WG + c.warp * 32 + c.lane
        if const_expr(self.stage_q):
            staged = work.block_base - 2  # the ring positions of the slot's two block tiles
            for half in cutlass.range_constexpr(2):
                self.kv_ring.wait(c.mbar_kv_full, staged + half)
            quantize_staged_q_tile(
                c.sK_base + self.kv_ring.index(staged) * self.k_tile_bytes,
                thread,
                sQ_base,
                q_row_scale.iterator.toint(),
                B_H,
                self.d_qk,
            )
            for half in cutlass.range_constexpr(2):
                self.kv_ring.arrive(c.mbar_kv_empty, staged + half)
            self.kv_ring.arrive(c.mbar_p_full, staged + c.index)
        else:  # small heads: the first 4 * heads threads (whole warps)
            if thread < Q_THREADS_PER_ROW * self.b_h:
                q_row = self.scheduler.first_q_row(work.tile, heads)
                quantize_q_tile(mQ, q_row, thread, sQ_base, q_row_scale.iterator.toint(), self.b_h, self.d_qk)
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores, seen by the WGMMAs
        cute.arch.mbarrier_arrive(mbar_q)
        if const_expr(self.stage_q):
            # The other consumer's p_full phase of the slot completes before its q_full arrival, which
            # the tile waits for anyway: waited for here, so that no phase of p_full goes unobserved.
            self.kv_ring.wait(c.mbar_p_full, staged + 1 - c.index)

    @cute.jit
    def reset_tile_state(self, acc_o, row_max_own, row_max_true, row_sum):
        """O^T = 0 and the per-row softmax state emptied, before a tile."""
        zero = ptx.zero_f32()  # not hoisted into the prologue (see ptx.zero_f32)
        for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
            acc_o[mt].fill(zero)
        row_max_own.fill(-Float32.inf)
        row_max_true.fill(-Float32.inf)
        row_sum.fill(0.0)

    @cute.jit
    def consume_tile(self, c: Consumer, tile_iter, mbar_q, mbar_q_empty, epilogue_args, q_source):
        """One tile: the step loop over its blocks, then the epilogue.

        Persistent, besides: each consumer releases Q (``q_empty``) once its last QK of the tile
        has completed; after an odd block count both release the pair's zero-filled extra block,
        and its owner completes its ``p_full`` phase, so every ring position g keeps one phase per
        use.

        The P buffers, the running maxima and the row statistics are reused from tile to tile; two
        more mbarriers, each completing once per tile (tile t: phase t % 2), hand them over:

        - ``stats_full[c]``: the 128 threads of consumer c arrive after publishing the tile's row
          statistics; each epilogue waits on both (on its own too: a quad's first thread wrote
          what all four read);
        - ``tile_done``: the 128 threads of consumer 1 arrive after their epilogue; consumer 0 waits
          for the previous tile's completion before its first P of a tile (block 0) or, in a tile
          without blocks, before publishing its statistics.

        Consumer 1's first write of a tile follows consumer 0's epilogue of the previous tile
        through the ``p_full`` chain from block 0; in a tile without blocks it waits for
        ``stats_full[0]`` of the tile before publishing. So neither consumer writes P, a running
        max or its statistics of tile t + 1 before the other has read those of tile t. Neither
        barrier completes twice before a wait: ``stats_full[c]`` completes for tile t + 1 only
        after the other consumer's epilogue of tile t, ``tile_done`` for tile t + 1 only after
        consumer 1's epilogue of tile t + 1, which needs consumer 0's statistics of tile t + 1,
        published after its ``tile_done`` wait. And no arrival runs ahead into a barrier's next
        phase: a thread's arrival for tile t + 1 follows its epilogue's wait on its own
        ``stats_full[c]`` of tile t (``tile_done``: of tile t + 1), which completes only after every
        thread of its warpgroup has arrived for tile t."""
        consumer = c.index
        num_blocks = c.work.num_blocks
        TILE_RING.wait(mbar_q, tile_iter)
        if const_expr(self.q_bf16):  # row r's logit scale: its q scale times kv_scale * sm_scale
            q_row_scale = q_source[2]
            c = c._replace(
                scale_log2=tuple(
                    q_row_scale[self.softmax_row(c, r)] * c.scale_log2 for r in range(self.rows_per_thread)
                )
            )
        if const_expr(self.persistent):
            if num_blocks <= consumer:  # no QK here
                cute.arch.mbarrier_arrive(mbar_q_empty)
        if num_blocks > 0:
            # Step i: own block 2i + c (when it exists) and the other consumer's block 2i + c - 1
            # (when it exists); see consumer_steps.
            for step in cutlass.range(consumer_steps(num_blocks, consumer), unroll=1):
                own = 2 * step + consumer
                own_moved = Int32(0)
                if own < num_blocks:
                    tile = self.issue_qk(c, own)
                    if const_expr(self.small):  # from the producer (bit s: slot s of the block is valid)
                        valid_bits = row_valid_bits(c.s_valid_slots[tile], c.warp, c.quad_row)
                    else:  # the index row (with the producer's words two bf16-q persistent variants spill)
                        first_slot = own * B_TOPK
                        if const_expr(self.split):
                            first_slot += c.work.slot_base
                        valid_bits = slot_valid_bits(
                            c.mIdx, c.work.token, first_slot, c.lane, c.quad_lane, c.s_kv, c.work.valid_len, 2
                        )
                    warpgroup.wait_group(0)  # S(own)
                    if const_expr(self.row_scaled):
                        self.scale_row_scaled_s(c, tile)
                    if const_expr(self.persistent):
                        if own + 2 >= num_blocks:  # this consumer's last QK of the tile is done
                            cute.arch.mbarrier_arrive(mbar_q_empty)
                    if const_expr(self.small):
                        shifted = None  # P carries the rows' scales: (y maxima, x maxima), see softmax_own
                        if const_expr(self.p_carries_row_scale):
                            shifts = [
                                ptx.ld_shared_f32(c.tables.exponent + row * 4) for row in self.s_rows(c, tile)
                            ]
                            shifted = (shifts, c.s_column_max_shifted)
                        block_maxima = mask_and_column_max(
                            c.acc_s,
                            valid_bits,
                            c.scale_log2,
                            c.s_column_max,
                            (consumer, step % 2),
                            c.warp,
                            c.quad_row,
                            c.quad_lane,
                            int(NamedBarrierFp8.ColumnMax0) + consumer,
                            shifted,
                        )
                    else:
                        block_maxima = mask_and_row_max(c.acc_s, valid_bits, c.scale_log2)
                        if const_expr(self.p_carries_row_scale):  # (y maxima, x maxima), see softmax_own
                            shifts = functools.partial(self.slot_pair, c, c.tables.exponent, tile)
                            block_maxima = (shifted_row_max(c.acc_s, c.scale_log2, shifts), block_maxima)
                    if const_expr(self.persistent):
                        if own == 0:  # consumer 0, the tile's first P
                            self.wait_previous_tile(c, tile_iter)
                    own_moved = self.softmax_own(c, own, block_maxima)
                    if own + 2 >= num_blocks:  # this consumer's last own block
                        self.publish_row_stats(c)
                self.accumulate_pv(c, own - 1, own, own_moved)
                # Drained at the end of each step: WGMMAs in flight across the loop's back edge
                # make ptxas serialise them (C7520/C7513).
                warpgroup.wait_group(0)
        if num_blocks <= consumer:  # owned no block: nothing was published in the loop
            if const_expr(self.persistent):
                if num_blocks == 0:  # no p_full chain orders the statistics after the previous tile's
                    if consumer == 0:
                        self.wait_previous_tile(c, tile_iter)
                    else:
                        TILE_RING.wait(c.mbar_stats_full, tile_iter)  # consumer 0 published this tile's
            self.publish_row_stats(c)
        if const_expr(self.persistent):
            if num_blocks % 2 == 1:  # the last pair's zero-filled second block
                ring = c.work.block_base + num_blocks
                self.kv_ring.wait(c.mbar_kv_full, ring)
                self.kv_ring.arrive(c.mbar_kv_empty, ring)
                if consumer == 1:  # its owner (odd index)
                    self.kv_ring.arrive(c.mbar_p_full, ring)

        self.epilogue(c, tile_iter, *epilogue_args)
        if const_expr(self.persistent):
            if consumer == 1:  # consumer 1 has read everything of the tile that consumer 0 rewrites
                cute.arch.mbarrier_arrive(c.mbar_tile_done)

    @cute.jit
    def wait_previous_tile(self, c: Consumer, tile_iter):
        """Persistent, consumer 0: wait until consumer 1 has finished the previous tile (its
        ``tile_done`` completion ``tile_iter - 1``; nothing to wait for in the CTA's first tile)."""
        if tile_iter > 0:
            TILE_RING.wait(c.mbar_tile_done, tile_iter - 1)
