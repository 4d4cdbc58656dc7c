"""The FP8 kernel's QK product S = Q . K^T of a block (small heads: S^T = K . Q^T) and its precision strategy:
one WGMMA chain; summed in float32 from groups of a few k-steps (``precision`` "accurate", "accurate_logits");
from a paged cache, summed per scale group with the exact scales (V3.2) or over rows rescaled to one
power-of-two scale each, then scaled per slot (V4, V4.1).

``QkProducts`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self`` and the consumer's MMAs and fragments from its ``Consumer`` bundle."""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup

from cute_kernels import ptx
from cute_kernels.sm90.cta import THREADS_PER_WG
from cute_kernels.sm90.fp8_tile import B_TOPK, TILE_ROW_GROUP_BYTES, Consumer
from cute_kernels.sm90.named_barrier import NamedBarrierFp8
from cute_kernels.sm90.paged_rows import ROW_SCALE, convert_rope, convert_row, scale_slots, slot_scales

# S summed in float32 ("accurate", "accurate_logits"): from WGMMA groups of at most this many k-steps (64
# elements of d_qk), each started from zero: the FP8 tensor cores' own accumulation keeps about 14 bits, which
# costs the logits ~2e-3 relative over the 18 k-steps of d_qk 576, up to 7.5e-4 over 3 on a row led by one
# slot (same-sign products), and 3.3e-4 over 2 (docs/perf-notes.md, "The logits: QK accumulation")
QK_PROMOTION_KSTEPS = 2
# ... and V4.1's rows rescaled (16 k-steps, no RoPE group): 8 chunks of 2, as V4's scale groups (chunks of 4
# left 8e-4 on rows led by one slot at logits 20-30; a last chunk of one k-step makes ptxas serialise the
# 64-head kernel's WGMMAs, C7512)
ROW_SCALED_PROMOTION_KSTEPS = 2
# A V3.2 scale group is 4 k-steps: S summed in float32 sums them 2 at a time.
PAGED_ACCURATE_CHUNK_KSTEPS = 2


def add_into(total: cute.Tensor, part: cute.Tensor):
    """total += part, element by element (float32 registers)."""
    for i in range(cute.size(part)):
        total[i] = total[i] + part[i]


