"""The FP8 kernel's consumer epilogue: each consumer's row statistics published after its last own block, both
consumers' brought to the tile's final max, the output scales with kv_scale and the sink, max_logits and lse,
and this consumer's half of out in bf16 (split: the parts' results merged instead, ``split_merge``).

``TileEpilogue`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self`` and the consumer's state from its ``Consumer`` bundle."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import ptx
from cute_kernels.interface import D_V, SINK_FLAG
from cute_kernels.sm90.cta import CONSUMER_THREADS, THREADS_PER_WG, WARPS_PER_WG
from cute_kernels.sm90.epilogue import output_scale, publish_row_stats, write_max_logits_lse
from cute_kernels.sm90.fp8_tile import D_TILES_PER_CONSUMER, P_SCALE_LOG2, TILE_RING, Consumer
from cute_kernels.sm90.mask import accumulator_row
from cute_kernels.sm90.named_barrier import NamedBarrierFp8
from cute_kernels.sm90.tile_scheduler import plain_int32


class TileEpilogue:
    """The consumers' epilogue of ``SparsePrefillSm90``."""

    @cute.jit
    def publish_row_stats(self, c: Consumer):
        """After this consumer's last own softmax (or when it owns no block): its row sums (relative
        to its last own max), that max and the exact row maxima, for both consumers' epilogues;
        signals them without waiting: named barrier ``NamedBarrierFp8.StatsPublished0 + c``
        (arrive), persistent: an arrival on ``stats_full[c]``."""
        tables = ((c.s_max_own, c.row_max_own), (c.s_max_true, c.row_max_true))
        if const_expr(self.small):
            self.publish_head_stats(c, tables)
        else:
            publish_row_stats(c.row_sum, c.s_row_sum, tables, c.warp, c.quad_row, c.quad_lane, c.index)
        if const_expr(self.persistent):
            cute.arch.mbarrier_arrive(c.mbar_stats_full + c.index)
        else:
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrierFp8.StatsPublished0) + c.index, number_of_threads=CONSUMER_THREADS
            )

    @cute.jit
    def publish_head_stats(self, c: Consumer, tables):
        """Small heads: per head of this thread, the warp's total of ``row_sum`` (over its eight quad rows)
        into ``s_head_sum[head, 4 c + warp]``, and each ``(s_table, values)`` entry into
        ``s_table[head, c]`` (warp 0's quad row 0)."""
        for r in cutlass.range_constexpr(self.rows_per_thread):
            head = self.softmax_row(c, r)
            total = c.row_sum[r]
            for offset in (4, 8, 16):
                total += cute.arch.shuffle_sync_bfly(total, offset=offset)
            if c.quad_row == 0:
                c.s_head_sum[head, c.index * WARPS_PER_WG + c.warp] = total
                if c.warp == 0:
                    for s_table, values in tables:
                        s_table[head, c.index] = values[r]

    @cute.jit
    def final_row_stats(self, c: Consumer, row, last_buffer):
        """Row (small heads: head) ``row``'s m_final, the max that the P of the tile's last block (in P buffer
        ``last_buffer``) is relative to, and its sum of 2^7 P over all slots relative to m_final: both
        consumers' parts (small heads: each the sum of its warps' parts), in the same order in both
        consumers, so both get the same result."""
        max_used = -Float32.inf
        if c.work.num_blocks > 0:
            max_used = c.s_max_used[last_buffer, row]
        scaled_sum = Float32(0.0)
        for k in cutlass.range_constexpr(2):
            if const_expr(self.small):
                part = c.s_head_sum[row, k * WARPS_PER_WG]
                for w in cutlass.range_constexpr(1, WARPS_PER_WG):
                    part += c.s_head_sum[row, k * WARPS_PER_WG + w]
            else:
                part = c.s_row_sum[row, k]
            if c.s_max_own[row, k] != max_used:
                part = part * cute.math.exp2(c.s_max_own[row, k] - max_used, fastmath=True)
            scaled_sum += part
        return max_used, scaled_sum

    @cute.jit
    def small_head_scale(self, c: Consumer, rows, kv_scale, flags, mSink, mMaxLogits, mLse):
        """Small heads, threads 0 .. heads - 1 of each consumer: the output scale of head ``thread`` into
        ``s_out_scale[head, c]``; consumer 0 writes its max_logits and lse."""
        head = c.warp * 32 + c.lane
        if head < self.b_h:
            last_buffer = self.kv_ring.index_before(c.work.block_base + c.work.num_blocks)
            max_used, scaled_sum = self.final_row_stats(c, head, last_buffer)
            c.s_out_scale[head, c.index] = output_scale(
                scaled_sum, max_used, kv_scale, flags, mSink, head, P_SCALE_LOG2
            )
            if c.index == 0:
                write_max_logits_lse(
                    mMaxLogits,
                    mLse,
                    rows.q_row + head,
                    scaled_sum,
                    max_used,
                    c.s_max_true,
                    head,
                    P_SCALE_LOG2,
                )

    @cute.jit
    def epilogue(self, c: Consumer, tile_iter, mSink, mKVScale, mOut, mMaxLogits, mLse, flags):
        """Normalise O, apply kv_scale and the sink, write out (bf16), max_logits and lse of the CTA's
        tile ``tile_iter`` (split: this part's result, merged with the other parts' by ``merge_parts``)."""
        kv_scale = mKVScale[0]
        scale_flags = flags
        if const_expr(self.split):
            scale_flags = flags & ~SINK_FLAG  # a part's scales normalise over its range; the merge adds sinks
            self.open_merge(c)
        # O (both halves) is relative to the last block's max, m_final; both consumers waited for
        # the last block's p_full in their last step. The other consumer published its row
        # statistics after its last own softmax (``publish_row_stats``), usually while this one
        # still ran PV, so the first consumer to finish writes its half of out while the other
        # runs its last PV.
        if const_expr(self.persistent):
            # Both consumers' statistics of the tile: the own ones were written by the quads' first
            # threads, read here by all four.
            TILE_RING.wait(c.mbar_stats_full + (1 - c.index), tile_iter)
            TILE_RING.wait(c.mbar_stats_full + c.index, tile_iter)
        else:
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFp8.StatsPublished1) - c.index, number_of_threads=CONSUMER_THREADS
            )
        # Computed here, from the tile index: nothing of it is live during the tile's blocks.
        rows = self.scheduler.rows(c.work.tile, plain_int32(cute.size(mOut, mode=[1])))
        if const_expr(self.small):
            self.small_head_scale(c, rows, kv_scale, flags, mSink, mMaxLogits, mLse)
        else:
            self.row_scale(c, rows, kv_scale, scale_flags, mSink, mMaxLogits, mLse)
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFp8.ScaleReady0) + c.index, number_of_threads=THREADS_PER_WG
        )
        if const_expr(self.split):
            self.merge_parts(c, rows, flags, mSink, mOut, mMaxLogits, mLse, kv_scale)
        else:
            self.store_out(c, rows, mOut)

    @cute.jit
    def store_out(self, c: Consumer, rows, mOut):
        """This consumer's half of out: O^T times the rows' output scales, in bf16."""

        out_base = mOut.iterator.toint()
        out_bytes = mOut.element_type.width // 8
        # This thread's heads 8j + 2t + e of the tile; those below head_rows are the token's (the others
        # are not stored: predicated stores, no branches).
        own_rows = rows.head_rows - 2 * c.quad_lane
        for j in cutlass.range_constexpr(self.b_h // 8):
            for e in cutlass.range_constexpr(2):
                head = 8 * j + 2 * c.quad_lane + e
                scale = c.s_out_scale[head, c.index]
                row_addr = out_base + Int64(rows.q_row + head) * (D_V * out_bytes)
                store = None if const_expr(self.small) else Int32(8 * j + e < own_rows)
                for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
                    d = (c.index * D_TILES_PER_CONSUMER + mt) * 64 + c.warp * 16 + 2 * c.quad_row
                    lo, hi = c.acc_o[mt][e + 4 * j] * scale, c.acc_o[mt][e + 2 + 4 * j] * scale
                    ptx.st_global_u32(row_addr + d * out_bytes, ptx.pack_bf16x2(lo, hi), store)

    @cute.jit
    def row_scale(self, c: Consumer, rows, kv_scale, flags, mSink, mMaxLogits, mLse):
        """The output scales of this thread's rows into ``s_out_scale[row, c]`` (the quad's first thread);
        consumer 0 writes their max_logits and lse (split: publishes them to every part, see
        ``merge_parts``)."""
        last_buffer = self.kv_ring.index_before(c.work.block_base + c.work.num_blocks)
        for r in cutlass.range_constexpr(2):
            row = accumulator_row(c.warp, c.quad_row, r)
            max_used, scaled_sum = self.final_row_stats(c, row, last_buffer)
            # A row past the token's heads (not written) reads the sink of its last head.
            head = rows.first_head + cutlass.min(row, rows.head_rows - 1)
            out_scale = output_scale(scaled_sum, max_used, kv_scale, flags, mSink, head, P_SCALE_LOG2)
            if c.quad_lane == 0:
                c.s_out_scale[row, c.index] = out_scale
                if c.index == 0:
                    if const_expr(self.split):
                        self.publish_part_stats(c, row, scaled_sum, max_used)
                    elif row < rows.head_rows:
                        write_max_logits_lse(
                            mMaxLogits,
                            mLse,
                            rows.q_row + row,
                            scaled_sum,
                            max_used,
                            c.s_max_true,
                            row,
                            P_SCALE_LOG2,
                        )
