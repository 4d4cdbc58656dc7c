"""SM90 FP8 sparse MLA prefill: out = softmax(q . kv[idx]^T) . kv[idx, :512], TMA + WGMMA e4m3.

One CTA per (query token, group of B_H = 64 heads): the Q tile is [64, d_qk], the CTA walks the
token's ``topk`` gathered KV rows in blocks of B_TOPK = 64 rows, two blocks (a *pair*) at a
time, so ``topk % 128 == 0``.

Warp roles (384 threads, ``setmaxregister``; launched with ``min_blocks_per_mp=1``):

- WG0, the producer. One thread issues the Q tile's TMA. Every pair, warps 0-1 gather the
  pair's first block and warps 2-3 its second: 16-byte ``cp.async`` copies straight from the
  gathered rows into the K-major, 64-byte-swizzled tile (L2 evict-last). A slot that is not
  valid (index outside [0, s_kv), or slot >= topk_length) is zero-filled and never read.
- WG1 / WG2, the consumers c = 0 / 1. Consumer c owns block c of every pair for S = Q.K^T and
  half c of d_v (256 columns) for O.
  1. S_c = Q . K_c^T: SS WGMMA m64n64k32 over d_qk (e4m3 x e4m3 -> f32).
  2. Logits are scaled by ``q_scale*kv_scale*sm_scale*log2(e)`` (exp2 domain), invalid slots
     set to -inf, row maxima exchanged between the consumers through shared memory (named
     barrier 1) so both use the same running max m for the pair.
  3. P_c = exp2(S - m) * 2^8 (an exact power of two, so small probabilities stay normal in e4m3)
     is rounded to e4m3 and stored, head-major, as the K-major B operand of the PV product
     (named barrier 2 publishes both blocks' P).
  4. The PV product is computed transposed, O^T[d, h] += V^T[d, slot] . P^T[slot, h], with
     A = V^T taken from registers (RS WGMMA): ``ldmatrix.trans`` reads the gathered rows as
     they are (no transposed copy of V in shared memory), and two byte permutes turn each pair
     of 8x8 b16 matrices into the e4m3 A fragment. The slot order this produces inside each
     32-slot k-step (sigma below) is the order in which P is stored, so the product is exact;
     the d order it produces (A row g <-> d 2g, row g+8 <-> d 2g+1) is undone in the epilogue,
     where each thread then owns two adjacent d columns (one 32-bit bf16x2 store).
- Epilogue: row sums are exchanged (named barrier 3); out = O / (2^8 (l + exp(sink - m)))
  * kv_scale in bf16; max_logits = m ln2, lse = (m + log2 l) ln2. A row with no valid slot
  writes out = 0, max_logits = -inf, lse = +inf.

Barriers: mbarriers ``q_full``; ``kv_full[stage][block]`` (64 producer threads, cp.async
arrive.noinc); ``kv_empty[stage]`` (256 consumer threads). Shared buffers that both consumers
write per pair (row maxima, P) are double-buffered by pair parity.

Constraints: h % 64 == 0 (the wrapper pads heads), topk % 128 == 0, d_qk in {512, 576},
d_v = 512, every tensor row-major with 16-byte aligned rows. ``topk_length`` values are
clamped to [0, topk]; only ceil(topk_length / 128) pairs are visited.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from cute_kernels import ptx

B_H = 64  # heads per CTA: one WGMMA M tile
B_TOPK = 64  # gathered KV rows per block: the N tile of S and two k-steps of the PV product
PAIR = 2 * B_TOPK  # rows per loop iteration (one block per consumer)
D_V = 512  # value width: the first 512 columns of each KV row
NUM_STAGES = 2  # pairs of KV blocks in flight
P_SCALE = 256.0  # 2^8: P is stored as e4m3(p * 2^8); undone in the epilogue
SW64_TILE_COLS = 64  # bytes per row of one 64-byte-swizzled column tile
TILE_ROW_GROUP_BYTES = B_TOPK * SW64_TILE_COLS  # one [64 rows x 64 B] swizzle column tile

THREADS_PER_WG = 128
NUM_THREADS = 3 * THREADS_PER_WG
PRODUCER_REGS = 40
CONSUMER_REGS = 232

# Named barrier ids (0 is __syncthreads).
BAR_MAX_READY = 1  # both consumers published their block's row maxima
BAR_P_READY = 2  # both consumers stored P and alpha
BAR_SUM_READY = 3  # both consumers published their row sums (epilogue)
BAR_SCALE_READY = 4  # per consumer (4 + c): output scales ready (epilogue)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _swizzle64(row, chunk16):
    """Byte offset of 16-byte chunk ``chunk16`` (0..3) of ``row`` inside a [rows x 64 B]
    column tile with the WGMMA 64-byte swizzle (Swizzle<2,4,3>: chunk ^= (row >> 1) & 3)."""
    return row * SW64_TILE_COLS + ((chunk16 ^ ((row >> 1) & 3)) << 4)


class SparsePrefillSm90:
    """Compile-time configuration of the kernel: ``d_qk`` (512 or 576)."""

    def __init__(self, d_qk: int):
        if d_qk not in (512, 576):
            raise ValueError(f"d_qk must be 512 or 576, got {d_qk}")
        self.d_qk = d_qk
        self.k_tile_bytes = B_TOPK * d_qk  # one gathered block in shared memory
        self.q_tile_bytes = B_H * d_qk

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory per CTA (the SharedStorage struct built in ``__call__``)."""
        barriers_and_stats = 8 * (1 + 3 * NUM_STAGES) + 4 * B_H * (4 + 4 + 2 + 2)
        aligned = -(-barriers_and_stats // 1024) * 1024
        return aligned + self.q_tile_bytes + NUM_STAGES * 2 * self.k_tile_bytes + 2 * B_H * PAIR

    # ------------------------------------------------------------------------------------
    # Host side: layouts, TMA atom, shared storage, launch
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h, d_qk] e4m3, row-major
        mKV: cute.Tensor,  # [s_kv, 1, d_qk] e4m3, row stride dynamic (multiple of 16 bytes)
        mIdx: cute.Tensor,  # [s_q, 1, topk] int32, row stride dynamic
        mTopkLen: cute.Tensor,  # [s_q] int32 (read when flags & 1)
        mSink: cute.Tensor,  # [h] f32 (read when flags & 2)
        mQScale: cute.Tensor,  # [1] f32
        mKVScale: cute.Tensor,  # [1] f32
        mOut: cute.Tensor,  # [s_q, h, 512] bf16, row-major
        mMaxLogits: cute.Tensor,  # [s_q, h] f32, row-major
        mLse: cute.Tensor,  # [s_q, h] f32, row-major
        sm_scale_log2: Float32,  # sm_scale * log2(e)
        flags: Int32,  # bit 0: topk_length given, bit 1: attn_sink given
        stream,
    ):
        e4m3 = mQ.element_type
        # Row views: query rows are (token, head) pairs; kv and indices keep their row strides.
        rows = cute.size(mQ, mode=[0]) * cute.size(mQ, mode=[1])
        mQ_rows = cute.make_tensor(mQ.iterator, cute.make_layout((rows, self.d_qk), stride=(self.d_qk, 1)))
        mKV_rows = cute.make_tensor(
            mKV.iterator, cute.make_layout((cute.size(mKV, mode=[0]), self.d_qk), stride=(mKV.stride[0], 1))
        )
        mIdx_rows = cute.make_tensor(
            mIdx.iterator,
            cute.make_layout(
                (cute.size(mIdx, mode=[0]), cute.size(mIdx, mode=[2])), stride=(mIdx.stride[0], 1)
            ),
        )
        mMaxLogits_rows = cute.make_tensor(mMaxLogits.iterator, cute.make_layout(rows))
        mLse_rows = cute.make_tensor(mLse.iterator, cute.make_layout(rows))
        smem_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, e4m3)
        sQ_layout = cute.tile_to_shape(smem_atom, (B_H, self.d_qk), (0, 1))
        sK_layout = cute.tile_to_shape(smem_atom, (B_TOPK, self.d_qk, NUM_STAGES * 2), (0, 1, 2))
        sP_layout = cute.tile_to_shape(smem_atom, (B_H, PAIR, 2), (0, 1, 2))

        tma_atom_q, tma_tensor_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ_rows, sQ_layout, (B_H, self.d_qk)
        )

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, 1]
            mbar_kv_full: cute.struct.MemRange[Int64, NUM_STAGES * 2]
            mbar_kv_empty: cute.struct.MemRange[Int64, NUM_STAGES]
            row_max: cute.struct.MemRange[Float32, B_H * 2 * 2]  # [row, consumer, parity]
            alpha: cute.struct.MemRange[Float32, B_H * 2 * 2]  # [row, consumer, parity]
            row_sum: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            out_scale: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            sQ: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sP_layout)], 1024]

        num_ctas = rows // B_H
        self.kernel(
            tma_atom_q,
            tma_tensor_q,
            mKV_rows,
            mIdx_rows,
            mTopkLen,
            mSink,
            mQScale,
            mKVScale,
            mOut,
            mMaxLogits_rows,
            mLse_rows,
            sm_scale_log2,
            flags,
            sQ_layout,
            sK_layout,
            sP_layout,
            SharedStorage,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
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
        mQScale: cute.Tensor,
        mKVScale: cute.Tensor,
        mOut: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        sm_scale_log2: Float32,
        flags: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bid, _, _ = cute.arch.block_idx()

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_q = storage.mbar_q.data_ptr()
        mbar_kv_full = storage.mbar_kv_full.data_ptr()
        mbar_kv_empty = storage.mbar_kv_empty.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        s_row_max = storage.row_max.get_tensor(cute.make_layout((B_H, 2, 2)))
        s_alpha = storage.alpha.get_tensor(cute.make_layout((B_H, 2, 2)))
        s_row_sum = storage.row_sum.get_tensor(cute.make_layout((B_H, 2)))
        s_out_scale = storage.out_scale.get_tensor(cute.make_layout((B_H, 2)))

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_q, 1)
                for i in cutlass.range_constexpr(NUM_STAGES * 2):
                    cute.arch.mbarrier_init(mbar_kv_full + i, 2 * 32)
                for i in cutlass.range_constexpr(NUM_STAGES):
                    cute.arch.mbarrier_init(mbar_kv_empty + i, 2 * THREADS_PER_WG)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Problem geometry of this CTA.
        topk = cute.size(mIdx, mode=[1])
        num_head_groups = cute.size(mOut, mode=[1]) // B_H
        token = bid // num_head_groups
        head_group = bid - token * num_head_groups
        valid_len = topk
        if (flags & 1) != 0:
            valid_len = cutlass.min(cutlass.max(mTopkLen[token], 0), topk)
        num_pairs = (valid_len + PAIR - 1) // PAIR

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(
                tma_atom_q,
                mQ_tma,
                sQ,
                sK,
                mKV,
                mIdx,
                mbar_q,
                mbar_kv_full,
                mbar_kv_empty,
                bid,
                token,
                valid_len,
                num_pairs,
                warp_idx,
                lane,
            )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(
                sQ,
                sK,
                sP,
                s_row_max,
                s_alpha,
                s_row_sum,
                s_out_scale,
                mIdx,
                mKV,
                mSink,
                mQScale,
                mKVScale,
                mOut,
                mMaxLogits,
                mLse,
                mbar_q,
                mbar_kv_full,
                mbar_kv_empty,
                sm_scale_log2,
                flags,
                bid,
                token,
                head_group,
                valid_len,
                num_pairs,
                tidx - THREADS_PER_WG,
                lane,
            )

    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self,
        tma_atom_q,
        mQ_tma,
        sQ,
        sK,
        mKV,
        mIdx,
        mbar_q,
        mbar_kv_full,
        mbar_kv_empty,
        bid,
        token,
        valid_len,
        num_pairs,
        warp_idx,
        lane,
    ):
        """WG0: Q by TMA (one thread), then the pair-by-pair row gather."""
        if warp_idx == 0:
            gQ = cute.local_tile(mQ_tma, (B_H, self.d_qk), (bid, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, self.q_tile_bytes)
            cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=mbar_q)

        s_kv = cute.size(mKV, mode=[0])
        kv_row_stride = Int64(mKV.stride[0])
        kv_base = mKV.iterator.toint()
        sK_base = sK.iterator.toint()
        block_in_pair = warp_idx // 2  # warps 0-1: first block, warps 2-3: second block
        row_base = (warp_idx % 2) * 32  # this warp's 32 rows inside its block
        chunk16 = lane % 4  # 16-byte chunk of a 64-byte column tile this lane copies
        lane_row = lane // 4  # row (of 8) this lane copies per 8-row group

        for pair in cutlass.range(num_pairs, unroll=1):
            stage = pair % NUM_STAGES
            phase = (pair // NUM_STAGES) % 2
            slot = pair * PAIR + warp_idx * 32 + lane
            kv_row = mIdx[token, slot]
            is_valid = Int32(0)
            if (kv_row >= 0) & (kv_row < s_kv) & (slot < valid_len):
                is_valid = Int32(1)
            cute.arch.mbarrier_wait(mbar_kv_empty + stage, phase ^ 1)

            tile_base = sK_base + (stage * 2 + block_in_pair) * self.k_tile_bytes
            for group in cutlass.range_constexpr(4):
                src_lane = group * 8 + lane_row
                row_kv = cute.arch.shuffle_sync(kv_row, src_lane)
                row_valid = cute.arch.shuffle_sync(is_valid, src_lane)
                row = row_base + group * 8 + lane_row
                g_addr = kv_base + Int64(row_kv * row_valid) * kv_row_stride + chunk16 * 16
                s_addr = tile_base + _swizzle64(row, chunk16)
                nbytes = row_valid * 16
                for col_tile in cutlass.range_constexpr(self.d_qk // SW64_TILE_COLS):
                    ptx.cp_async_16_zfill(
                        s_addr + col_tile * TILE_ROW_GROUP_BYTES,
                        g_addr + col_tile * SW64_TILE_COLS,
                        nbytes,
                    )
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar_kv_full + stage * 2 + block_in_pair)
        ptx.cp_async_wait_all()

    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self,
        sQ,
        sK,
        sP,
        s_row_max,
        s_alpha,
        s_row_sum,
        s_out_scale,
        mIdx,
        mKV,
        mSink,
        mQScale,
        mKVScale,
        mOut,
        mMaxLogits,
        mLse,
        mbar_q,
        mbar_kv_full,
        mbar_kv_empty,
        sm_scale_log2,
        flags,
        bid,
        token,
        head_group,
        valid_len,
        num_pairs,
        ctidx,
        lane,
    ):
        """WG1/WG2: S for block c of each pair, softmax, O^T for half c of d_v, epilogue."""
        e4m3 = sQ.element_type
        consumer = ctidx // THREADS_PER_WG  # c: block of the pair for S, half of d_v for O
        wtid = ctidx % THREADS_PER_WG  # thread index inside the warpgroup
        cwarp = wtid // 32  # warp inside the warpgroup: rows 16*cwarp.. of every M tile
        quad_row = lane // 4  # g: C-fragment row inside the warp's 16 rows
        quad_lane = lane % 4  # t: C-fragment column pair 2t, 2t+1
        other = 1 - consumer
        s_kv = cute.size(mKV, mode=[0])

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (B_H, B_TOPK)
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            e4m3,
            e4m3,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (64, B_H),
            warpgroup.OperandSource.RMEM,
        )
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)  # O^T always accumulates (zeroed below)
        thr_mma_qk = tiled_mma_qk.get_slice(wtid)
        thr_mma_pv = tiled_mma_pv.get_slice(wtid)
        tSrQ = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))  # (MMA, 1, d_qk/32)
        tSrK = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))  # (MMA, 1, d_qk/32, tiles)
        tOrP = tiled_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sP))  # (MMA, 1, 4, parity)
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((B_H, B_TOPK)), Float32)
        acc_o = [cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((64, B_H)), Float32) for _ in range(4)]
        for mt in cutlass.range_constexpr(4):
            acc_o[mt].fill(0.0)
        # Two A-fragment buffers (V^T, 4 k-steps = one pair) so the PV of d tile mt+1 is
        # loaded while the PV of d tile mt runs.
        frag_v = [cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((64, PAIR)), e4m3) for _ in range(2)]
        frag_v_words = [cute.recast_tensor(f, Uint32) for f in frag_v]

        row_max_run = cute.make_rmem_tensor((2,), Float32)  # running max (exp2 domain), rows g, g+8
        row_sum_run = cute.make_rmem_tensor((2,), Float32)  # this thread's partial row sums
        row_max_run.fill(-Float32.inf)
        row_sum_run.fill(0.0)
        alpha_cols = cute.make_rmem_tensor((16,), Float32)

        scale_log2 = mQScale[0] * mKVScale[0] * sm_scale_log2
        sK_base = sK.iterator.toint()
        sP_base = sP.iterator.toint()

        cute.arch.mbarrier_wait(mbar_q, 0)
        for pair in cutlass.range(num_pairs, unroll=1):
            stage = pair % NUM_STAGES
            phase = (pair // NUM_STAGES) % 2
            parity = pair % 2

            # ---- 1. S = Q . K_c^T ------------------------------------------------------
            cute.arch.mbarrier_wait(mbar_kv_full + stage * 2 + consumer, phase)
            warpgroup.fence()
            tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, False)
            for k in cutlass.range_constexpr(self.d_qk // 32):
                cute.gemm(
                    tiled_mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage * 2 + consumer], acc_s
                )
                tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()

            # Slot validity of this block, one bit per slot, while the MMA runs.
            slot0 = pair * PAIR + consumer * B_TOPK
            idx_lo = mIdx[token, slot0 + lane]
            idx_hi = mIdx[token, slot0 + 32 + lane]
            ok_lo = (idx_lo >= 0) & (idx_lo < s_kv) & (slot0 + lane < valid_len)
            ok_hi = (idx_hi >= 0) & (idx_hi < s_kv) & (slot0 + 32 + lane < valid_len)
            valid_lo = Uint32(cute.arch.vote_ballot_sync(ok_lo)) >> Uint32(2 * quad_lane)
            valid_hi = Uint32(cute.arch.vote_ballot_sync(ok_hi)) >> Uint32(2 * quad_lane)
            warpgroup.wait_group(0)

            # ---- 2. scale, mask, row max, exchange -------------------------------------
            for r in cutlass.range_constexpr(2):
                block_max = -Float32.inf
                for j in cutlass.range_constexpr(8):
                    for e in cutlass.range_constexpr(2):
                        i = e + 2 * r + 4 * j
                        bits = valid_lo if j < 4 else valid_hi
                        bit = (bits >> Uint32(8 * (j % 4) + e)) & Uint32(1)
                        logit = acc_s[i] * scale_log2
                        acc_s[i] = logit if bit != 0 else -Float32.inf
                        block_max = cute.arch.fmax(block_max, acc_s[i])
                block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=1))
                block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=2))
                if quad_lane == 0:
                    s_row_max[cwarp * 16 + quad_row + 8 * r, consumer, parity] = block_max
            cute.arch.barrier(barrier_id=BAR_MAX_READY, number_of_threads=2 * THREADS_PER_WG)

            # ---- 3. P = exp2(S - m) * 2^8 -> e4m3, stored K-major for the PV product ------
            for r in cutlass.range_constexpr(2):
                row = cwarp * 16 + quad_row + 8 * r
                max_new = cute.arch.fmax(
                    row_max_run[r], cute.arch.fmax(s_row_max[row, 0, parity], s_row_max[row, 1, parity])
                )
                # A row with no valid slot so far keeps max -inf; subtract 0 instead (P = 0).
                max_use = max_new if max_new != -Float32.inf else Float32(0.0)
                alpha = cute.math.exp2(row_max_run[r] - max_use, fastmath=True)
                row_max_run[r] = max_new
                row_sum = Float32(0.0)
                for j in cutlass.range_constexpr(8):
                    for e in cutlass.range_constexpr(2):
                        i = e + 2 * r + 4 * j
                        p = cute.math.exp2(acc_s[i] - max_use, fastmath=True)
                        row_sum += p
                        acc_s[i] = p * P_SCALE
                row_sum_run[r] = row_sum_run[r] * alpha + row_sum
                if quad_lane == 0:
                    s_alpha[row, consumer, parity] = alpha
                # Slot order inside a 32-slot k-step (sigma): k = 4t + b holds slot
                # [2t, 2t+1, 8+2t, 9+2t][b] and k + 16 holds slot + 16 -- the order that
                # ldmatrix.trans + prmt give the V^T fragment. This thread's S columns
                # 8j + 2t + e therefore land in two 4-byte words per 32-slot group.
                row_addr = sP_base + parity * (B_H * PAIR) + consumer * TILE_ROW_GROUP_BYTES
                for kstep in cutlass.range_constexpr(2):
                    for half in cutlass.range_constexpr(2):
                        j0 = 4 * kstep + 2 * half
                        word = ptx.pack_e4m3x4(
                            acc_s[0 + 2 * r + 4 * j0],
                            acc_s[1 + 2 * r + 4 * j0],
                            acc_s[0 + 2 * r + 4 * (j0 + 1)],
                            acc_s[1 + 2 * r + 4 * (j0 + 1)],
                        )
                        ptx.st_shared_u32(row_addr + _swizzle64(row, 2 * kstep + half) + 4 * quad_lane, word)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=2 * THREADS_PER_WG)

            # ---- 4. O^T = alpha * O^T + V^T . P^T ----------------------------------------
            # O^T columns are heads 8j + 2t + e.
            for j in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(2):
                    alpha_cols[2 * j + e] = s_alpha[8 * j + 2 * quad_lane + e, consumer, parity]
            for mt in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(8):
                    for r in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            acc_o[mt][e + 2 * r + 4 * j] = (
                                acc_o[mt][e + 2 * r + 4 * j] * alpha_cols[2 * j + e]
                            )

            cute.arch.mbarrier_wait(mbar_kv_full + stage * 2 + other, phase)
            for mt in cutlass.range_constexpr(4):
                buf = mt % 2
                if const_expr(mt >= 2):
                    warpgroup.wait_group(1)  # the PV that used this buffer is done
                d_tile = consumer * 4 + mt  # 64-column tile of d (0..7)
                for ks in cutlass.range_constexpr(4):
                    slot = (ks % 2) * 32 + lane  # lane L addresses row L of the 4 matrices
                    addr = (
                        sK_base
                        + (stage * 2 + ks // 2) * self.k_tile_bytes
                        + d_tile * TILE_ROW_GROUP_BYTES
                        + _swizzle64(slot, cwarp)
                    )
                    m0, m1, m2, m3 = ptx.ldmatrix_x4_trans(addr)
                    frag_v_words[buf][4 * ks + 0] = ptx.prmt(m0, m1, 0x6420)  # d 2g,   k 4t..
                    frag_v_words[buf][4 * ks + 1] = ptx.prmt(m0, m1, 0x7531)  # d 2g+1, k 4t..
                    frag_v_words[buf][4 * ks + 2] = ptx.prmt(m2, m3, 0x6420)  # d 2g,   k 16+4t..
                    frag_v_words[buf][4 * ks + 3] = ptx.prmt(m2, m3, 0x7531)  # d 2g+1, k 16+4t..
                warpgroup.fence()
                for ks in cutlass.range_constexpr(4):
                    cute.gemm(
                        tiled_mma_pv,
                        acc_o[mt],
                        frag_v[buf][None, None, ks],
                        tOrP[None, None, ks, parity],
                        acc_o[mt],
                    )
                warpgroup.commit_group()
            cute.arch.mbarrier_arrive(mbar_kv_empty + stage)

        warpgroup.wait_group(0)

        # ---- epilogue ---------------------------------------------------------------------
        kv_scale = mKVScale[0]
        for r in cutlass.range_constexpr(2):
            total = row_sum_run[r]
            total += cute.arch.shuffle_sync_bfly(total, offset=1)
            total += cute.arch.shuffle_sync_bfly(total, offset=2)
            if quad_lane == 0:
                s_row_sum[cwarp * 16 + quad_row + 8 * r, consumer] = total
        cute.arch.barrier(barrier_id=BAR_SUM_READY, number_of_threads=2 * THREADS_PER_WG)
        for r in cutlass.range_constexpr(2):
            row = cwarp * 16 + quad_row + 8 * r
            out_row = bid * B_H + row
            row_sum = s_row_sum[row, 0] + s_row_sum[row, 1]
            row_max = row_max_run[r]
            denom = row_sum
            if (flags & 2) != 0:
                denom += cute.math.exp2(mSink[head_group * B_H + row] * LOG2_E - row_max, fastmath=True)
            out_scale = Float32(0.0)
            if row_sum > 0.0:
                out_scale = kv_scale / (P_SCALE * denom)
            if quad_lane == 0:
                s_out_scale[row, consumer] = out_scale
                if consumer == 0:
                    if row_sum > 0.0:
                        mMaxLogits[out_row] = row_max * LN_2
                        mLse[out_row] = (row_max + cute.math.log2(row_sum, fastmath=True)) * LN_2
                    else:
                        mMaxLogits[out_row] = -Float32.inf
                        mLse[out_row] = Float32.inf
        cute.arch.barrier(barrier_id=BAR_SCALE_READY + consumer, number_of_threads=THREADS_PER_WG)

        out_base = mOut.iterator.toint()
        for j in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(2):
                head = 8 * j + 2 * quad_lane + e
                scale = s_out_scale[head, consumer]
                row_addr = out_base + Int64(bid * B_H + head) * (D_V * 2)
                for mt in cutlass.range_constexpr(4):
                    d = consumer * 256 + mt * 64 + cwarp * 16 + 2 * quad_row
                    word = ptx.pack_bf16x2(acc_o[mt][e + 4 * j] * scale, acc_o[mt][e + 2 + 4 * j] * scale)
                    ptx.st_global_u32(row_addr + d * 2, word)
