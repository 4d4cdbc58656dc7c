"""Masking and row statistics of a consumer's S block, in the WGMMA accumulator layout.

A warpgroup's S block is the [64 rows x n columns] f32 accumulator of an m64nNk WGMMA: thread
(warp w, lane 4g + t) holds rows 16w + g + 8r (r = 0, 1) and, of each, columns 8j + 2t + e (e = 0, 1)
as element e + 2r + 4j. A block's slot validity is a tuple of 32-bit ballot words, one per 32
columns, each shifted right by 2t: bit 8(j % 4) + e of word j // 4 is the validity of the thread's
column 8j + 2t + e. The four threads of a quad (lanes 4g .. 4g + 3) hold the same rows.

The small-head kernel computes the transposed block S^T [64 slots x n heads]: the rows are the block's
slots and the columns the heads, so a head's maximum is a reduction over the rows: within a warp over
its eight quad rows (lanes 4g + t, g = 0..7), across the warpgroup's four warps through shared memory.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32, Uint64

from cute_kernels import ptx
from cute_kernels.sm90.cta import THREADS_PER_WG, WARPS_PER_WG
from cute_kernels.sm90.row_gather import slot_valid


def accumulator_row(warp, quad_row, r):
    """Row 16w + g + 8r of the [64 x n] accumulator: this thread's row ``r`` (0 or 1)."""
    return warp * 16 + quad_row + 8 * r


def quad_max(x):
    """The max of ``x`` over the thread's quad."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


def quad_sum(x):
    """The sum of ``x`` over the thread's quad."""
    x += cute.arch.shuffle_sync_bfly(x, offset=1)
    x += cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


def slot_valid_bits(mIdx, token, first_slot, lane, quad_lane, s_kv, valid_len, words: int):
    """Validity of the ``32 * words`` slots from ``first_slot`` of ``token``'s index row (lane l reads
    slots first_slot + 32i + l): the ballot words in the layout above, and whether every slot is
    valid (warp-uniform)."""

    def slot(word):
        return first_slot + 32 * word + lane if word else first_slot + lane

    indices = [mIdx[token, slot(w)] for w in range(words)]
    valid = [slot_valid(indices[w], slot(w), s_kv, valid_len) for w in range(words)]
    shift = Uint32(2 * quad_lane)
    bits = tuple(Uint32(cute.arch.vote_ballot_sync(v)) >> shift for v in valid)
    all_valid = valid[0]
    for w in range(1, words):
        all_valid = all_valid & valid[w]
    return bits, cute.arch.vote_all_sync(all_valid)


