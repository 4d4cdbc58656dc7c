"""SM90 BF16 sparse MLA prefill: the bf16 counterpart of ``sparse_prefill`` (bf16 TMA + WGMMA).

Same semantics with q_scale = kv_scale = 1. A CTA computes 64 heads of one token; its producer
warpgroup gathers the token's KV rows in blocks of 32 into a ring of 3-4 slots, consumer c computes
S and P of block c of each pair (a speculative lazy running max, redone when it moves) and
O = P . V for half c of d_v, V read MN-major from the gathered tiles. Design: docs/kernel.md.

Constraints: those of ``sparse_prefill``, and q 16-byte aligned.
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from cute_kernels import ptx
from cute_kernels.interface import D_V
from cute_kernels.sm90.cta import (
    B_H,
    CONSUMER_THREADS,
    PRODUCER_WARPS,
    THREADS_PER_WG,
    AttentionKernel,
    consumer_index,
    init_cta,
    launch_cta,
)
from cute_kernels.sm90.epilogue import output_scale, publish_row_stats, write_max_logits_lse
from cute_kernels.sm90.mask import accumulator_row, exp2_relative, mask_and_row_max, slot_valid_bits
from cute_kernels.sm90.named_barrier import NamedBarrierBf16
from cute_kernels.sm90.ring import Ring
from cute_kernels.sm90.row_gather import RowGather, copy_rows, slot_valid_flag, swizzle_offset
from cute_kernels.sm90.row_views import load_q_tile
from cute_kernels.sm90.shared_storage import allocate_shared_storage, tile_region, tile_tensor
from cute_kernels.sm90.tile_scheduler import TileScheduler, TileWork, plain_int32

B_TOPK = 32  # gathered KV rows per block: the N tile of S, two k-steps of the PV product
PAIR = 2 * B_TOPK  # rows per loop iteration (one block per consumer)
D_V_PER_CONSUMER = 256  # the N tile of O per consumer
ELEM_BYTES = 2
SW128_ROW_BYTES = 128  # bytes per row of one 128-byte-swizzled column tile (64 bf16)
SW128_COLS = SW128_ROW_BYTES // ELEM_BYTES
COL_TILE_BYTES = B_TOPK * SW128_ROW_BYTES  # one [32 rows x 128 B] column tile of a block
P_TILE_BYTES = B_H * PAIR * ELEM_BYTES  # P of one pair: [64 heads x 64 slots] bf16
PAIR_PARITY = Ring(2)  # pair p writes P, the row maxima and the redo flag into buffer p % 2
RESCALE_THRESHOLD = 8.0  # log2 units: the running max moves only past this (P <= 2^8 in bf16)
MAX_SMEM_BYTES = 232448  # SM90 opt-in dynamic shared memory per block

PRODUCER_REGS = 40
CONSUMER_REGS = 232


def num_slots_for(d_qk: int) -> int:
    """Ring slots (32-row blocks) that fit next to Q, P and the statistics: 4 at 512, 3 at 576."""
    return 4 if d_qk == 512 else 3


class Consumer(NamedTuple):
    """One consumer warpgroup's view of the CTA (trace-time bundle)."""

    index: Int32  # c: block of each pair for S, half of d_v for O (warp-uniform)
    warp: Int32  # warp inside the warpgroup: rows 16*warp.. of every M tile
    lane: Int32
    quad_row: Int32  # g: C-fragment row inside the warp's 16 rows
    quad_lane: Int32  # t: C-fragment column pair 2t, 2t+1
    work: TileWork
    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor  # Q descriptors (MMA, 1, d_qk/16)
    tSrK: cute.Tensor  # K descriptors (MMA, 1, d_qk/16, slot)
    tOrP: cute.Tensor  # P descriptors (MMA, 1, 4 k-steps, parity)
    tOrV: cute.Tensor  # V descriptors (MMA, 1, 2 k-steps, slot, consumer)
    acc_s: cute.Tensor  # S of this consumer's block (16 f32)
    acc_o: cute.Tensor  # O[64 heads, 256 d] of this consumer's half (128 f32)
    row_max_used: cute.Tensor  # per row r: max the stored P are relative to (exp2 domain)
    row_max_true: cute.Tensor  # per row r: exact running max (for max_logits)
    row_sum: cute.Tensor  # per row r: this thread's partial sum of P
    s_update: cute.Tensor  # smem [parity]: the last pair that needs the synchronous softmax
    s_max_true: cute.Tensor  # smem [row, consumer]: exact maxima (epilogue)
    s_row_max: cute.Tensor  # smem [row, consumer, parity]: block row maxima
    s_row_sum: cute.Tensor  # smem [row, consumer]
    sP_base: Int32  # shared-memory byte address of the P tiles
    mbar_kv_full: cute.Pointer
    mIdx: cute.Tensor
    s_kv: Int32
    scale_log2: Float32  # sm_scale * log2(e)


