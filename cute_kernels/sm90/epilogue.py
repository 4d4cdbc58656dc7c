"""Row statistics and output scales of the attention epilogue.

Each consumer warpgroup holds partial row sums of P for its rows (the accumulator layout of
``mask``: rows 16w + g + 8r); the consumers exchange them through [row, consumer] tables in shared
memory. The output of a row is ``O / (sum + 2^k exp(sink - m))`` times a numerator (the value scale),
where 2^k is the scale P was stored with; ``max_logits = true max * ln 2`` and
``lse = (m + log2(sum) - k) * ln 2`` (logits in the exp2 domain). A row with no valid slot (sum 0)
writes out = 0, max_logits = -inf and lse = +inf.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_kernels.interface import LOG2_E, SINK_FLAG
from cute_kernels.sm90.mask import accumulator_row, quad_sum

LN_2 = math.log(2.0)


@cute.jit
def publish_row_stats(row_sum, s_row_sum, tables, warp, quad_row, quad_lane, consumer):
    """For this thread's rows r: the quad's total of ``row_sum[r]`` into ``s_row_sum[row, consumer]``
    and, per ``(s_table, values)`` of ``tables``, ``values[r]`` into ``s_table[row, consumer]`` (one
    thread of the quad writes)."""
    for r in cutlass.range_constexpr(2):
        row = accumulator_row(warp, quad_row, r)
        total = quad_sum(row_sum[r])
        if quad_lane == 0:
            s_row_sum[row, consumer] = total
            for s_table, values in tables:
                s_table[row, consumer] = values[r]


@cute.jit
def output_scale(
    row_sum,
    max_used,
    numerator,
    flags,
    mSink,
    head,
    p_scale_log2: cutlass.Constexpr,
):
    """``numerator / (row_sum + 2^p_scale_log2 exp(sink - max_used))`` of a row of head ``head`` (the sink
    term only when the flags say attn_sink is given; ``row_sum`` and ``max_used`` in the exp2 domain), or 0
    when ``row_sum`` is 0."""
    denom = row_sum
    if (flags & SINK_FLAG) != 0:
        sink_log2 = mSink[head] * LOG2_E
        if const_expr(p_scale_log2 != 0):
            denom += cute.math.exp2(sink_log2 - max_used + p_scale_log2, fastmath=True)
        else:
            denom += cute.math.exp2(sink_log2 - max_used, fastmath=True)
    scale = Float32(0.0)
    if row_sum > 0.0:
        scale = numerator / denom
    return scale


@cute.jit
def max_logits_and_lse(row_sum, max_used, s_max_true, row, p_scale_log2: cutlass.Constexpr):
    """``(max_logits, lse)`` of a row from its total ``row_sum`` of 2^p_scale_log2 P relative to
    ``max_used`` and the consumers' exact maxima ``s_max_true[row, consumer]``; (-inf, +inf) when
    ``row_sum`` is 0."""
    max_logits = -Float32.inf
    lse = Float32.inf
    if row_sum > 0.0:
        max_logits = cute.arch.fmax(s_max_true[row, 0], s_max_true[row, 1]) * LN_2
        if const_expr(p_scale_log2 != 0):
            lse = (max_used + cute.math.log2(row_sum, fastmath=True) - p_scale_log2) * LN_2
        else:
            lse = (max_used + cute.math.log2(row_sum, fastmath=True)) * LN_2
    return max_logits, lse


@cute.jit
def write_max_logits_lse(
    mMaxLogits, mLse, out_row, row_sum, max_used, s_max_true, row, p_scale_log2: cutlass.Constexpr
):
    """``max_logits_and_lse`` of a row, written to ``out_row`` of max_logits and lse."""
    max_logits, lse = max_logits_and_lse(row_sum, max_used, s_max_true, row, p_scale_log2)
    mMaxLogits[out_row] = max_logits
    mLse[out_row] = lse
