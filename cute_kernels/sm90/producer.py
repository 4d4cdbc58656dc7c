"""The FP8 kernel's producer warpgroup (WG0): each tile's Q (by TMA, or its bf16 rows staged in the KV ring's
pair slot), then the tile's KV rows gathered pair by pair into the block tiles, from a row-major kv
(``row_gather``) or a paged cache (``paged_rows``); and the L2 prefetch of the next tile's bf16 rows that a
consumer warp runs for the persistent small-head kernel.

``Producer`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self``."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from cute_kernels import ptx
from cute_kernels.sm90.cta import NUM_THREADS
from cute_kernels.sm90.fp8_tile import B_TOPK, PAIR, SW64_TILE_COLS, TILE_RING
from cute_kernels.sm90.named_barrier import NamedBarrierFp8
from cute_kernels.sm90.paged_rows import BlockScaleTables, PagedRowGather
from cute_kernels.sm90.row_gather import RowGather
from cute_kernels.sm90.row_views import STAGED_ROWS_PER_TILE, load_q_tile, stage_q_rows
from cute_kernels.sm90.tile_scheduler import plain_int32

L2_LINE_BYTES = 128


class ProducerInputs(NamedTuple):
    """What the kernel hands its producer warpgroup (``Producer.produce``)."""

    tma_atom_q: object  # the Q tile's TMA (None for a bf16 q)
    mQ_tma: cute.Tensor  # the Q TMA's tensor; bf16 q: the q row view
    sQ: cute.Tensor
    sK: cute.Tensor
    s_valid_words: cute.Tensor  # small heads: the gathered slots' validity (None otherwise)
    mKV: cute.Tensor  # row-major kv, or a paged cache
    mExtraCache: cute.Tensor  # paged: the extra cache (0 pages when there is none); None otherwise
    extra_from: Int32  # paged: the extra cache's first index slot; None otherwise
    mIdx: cute.Tensor
    mbar_q: cute.Pointer
    mbar_q_empty: cute.Pointer
    mbar_kv_full: cute.Pointer
    mbar_kv_empty: cute.Pointer
    tiles: object  # the CTA's tiles (TileScheduler.cta_tiles)
    tables: BlockScaleTables  # paged: the block tiles' scale tables (None otherwise)


class ProducerLanes(NamedTuple):
    """What a producer thread copies: the gather, and its place in a pair's block tiles."""

    gather: object  # RowGather or PagedRowGather
    block_in_pair: Int32  # warps 0-1: the pair's first block, warps 2-3: its second
    row_base: Int32  # this warp's 32 rows inside its block
    lane_row: Int32  # the row (of 8) this lane copies per 8-row group