class ConsumerInputs(NamedTuple):
    """What the kernel hands its consumer warpgroups (``SparsePrefillBf16Sm90.consume``)."""

    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor  # V^T: the gathered tiles seen as PV's MN-major B operand
    sP: cute.Tensor
    smem_stats: tuple  # row_max, row_sum, update, max_true
    mIdx: cute.Tensor
    mKV: cute.Tensor
    mSink: cute.Tensor
    mOut: cute.Tensor
    mMaxLogits: cute.Tensor
    mLse: cute.Tensor
    mbar_q: cute.Pointer
    mbar_kv_full: cute.Pointer
    mbar_kv_empty: cute.Pointer
    sm_scale_log2: Float32
    flags: Int32
    work: object  # the CTA's tile (TileScheduler.work)


class SparsePrefillBf16Sm90(AttentionKernel):
    """Compile-time configuration of the bf16 kernel: ``d_qk`` (512 or 576)."""

    SMEM_ATOM_KIND = warpgroup.SmemLayoutAtomKind.K_SW128
    ELEMENT_TYPE = BFloat16

    def __init__(self, d_qk: int):
        if d_qk not in (512, 576):
            raise ValueError(f"d_qk must be 512 or 576, got {d_qk}")
        self.d_qk = d_qk
        self.num_slots = num_slots_for(d_qk)
        self.scheduler = TileScheduler(False, B_TOPK)  # one tile per CTA
        self.kv_ring = Ring(self.num_slots)  # block b: KV slot b % num_slots and its barriers
        self.k_tile_bytes = B_TOPK * d_qk * ELEM_BYTES  # one gathered block in shared memory
        self.q_tile_bytes = B_H * d_qk * ELEM_BYTES
        self.q_shape = (B_H, d_qk)
        self.k_shape = (B_TOPK, d_qk, self.num_slots)
        self.p_shape = (B_H, PAIR, 2)  # [parity] P tiles of a pair

    def shared_storage(self):
        """The CTA's shared memory: barriers and row statistics, then the Q, KV block and P tiles."""

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, 1]
            mbar_kv_full: cute.struct.MemRange[Int64, self.num_slots]
            mbar_kv_empty: cute.struct.MemRange[Int64, self.num_slots]
            row_max: cute.struct.MemRange[Float32, B_H * 2 * 2]  # [row, consumer, parity]
            row_sum: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            max_true: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            update: cute.struct.MemRange[Int32, 2]  # [parity]
            sQ: tile_region(BFloat16, self.q_shape)
            sK: tile_region(BFloat16, self.k_shape)
            sP: tile_region(BFloat16, self.p_shape)

        return SharedStorage

    # ------------------------------------------------------------------------------------
    # Host side: layouts, TMA atom, shared storage, launch
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h, d_qk] bf16, row-major
        mKV: cute.Tensor,  # [s_kv, 1, d_qk] bf16, row stride dynamic (multiple of 8 elements)
        mIdx: cute.Tensor,  # [s_q, 1, topk] int32, row stride dynamic
        mTopkLen: cute.Tensor,  # [s_q] int32 (read when flags & 1)
        mSink: cute.Tensor,  # [h] f32 (read when flags & 2)
        mOut: cute.Tensor,  # [s_q, h, 512] bf16, row-major
        mMaxLogits: cute.Tensor,  # [s_q, h] f32, row-major
        mLse: cute.Tensor,  # [s_q, h] f32, row-major
        sm_scale_log2: Float32,  # sm_scale * log2(e)
        flags: Int32,  # bit 0: topk_length given, bit 1: attn_sink given
        stream,
    ):
        views, layouts, tma_atom_q, tma_tensor_q = self.host_setup(mQ, mKV, mIdx, mMaxLogits, mLse)
        sQ_layout, sK_layout, sP_layout = layouts
        # V as the MN-major B operand of PV, viewing the same gathered tiles: (d, slot, ring slot,
        # consumer) with d = (64 inside a column tile, 4 column tiles), slot = (8 rows of an
        # atom, 4 atoms); the consumer's half starts 4 column tiles further.
        sV_outer = cute.make_layout(
            ((SW128_COLS, 4), (8, B_TOPK // 8), self.num_slots, 2),
            stride=(
                (1, COL_TILE_BYTES // ELEM_BYTES),
                (SW128_COLS, 8 * SW128_COLS),
                B_TOPK * self.d_qk,
                4 * COL_TILE_BYTES // ELEM_BYTES,
            ),
        )
        launch_cta(
            self.kernel(
                tma_atom_q,
                tma_tensor_q,
                views.kv,
                views.indices,
                mTopkLen,
                mSink,
                mOut,
                views.max_logits,
                views.lse,
                sm_scale_log2,
                flags,
                sQ_layout,
                sK_layout,
                sP_layout,
                sV_outer,
                self.shared_storage(),
            ),
            self.scheduler.grid(self.scheduler.num_tiles(cute.size(mQ, mode=[0]), cute.size(mQ, mode=[1]))),
            stream,
        )

    # ------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mSink: cute.Tensor,
        mOut: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        sm_scale_log2: Float32,
        flags: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sV_outer: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bid, _, _ = cute.arch.block_idx()

        storage = allocate_shared_storage(SharedStorage)
        mbar_q = storage.mbar_q.data_ptr()
        mbar_kv_full = storage.mbar_kv_full.data_ptr()
        mbar_kv_empty = storage.mbar_kv_empty.data_ptr()
        sQ = tile_tensor(storage.sQ, sQ_layout)
        sK = tile_tensor(storage.sK, sK_layout)
        sV = storage.sK.get_tensor(sV_outer, swizzle=sK_layout.inner)
        sP = tile_tensor(storage.sP, sP_layout)
        init_cta(
            warp_idx, tma_atom_q, functools.partial(self.init_barriers, mbar_q, mbar_kv_full, mbar_kv_empty)
        )

        tiles = self.scheduler.cta_tiles(bid, mIdx, mTopkLen, cute.size(mOut, mode=[1]), flags)
        work = self.scheduler.work(tiles, 0, 0)

        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(
                tma_atom_q, mQ_tma, sQ, sK, mKV, mIdx, mbar_q, mbar_kv_full, mbar_kv_empty, work, tiles.heads
            )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            consumer = consumer_index(warp_idx)
            smem_stats = (
                storage.row_max.get_tensor(cute.make_layout((B_H, 2, 2))),
                storage.row_sum.get_tensor(cute.make_layout((B_H, 2))),
                storage.update.get_tensor(cute.make_layout(2)),
                storage.max_true.get_tensor(cute.make_layout((B_H, 2))),
            )
            self.consume(
                consumer,
                ConsumerInputs(
                    sQ, sK, sV, sP, smem_stats, mIdx, mKV, mSink, mOut, mMaxLogits, mLse, mbar_q,
                    mbar_kv_full, mbar_kv_empty, sm_scale_log2, flags, work,
                ),
            )  # fmt: skip

    @cute.jit
    def init_barriers(self, mbar_q, mbar_kv_full, mbar_kv_empty):
        """(One thread.) q_full: the TMA; per ring slot, kv_full: the producer warpgroup (cp.async
        arrivals), kv_empty: both consumers."""
        cute.arch.mbarrier_init(mbar_q, 1)
        for i in cutlass.range_constexpr(self.num_slots):
            cute.arch.mbarrier_init(mbar_kv_full + i, THREADS_PER_WG)
            cute.arch.mbarrier_init(mbar_kv_empty + i, CONSUMER_THREADS)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self, tma_atom_q, mQ_tma, sQ, sK, mKV, mIdx, mbar_q, mbar_kv_full, mbar_kv_empty, work, heads
    ):
        """WG0: Q by TMA (one thread), then the block-by-block row gather into the ring; ``heads``: h."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if warp_idx == 0:
            q_row = self.scheduler.first_q_row(work.tile, heads)
            load_q_tile(tma_atom_q, mQ_tma, sQ, mbar_q, q_row, B_H, self.d_qk, self.q_tile_bytes)

        # Lane: 16-byte chunk lane % 8 of each 128-byte column tile (of rows row0 and row0 + 4).
        gather = RowGather(mKV, sK, self.d_qk, lane, SW128_ROW_BYTES, B_TOPK)
        row0 = warp_idx * 8 + lane // 8  # this lane copies rows row0 and row0 + 4 of each block

        for block in cutlass.range(2 * work.num_pairs, unroll=1):
            ring = self.kv_ring.index(block)
            phase = self.kv_ring.phase(block)
            slot_a = block * B_TOPK + row0
            slot_b = slot_a + 4
            kv_a = mIdx[work.token, slot_a]
            kv_b = mIdx[work.token, slot_b]
            valid_a = slot_valid_flag(kv_a, slot_a, gather.s_kv, work.valid_len)
            valid_b = slot_valid_flag(kv_b, slot_b, gather.s_kv, work.valid_len)
            cute.arch.mbarrier_wait(mbar_kv_empty + ring, phase ^ 1)
            tile_base = gather.sK_base + ring * self.k_tile_bytes
            copy_rows(gather, tile_base, row0, ((0, kv_a, valid_a), (4, kv_b, valid_b)))
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar_kv_full + ring)
        ptx.cp_async_wait_all()

    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, consumer, cta: ConsumerInputs):
        """WG1/WG2: S for block c of each pair, softmax, O for half c of d_v, epilogue."""
        sQ, sK, sV, sP, smem_stats, mIdx, mKV, mSink, mOut, mMaxLogits, mLse = cta[:11]
        mbar_q, mbar_kv_full, mbar_kv_empty, sm_scale_log2, flags, work = cta[11:]
        bf16 = sQ.element_type
        wtid = cute.arch.thread_idx()[0] % THREADS_PER_WG  # thread index inside the warpgroup
        lane = cute.arch.lane_idx()

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (B_H, B_TOPK)
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1), (B_H, D_V_PER_CONSUMER)
        )
        # Both always accumulate: O is zeroed once below, S before each block (16 registers).
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma_qk = tiled_mma_qk.get_slice(wtid)
        thr_mma_pv = tiled_mma_pv.get_slice(wtid)
        tSrQ = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrP = tiled_mma_pv.make_fragment_A(thr_mma_pv.partition_A(sP))
        tOrV = tiled_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sV))
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((B_H, B_TOPK)), Float32)
        acc_o = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((B_H, D_V_PER_CONSUMER)), Float32)
        acc_o.fill(0.0)

        # Per-row softmax state for rows 16*warp + quad_row + 8r, r = 0, 1 (exp2 domain).
        row_max_used = cute.make_rmem_tensor((2,), Float32)
        row_max_true = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max_used.fill(-Float32.inf)
        row_max_true.fill(-Float32.inf)
        row_sum.fill(0.0)

        s_row_max, s_row_sum, s_update, s_max_true = smem_stats
        if wtid == 0:  # before any reader: pair 0 always takes the synchronous path
            if consumer == 0:
                s_update[0] = -1
                s_update[1] = -1
        c = Consumer(
            index=consumer,
            warp=wtid // 32,
            lane=lane,
            quad_row=lane // 4,
            quad_lane=lane % 4,
            work=work,
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            tSrQ=tSrQ,
            tSrK=tSrK,
            tOrP=tOrP,
            tOrV=tOrV,
            acc_s=acc_s,
            acc_o=acc_o,
            row_max_used=row_max_used,
            row_max_true=row_max_true,
            row_sum=row_sum,
            s_update=s_update,
            s_max_true=s_max_true,
            s_row_max=s_row_max,
            s_row_sum=s_row_sum,
            sP_base=sP.iterator.toint(),
            mbar_kv_full=mbar_kv_full,
            mIdx=mIdx,
            s_kv=cute.size(mKV, mode=[0]),
            scale_log2=sm_scale_log2,
        )

        cute.arch.mbarrier_wait(mbar_q, 0)
        if work.num_pairs > 0:
            for pair in cutlass.range(work.num_pairs, unroll=1):
                self.issue_qk(c, pair)
                first_slot = pair * PAIR + consumer * B_TOPK  # this consumer's block of the pair
                valid_bits = slot_valid_bits(
                    c.mIdx, work.token, first_slot, c.lane, c.quad_lane, c.s_kv, work.valid_len, 1
                )
                warpgroup.wait_group(0)  # S(pair)
                block_maxima = mask_and_row_max(
                    c.acc_s, valid_bits, c.scale_log2, functools.partial(self.publish_row_max, c, pair)
                )
                if pair == 0:
                    self.softmax_p(c, pair)  # O is still 0: nothing to rescale
                else:
                    self.softmax_p_speculative(c, pair, block_maxima)
                self.issue_pv(c, pair)
                # Drained every iteration: no WGMMA in flight across the loop's back edge (C7520).
                warpgroup.wait_group(0)
                for b in cutlass.range_constexpr(2):  # both consumers' PV read both blocks
                    self.kv_ring.arrive(mbar_kv_empty, 2 * pair + b)

        self.epilogue(c, mSink, mOut, mMaxLogits, mLse, flags)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def issue_qk(self, c: Consumer, pair):
        """Queue S = Q . K_c^T for block 2 pair + c (one WGMMA group). A block past topk_length is
        zero-filled and fully masked; its product is not skipped (a branch around the WGMMAs makes
        ptxas inject warpgroup.arrive, C7519)."""
        block = 2 * pair + c.index
        ring = self.kv_ring.index(block)
        cute.arch.mbarrier_wait(c.mbar_kv_full + ring, self.kv_ring.phase(block))
        c.acc_s.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.d_qk // 16):
            cute.gemm(c.tiled_mma_qk, c.acc_s, c.tSrQ[None, None, k], c.tSrK[None, None, k, ring], c.acc_s)
        warpgroup.commit_group()

    @cute.jit
    def publish_row_max(self, c: Consumer, pair, r, row_max):
        """Row ``r``'s max of this consumer's block of ``pair`` into shared memory (exp2 domain), for
        the other consumer."""
        if c.quad_lane == 0:
            c.s_row_max[accumulator_row(c.warp, c.quad_row, r), c.index, PAIR_PARITY.index(pair)] = row_max

    @cute.jit
    def softmax_p(self, c: Consumer, pair):
        """First pair: agree on the running max with the other consumer (named barrier 1), store P
        (named barrier 2 publishes both halves)."""
        cute.arch.barrier(barrier_id=NamedBarrierBf16.MaxReady, number_of_threads=CONSUMER_THREADS)
        self.exp_with_pair_max(c, pair, False)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=NamedBarrierBf16.PReady, number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def softmax_p_speculative(self, c: Consumer, pair, block_maxima):
        """Later pairs: store P relative to the running max both consumers already share, with no
        exchange first; if some row's block max exceeds it by more than the threshold, the pair
        is flagged and both consumers redo it synchronously (new max, P rewritten, O rescaled)."""
        parity = PAIR_PARITY.index(pair)
        logit_scale = c.scale_log2 if c.scale_log2 > 0.0 else Float32(1.0)
        tile_addr = c.sP_base + parity * P_TILE_BYTES
        exceeds = False
        block_sums = []
        for r in cutlass.range_constexpr(2):
            row = accumulator_row(c.warp, c.quad_row, r)
            c.row_max_true[r] = cute.arch.fmax(c.row_max_true[r], block_maxima[r])
            exceeds = exceeds | (block_maxima[r] - c.row_max_used[r] > RESCALE_THRESHOLD)
            max_used = c.row_max_used[r]
            bias = max_used if max_used != -Float32.inf else Float32(0.0)
            block_sums.append(self.exp_and_store_p(c, r, row, logit_scale, bias, tile_addr))
        if exceeds:
            c.s_update[parity] = pair  # any thread: this pair needs the synchronous path
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=NamedBarrierBf16.PReady, number_of_threads=CONSUMER_THREADS)
        if c.s_update[parity] == pair:
            self.exp_with_pair_max(c, pair, True)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=NamedBarrierBf16.PReady, number_of_threads=CONSUMER_THREADS)
        else:
            for r in cutlass.range_constexpr(2):
                c.row_sum[r] = c.row_sum[r] + block_sums[r]

    @cute.jit
    def exp_with_pair_max(self, c: Consumer, pair, rescale: cutlass.Constexpr):
        """Both consumers' block maxima are published: move the lazy running max where the pair's
        max exceeds it by more than the threshold, store P relative to it, accumulate the row
        sums and (``rescale``) multiply this thread's O rows by alpha."""
        parity = PAIR_PARITY.index(pair)
        logit_scale = c.scale_log2 if c.scale_log2 > 0.0 else Float32(1.0)
        tile_addr = c.sP_base + parity * P_TILE_BYTES
        for r in cutlass.range_constexpr(2):
            row = accumulator_row(c.warp, c.quad_row, r)
            pair_max = cute.arch.fmax(c.s_row_max[row, 0, parity], c.s_row_max[row, 1, parity])
            c.row_max_true[r] = cute.arch.fmax(c.row_max_true[r], pair_max)
            alpha = Float32(1.0)
            if pair_max - c.row_max_used[r] > RESCALE_THRESHOLD:  # a difference: exact near huge maxima
                alpha = cute.math.exp2(c.row_max_used[r] - pair_max, fastmath=True)
                c.row_max_used[r] = pair_max
            max_used = c.row_max_used[r]
            bias = max_used if max_used != -Float32.inf else Float32(0.0)
            block_sum = self.exp_and_store_p(c, r, row, logit_scale, bias, tile_addr)
            c.row_sum[r] = c.row_sum[r] * alpha + block_sum
            if const_expr(rescale):
                for j in cutlass.range_constexpr(D_V_PER_CONSUMER // 8):
                    for e in cutlass.range_constexpr(2):
                        c.acc_o[e + 2 * r + 4 * j] = c.acc_o[e + 2 * r + 4 * j] * alpha

    @cute.jit
    def exp_and_store_p(self, c: Consumer, r, row, logit_scale, bias, tile_addr):
        """Row ``r`` of this thread's S (left unchanged): p = 2^(S * scale - bias), stored as bf16 P
        (columns 32c + 8j + 2t, +1: one 32-bit word per j in the 128-byte-swizzled P tile);
        returns the sum of the 8 p."""
        block_sum = Float32(0.0)
        for j in cutlass.range_constexpr(B_TOPK // 8):
            p0 = exp2_relative(c.acc_s[2 * r + 4 * j], logit_scale, bias)
            p1 = exp2_relative(c.acc_s[1 + 2 * r + 4 * j], logit_scale, bias)
            block_sum += p0 + p1
            addr = (
                tile_addr
                + swizzle_offset(row, c.index * (B_TOPK // 8) + j, SW128_ROW_BYTES)
                + 4 * c.quad_lane
            )
            ptx.st_shared_u32(addr, ptx.pack_bf16x2(p0, p1))
        return block_sum

    @cute.jit
    def issue_pv(self, c: Consumer, pair):
        """Queue O += P . V for the pair's 64 slots (4 k-steps of m64n256k16, one WGMMA group)."""
        # The other consumer's block is read too: wait on its barrier (a no-op wait by now) so
        # its cp.async writes are visible to this thread.
        other = 2 * pair + 1 - c.index
        self.kv_ring.wait(c.mbar_kv_full, other)
        warpgroup.fence()
        for ks in cutlass.range_constexpr(PAIR // 16):
            ring = self.kv_ring.index(2 * pair + ks // 2)
            cute.gemm(
                c.tiled_mma_pv,
                c.acc_o,
                c.tOrP[None, None, ks, PAIR_PARITY.index(pair)],
                c.tOrV[None, None, ks % 2, ring, c.index],
                c.acc_o,
            )
        warpgroup.commit_group()

    @cute.jit
    def epilogue(self, c: Consumer, mSink, mOut, mMaxLogits, mLse, flags):
        """Normalise O, apply the sink, write out (bf16), max_logits and lse."""
        tables = ((c.s_max_true, c.row_max_true),)
        publish_row_stats(c.row_sum, c.s_row_sum, tables, c.warp, c.quad_row, c.quad_lane, c.index)
        cute.arch.barrier(barrier_id=NamedBarrierBf16.SumReady, number_of_threads=CONSUMER_THREADS)
        out_base = mOut.iterator.toint()
        rows = self.scheduler.rows(c.work.tile, plain_int32(cute.size(mOut, mode=[1])))
        for r in cutlass.range_constexpr(2):
            row = accumulator_row(c.warp, c.quad_row, r)
            if row < rows.head_rows:  # a row of the token's heads (the others are not written)
                out_row = rows.q_row + row
                row_total = c.s_row_sum[row, 0] + c.s_row_sum[row, 1]
                max_used = c.row_max_used[r]
                head = rows.first_head + row
                out_scale = output_scale(row_total, max_used, Float32(1.0), flags, mSink, head, 0)
                if c.quad_lane == 0:
                    if c.index == 0:
                        write_max_logits_lse(
                            mMaxLogits, mLse, out_row, row_total, max_used, c.s_max_true, row, 0
                        )
                row_addr = out_base + Int64(out_row) * (D_V * ELEM_BYTES)
                for j in cutlass.range_constexpr(D_V_PER_CONSUMER // 8):
                    d = c.index * D_V_PER_CONSUMER + 8 * j + 2 * c.quad_lane
                    word = ptx.pack_bf16x2(
                        c.acc_o[2 * r + 4 * j] * out_scale, c.acc_o[1 + 2 * r + 4 * j] * out_scale
                    )
                    ptx.st_global_u32(row_addr + d * ELEM_BYTES, word)
