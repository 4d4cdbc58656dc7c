"""Merge of the split schedule's partial results: one (token, head) row per warp.

The split attention kernel (``sparse_prefill.py``, ``split=True``) writes, for each of ``splits`` ranges of
a row's index slots, out_s (float32, normalised over the range), max_logits m_s and lse l_s (natural log,
without the sink; a range without a valid slot: m_s = -inf, l_s = +inf, out_s = 0), split s of row r at
row s * rows + r. The merge, over the ranges with a valid slot, in split order (so the result is the same
bits on every run):

    L = max l_s,  t = sum exp(l_s - L),  lse = L + log t,  max_logits = max m_s,
    out = sum exp(l_s - L) / (t + exp(sink - L)) * out_s      (the sink term only when it is given)

and a row without a valid slot gets out = 0, max_logits = -inf, lse = +inf, as from the one-tile kernel.
Lane l of a row's warp owns columns 128 i + 4 l .. + 3 (i < 4): float4 loads, 8-byte bf16 stores.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cute_kernels import ptx
from cute_kernels.interface import D_V, LOG2_E, SINK_FLAG
from cute_kernels.sm90.epilogue import LN_2

ROWS_PER_CTA = 4  # one warp per row
LANE_COLUMNS = 4  # consecutive float32 columns per lane and load
COLUMN_STEPS = D_V // (32 * LANE_COLUMNS)  # loads per lane and split


class SplitCombineSm90:
    """The merge kernel (no compile-time options: d_v is 512)."""

    @cute.jit
    def __call__(
        self,
        mPartOut: cute.Tensor,  # [splits * s_q, h, 512] f32, row-major
        mPartMax: cute.Tensor,  # [splits * s_q, h] f32, row-major
        mPartLse: cute.Tensor,  # [splits * s_q, h] f32, row-major
        mSink: cute.Tensor,  # [h] f32 (read when flags & SINK_FLAG)
        mOut: cute.Tensor,  # [s_q, h, 512] bf16, row-major
        mMaxLogits: cute.Tensor,  # [s_q, h] f32, row-major
        mLse: cute.Tensor,  # [s_q, h] f32, row-major
        flags: Int32,
        stream,
    ):
        rows = cute.size(mOut, mode=[0]) * cute.size(mOut, mode=[1])
        self.kernel(mPartOut, mPartMax, mPartLse, mSink, mOut, mMaxLogits, mLse, flags).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1],
            block=[32 * ROWS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mPartOut: cute.Tensor,
        mPartMax: cute.Tensor,
        mPartLse: cute.Tensor,
        mSink: cute.Tensor,
        mOut: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        flags: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        heads = cute.size(mOut, mode=[1])
        rows = cute.size(mOut, mode=[0]) * heads
        splits = cute.size(mPartOut, mode=[0]) // cute.size(mOut, mode=[0])
        row = bid * ROWS_PER_CTA + tidx // 32
        if row < rows:
            part_max = cute.make_tensor(mPartMax.iterator, cute.make_layout(rows * splits))
            part_lse = cute.make_tensor(mPartLse.iterator, cute.make_layout(rows * splits))
            # The largest lse and max over the ranges with a valid slot (L = -inf: none).
            lse_max = -Float32.inf
            max_logit = -Float32.inf
            for s in cutlass.range(splits, unroll=1):
                m = part_max[s * rows + row]
                max_logit = cute.arch.fmax(max_logit, m)
                if m > -Float32.inf:
                    lse_max = cute.arch.fmax(lse_max, part_lse[s * rows + row])
            acc = cute.make_rmem_tensor((COLUMN_STEPS * LANE_COLUMNS,), Float32)
            acc.fill(0.0)
            out_max = cute.make_tensor(mMaxLogits.iterator, cute.make_layout(rows))
            out_lse = cute.make_tensor(mLse.iterator, cute.make_layout(rows))
            if lse_max > -Float32.inf:
                lse_max_log2 = lse_max * LOG2_E
                total = Float32(0.0)
                for s in cutlass.range(splits, unroll=1):
                    if part_max[s * rows + row] > -Float32.inf:
                        total += cute.math.exp2(
                            part_lse[s * rows + row] * LOG2_E - lse_max_log2, fastmath=True
                        )
                denom = total
                if (flags & SINK_FLAG) != 0:
                    head = row - (row // heads) * heads
                    denom += cute.math.exp2(mSink[head] * LOG2_E - lse_max_log2, fastmath=True)
                for s in cutlass.range(splits, unroll=1):
                    if part_max[s * rows + row] > -Float32.inf:
                        weight = (
                            cute.math.exp2(part_lse[s * rows + row] * LOG2_E - lse_max_log2, fastmath=True)
                            / denom
                        )
                        src = (
                            mPartOut.iterator.toint()
                            + (Int64(s * rows + row) * D_V + lane * LANE_COLUMNS) * 4
                        )
                        for i in cutlass.range_constexpr(COLUMN_STEPS):
                            values = ptx.ld_global_nc_v4_f32(src + i * (32 * LANE_COLUMNS * 4))
                            for k in cutlass.range_constexpr(LANE_COLUMNS):
                                acc[i * LANE_COLUMNS + k] += weight * values[k]
                if lane == 0:
                    out_max[row] = max_logit
                    out_lse[row] = (lse_max_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            else:
                if lane == 0:
                    out_max[row] = -Float32.inf
                    out_lse[row] = Float32.inf
            dst = mOut.iterator.toint() + (Int64(row) * D_V + lane * LANE_COLUMNS) * 2
            for i in cutlass.range_constexpr(COLUMN_STEPS):
                a = i * LANE_COLUMNS
                ptx.st_global_v2(
                    dst + i * (32 * LANE_COLUMNS * 2),
                    ptx.pack_bf16x2(acc[a], acc[a + 1]),
                    ptx.pack_bf16x2(acc[a + 2], acc[a + 3]),
                )
