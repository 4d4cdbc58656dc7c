"""Two attentions over disjoint row sets merged into one softmax (an extra cache's part beside the main one, a
serving layer's merged parts), in one launch.

Per (token, head) row, from each part's ``out`` (bf16, normalised over its own rows, computed without a
sink), ``max_logits`` and ``lse``: ``out = sum_p w_p out_p`` with ``w_p = exp(lse_p - L) / (t + exp(sink -
L))``, ``L`` the largest lse of the parts that have a valid slot (``max_logits > -inf``) and ``t = sum_p
exp(lse_p - L)`` over them; ``lse = L + log t`` (without the sink), ``max_logits`` the larger of the parts'. A
part without a valid slot weighs nothing; a row without one in either part gets out 0, max_logits -inf, lse
+inf. The weights as the split kernel's merge computes them (``split_merge.py``), in float32; out rounded
once to bf16.

One warp a row: each lane its ``VALUES_PER_LANE`` values of each part (every 16-byte load issued before any is
used), the row's statistics read by every lane. Constraints: rows of ``D_V`` bf16 values, contiguous and
16-byte aligned; the statistics contiguous float32; rows of head ``row % num_heads``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_kernels import ptx
from cute_kernels.interface import D_V, LOG2_E, SINK_FLAG
from cute_kernels.sm90.epilogue import LN_2

ROWS_PER_CTA = 4  # one warp a row
PARTS = 2
VALUES_PER_LANE = D_V // 32  # 16 bf16: two 16-byte chunks a part
CHUNKS_PER_LANE = VALUES_PER_LANE // 8


def bf16_pair(word):
    """The two float32 values of a word of two bf16 (low half first)."""
    return ptx.f32_from_bits(word << 16), ptx.f32_from_bits(word & Uint32(0xFFFF0000))


class AttentionMergeSm90:
    """No compile-time configuration: two parts, rows of ``D_V`` values."""

    @cute.jit
    def __call__(
        self,
        mOut0: cute.Tensor,  # [rows, D_V] bf16, row-major: part 0's out
        mMax0: cute.Tensor,  # [rows] f32: part 0's max_logits
        mLse0: cute.Tensor,  # [rows] f32: part 0's lse
        mOut1: cute.Tensor,  # part 1's, as part 0's
        mMax1: cute.Tensor,
        mLse1: cute.Tensor,
        mSink: cute.Tensor,  # [h] f32, read only with SINK_FLAG
        mOut: cute.Tensor,  # [rows, D_V] bf16, row-major
        mMaxLogits: cute.Tensor,  # [rows] f32
        mLseOut: cute.Tensor,  # [rows] f32
        num_heads: Int32,
        flags: Int32,
        stream,
    ):
        rows = cute.size(mOut, mode=[0])
        self.kernel(
            mOut0, mMax0, mLse0, mOut1, mMax1, mLse1, mSink, mOut, mMaxLogits, mLseOut, num_heads, flags
        ).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1],
            block=[32 * ROWS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mOut0: cute.Tensor,
        mMax0: cute.Tensor,
        mLse0: cute.Tensor,
        mOut1: cute.Tensor,
        mMax1: cute.Tensor,
        mLse1: cute.Tensor,
        mSink: cute.Tensor,
        mOut: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLseOut: cute.Tensor,
        num_heads: Int32,
        flags: Int32,
    ):
        thread, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane = thread % 32
        row = block * ROWS_PER_CTA + thread // 32
        if row < cute.size(mOut, mode=[0]):
            offset = (Int64(row) * D_V + lane * VALUES_PER_LANE) * 2  # bytes
            words = []  # part p's chunk c: words[p][4c .. 4c + 3]
            for part_out in (mOut0, mOut1):
                part_words = []
                for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                    part_words.extend(ptx.ld_global_nc_v4(part_out.iterator.toint() + offset + 16 * c))
                words.append(part_words)
            maxima = (mMax0[row], mMax1[row])
            lses = (mLse0[row], mLse1[row])
            max_logits = cute.arch.fmax(maxima[0], maxima[1])
            lse_max = -Float32.inf
            for p in cutlass.range_constexpr(PARTS):
                if maxima[p] > -Float32.inf:
                    lse_max = cute.arch.fmax(lse_max, lses[p])
            terms = cute.make_rmem_tensor((PARTS,), Float32)
            terms.fill(0.0)
            total = Float32(0.0)
            for p in cutlass.range_constexpr(PARTS):
                if maxima[p] > -Float32.inf:
                    terms[p] = cute.math.exp2((lses[p] - lse_max) * LOG2_E, fastmath=True)
                    total += terms[p]
            scale = Float32(0.0)
            lse = Float32.inf
            if lse_max > -Float32.inf:
                lse = (lse_max * LOG2_E + cute.math.log2(total, fastmath=True)) * LN_2
                denom = total
                if (flags & SINK_FLAG) != 0:
                    denom += cute.math.exp2((mSink[row % num_heads] - lse_max) * LOG2_E, fastmath=True)
                scale = 1.0 / denom
            w0 = terms[0] * scale
            w1 = terms[1] * scale
            merged = []
            for i in cutlass.range_constexpr(4 * CHUNKS_PER_LANE):
                a_lo, a_hi = bf16_pair(words[0][i])
                b_lo, b_hi = bf16_pair(words[1][i])
                merged.append(ptx.pack_bf16x2(w0 * a_lo + w1 * b_lo, w0 * a_hi + w1 * b_hi))
            for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                ptx.st_global_v4(mOut.iterator.toint() + offset + 16 * c, *merged[4 * c : 4 * c + 4])
            if lane == 0:
                mMaxLogits[row] = max_logits
                mLseOut[row] = lse