class Producer:
    """WG0 of ``SparsePrefillSm90``: Q and the KV row gather."""

    @cute.jit
    def produce(self, cta: ProducerInputs):
        """WG0, per tile: Q by TMA (one thread; persistent: once both consumers' QKs of the previous
        tile are done; ``stage_q``: the bf16 rows, see ``produce_tile``), then the pair-by-pair row
        gather. Pairs are counted across the CTA's tiles, so the gather runs into the next tile as soon
        as block tiles are free."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # Lane: 16-byte chunk lane % 4 of each 64-byte column tile (of rows lane // 4 + 8i).
        if const_expr(self.cache is None):
            gather = RowGather(cta.mKV, cta.sK, self.d_qk, lane, SW64_TILE_COLS, B_TOPK)
        else:
            gather = PagedRowGather(
                cta.mKV,
                cta.mExtraCache,
                cta.extra_from,
                self.cache,
                cta.sK.iterator.toint(),
                cta.tables.lo,
                cta.tables.raw,
                lane,
            )
        lanes = ProducerLanes(gather, warp_idx // 2, (warp_idx % 2) * 32, lane // 4)
        if const_expr(self.persistent):
            pair_base = Int32(0)  # pairs this CTA gathered before the current tile
            for tile_iter in cutlass.range(cta.tiles.count, unroll=1):
                work = self.scheduler.work(cta.tiles, tile_iter, 2 * (pair_base + self.q_pairs))
                if const_expr(not self.q_bf16):
                    if warp_idx == 0:
                        TILE_RING.wait_empty(cta.mbar_q_empty, tile_iter)
                q_row = self.scheduler.first_q_row(work.tile, cta.tiles.heads)
                self.produce_tile(cta, lanes, work, q_row, pair_base)
                pair_base += work.num_pairs + self.q_pairs
        else:
            work = self.scheduler.work(cta.tiles, 0, 2 * self.q_pairs)
            q_row = self.scheduler.first_q_row(work.tile, cta.tiles.heads)
            self.produce_tile(cta, lanes, work, q_row, 0)
        ptx.cp_async_wait_all()
        if const_expr(self.split):  # no copy of this CTA lands in its KV tiles from here on
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFp8.RingFree), number_of_threads=NUM_THREADS)

    @cute.jit
    def produce_tile(self, cta: ProducerInputs, lanes: ProducerLanes, work, q_row, pair_base):
        """One tile's Q (rows ``q_row`` onwards) and pairs, from the ring's pair position ``pair_base`` on
        (the pairs and staged Q tiles of the CTA's earlier tiles). e4m3 q: the Q tile by TMA (warp 0).
        ``stage_q``: the tile's bf16 rows into the pair slot of position ``pair_base`` (``stage_q_rows``),
        the pairs after it. Small heads with a bf16 q: nothing (the consumers load it)."""
        gather, block_in_pair, row_base, lane_row = lanes
        mQ_tma, mIdx, mbar_kv_full, mbar_kv_empty = cta.mQ_tma, cta.mIdx, cta.mbar_kv_full, cta.mbar_kv_empty
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if const_expr(not self.q_bf16):
            if warp_idx == 0:
                load_q_tile(
                    cta.tma_atom_q, mQ_tma, cta.sQ, cta.mbar_q, q_row, self.b_h, self.d_qk, self.q_tile_bytes
                )
        if const_expr(self.stage_q):
            q_tile = self.pair_ring.index(pair_base) * 2 + block_in_pair
            cute.arch.mbarrier_wait(mbar_kv_empty + q_tile, self.pair_ring.phase(pair_base) ^ 1)
            stage_q_rows(
                mQ_tma,
                q_row,
                plain_int32(cute.size(mQ_tma, mode=[0])) - 1,
                block_in_pair * STAGED_ROWS_PER_TILE,
                row_base + lane,
                gather.sK_base + q_tile * self.k_tile_bytes,
                mbar_kv_full + q_tile,
                self.d_qk,
            )

        # The KV source's two steps, bound outside the loop (a method called inside would make the DSL carry
        # the gather object through the loop as a value it may change)
        locate, copy_row = gather.locate, gather.copy_row
        for pair in cutlass.range(work.num_pairs, unroll=1):
            ring_pair = pair_base + self.q_pairs + pair
            stage = self.pair_ring.index(ring_pair)
            phase = self.pair_ring.phase(ring_pair)
            full_barrier = mbar_kv_full + stage * 2 + block_in_pair
            empty_barrier = mbar_kv_empty + stage * 2 + block_in_pair
            slot = pair * PAIR + warp_idx * 32 + lane
            if const_expr(self.split):
                slot += work.slot_base
            kv_row = mIdx[work.token, slot]  # paged: a token slot of the cache
            is_valid, where = locate(kv_row, slot, work.valid_len)
            cute.arch.mbarrier_wait(empty_barrier, phase ^ 1)
            if const_expr(self.small):  # the warp's 32 slots' validity (the consumers read it after kv_full)
                valid_word = cute.arch.vote_ballot_sync(is_valid != 0)
                if lane == 0:
                    cta.s_valid_words[stage * 2 + block_in_pair, warp_idx % 2] = valid_word
                    cute.arch.mbarrier_arrive(full_barrier)
            tile_base = gather.sK_base + (stage * 2 + block_in_pair) * self.k_tile_bytes
            for group in cutlass.range_constexpr(4):  # lane l holds the index of the warp's row l
                src_lane = group * 8 + lane_row
                row_valid = cute.arch.shuffle_sync(is_valid, src_lane)
                row = row_base + group * 8 + lane_row
                row_where = [cute.arch.shuffle_sync(value, src_lane) for value in where]
                copy_row(stage * 2 + block_in_pair, tile_base, row, row_where, row_valid)
            cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier)

    @cute.jit
    def prefetch_next_q(self, mQ, tile, heads):
        """Persistent small heads, bf16 q (one consumer warp): prefetch into L2 the Q rows of the CTA's next
        tile (tile + grid size, a whole token), when it exists; ``heads``: h. (Measured on the 64-head
        persistent kernel before its rows were staged: 2-4% off its rows with a bf16 q.)"""
        rows = plain_int32(cute.size(mQ, mode=[0]))
        next_tile = tile + cute.arch.grid_dim()[0]
        if next_tile < rows // self.b_h:
            row_bytes = self.d_qk * 2
            tile_bytes = self.b_h * row_bytes
            lane_offset = cute.arch.lane_idx() * L2_LINE_BYTES
            first_row = self.scheduler.first_q_row(next_tile, heads)
            base = mQ.iterator.toint() + Int64(first_row) * row_bytes + lane_offset
            line_set = 32 * L2_LINE_BYTES  # a line per lane
            for line in cutlass.range_constexpr(-(-tile_bytes // line_set)):
                if const_expr((line + 1) * line_set <= tile_bytes):
                    ptx.prefetch_l2(base + line * line_set)
                else:  # the tile ends inside this set of lines
                    if lane_offset < tile_bytes - line * line_set:
                        ptx.prefetch_l2(base + line * line_set)
