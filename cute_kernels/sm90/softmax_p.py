"""The FP8 kernel's softmax of a consumer's own block: the lazy running max chained from the other consumer's
block, the row sums, and P (P^T for small heads) stored in e4m3 (one term, or two with ``precision``
"accurate" or "accurate_out") in the slot order of the V^T fragments, published by the block's ``p_full``.

``SoftmaxP`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self`` and the consumer's state from its ``Consumer`` bundle."""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from cute_kernels import ptx
from cute_kernels.sm90.fp8_tile import B_TOPK, P_SCALE_LOG2, SW64_TILE_COLS, Consumer
from cute_kernels.sm90.mask import accumulator_row, exp2_relative
from cute_kernels.sm90.row_gather import swizzle_offset

RESCALE_THRESHOLD = 1.75  # log2 units; 2^(P_SCALE_LOG2 + RESCALE_THRESHOLD) = 430 < 448


class SoftmaxP:
    """The consumers' softmax and P stores of ``SparsePrefillSm90``."""

    @cute.jit
    def softmax_own(self, c: Consumer, block, block_maxima):
        """Softmax of an own block: m_block from m_{block-1} (published by the other consumer)
        and the block's maxima, then P = e4m3(2^7 exp2(S - m_block)) with m_block, alpha_block
        and the moved flag, published by ``p_full``; accumulates this consumer's row sums. Small heads:
        returns the moved flag (warp-uniform: every warp holds every head's maxima); else 0.
        Paged: ``block_maxima`` is (the maxima of y = x + E_s, those of the logits x); the
        running max, alpha and P are y's (P = e4m3(2^7 exp2(x - m_block) 2^E_s)), the row sums and
        ``max_logits`` x's, so that O = sum P V'' has V's own scale."""
        ring = c.work.block_base + block  # the block's ring position (buffers, phases, moved flag)
        buffer = self.kv_ring.index(ring)
        true_maxima = block_maxima
        p_scales = None  # paged: the 2^E of this thread's columns 8j + 2t + e, e = 0, 1, by j
        if const_expr(self.p_carries_row_scale):
            block_maxima, true_maxima = block_maxima
            if const_expr(self.small):  # this thread's rows (slots) of S^T, r = 0, 1
                p_scales = [ptx.ld_shared_f32(c.tables.row_scale + row * 4) for row in self.s_rows(c, buffer)]
            else:
                p_scales = functools.partial(self.slot_pair, c, c.tables.row_scale, buffer)
        # S is still unscaled when the scale is positive (see mask_and_row_max).
        row_scales = c.scale_log2
        if const_expr(not isinstance(c.scale_log2, tuple)):
            row_scales = (c.scale_log2,) * self.rows_per_thread
        tile_addr = c.sP_base + buffer * (self.b_h * B_TOPK)  # the hi term's tile
        prev_buffer = self.kv_ring.index_before(ring)
        if block > 0:
            cute.arch.mbarrier_wait(c.mbar_p_full + prev_buffer, self.kv_ring.phase(ring - 1))
        moved = False
        exponents = []  # small heads: (logit scale, bias) per head, for the P^T stores after the loop
        for r in cutlass.range_constexpr(self.rows_per_thread):
            row = self.softmax_row(c, r)
            max_prev = -Float32.inf
            if block > 0:
                max_prev = c.s_max_used[prev_buffer, row]
            c.row_max_true[r] = cute.arch.fmax(c.row_max_true[r], true_maxima[r])
            # Lazy max: move only when the block's max exceeds it by more than the threshold (compared as a
            # difference: at logits of 2^22 and more, max_prev + threshold would round to max_prev).
            max_used = max_prev
            alpha = Float32(1.0)
            rises = block_maxima[r] - max_prev > RESCALE_THRESHOLD
            if rises:
                alpha = cute.math.exp2(max_prev - block_maxima[r], fastmath=True)
                max_used = block_maxima[r]
            moved = moved | rises
            if max_used != c.row_max_own[r]:  # bring this consumer's sum to the new max
                c.row_sum[r] = c.row_sum[r] * cute.math.exp2(c.row_max_own[r] - max_used, fastmath=True)
                c.row_max_own[r] = max_used
            if self.writes_row(c):
                c.s_max_used[buffer, row] = max_used
                c.s_alpha[buffer, row] = alpha
            # Exponent offset: 2^7 folded in; a row with no valid slot so far (max -inf) uses 0.
            bias = (max_used if max_used != -Float32.inf else Float32(0.0)) - P_SCALE_LOG2
            logit_scale = row_scales[r] if row_scales[r] > 0.0 else Float32(1.0)
            if const_expr(self.small):
                exponents.append((logit_scale, bias))
            else:
                block_sum = self.exp_and_store_p(c, r, row, logit_scale, bias, tile_addr, p_scales)
                c.row_sum[r] = c.row_sum[r] + block_sum
        if const_expr(self.small):
            self.exp_and_store_p_transposed(c, exponents, tile_addr, p_scales)
        if moved:
            c.s_moved[buffer] = ring  # any thread: some row's max moved at this block
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(c.mbar_p_full + buffer)
        own_moved = Int32(0)
        if const_expr(self.small):
            own_moved = cute.arch.make_warp_uniform(Int32(cute.arch.vote_any_sync(moved)))
        return own_moved

    def softmax_row(self, c: Consumer, r):
        """The row (head) of this thread's softmax state entry ``r``: accumulator row 16w + g + 8r; small
        heads: column 8j + 2t + e of S^T for r = 2j + e."""
        if const_expr(self.small):
            return 8 * (r // 2) + 2 * c.quad_lane + r % 2
        return accumulator_row(c.warp, c.quad_row, r)

    def writes_row(self, c: Consumer):
        """Whether this thread writes its rows' entries of the shared softmax tables (one thread per row:
        the quad's first; small heads: those of quad row 0 in warp 0)."""
        if const_expr(self.small):
            return (c.warp == 0) & (c.quad_row == 0)
        return c.quad_lane == 0

    @cute.jit
    def exp_and_store_p_transposed(self, c: Consumer, exponents, tile_addr, p_scales=None):
        """Small heads: p = 2^(S^T * scale - bias) of the head's ``exponents`` entry, added to the head's
        row sum and stored as P^T [head][slot] in e4m3 (two terms: the lo tile after the hi one),
        times its slot's ``p_scales`` entry (this thread's rows r = 0, 1) when given.

        The slot order inside a 32-slot k-step is the 64-head kernel's (``load_v_fragment``): position
        4t + b holds slot [2t, 2t + 1, 8 + 2t, 9 + 2t][b], position + 16 slot + 16. This thread's slots
        16w + g + 8r (r = 0, 1) sit in word g // 2 of chunk w of a head's row, beside those of quad row
        g ^ 1 (lane ^ 4): the two lanes swap one head's pair by a shuffle, and each stores one head's
        whole word (even g: head 8j + 2t, odd g: 8j + 2t + 1), one 32-bit store per term."""
        odd = (c.lane >> 2) & 1  # g % 2
        word_offset = (c.lane >> 3) << 2  # 4 (g // 2)
        for j in cutlass.range_constexpr(self.b_h // 8):
            p = []
            for e in cutlass.range_constexpr(2):
                logit_scale, bias = exponents[2 * j + e]
                for r in cutlass.range_constexpr(2):
                    p.append(exp2_relative(c.acc_s[e + 2 * r + 4 * j], logit_scale, bias))
                c.row_sum[2 * j + e] = c.row_sum[2 * j + e] + (p[2 * e] + p[2 * e + 1])
            if const_expr(p_scales is not None):  # p[2e + r]: row r's slot
                p = [p[k] * p_scales[k % 2] for k in range(4)]
            # words[term]: bytes [head 2t: slot g, g + 8; head 2t + 1: slot g, g + 8]
            if const_expr(self.p_terms == 1):
                words = (ptx.pack_e4m3x4(p[0], p[1], p[2], p[3]),)
            else:
                words = ptx.split_e4m3x4_from_f16x2(ptx.pack_f16x2(p[0], p[1]), ptx.pack_f16x2(p[2], p[3]))
            # The bytes of the other lane's head (its e is 1 - this lane's), of the hi term then the lo term;
            # then this lane's word per term: its own bytes and the received ones, slot g (even lane) first.
            lo_term = words[self.p_terms - 1]
            sent = ptx.prmt(words[0], lo_term, 0x5410) if odd == 1 else ptx.prmt(words[0], lo_term, 0x7632)
            received = Uint32(cute.arch.shuffle_sync_bfly(Int32(sent), offset=4))
            head = 8 * j + 2 * c.quad_lane + odd
            addr = tile_addr + swizzle_offset(head, c.warp, SW64_TILE_COLS) + word_offset
            for term in cutlass.range_constexpr(self.p_terms):
                own = words[term]
                if const_expr(term == 0):
                    word = ptx.prmt(own, received, 0x3524) if odd == 1 else ptx.prmt(own, received, 0x5140)
                else:
                    word = ptx.prmt(own, received, 0x3726) if odd == 1 else ptx.prmt(own, received, 0x7160)
                ptx.st_shared_u32(addr + term * self.p_term_bytes, word)

    @cute.jit
    def exp_and_store_p(self, c: Consumer, r, row, logit_scale, bias, tile_addr, p_scales=None):
        """Row ``r`` of this thread's S (left unchanged): p = 2^(S * scale - bias) in f32, stored as
        e4m3 P (one term; two terms: rounded to f16, then the terms hi = e4m3(p) and lo = e4m3(p - hi),
        the lo tile ``p_term_bytes`` after the hi one), times its column's scale when ``p_scales`` (j -> the
        scales of columns 8j + 2t, 8j + 2t + 1) is given; returns the sum of the 16 p (in f32).

        Slot order inside a 32-slot k-step (sigma): k = 4t + b holds slot
        [2t, 2t+1, 8+2t, 9+2t][b] and k + 16 holds slot + 16 -- the order that ldmatrix.trans +
        prmt give the V^T fragment. This thread's S columns 8j + 2t + e therefore land in two
        4-byte words per 32-slot group."""
        block_sum = Float32(0.0)
        for kstep in cutlass.range_constexpr(2):
            for half in cutlass.range_constexpr(2):
                j0 = 4 * kstep + 2 * half
                columns = (2 * r + 4 * j0, 1 + 2 * r + 4 * j0, 2 * r + 4 * j0 + 4, 1 + 2 * r + 4 * j0 + 4)
                p = [exp2_relative(c.acc_s[i], logit_scale, bias) for i in columns]
                block_sum += (p[0] + p[1]) + (p[2] + p[3])
                if const_expr(p_scales is not None):  # columns 8 j0 + 2t + e, then 8 (j0 + 1) + 2t + e
                    scales = p_scales(j0) + p_scales(j0 + 1)
                    p = [p[k] * scales[k] for k in range(4)]
                if const_expr(self.p_terms == 1):
                    words = (ptx.pack_e4m3x4(p[0], p[1], p[2], p[3]),)
                else:
                    words = ptx.split_e4m3x4_from_f16x2(
                        ptx.pack_f16x2(p[0], p[1]), ptx.pack_f16x2(p[2], p[3])
                    )
                addr = tile_addr + swizzle_offset(row, 2 * kstep + half, SW64_TILE_COLS) + 4 * c.quad_lane
                ptx.st_shared_u32(addr, words[0])
                if const_expr(self.p_terms == 2):
                    ptx.st_shared_u32(addr + self.p_term_bytes, words[1])
        return block_sum
