"""The FP8 kernel's PV product O^T += V^T . P^T over a consumer's step blocks, for its half of d_v: the O
rescales of the lazy max, the V^T A fragments read from the gathered block tiles by ldmatrix.trans and byte
permutes (RS WGMMA), the WGMMA groups of the d tiles and the release of the block tiles.

``PvProduct`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self`` and the consumer's state from its ``Consumer`` bundle."""

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import warpgroup

from cute_kernels import ptx
from cute_kernels.sm90.fp8_tile import (
    B_TOPK,
    D_TILES_PER_CONSUMER,
    NUM_KV_TILES,
    SW64_TILE_COLS,
    TILE_ROW_GROUP_BYTES,
    Consumer,
)
from cute_kernels.sm90.paged_rows import scale_v_fragment
from cute_kernels.sm90.row_gather import swizzle_offset


class PvProduct:
    """The consumers' PV products of ``SparsePrefillSm90``."""

    @cute.jit
    def rescale_o(self, c: Consumer, buffer):
        """O^T *= alpha of P buffer ``buffer`` per head (column 8j + 2t + e); skipped when the
        warp's alphas are all 1."""
        alpha_cols = cute.make_rmem_tensor((self.b_h // 4,), Float32)
        needed = False
        for j in cutlass.range_constexpr(self.b_h // 8):
            for e in cutlass.range_constexpr(2):
                alpha_cols[2 * j + e] = c.s_alpha[buffer, 8 * j + 2 * c.quad_lane + e]
                needed = needed | (alpha_cols[2 * j + e] != 1.0)
        if cute.arch.make_warp_uniform(Int32(cute.arch.vote_any_sync(needed))) != 0:
            for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
                for j in cutlass.range_constexpr(self.b_h // 8):
                    for r in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            i = e + 2 * r + 4 * j
                            c.acc_o[mt][i] = c.acc_o[mt][i] * alpha_cols[2 * j + e]

    @cute.jit
    def accumulate_pv(self, c: Consumer, prev, own, own_moved):
        """O^T += V^T . P^T over block ``prev`` (the other consumer's; none when < 0) and block
        ``own`` (none when past the tile's last block), each after its O rescale (small heads: ``own``'s
        moved flag is ``own_moved``, from ``softmax_own``)."""
        has_prev = prev >= 0
        has_own = own < c.work.num_blocks
        prev = c.work.block_base + prev  # ring positions from here on
        own = c.work.block_base + own
        split = Int32(0)
        if has_prev:
            prev_buffer = self.kv_ring.index(prev)
            phase = self.kv_ring.phase(prev)
            cute.arch.mbarrier_wait(c.mbar_p_full + prev_buffer, phase)  # P, m, alpha of prev
            cute.arch.mbarrier_wait(c.mbar_kv_full + prev_buffer, phase)  # its cp.async writes
            if c.s_moved[prev_buffer] == prev:
                warpgroup.wait_group(0)  # nothing in flight; tells ptxas O is settled (else C7515)
                self.rescale_o(c, prev_buffer)
            if has_own:
                # Own P is this warpgroup's: wait for all of it (and the moved flag).
                self.kv_ring.wait(c.mbar_p_full, own)
                if const_expr(self.small):
                    split = own_moved
                else:
                    split = cute.arch.make_warp_uniform(Int32(c.s_moved[self.kv_ring.index(own)] == own))
        if has_prev & has_own & (split == 0):
            self.pv_run(c, (prev, own))
            self.kv_ring.arrive(c.mbar_kv_empty, prev)
            self.kv_ring.arrive(c.mbar_kv_empty, own)
        else:
            if has_prev:
                self.pv_run(c, (prev,))
                self.kv_ring.arrive(c.mbar_kv_empty, prev)
                warpgroup.wait_group(0)  # drained inside this branch (else ptxas serialises: C7512)
            if has_own:
                if split != 0:  # own block moved the max: rescale between the two products
                    self.rescale_o(c, self.kv_ring.index(own))
                self.pv_run(c, (own,))
                self.kv_ring.arrive(c.mbar_kv_empty, own)

    @cute.jit
    def pv_run(self, c: Consumer, blocks):
        """Queue O^T += V^T . P^T over ``blocks`` (ring positions, one or two) for the 4 d tiles of
        this consumer's half, one WGMMA group each, at most ``pv_groups_in_flight`` in flight (as many A
        fragments live)."""
        in_flight = self.pv_groups_in_flight
        for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
            if const_expr(mt >= in_flight):
                warpgroup.wait_group(in_flight - 1)  # the PV in_flight d tiles back has read its A fragment
            self.issue_pv(c, mt, blocks)

    @cute.jit
    def issue_pv(self, c: Consumer, mt, blocks):
        """Load the V^T A fragment of d tile ``mt`` (of this consumer's half) for ``blocks`` (one
        or two, 2 k-steps each) with ldmatrix.trans + prmt and queue their k-steps (one WGMMA
        group)."""
        # A fresh fragment per call (not a buffer carried through the loop: the single-block calls
        # would carry the unused half, live, through every step).
        frag = cute.make_rmem_tensor(c.thr_mma_pv.partition_shape_A((64, B_TOPK * len(blocks))), Float8E4M3FN)
        words = cute.recast_tensor(frag, Uint32)
        d_tile = c.index * D_TILES_PER_CONSUMER + mt  # 64-column tile of d (0..7)
        for i, block in enumerate(blocks):
            tile_base = (
                c.sK_base + self.kv_ring.index(block) * self.k_tile_bytes + d_tile * TILE_ROW_GROUP_BYTES
            )
            for half in cutlass.range_constexpr(2):
                self.load_v_fragment(words, 2 * i + half, tile_base, half, c.warp, c.lane)
                if const_expr(self.v_fragment_factors):  # V's bytes to their rows' 2^E (paged_rows)
                    group = d_tile // (8 // self.cache.groups)
                    tile = self.kv_ring.index(block)
                    scale_v_fragment(
                        self.cache, c.tables, words, 2 * i + half, tile, group, half, c.quad_lane
                    )
        warpgroup.fence()
        for i, block in enumerate(blocks):
            for half in cutlass.range_constexpr(2):
                for term in cutlass.range_constexpr(self.p_terms):
                    cute.gemm(
                        c.tiled_mma_pv,
                        c.acc_o[mt],
                        frag[None, None, 2 * i + half],
                        c.tOrP[None, None, half, term * NUM_KV_TILES + self.kv_ring.index(block)],
                        c.acc_o[mt],
                    )
        warpgroup.commit_group()

    @cute.jit
    def load_v_fragment(self, words, ks, tile_base, half, warp, lane):
        """k-step ``ks`` of the V^T A fragment, slots 32 * ``half`` .. + 31 of the block tile at
        ``tile_base`` (one d tile): one ldmatrix.x4.trans + 4 prmt.

        Lane L addresses row (slot) L of the four 8x8 b16 matrices (slots 32*half + 8i + L%8, the
        16 d bytes of this warp). Thread (g, t) receives, per matrix, bytes
        [V[2t][2g], V[2t][2g+1], V[2t+1][2g], V[2t+1][2g+1]]; the permutes gather the e4m3 A
        registers a0 = (d 2g, slots 2t, 2t+1, 8+2t, 9+2t), a1 = the same for d 2g+1, and a2, a3 for
        slots + 16."""
        addr = tile_base + swizzle_offset(half * 32 + lane, warp, SW64_TILE_COLS)
        m0, m1, m2, m3 = ptx.ldmatrix_x4_trans(addr)
        words[4 * ks + 0] = ptx.prmt(m0, m1, 0x6420)
        words[4 * ks + 1] = ptx.prmt(m0, m1, 0x7531)
        words[4 * ks + 2] = ptx.prmt(m2, m3, 0x6420)
        words[4 * ks + 3] = ptx.prmt(m2, m3, 0x7531)