@cute.jit
def mask_and_row_max(acc_s, valid_bits, scale_log2, publish=None):
    """Set the invalid slots of S to -inf and return the block's row maxima (exp2 domain) for this
    thread's rows r = 0, 1; ``publish(r, row_max)`` (optional) is called with each as it is found.

    S stays unscaled when the logit scale ``scale_log2`` (one for both rows, or a pair: row r's) is
    positive (the scale is folded into the exponent later); a scale <= 0 (never a sensible
    dequantisation scale, but defined) is applied here first so that the max is still the max of the
    logits."""
    words, all_valid = valid_bits
    column_groups = cute.size(acc_s) // 4  # j: 8-column groups
    if cutlass.const_expr(isinstance(scale_log2, tuple)):
        row_scales = scale_log2
        for r in cutlass.range_constexpr(2):
            if row_scales[r] <= 0.0:
                for j in cutlass.range_constexpr(column_groups):
                    for e in cutlass.range_constexpr(2):
                        acc_s[e + 2 * r + 4 * j] = acc_s[e + 2 * r + 4 * j] * row_scales[r]
    else:
        row_scales = (scale_log2, scale_log2)
        if scale_log2 <= 0.0:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * scale_log2
    if not all_valid:
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(column_groups):
                for e in cutlass.range_constexpr(2):
                    i = e + 2 * r + 4 * j
                    bit = (words[j // 4] >> Uint32(8 * (j % 4) + e)) & Uint32(1)
                    acc_s[i] = acc_s[i] if bit != 0 else -Float32.inf
    row_maxima = []
    for r in cutlass.range_constexpr(2):
        row_max = -Float32.inf
        for j in cutlass.range_constexpr(column_groups):
            for e in cutlass.range_constexpr(2):
                row_max = cute.arch.fmax(row_max, acc_s[e + 2 * r + 4 * j])
        row_max = quad_max(row_max)
        if row_scales[r] > 0.0:
            row_max = ptx.mul_rn_f32(row_max, row_scales[r])  # rounded as exp2_relative rounds S
        if cutlass.const_expr(publish is not None):
            publish(r, row_max)
        row_maxima.append(row_max)
    return row_maxima


@cute.jit
def shifted_row_max(acc_s, scale_log2, shifts):
    """After ``mask_and_row_max``: this thread's rows' maxima of y = S * scale + shift[column] (exp2 domain;
    ``shifts(j)``: those of columns 8j + 2t, 8j + 2t + 1), S * scale rounded as ``exp2_relative`` rounds it
    (S is already scaled where the scale is <= 0), -inf where S is."""
    column_groups = cute.size(acc_s) // 4  # j: 8-column groups
    row_scales = scale_log2
    if cutlass.const_expr(not isinstance(scale_log2, tuple)):
        row_scales = (scale_log2, scale_log2)
    row_maxima = []
    for r in cutlass.range_constexpr(2):
        logit_scale = row_scales[r] if row_scales[r] > 0.0 else Float32(1.0)
        row_max = -Float32.inf
        for j in cutlass.range_constexpr(column_groups):
            pair = shifts(j)
            for e in cutlass.range_constexpr(2):
                x = ptx.mul_rn_f32(acc_s[e + 2 * r + 4 * j], logit_scale)
                row_max = cute.arch.fmax(row_max, x + pair[e])
        row_maxima.append(quad_max(row_max))
    return row_maxima


def exp2_relative(s, logit_scale, bias):
    """2^(s * logit_scale - bias), the product rounded before the subtraction, as the block maxima are
    (``mask_and_row_max``). Fused, a product of 2^22 or more would differ from the rounded maximum by up to
    half its unit in the last place, so the exponent of a row's largest logit could be anything from -2^k to
    2^k (p zero or infinite). Rounded, and with the lazy maximum moved on the difference of two maxima, the
    exponents stay at most the rescale threshold plus P's scale exponent above their bias, and the largest
    one at least at it, at every magnitude of the logits."""
    return cute.math.exp2(ptx.mul_rn_f32(s, logit_scale) - bias, fastmath=True)


def row_valid_bits(valid_slots, warp, quad_row):
    """S^T block: the validity of this thread's two rows (slots 16w + g + 8r, r = 0, 1) from the block's
    ``valid_slots`` (64 bits, bit s: slot s), and whether all 16 rows of its warp are valid (warp-uniform)."""
    rows = Uint32(valid_slots >> Uint64(16 * warp)) & Uint32(0xFFFF)
    valid = [((rows >> Uint32(quad_row + 8 * r)) & Uint32(1)) != Uint32(0) for r in range(2)]
    return valid[0], valid[1], rows == Uint32(0xFFFF)


@cute.jit
def mask_and_column_max(
    acc_s, rows_valid, scale_log2, s_column_max, buffer, warp, quad_row, quad_lane, barrier_id, shifted=None
):
    """S^T block: set the invalid rows (slots) to -inf and return the block's column (head) maxima (exp2
    domain) of this thread's columns 8j + 2t + e, as a list indexed 2j + e. The warps' maxima meet in
    ``s_column_max[buffer..., warp, head]`` (``buffer``: the leading coordinates of the warpgroup's table
    for this block) behind named barrier ``barrier_id`` of the warpgroup's 128 threads. The logit scale
    ``scale_log2`` (one, or a tuple: column 8j + 2t + e's as entry 2j + e) is handled as in
    ``mask_and_row_max``. ``shifted`` (``(shifts, s_shifted_max)``: this thread's rows' shifts, r = 0, 1,
    and a table shaped as ``s_column_max``): returns (the maxima of y = S * scale + shift[row], those of
    S * scale), S * scale rounded as ``exp2_relative`` rounds it."""
    valid_0, valid_1, all_valid = rows_valid
    column_groups = cute.size(acc_s) // 4
    if cutlass.const_expr(isinstance(scale_log2, tuple)):
        column_scales = scale_log2
        for j in cutlass.range_constexpr(column_groups):
            for e in cutlass.range_constexpr(2):
                if column_scales[2 * j + e] <= 0.0:
                    for r in cutlass.range_constexpr(2):
                        acc_s[e + 2 * r + 4 * j] = acc_s[e + 2 * r + 4 * j] * column_scales[2 * j + e]
    else:
        column_scales = (scale_log2,) * (2 * column_groups)
        if scale_log2 <= 0.0:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * scale_log2
    if not all_valid:
        for j in cutlass.range_constexpr(column_groups):
            for e in cutlass.range_constexpr(2):
                acc_s[e + 4 * j] = acc_s[e + 4 * j] if valid_0 else -Float32.inf
                acc_s[e + 2 + 4 * j] = acc_s[e + 2 + 4 * j] if valid_1 else -Float32.inf
    tables = [s_column_max]
    if cutlass.const_expr(shifted is not None):
        tables.append(shifted[1])
    for k in cutlass.range_constexpr(len(tables)):
        warp_maxima = []
        for j in cutlass.range_constexpr(column_groups):
            for e in cutlass.range_constexpr(2):
                values = [acc_s[e + 2 * r + 4 * j] for r in range(2)]
                if cutlass.const_expr(k == 1):  # y: scaled here (as exp2_relative scales), then shifted
                    scale = column_scales[2 * j + e] if column_scales[2 * j + e] > 0.0 else Float32(1.0)
                    values = [ptx.mul_rn_f32(values[r], scale) + shifted[0][r] for r in range(2)]
                column_max = cute.arch.fmax(values[0], values[1])
                for offset in (4, 8, 16):  # the warp's eight quad rows
                    column_max = cute.arch.fmax(
                        column_max, cute.arch.shuffle_sync_bfly(column_max, offset=offset)
                    )
                warp_maxima.append(column_max)
        if quad_row == 0:
            for j in cutlass.range_constexpr(column_groups):
                for e in cutlass.range_constexpr(2):
                    tables[k][(*buffer, warp, 8 * j + 2 * quad_lane + e)] = warp_maxima[2 * j + e]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS_PER_WG)
    maxima = []
    for k in cutlass.range_constexpr(len(tables)):
        column_maxima = []
        for j in cutlass.range_constexpr(column_groups):
            for e in cutlass.range_constexpr(2):
                head = 8 * j + 2 * quad_lane + e
                column_max = tables[k][(*buffer, 0, head)]
                for w in cutlass.range_constexpr(1, WARPS_PER_WG):
                    column_max = cute.arch.fmax(column_max, tables[k][(*buffer, w, head)])
                if cutlass.const_expr(k == 0):
                    if column_scales[2 * j + e] > 0.0:  # as exp2_relative rounds
                        column_max = ptx.mul_rn_f32(column_max, column_scales[2 * j + e])
                column_maxima.append(column_max)
        maxima.append(column_maxima)
    if cutlass.const_expr(shifted is not None):
        return maxima[1], maxima[0]
    return maxima[0]
