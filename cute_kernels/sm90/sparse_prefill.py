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
     set to -inf, block row maxima published in shared memory. On a tile's first pair the
     consumers exchange them (named barrier 1) to agree on the running max m. On later pairs
     each consumer goes ahead with the m both already share (speculatively, no exchange); a
     consumer whose block max exceeds m by more than the lazy threshold flags the pair, and
     after the P barrier both redo it synchronously (new m from the published maxima, P
     rewritten, O rescaled). Flags are pair numbers in a parity slot, so they need no reset.
  3. P_c = exp2(S - m) * 2^7, rounded to e4m3 and stored head-major as the K-major B operand of
     the PV product (named barrier 2 publishes both blocks' P). 2^7 is exact and keeps small
     probabilities normal in e4m3. The running max is *lazy*: it only moves when a block's max
     exceeds it by more than RESCALE_THRESHOLD (log2 units), so most pairs need no rescale of
     O, and stored P stay below 2^(7 + 1.75) < 448, the e4m3 maximum.
     ``precision="accurate"``: the exponentials are taken in f16x2 and P is stored as two e4m3
     terms, hi = e4m3(p) and lo = e4m3(p - hi) (the difference is exact in f16), in two P
     tiles; step 4 runs once per term with the same V^T fragments, so O accumulates P with
     about 8 significant bits instead of 4 (measured: out error 2e-3..3e-3 instead of 3e-2,
     for 1.15-1.26x the time).
  4. The PV product is computed transposed, O^T[d, h] += V^T[d, slot] . P^T[slot, h], with
     A = V^T taken from registers (RS WGMMA): ``ldmatrix.trans`` reads the gathered rows as
     they are (no transposed copy of V in shared memory), and two byte permutes turn each pair
     of 8x8 b16 matrices into the e4m3 A fragment. The slot order this produces inside each
     32-slot k-step (sigma below) is the order in which P is stored, so the product is exact;
     the d order it produces (A row g <-> d 2g, row g+8 <-> d 2g+1) is undone in the epilogue,
     where each thread then owns two adjacent d columns (one 32-bit bf16x2 store).
  Schedule per consumer: QK(p), softmax(p), PV(p) in turn, two V^T
  A-fragment buffers alternating over the four d tiles, the pair's stage released right after
  its last V^T load, so the producer has a whole iteration to gather pair p + 2 (measured: the
  gather alone needs about half the kernel's time, the math alone 94%). Queueing PV(p-1)
  around the softmax of pair p instead releases stages later and measured 25% slower
  (docs/perf-notes.md). A block past topk_length (the second block of the last pair) is zero-filled, its S
  product skipped (fully masked) and its PV k-steps multiply zeros. Branches that hold WGMMAs
  depend only on warp-uniform values (the consumer index comes from the warp index) and no
  WGMMA is in flight across a loop's back edge, so ptxas does not serialise them (C7520).
  The softmax masks only blocks that hold an invalid slot, and folds the logit scale into
  the exponent's FMA.
- Epilogue: row sums are exchanged (named barrier 3); out = O / (sum + 2^7 exp(sink - m))
  * kv_scale in bf16; max_logits = true max * ln2, lse = (m + log2(sum) - 7) * ln2. A row with
  no valid slot writes out = 0, max_logits = -inf, lse = +inf.

Barriers: mbarriers ``q_full``; ``kv_full[stage][block]`` (64 producer threads, cp.async
arrive.noinc); ``kv_empty[stage]`` (256 consumer threads). Shared buffers that both consumers
write per pair (row maxima, P) are double-buffered by pair parity.

Constraints: h % 64 == 0 (the wrapper pads heads), topk % 128 == 0, d_qk in {512, 576},
d_v = 512, q/out/max_logits/lse row-major, kv rows 16-byte aligned. ``topk_length`` values
are clamped to [0, topk]; only ceil(topk_length / 128) pairs are visited and only the rows
below topk_length are read.
"""

import math
from typing import NamedTuple

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
D_TILES_PER_CONSUMER = 4  # 64-wide d tiles of O^T per consumer (256 of d_v)
NUM_STAGES = 2  # pairs of KV blocks in flight
P_SCALE_LOG2 = 7  # P is stored as e4m3(p * 2^7); undone in the epilogue
RESCALE_THRESHOLD = 1.75  # log2 units; 2^(P_SCALE_LOG2 + RESCALE_THRESHOLD) = 430 < 448
SW64_TILE_COLS = 64  # bytes per row of one 64-byte-swizzled column tile
TILE_ROW_GROUP_BYTES = B_TOPK * SW64_TILE_COLS  # one [64 rows x 64 B] swizzle column tile

THREADS_PER_WG = 128
NUM_THREADS = 3 * THREADS_PER_WG
PRODUCER_REGS = 24
CONSUMER_REGS = 240

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


class CtaWork(NamedTuple):
    """What one CTA computes (trace-time bundle of runtime values)."""

    bid: Int32  # CTA index: row tile [64 * bid, 64 * bid + 64) of the (token, head) rows
    token: Int32
    head_group: Int32
    valid_len: Int32  # topk_length clamped to [0, topk] (topk when not given)
    num_blocks: Int32  # ceil(valid_len / 64)
    num_pairs: Int32  # ceil(valid_len / 128)


class Consumer(NamedTuple):
    """One consumer warpgroup's view of the CTA (trace-time bundle): who it is, its MMAs and
    fragments, its running softmax state and the shared buffers it exchanges through."""

    index: Int32  # c: block of each pair for S, half of d_v for O (warp-uniform)
    warp: Int32  # warp inside the warpgroup: rows 16*warp.. of every M tile
    lane: Int32
    quad_row: Int32  # g: C-fragment row inside the warp's 16 rows
    quad_lane: Int32  # t: C-fragment column pair 2t, 2t+1
    work: CtaWork
    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor  # Q descriptors (MMA, 1, d_qk/32)
    tSrK: cute.Tensor  # K descriptors (MMA, 1, d_qk/32, stage*2 + block)
    tOrP: cute.Tensor  # P^T descriptors (MMA, 1, 4 k-steps, parity * p_terms + term)
    acc_s: cute.Tensor  # S of this consumer's block (32 f32)
    acc_o: list  # O^T, one 64x64 accumulator per d tile (4 x 32 f32)
    frag_v: list  # two V^T A-fragment buffers (4 k-steps each, 16 registers)
    row_max_used: cute.Tensor  # per row r: max the stored P are relative to (exp2 domain)
    row_max_true: cute.Tensor  # per row r: exact running max (for max_logits)
    row_sum: cute.Tensor  # per row r: this thread's partial sum of 2^7 P
    s_update: cute.Tensor  # smem [parity]: the last pair that needs the synchronous softmax
    s_max_true: cute.Tensor  # smem [row, consumer]: exact maxima (epilogue)
    s_row_max: cute.Tensor  # smem [row, consumer, parity]: block row maxima
    s_alpha: cute.Tensor  # smem [row, consumer, parity]: O rescale factors
    s_row_sum: cute.Tensor  # smem [row, consumer]
    s_out_scale: cute.Tensor  # smem [row, consumer]
    sK_base: Int32  # shared-memory byte address of the gathered KV tiles
    sP_base: Int32  # shared-memory byte address of the P tiles
    mbar_kv_full: cute.Pointer
    mIdx: cute.Tensor
    s_kv: Int32
    scale_log2: Float32  # q_scale * kv_scale * sm_scale * log2(e)


class SparsePrefillSm90:
    """Compile-time configuration of the kernel: ``d_qk`` (512 or 576)."""

    def __init__(
        self,
        d_qk: int,
        precision: str = "default",
        exp2_f16x2: bool | None = None,
        experiment: str | None = None,
        exp2_poly_groups: int = 0,
    ):
        """``precision``: "default" rounds P to one e4m3 term; "accurate" splits it into two
        (hi = e4m3(p), lo = e4m3(p - hi)) and runs the PV product once per term.
        ``exp2_f16x2``: exponentials as f16x2 ``ex2.approx`` instead of f32 (default: only for
        "accurate", whose split needs f16 values; SM90 runs an f16x2 ex2 as two MUFU ops, so it
        does not halve the MUFU work, and measured 0.3-1% slower in the default mode).
        ``experiment`` (timing studies only, wrong results): "gather_only" skips all math,
        "math_only" skips the gather. ``exp2_poly_groups`` (0-4, f32 exponentials only): how many
        of each row's four groups of 4 exponentials run as a cubic on the FMA pipe
        (``ptx.exp2_poly``) instead of the MUFU, to share the exponential work between pipes
        (an experiment: not measured yet)."""
        if d_qk not in (512, 576):
            raise ValueError(f"d_qk must be 512 or 576, got {d_qk}")
        if precision not in ("default", "accurate"):
            raise ValueError(f"precision must be 'default' or 'accurate', got {precision!r}")
        if exp2_f16x2 is None:
            exp2_f16x2 = precision == "accurate"
        if not 0 <= exp2_poly_groups <= 4 or (exp2_poly_groups and exp2_f16x2):
            raise ValueError("exp2_poly_groups must be 0-4, and 0 with f16x2 exponentials")
        if precision == "accurate" and not exp2_f16x2:
            raise ValueError("precision='accurate' needs exp2_f16x2")
        if experiment not in (None, "gather_only", "math_only"):
            raise ValueError(f"unknown experiment {experiment!r}")
        self.d_qk = d_qk
        self.precision = precision
        self.p_terms = 2 if precision == "accurate" else 1  # e4m3 terms P is stored as
        self.exp2_f16x2 = exp2_f16x2
        self.experiment = experiment
        self.exp2_poly_groups = exp2_poly_groups
        self.k_tile_bytes = B_TOPK * d_qk  # one gathered block in shared memory
        self.q_tile_bytes = B_H * d_qk

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory per CTA (the SharedStorage struct built in ``__call__``)."""
        barriers_and_stats = 8 * (1 + 3 * NUM_STAGES) + 4 * B_H * (4 + 4 + 2 + 2 + 2) + 4 * 2
        aligned = -(-barriers_and_stats // 1024) * 1024
        p_bytes = 2 * self.p_terms * B_H * PAIR  # [parity][term] P tiles
        return aligned + self.q_tile_bytes + NUM_STAGES * 2 * self.k_tile_bytes + p_bytes

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
        sP_layout = cute.tile_to_shape(smem_atom, (B_H, PAIR, 2 * self.p_terms), (0, 1, 2))

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
            max_true: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            update: cute.struct.MemRange[Int32, 2]  # [parity]
            out_scale: cute.struct.MemRange[Float32, B_H * 2]  # [row, consumer]
            sQ: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[e4m3, cute.cosize(sP_layout)], 1024]

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
            grid=[rows // B_H, 1, 1],
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
        bid, _, _ = cute.arch.block_idx()

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_q = storage.mbar_q.data_ptr()
        mbar_kv_full = storage.mbar_kv_full.data_ptr()
        mbar_kv_empty = storage.mbar_kv_empty.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

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

        topk = cute.size(mIdx, mode=[1])
        num_head_groups = cute.size(mOut, mode=[1]) // B_H
        token = bid // num_head_groups
        valid_len = topk
        if (flags & 1) != 0:
            valid_len = cutlass.min(cutlass.max(mTopkLen[token], 0), topk)
        valid_len = cute.arch.make_warp_uniform(valid_len)
        work = CtaWork(
            bid=bid,
            token=token,
            head_group=bid - token * num_head_groups,
            valid_len=valid_len,
            num_blocks=(valid_len + B_TOPK - 1) // B_TOPK,
            num_pairs=(valid_len + PAIR - 1) // PAIR,
        )

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(tma_atom_q, mQ_tma, sQ, sK, mKV, mIdx, mbar_q, mbar_kv_full, mbar_kv_empty, work)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            consumer = warp_idx // 4 - 1  # warp-uniform, so branches on it are not divergent
            smem_stats = (
                storage.row_max.get_tensor(cute.make_layout((B_H, 2, 2))),
                storage.alpha.get_tensor(cute.make_layout((B_H, 2, 2))),
                storage.row_sum.get_tensor(cute.make_layout((B_H, 2))),
                storage.out_scale.get_tensor(cute.make_layout((B_H, 2))),
                storage.update.get_tensor(cute.make_layout(2)),
                storage.max_true.get_tensor(cute.make_layout((B_H, 2))),
            )
            self.consume(
                consumer,
                sQ,
                sK,
                sP,
                smem_stats,
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
                work,
            )

    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom_q, mQ_tma, sQ, sK, mKV, mIdx, mbar_q, mbar_kv_full, mbar_kv_empty, work):
        """WG0: Q by TMA (one thread), then the pair-by-pair row gather."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if warp_idx == 0:
            gQ = cute.local_tile(mQ_tma, (B_H, self.d_qk), (work.bid, 0))
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

        for pair in cutlass.range(work.num_pairs, unroll=1):
            stage = pair % NUM_STAGES
            phase = (pair // NUM_STAGES) % 2
            full_barrier = mbar_kv_full + stage * 2 + block_in_pair
            if const_expr(self.experiment == "math_only"):
                cute.arch.mbarrier_wait(mbar_kv_empty + stage, phase ^ 1)
                cute.arch.mbarrier_arrive(full_barrier)
            else:
                slot = pair * PAIR + warp_idx * 32 + lane
                kv_row = mIdx[work.token, slot]
                is_valid = Int32(0)
                if (kv_row >= 0) & (kv_row < s_kv) & (slot < work.valid_len):
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
                cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier)
        ptx.cp_async_wait_all()

    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self,
        consumer,
        sQ,
        sK,
        sP,
        smem_stats,
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
        work,
    ):
        """WG1/WG2: S for block c of each pair, softmax, O^T for half c of d_v, epilogue."""
        e4m3 = sQ.element_type
        wtid = cute.arch.thread_idx()[0] % THREADS_PER_WG  # thread index inside the warpgroup
        lane = cute.arch.lane_idx()

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
        # O^T always accumulates (zeroed once below); S overwrites on its first k-step.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma_qk = tiled_mma_qk.get_slice(wtid)
        thr_mma_pv = tiled_mma_pv.get_slice(wtid)
        tSrQ = tiled_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))  # (MMA, 1, d_qk/32)
        tSrK = tiled_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))  # (MMA, 1, d_qk/32, tiles)
        tOrP = tiled_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sP))  # (MMA, 1, 4, parity*terms+term)
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((B_H, B_TOPK)), Float32)
        acc_o = [
            cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((64, B_H)), Float32)
            for _ in range(D_TILES_PER_CONSUMER)
        ]
        for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
            acc_o[mt].fill(0.0)
        # Two A-fragment buffers (V^T, 4 k-steps = one pair): the PV of one d tile is loaded
        # while the PV of the previous one runs.
        frag_v = [cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((64, PAIR)), e4m3) for _ in range(2)]

        # Per-row softmax state for rows 16*cwarp + quad_row + 8r, r = 0, 1 (exp2 domain).
        row_max_used = cute.make_rmem_tensor((2,), Float32)  # max the stored P are relative to
        row_max_true = cute.make_rmem_tensor((2,), Float32)  # exact running max (max_logits)
        row_sum = cute.make_rmem_tensor((2,), Float32)  # this thread's partial sums of 2^7 P
        row_max_used.fill(-Float32.inf)
        row_max_true.fill(-Float32.inf)
        row_sum.fill(0.0)

        s_row_max, s_alpha, s_row_sum, s_out_scale, s_update, s_max_true = smem_stats
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
            acc_s=acc_s,
            acc_o=acc_o,
            frag_v=frag_v,
            row_max_used=row_max_used,
            row_max_true=row_max_true,
            row_sum=row_sum,
            s_update=s_update,
            s_max_true=s_max_true,
            s_row_max=s_row_max,
            s_alpha=s_alpha,
            s_row_sum=s_row_sum,
            s_out_scale=s_out_scale,
            sK_base=sK.iterator.toint(),
            sP_base=sP.iterator.toint(),
            mbar_kv_full=mbar_kv_full,
            mIdx=mIdx,
            s_kv=cute.size(mKV, mode=[0]),
            scale_log2=mQScale[0] * mKVScale[0] * sm_scale_log2,
        )

        cute.arch.mbarrier_wait(mbar_q, 0)
        if const_expr(self.experiment == "gather_only"):
            for pair in cutlass.range(work.num_pairs, unroll=1):
                stage = pair % NUM_STAGES
                for block in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_wait(mbar_kv_full + stage * 2 + block, (pair // NUM_STAGES) % 2)
                cute.arch.mbarrier_arrive(mbar_kv_empty + stage)
        elif work.num_pairs > 0:
            for pair in cutlass.range(work.num_pairs, unroll=1):
                self.issue_qk(c, pair)
                valid_bits = self.block_valid_bits(c, pair)
                warpgroup.wait_group(0)  # S(pair)
                block_maxima = self.softmax_block_max(c, pair, valid_bits)
                if pair == 0:
                    self.softmax_p(c, pair)  # O is still 0: nothing to rescale
                else:
                    self.softmax_p_speculative(c, pair, block_maxima)
                for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
                    if const_expr(mt >= 2):
                        warpgroup.wait_group(1)  # the PV that used this A buffer has finished
                    self.issue_pv(c, pair, mt, mt % 2)
                cute.arch.mbarrier_arrive(mbar_kv_empty + pair % NUM_STAGES)  # both blocks of pair read
                # Drained at the end of each iteration: WGMMAs in flight across the loop's back
                # edge make ptxas serialise them (C7520, or C7513 when the next pair's QK is
                # queued here: measured 24% slower).
                warpgroup.wait_group(0)

        self.epilogue(c, mSink, mKVScale, mOut, mMaxLogits, mLse, flags)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def issue_qk(self, c: Consumer, pair):
        """Queue S = Q . K_c^T for block c of ``pair`` (one WGMMA group; empty for a block past
        topk_length, whose S is then fully masked)."""
        stage = pair % NUM_STAGES
        tile = stage * 2 + c.index
        cute.arch.mbarrier_wait(c.mbar_kv_full + tile, (pair // NUM_STAGES) % 2)
        # The first k-step overwrites S (no zeroing pass). A skipped block's S is left as it
        # was, but every one of its slots is masked to -inf.
        warpgroup.fence()
        if pair * 2 + c.index < c.work.num_blocks:
            for k in cutlass.range_constexpr(self.d_qk // 32):
                c.tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(
                    c.tiled_mma_qk, c.acc_s, c.tSrQ[None, None, k], c.tSrK[None, None, k, tile], c.acc_s
                )
        warpgroup.commit_group()

    @cute.jit
    def block_valid_bits(self, c: Consumer, pair):
        """Validity of the 64 slots of block c of ``pair``: one bit per slot, shifted so bit
        8j + e is the slot of this thread's S column 8j + 2t + e (j < 4: low word), and whether
        every slot is valid (warp-uniform)."""
        slot0 = pair * PAIR + c.index * B_TOPK
        idx_lo = c.mIdx[c.work.token, slot0 + c.lane]
        idx_hi = c.mIdx[c.work.token, slot0 + 32 + c.lane]
        ok_lo = (idx_lo >= 0) & (idx_lo < c.s_kv) & (slot0 + c.lane < c.work.valid_len)
        ok_hi = (idx_hi >= 0) & (idx_hi < c.s_kv) & (slot0 + 32 + c.lane < c.work.valid_len)
        shift = Uint32(2 * c.quad_lane)
        return (
            Uint32(cute.arch.vote_ballot_sync(ok_lo)) >> shift,
            Uint32(cute.arch.vote_ballot_sync(ok_hi)) >> shift,
            cute.arch.vote_all_sync(ok_lo & ok_hi),
        )

    @cute.jit
    def softmax_block_max(self, c: Consumer, pair, valid_bits):
        """Set invalid slots of S to -inf, publish the block's row maxima (exp2 domain) and return
        them (this thread's rows r = 0, 1).

        S stays unscaled when the logit scale is positive (the scale is folded into the
        exponent later); a scale <= 0 (never a sensible dequantisation scale, but defined) is
        applied here first so the max is still the max of the logits."""
        valid_lo, valid_hi, all_valid = valid_bits
        if c.scale_log2 <= 0.0:
            for i in cutlass.range_constexpr(cute.size(c.acc_s)):
                c.acc_s[i] = c.acc_s[i] * c.scale_log2
        if not all_valid:
            for r in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(8):
                    for e in cutlass.range_constexpr(2):
                        i = e + 2 * r + 4 * j
                        bits = valid_lo if j < 4 else valid_hi
                        bit = (bits >> Uint32(8 * (j % 4) + e)) & Uint32(1)
                        c.acc_s[i] = c.acc_s[i] if bit != 0 else -Float32.inf
        block_maxima = []
        for r in cutlass.range_constexpr(2):
            block_max = -Float32.inf
            for j in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(2):
                    block_max = cute.arch.fmax(block_max, c.acc_s[e + 2 * r + 4 * j])
            block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=1))
            block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=2))
            if c.scale_log2 > 0.0:
                block_max = block_max * c.scale_log2
            if c.quad_lane == 0:
                c.s_row_max[c.warp * 16 + c.quad_row + 8 * r, c.index, pair % 2] = block_max
            block_maxima.append(block_max)
        return block_maxima

    @cute.jit
    def softmax_p(self, c: Consumer, pair):
        """First pair of a tile: agree on the running max with the other consumer (named barrier
        1), store P = e4m3(2^7 exp2(S - m)) as the PV B operand and the O rescale factors alpha."""
        cute.arch.barrier(barrier_id=BAR_MAX_READY, number_of_threads=2 * THREADS_PER_WG)
        self.exp_with_pair_max(c, pair)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def softmax_p_speculative(self, c: Consumer, pair, block_maxima):
        """Later pairs: store P relative to the running max both consumers already share, with no
        exchange first. Only if some row's block max exceeds it by more than the threshold
        (rare after the first pair) does either consumer flag the pair; then both redo it the
        synchronous way (new max from the published block maxima, P rewritten, O rescaled)."""
        parity = pair % 2
        logit_scale = c.scale_log2 if c.scale_log2 > 0.0 else Float32(1.0)
        tile_addr = c.sP_base + parity * self.p_terms * (B_H * PAIR) + c.index * TILE_ROW_GROUP_BYTES
        exceeds = False
        block_sums = []
        for r in cutlass.range_constexpr(2):
            row = c.warp * 16 + c.quad_row + 8 * r
            c.row_max_true[r] = cute.arch.fmax(c.row_max_true[r], block_maxima[r])
            exceeds = exceeds | (block_maxima[r] > c.row_max_used[r] + RESCALE_THRESHOLD)
            max_used = c.row_max_used[r]
            bias = (max_used if max_used != -Float32.inf else Float32(0.0)) - P_SCALE_LOG2
            block_sums.append(self.exp_and_store_p(c, r, row, logit_scale, bias, tile_addr))
        if exceeds:
            c.s_update[parity] = pair  # any thread: this pair needs the synchronous path
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=2 * THREADS_PER_WG)
        if c.s_update[parity] == pair:
            self.exp_with_pair_max(c, pair)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=2 * THREADS_PER_WG)
            self.rescale_o(c, pair)
        else:
            for r in cutlass.range_constexpr(2):
                c.row_sum[r] = c.row_sum[r] + block_sums[r]

    @cute.jit
    def exp_with_pair_max(self, c: Consumer, pair):
        """Both consumers' block maxima are published: move the lazy running max where the pair's
        max exceeds it by more than the threshold (alpha = the O rescale factor), store P
        relative to it and accumulate the row sums."""
        parity = pair % 2
        # S is still unscaled when the scale is positive (see softmax_block_max).
        logit_scale = c.scale_log2 if c.scale_log2 > 0.0 else Float32(1.0)
        tile_addr = c.sP_base + parity * self.p_terms * (B_H * PAIR) + c.index * TILE_ROW_GROUP_BYTES
        for r in cutlass.range_constexpr(2):
            row = c.warp * 16 + c.quad_row + 8 * r
            pair_max = cute.arch.fmax(c.s_row_max[row, 0, parity], c.s_row_max[row, 1, parity])
            c.row_max_true[r] = cute.arch.fmax(c.row_max_true[r], pair_max)
            # Lazy max: move only when the pair's max exceeds it by more than the threshold.
            alpha = Float32(1.0)
            if pair_max > c.row_max_used[r] + RESCALE_THRESHOLD:
                alpha = cute.math.exp2(c.row_max_used[r] - pair_max, fastmath=True)
                c.row_max_used[r] = pair_max
            # Exponent offset: 2^7 folded in; a row with no valid slot so far (max -inf) uses 0.
            max_used = c.row_max_used[r]
            bias = (max_used if max_used != -Float32.inf else Float32(0.0)) - P_SCALE_LOG2
            if c.quad_lane == 0:
                c.s_alpha[row, c.index, parity] = alpha
            block_sum = self.exp_and_store_p(c, r, row, logit_scale, bias, tile_addr)
            c.row_sum[r] = c.row_sum[r] * alpha + block_sum

    @cute.jit
    def exp_and_store_p(self, c: Consumer, r, row, logit_scale, bias, tile_addr):
        """Row ``r`` of this thread's S (left unchanged): p = 2^(S * scale - bias), stored as e4m3
        P; returns the sum of the 16 p.

        Slot order inside a 32-slot k-step (sigma): k = 4t + b holds slot
        [2t, 2t+1, 8+2t, 9+2t][b] and k + 16 holds slot + 16 -- the order that ldmatrix.trans +
        prmt give the V^T fragment. This thread's S columns 8j + 2t + e therefore land in two
        4-byte words per 32-slot group."""
        if const_expr(self.exp2_f16x2):
            return self.exp2_and_store_p_f16x2(c, r, row, logit_scale, bias, tile_addr)
        block_sum = Float32(0.0)
        for kstep in cutlass.range_constexpr(2):
            for half in cutlass.range_constexpr(2):
                j0 = 4 * kstep + 2 * half
                columns = (2 * r + 4 * j0, 1 + 2 * r + 4 * j0, 2 * r + 4 * j0 + 4, 1 + 2 * r + 4 * j0 + 4)
                if const_expr(2 * kstep + half >= 4 - self.exp2_poly_groups):
                    p = [ptx.exp2_poly(c.acc_s[i] * logit_scale - bias) for i in columns]
                else:
                    p = [cute.math.exp2(c.acc_s[i] * logit_scale - bias, fastmath=True) for i in columns]
                block_sum += (p[0] + p[1]) + (p[2] + p[3])
                word = ptx.pack_e4m3x4(p[0], p[1], p[2], p[3])
                ptx.st_shared_u32(tile_addr + _swizzle64(row, 2 * kstep + half) + 4 * c.quad_lane, word)
        return block_sum

    @cute.jit
    def exp2_and_store_p_f16x2(self, c: Consumer, r, row, logit_scale, bias, tile_addr):
        """Row ``r`` of this thread's S: p = 2^(S * scale - bias) as f16x2 pairs (columns 8j + 2t,
        8j + 2t + 1), stored as e4m3 P (one term, or hi and lo terms for "accurate"); returns
        the sum of the 16 p (f16 tree sum, in f32)."""
        p = [
            ptx.exp2_f16x2(
                c.acc_s[2 * r + 4 * j] * logit_scale - bias, c.acc_s[1 + 2 * r + 4 * j] * logit_scale - bias
            )
            for j in range(8)
        ]
        quarter = [ptx.add_f16x2(p[2 * k], p[2 * k + 1]) for k in range(4)]
        block_sum = ptx.sum_f16x2_to_f32(
            ptx.add_f16x2(ptx.add_f16x2(quarter[0], quarter[1]), ptx.add_f16x2(quarter[2], quarter[3]))
        )
        for kstep in cutlass.range_constexpr(2):
            for half in cutlass.range_constexpr(2):
                j0 = 4 * kstep + 2 * half
                addr = tile_addr + _swizzle64(row, 2 * kstep + half) + 4 * c.quad_lane
                if const_expr(self.p_terms == 1):
                    ptx.st_shared_u32(addr, ptx.pack_e4m3x4_from_f16x2(p[j0], p[j0 + 1]))
                else:
                    hi, lo = ptx.split_e4m3x4_from_f16x2(p[j0], p[j0 + 1])
                    ptx.st_shared_u32(addr, hi)
                    ptx.st_shared_u32(addr + B_H * PAIR, lo)
        return block_sum

    @cute.jit
    def rescale_o(self, c: Consumer, pair):
        """O^T *= alpha per head (column 8j + 2t + e); skipped when the warp's alphas are all 1."""
        alpha_cols = cute.make_rmem_tensor((16,), Float32)
        needed = False
        for j in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(2):
                alpha_cols[2 * j + e] = c.s_alpha[8 * j + 2 * c.quad_lane + e, c.index, pair % 2]
                needed = needed | (alpha_cols[2 * j + e] != 1.0)
        if cute.arch.make_warp_uniform(Int32(cute.arch.vote_any_sync(needed))) != 0:
            for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
                for j in cutlass.range_constexpr(8):
                    for r in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            i = e + 2 * r + 4 * j
                            c.acc_o[mt][i] = c.acc_o[mt][i] * alpha_cols[2 * j + e]

    @cute.jit
    def issue_pv(self, c: Consumer, pair, mt, buf):
        """Load the V^T A fragment of d tile ``mt`` (of this consumer's half) for ``pair`` into
        A buffer ``buf`` with ldmatrix.trans + prmt and queue its 4 k-steps (one WGMMA group)."""
        stage = pair % NUM_STAGES
        # The other consumer's block is read too: wait on its barrier (a no-op wait by now)
        # so its cp.async writes are visible to this thread.
        cute.arch.mbarrier_wait(c.mbar_kv_full + stage * 2 + (1 - c.index), (pair // NUM_STAGES) % 2)
        frag = c.frag_v[buf]
        words = cute.recast_tensor(frag, Uint32)
        d_tile = c.index * D_TILES_PER_CONSUMER + mt  # 64-column tile of d (0..7)
        tile_base = c.sK_base + stage * 2 * self.k_tile_bytes + d_tile * TILE_ROW_GROUP_BYTES
        for ks in cutlass.range_constexpr(4):
            self.load_v_fragment(words, ks, tile_base, c.warp, c.lane)
        warpgroup.fence()
        for ks in cutlass.range_constexpr(4):
            for term in cutlass.range_constexpr(self.p_terms):
                cute.gemm(
                    c.tiled_mma_pv,
                    c.acc_o[mt],
                    frag[None, None, ks],
                    c.tOrP[None, None, ks, (pair % 2) * self.p_terms + term],
                    c.acc_o[mt],
                )
        warpgroup.commit_group()

    @cute.jit
    def load_v_fragment(self, words, ks, tile_base, warp, lane):
        """k-step ``ks`` (32 slots) of the V^T A fragment: one ldmatrix.x4.trans + 4 prmt.

        Lane L addresses row (slot) L of the four 8x8 b16 matrices (slots 32*(ks%2) + 8i + L%8,
        the 16 d bytes of this warp). Thread (g, t) receives, per matrix, bytes
        [V[2t][2g], V[2t][2g+1], V[2t+1][2g], V[2t+1][2g+1]]; the permutes gather the e4m3 A
        registers a0 = (d 2g, slots 2t, 2t+1, 8+2t, 9+2t), a1 = the same for d 2g+1, and a2, a3 for
        slots + 16."""
        slot = (ks % 2) * 32 + lane
        addr = tile_base + (ks // 2) * self.k_tile_bytes + _swizzle64(slot, warp)
        m0, m1, m2, m3 = ptx.ldmatrix_x4_trans(addr)
        words[4 * ks + 0] = ptx.prmt(m0, m1, 0x6420)
        words[4 * ks + 1] = ptx.prmt(m0, m1, 0x7531)
        words[4 * ks + 2] = ptx.prmt(m2, m3, 0x6420)
        words[4 * ks + 3] = ptx.prmt(m2, m3, 0x7531)

    @cute.jit
    def epilogue(self, c: Consumer, mSink, mKVScale, mOut, mMaxLogits, mLse, flags):
        """Normalise O, apply kv_scale and the sink, write out (bf16), max_logits and lse."""
        kv_scale = mKVScale[0]
        for r in cutlass.range_constexpr(2):
            total = c.row_sum[r]
            total += cute.arch.shuffle_sync_bfly(total, offset=1)
            total += cute.arch.shuffle_sync_bfly(total, offset=2)
            if c.quad_lane == 0:
                c.s_row_sum[c.warp * 16 + c.quad_row + 8 * r, c.index] = total
                c.s_max_true[c.warp * 16 + c.quad_row + 8 * r, c.index] = c.row_max_true[r]
        cute.arch.barrier(barrier_id=BAR_SUM_READY, number_of_threads=2 * THREADS_PER_WG)
        for r in cutlass.range_constexpr(2):
            row = c.warp * 16 + c.quad_row + 8 * r
            out_row = c.work.bid * B_H + row
            scaled_sum = c.s_row_sum[row, 0] + c.s_row_sum[row, 1]  # sum of 2^7 P over all slots
            max_used = c.row_max_used[r]
            denom = scaled_sum
            if (flags & 2) != 0:
                sink_log2 = mSink[c.work.head_group * B_H + row] * LOG2_E
                denom += cute.math.exp2(sink_log2 - max_used + P_SCALE_LOG2, fastmath=True)
            out_scale = Float32(0.0)
            if scaled_sum > 0.0:
                out_scale = kv_scale / denom
            if c.quad_lane == 0:
                c.s_out_scale[row, c.index] = out_scale
                if c.index == 0:
                    if scaled_sum > 0.0:
                        true_max = cute.arch.fmax(c.s_max_true[row, 0], c.s_max_true[row, 1])
                        mMaxLogits[out_row] = true_max * LN_2
                        log2_sum = cute.math.log2(scaled_sum, fastmath=True) - P_SCALE_LOG2
                        mLse[out_row] = (max_used + log2_sum) * LN_2
                    else:
                        mMaxLogits[out_row] = -Float32.inf
                        mLse[out_row] = Float32.inf
        cute.arch.barrier(barrier_id=BAR_SCALE_READY + c.index, number_of_threads=THREADS_PER_WG)

        out_base = mOut.iterator.toint()
        for j in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(2):
                head = 8 * j + 2 * c.quad_lane + e
                scale = c.s_out_scale[head, c.index]
                row_addr = out_base + Int64(c.work.bid * B_H + head) * (D_V * 2)
                for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
                    d = (c.index * D_TILES_PER_CONSUMER + mt) * 64 + c.warp * 16 + 2 * c.quad_row
                    word = ptx.pack_bf16x2(c.acc_o[mt][e + 4 * j] * scale, c.acc_o[mt][e + 2 + 4 * j] * scale)
                    ptx.st_global_u32(row_addr + d * 2, word)