class QkProducts:
    """The consumers' QK products of ``SparsePrefillSm90``."""

    @cute.jit
    def issue_qk(self, c: Consumer, block):
        """Queue S = Q . K_block^T (one WGMMA group; summed in float32: computed, see ``qk_promoted``,
        ``qk_paged``; paged V4 and V4.1: the block's rows rescaled first, see ``qk_row_scaled``);
        returns the block's KV tile (its data has landed)."""
        ring = c.work.block_base + block
        tile = self.kv_ring.index(ring)
        cute.arch.mbarrier_wait(c.mbar_kv_full + tile, self.kv_ring.phase(ring))
        if const_expr(self.row_scaled):
            self.qk_row_scaled(c, tile)  # S scaled after the consumer's wait (scale_row_scaled_s)
        elif const_expr(self.cache is not None):
            self.qk_paged(c, tile)
        elif const_expr(self.promote_qk):
            self.qk_promoted(c, tile)
        else:
            self.queue_qk_steps(c, c.acc_s, tile, range(self.d_qk // 32))
        return tile

    def queue_qk_steps(self, c: Consumer, acc, tile, steps, half=None):
        """Queue the k-steps ``steps`` of S (or of its N = 32 half ``half``) into ``acc`` as one WGMMA group,
        the first overwriting."""
        self.queue_qk_group(c, acc, self.step_operands(c, tile, steps, half), half)

    def step_operands(self, c: Consumer, tile, steps, half=None):
        """``(q_step, k_operand)`` of the k-steps ``steps`` of block tile ``tile`` (for S, or its N = 32 half
        ``half``), as ``queue_qk_group`` takes them."""
        k_tiles = c.tSrK if const_expr(half is None) else c.qk_chunks.k_halves[half]
        return [(k, k_tiles[None, None, k, tile]) for k in steps]

    def rope_lo_operands(self, lo_tiles, tile):
        """``(q_step, k_operand)`` of a bf16 RoPE's lo terms of block tile ``tile`` (descriptors ``lo_tiles``
        over the staging tile), each beside Q's RoPE k-step."""
        rope = self.cache.rope_column * 2  # the RoPE's first k-step
        return [(rope + j, lo_tiles[None, None, j, tile]) for j in range(2)]

    def queue_qk_group(self, c: Consumer, acc, operands, half=None):
        """Queue one WGMMA group into ``acc`` (the first k-step overwriting): per ``(q_step, k_operand)`` of
        ``operands``, Q's k-step ``q_step`` times the K descriptors ``k_operand`` (of S, of its N = 32 half
        ``half``, or of S^T = K . Q^T for small heads)."""
        warpgroup.fence()
        for i, (q_step, k_operand) in enumerate(operands):
            first = i == 0
            if half is not None:
                mma = c.qk_chunks.mmas[1 if first else 0]
                cute.gemm(mma, acc, c.tSrQ[None, None, q_step], k_operand, acc)
            else:
                mma = c.tiled_mma_qk_first if first else c.tiled_mma_qk
                if const_expr(self.small):  # S^T = K . Q^T
                    cute.gemm(mma, acc, k_operand, c.tSrQ[None, None, q_step], acc)
                else:
                    cute.gemm(mma, acc, c.tSrQ[None, None, q_step], k_operand, acc)
        warpgroup.commit_group()

    def qk_promoted(self, c: Consumer, tile):
        """S = Q . K^T summed in float32 ("accurate", "accurate_logits") from WGMMA groups of
        ``promotion_ksteps`` k-steps, each started from zero. The first lands in S itself, each later one
        in the chunk accumulator, waited for and added to S. 64 heads: S in its two N = 32 halves (a 64 x 64
        chunk accumulator next to O^T serialises the WGMMAs), both halves' first groups queued together.
        Returns with S complete."""
        first = range(self.promotion_ksteps)
        if const_expr(self.small):
            self.queue_qk_group(c, c.acc_s, self.first_group(c, tile, first, None))
            self.sum_chunks(c, tile, c.acc_s, None)
        else:
            # S's registers of half h are those of columns 32h.. (its 8-column groups 4h..4h+3)
            part = c.qk_chunks.part
            s_half = [cute.make_tensor(c.acc_s.iterator + h * cute.size(part), part.layout) for h in (0, 1)]
            for h in (0, 1):
                self.queue_qk_group(c, s_half[h], self.first_group(c, tile, first, h), h)
            for h in (0, 1):
                self.sum_chunks(c, tile, s_half[h], h)

    def first_group(self, c: Consumer, tile, steps, half):
        """The operands of S's first promoted group (of its N = 32 half ``half``): the k-steps ``steps``, and
        for rows rescaled with a bf16 RoPE (paged V4) the RoPE's lo terms, about 2^-8 of its hi terms, whose
        few products add nothing measurable to the group's truncation."""
        operands = self.step_operands(c, tile, steps, half)
        if const_expr(self.row_scaled and self.bf16_rope):  # (the RoPE's hi terms: the last chunk)
            lo_tiles = c.qk_chunks.rope_lo if const_expr(half is None) else c.qk_chunks.rope_lo[half]
            operands += self.rope_lo_operands(lo_tiles, tile)
        return operands

    @cute.jit
    def sum_chunks(self, c: Consumer, tile, total: cute.Tensor, half: cutlass.Constexpr):
        """``total`` (S, or its N = 32 half ``half``) += each later group of k-steps, one at a time through
        the chunk accumulator. A loop, not unrolled: unrolled, ptxas keeps the descriptors of several groups
        in uniform registers, and the producer's share of them no longer holds its tile state (it spills)."""
        kc = self.promotion_ksteps
        n = self.d_qk // 32
        for chunk in cutlass.range(1, n // kc, unroll=1):
            self.add_group(c, tile, total, [chunk * kc + j for j in range(kc)], half)
        if const_expr(n % kc):  # the last, shorter group
            self.add_group(c, tile, total, range(n - n % kc, n), half)

    def add_group(self, c: Consumer, tile, total, steps, half):
        """``total`` += the k-steps ``steps`` of S (or of its half ``half``), one WGMMA group into the chunk
        accumulator, waited for."""
        part = c.qk_chunks.part
        self.queue_qk_steps(c, part, tile, steps, half)
        warpgroup.wait_group(0)
        add_into(total, part)

    def qk_row_scaled(self, c: Consumer, tile):
        """Paged rows of power-of-two scales (V4, V4.1): this warpgroup rescales the block's rows to one
        power-of-two scale each (``convert_row``), then queues S = Q . K''^T over every k-step and a bf16
        RoPE's lo terms as one WGMMA group (S promoted: ``qk_promoted``, S complete on return); after its
        wait, ``scale_row_scaled_s`` multiplies each slot's S by its scale."""
        geo = self.cache
        convert_row(geo, c.tables, c.sK_base + tile * self.k_tile_bytes, tile, c.warp * 32 + c.lane)
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores, seen by the WGMMAs
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFp8.RopeConverted0) + c.index, number_of_threads=THREADS_PER_WG
        )
        if const_expr(self.promote_qk):
            self.qk_promoted(c, tile)
        else:
            operands = self.step_operands(c, tile, range(self.d_qk // 32))
            if const_expr(self.bf16_rope):
                operands += self.rope_lo_operands(c.rope_lo, tile)
            self.queue_qk_group(c, c.acc_s, operands)

    def s_rows(self, c: Consumer, tile):
        """Small heads: the [tile][slot] table entries (their indices) of this thread's rows of S^T, slots
        16w + g + 8r of block tile ``tile``, r = 0, 1."""
        return [tile * B_TOPK + c.warp * 16 + c.quad_row + 8 * r for r in range(2)]

    def slot_pair(self, c: Consumer, table, tile, j):
        """The float32 entries of ``table`` ([tile][slot]) for this thread's columns 8j + 2t and 8j + 2t + 1
        of block tile ``tile``."""
        return ptx.ld_shared_v2_f32(table + (tile * B_TOPK + 8 * j + 2 * c.quad_lane) * 4)

    def scale_row_scaled_s(self, c: Consumer, tile):
        """Paged rows rescaled, S complete: each slot's S times its row scale 2^E (``convert_row``)."""
        scale_slots(c.acc_s, None, self.slot_scales(c, c.acc_s, tile, ROW_SCALE, 0), True)

    def qk_paged(self, c: Consumer, tile):
        """S = Q . K^T from a paged cache's block tile (``paged_rows``): sum over the scale groups g of
        sigma[slot, g] * (Q_g . K_g^T), summed in float32 from WGMMA groups of ``paged_chunk_ksteps`` k-steps
        (a scale group, or promoted at most ``PAGED_ACCURATE_CHUNK_KSTEPS`` of it; 64 heads: S in
        its two N = 32 halves, as ``qk_promoted``; small heads: S^T whole), the RoPE a last group of its two
        e4m3 terms with its row scales. The first chunk lands in S while this warpgroup converts the block's
        staged RoPE (``convert_rope``). Returns with S complete."""
        geo = self.cache
        part = c.qk_chunks.part
        halves = [None]  # small heads: S^T, one chunk accumulator its shape
        s_parts = [c.acc_s]
        if const_expr(not self.small):
            halves = [0, 1]
            s_parts = [cute.make_tensor(c.acc_s.iterator + h * cute.size(part), part.layout) for h in halves]
        for h, s_part in zip(halves, s_parts, strict=True):
            self.queue_qk_steps(c, s_part, tile, range(self.paged_chunk_ksteps), h)
        convert_rope(
            geo,
            c.tables,
            c.sK_base + tile * self.k_tile_bytes + geo.rope_column * TILE_ROW_GROUP_BYTES,
            tile,
            c.warp * 32 + c.lane,
        )
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores, seen by the WGMMAs
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFp8.RopeConverted0) + c.index, number_of_threads=THREADS_PER_WG
        )
        scales = [self.slot_scales(c, s_part, tile, 0, h) for h, s_part in zip(halves, s_parts, strict=True)]
        warpgroup.wait_group(0)
        for s_part, part_scales in zip(s_parts, scales, strict=True):
            scale_slots(s_part, None, part_scales, True)
        for h, s_part in zip(halves, s_parts, strict=True):
            self.sum_scale_groups(c, tile, s_part, h)

    @cute.jit
    def sum_scale_groups(self, c: Consumer, tile, total: cute.Tensor, half: cutlass.Constexpr):
        """Paged: ``total`` (S's N = 32 half ``half``; small heads: S^T, ``half`` None) += sigma * each later
        chunk's product, then the RoPE's, one at a time through the chunk accumulator (a loop, as
        ``sum_chunks``)."""
        geo = self.cache
        part = c.qk_chunks.part
        chunk_ksteps = self.paged_chunk_ksteps
        chunks_per_group = geo.group_ksteps // chunk_ksteps
        for chunk in cutlass.range(1, geo.groups * chunks_per_group, unroll=1):
            self.queue_qk_steps(c, part, tile, [chunk * chunk_ksteps + j for j in range(chunk_ksteps)], half)
            scales = self.slot_scales(c, total, tile, chunk // chunks_per_group, half)
            warpgroup.wait_group(0)
            scale_slots(total, part, scales, False)
        # The RoPE: its hi term in the block tile's RoPE column, its lo term in the staging tile
        rope = geo.rope_column * 2  # its first k-step
        lo_tiles = c.qk_chunks.rope_lo if const_expr(half is None) else c.qk_chunks.rope_lo[half]
        operands = self.step_operands(c, tile, [rope, rope + 1], half) + self.rope_lo_operands(lo_tiles, tile)
        self.queue_qk_group(c, part, operands, half)
        scales = self.slot_scales(c, total, tile, geo.groups, half)
        warpgroup.wait_group(0)
        scale_slots(total, part, scales, False)

    def slot_scales(self, c: Consumer, total, tile, group, half):
        """Paged: ``(sigmas, slot_of)`` for ``scale_slots``: sigma[slot, group] of this thread's slots of
        ``total``, element i's slot being ``slot_of(i)``: its column (64 heads: S's N = 32 half ``half``) or
        its row (small heads: S^T); ``group`` == the cache's ``groups``: the RoPE's row scales."""
        if const_expr(self.small):  # rows 16w + g + 8r: element e + 2r + 4j
            slots = [c.warp * 16 + c.quad_row + 8 * r for r in range(2)]
            return slot_scales(self.cache, c.tables, tile, group, slots), lambda i: (i // 2) % 2
        # columns 32 half + 8j + 2t + e: element e + 2r + 4j
        columns = range(cute.size(total) // 4)
        slots = [32 * half + 8 * j + 2 * c.quad_lane + e for j in columns for e in range(2)]
        return slot_scales(self.cache, c.tables, tile, group, slots), lambda i: (i // 4) * 2 + i % 2
