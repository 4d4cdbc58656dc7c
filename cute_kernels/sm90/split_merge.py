"""The FP8 kernel's split-KV merge (``split=True``): the parts of a tile (one CTA each, a cluster) exchange
their row statistics and O^T fragments through distributed shared memory, into KV tiles that are free once a
part's loop is done, and each d tile's owner part adds the parts' fragments with their weights and writes
out.

``SplitMerge`` is a part of ``SparsePrefillSm90`` (``sparse_prefill.py``): its methods read the kernel's
configuration from ``self`` and the consumer's state from its ``Consumer`` bundle."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import ptx
from cute_kernels.interface import D_V, LOG2_E, SINK_FLAG, SPLIT_PARTS
from cute_kernels.sm90.cta import B_H, CONSUMER_THREADS, NUM_THREADS, THREADS_PER_WG
from cute_kernels.sm90.epilogue import LN_2, max_logits_and_lse
from cute_kernels.sm90.fp8_tile import D_TILES_PER_CONSUMER, P_SCALE_LOG2, Consumer
from cute_kernels.sm90.named_barrier import NamedBarrierFp8

# Split: the parts of a tile run as one cluster and merge through shared memory (``merge_parts``). Each of
# the 8 d tiles of O^T (4 per consumer) has an owner part (``d_tile_owner``); the others' fragments of it (a
# d tile's 32 values per consumer thread in f16: 8 KiB) and every part's row statistics land in the owner's
# KV tiles, free once its loop is done. A fragment is normalised over its part's range and divided by
# kv_scale, so it stays within the e4m3 range of V (|x| <= 448): f16 keeps 11 bits, more than bf16 out.
FRAGMENT_BYTES = THREADS_PER_WG * 32 * 2  # one d tile of O^T of one consumer, in f16
D_TILES = 2 * D_TILES_PER_CONSUMER  # d tiles of O^T, both consumers'


def fragments_received(splits: int) -> int:
    """Split: the d-tile fragments a part receives: from each other part, those of the d tiles it owns (8
    parts: its own one from every part, itself included)."""
    senders = splits if splits > D_TILES_PER_CONSUMER else splits - 1
    return senders * (D_TILES // splits)


# The received fragments come first (at most 8 x 8 KiB)
SPLIT_STATS_OFFSET = max(fragments_received(p) for p in SPLIT_PARTS) * FRAGMENT_BYTES
SPLIT_STATS_BYTES = B_H * 8  # a part's (max_logits, lse) per row
SPLIT_WEIGHTS_OFFSET = SPLIT_STATS_OFFSET + max(SPLIT_PARTS) * SPLIT_STATS_BYTES  # [row][part] merge weights
SPLIT_WEIGHTS_ROW_BYTES = max(SPLIT_PARTS) * 4


def fragment_slot(splits: int, sender, owner, consumer, mt):
    """Split: the slot (of ``fragments_received(splits)``, a fragment each) in which part ``owner`` receives
    part ``sender``'s fragment of d tile ``mt`` of consumer ``consumer``: with 2 or 4 parts, the sender's
    index among the owner's senders, then the (consumer, d tile) among the owner's, consumer-major (``sender``
    and ``owner`` ints); with 8, the sender (the owner's own fragment included; any may be a run-time
    value)."""
    if splits > D_TILES_PER_CONSUMER:
        return sender
    owned = D_TILES // splits  # (consumer, d tile) pairs a part owns
    return (sender - int(sender > owner)) * owned + consumer * (owned // 2) + mt - owner * (owned // 2)


def d_tile_owner(splits: int, mt: int, consumer):
    """The part (of ``splits``) that merges and writes d tile ``mt`` of consumer ``consumer``'s half of O^T:
    with 2 or 4 parts, d tiles mt // (4 / splits) of both consumers (an int: the consumer is not read); with
    8, part 2 mt + consumer (``consumer`` may be a run-time value)."""
    if splits <= D_TILES_PER_CONSUMER:
        return mt // (D_TILES_PER_CONSUMER // splits)
    return 2 * mt + consumer


class SplitMerge:
    """The split variant's merge of ``SparsePrefillSm90``."""

    @cute.jit
    def publish_part_stats(self, c: Consumer, row, scaled_sum, max_used):
        """Split: this part's (max_logits, lse) of ``row`` into row ``row`` of its statistics table in every
        part (itself included), counted on their ``merge_full``."""
        part = cute.arch.block_idx()[1]
        splits = cute.arch.grid_dim()[1]
        stats = max_logits_and_lse(scaled_sum, max_used, c.s_max_true, row, P_SCALE_LOG2)
        address = c.sK_base + SPLIT_STATS_OFFSET + (part * B_H + row) * 8
        for p in cutlass.range_constexpr(max(SPLIT_PARTS)):
            if p < splits:
                ptx.st_async_cluster(address, c.mbar_merge_full.toint(), p, stats)

    @cute.jit
    def open_merge(self, c: Consumer):
        """Split, the epilogue's start: once this CTA's loop and copies are done (``RingFree``, with the
        producer), its KV tiles may receive the other parts' results: tell them (one arrival each on their
        ``peers_free``), expect their bytes on ``merge_full``, and wait until theirs are free too."""
        cute.arch.barrier(barrier_id=int(NamedBarrierFp8.RingFree), number_of_threads=NUM_THREADS)
        cute.arch.cluster_wait()  # every CTA of the cluster has initialised its barriers
        part = cute.arch.block_idx()[1]
        splits = cute.arch.grid_dim()[1]
        if c.index == 0:
            if c.warp == 0:
                if c.lane == 0:
                    for p in cutlass.range_constexpr(max(SPLIT_PARTS)):
                        if p < splits:
                            if p != part:
                                ptx.mbarrier_arrive_cluster(c.mbar_peers_free.toint(), p)
                    for n in cutlass.range_constexpr(len(SPLIT_PARTS)):
                        if splits == SPLIT_PARTS[n]:
                            fragments = fragments_received(SPLIT_PARTS[n])
                            received = fragments * FRAGMENT_BYTES + SPLIT_PARTS[n] * SPLIT_STATS_BYTES
                            cute.arch.mbarrier_arrive_and_expect_tx(c.mbar_merge_full, received)
        ptx.mbarrier_wait_cluster(c.mbar_peers_free.toint(), 0)

    @cute.jit
    def merge_parts(self, c: Consumer, rows, flags, mSink, mOut, mMaxLogits, mLse, kv_scale):
        """Split: the tile's result from its parts' (one per CTA of the cluster, ``splits`` of them).

        Each part has published its (max_logits, lse) per row, over its range and without the sink, to
        every part (``row_scale``). Each d tile of O^T has its owner part (``d_tile_owner``): the other parts
        store their O^T fragments of it, times their output scales (normalised over their ranges) over
        kv_scale, in f16, into the owner's KV tiles, where the thread of the same consumer and index reads
        them. Over the parts with a valid slot, in part order (the same bits on every run):
        L = max lse_p, t = sum exp(lse_p - L), out = sum exp(lse_p - L) / (t + exp(sink - L)) out_p,
        lse = L + log t, max_logits = max max_logits_p; a row without a valid slot: out 0, -inf, +inf.

        The exchange and the merge are compiled once per (splits, part), selected by one uniform branch:
        with both known, the d tiles, senders and addresses are constants and the loops have no branches
        (with 8 parts they depend on the consumer: one uniform branch more)."""
        inv_kv_scale = 1.0 / kv_scale
        self.for_this_part(lambda splits, part: self.send_fragments(c, splits, part, inv_kv_scale))
        ptx.mbarrier_wait_cluster(c.mbar_merge_full.toint(), 0)  # every part's statistics and fragments
        if c.index == 0:
            if c.warp < B_H // 32:  # one thread per row: its parts' weights
                self.merge_weights(c, c.warp * 32 + c.lane, rows, flags, mSink, mMaxLogits, mLse)
        cute.arch.barrier(barrier_id=int(NamedBarrierFp8.WeightsReady), number_of_threads=CONSUMER_THREADS)
        self.for_this_part(lambda splits, part: self.merge_owned_tiles(c, rows, mOut, splits, part, kv_scale))

    @cute.jit
    def for_this_part(self, body):
        """Split: ``body(splits, part)`` with this CTA's part count and part as compile-time values, one
        specialised copy per (splits, part) behind one uniform branch on the launch's values; with 8 parts one
        copy, the part a run-time value (each part merges one d tile, all of it from shared memory)."""
        part = cute.arch.block_idx()[1]
        splits = cute.arch.grid_dim()[1]
        for n in cutlass.range_constexpr(len(SPLIT_PARTS)):
            if splits == SPLIT_PARTS[n]:
                if const_expr(SPLIT_PARTS[n] > D_TILES_PER_CONSUMER):
                    body(SPLIT_PARTS[n], part)
                else:
                    for p in cutlass.range_constexpr(SPLIT_PARTS[n]):
                        if part == p:
                            body(SPLIT_PARTS[n], p)

    @cute.jit
    def send_fragments(self, c: Consumer, splits: cutlass.Constexpr, part, inv_kv_scale):
        """Split, part ``part`` of ``splits``: this thread's O^T fragments of the d tiles other parts own (8
        parts: of every d tile, its own included), times the rows' output scales, to their owners
        (``st.async``, counted on their ``merge_full``)."""
        for mt in cutlass.range_constexpr(D_TILES_PER_CONSUMER):
            owner = d_tile_owner(splits, mt, c.index)
            if const_expr(splits > D_TILES_PER_CONSUMER or owner != part):
                for j in cutlass.range_constexpr(B_H // 8):
                    scales = (
                        c.s_out_scale[8 * j + 2 * c.quad_lane, c.index] * inv_kv_scale,
                        c.s_out_scale[8 * j + 2 * c.quad_lane + 1, c.index] * inv_kv_scale,
                    )
                    v = [c.acc_o[mt][4 * j + k] * scales[k % 2] for k in range(4)]
                    ptx.st_async_cluster(
                        self.fragment_address(c, splits, part, owner, mt, j),
                        c.mbar_merge_full.toint(),
                        owner,
                        [ptx.pack_f16x2(v[0], v[1]), ptx.pack_f16x2(v[2], v[3])],
                    )

    @cute.jit
    def merge_owned_tiles(self, c: Consumer, rows, mOut, splits: cutlass.Constexpr, part, kv_scale):
        """Split, part ``part`` of ``splits``: this thread's values of the d tiles the part owns, the parts'
        fragments added with their weights (the weights table) in part order, stored as bf16 out. With 8 parts
        a part owns one d tile of one consumer (the other has nothing to merge), every part's fragment of it
        in shared memory."""
        if const_expr(splits > D_TILES_PER_CONSUMER):
            if c.index == part % 2:
                self.merge_d_tiles(c, rows, mOut, splits, part, [part // 2], kv_scale)
        else:
            owned = [mt for mt in range(D_TILES_PER_CONSUMER) if d_tile_owner(splits, mt, None) == part]
            self.merge_d_tiles(c, rows, mOut, splits, part, owned, kv_scale)

    @cute.jit
    def merge_d_tiles(self, c: Consumer, rows, mOut, splits: cutlass.Constexpr, part, owned, kv_scale):
        """Split: ``merge_owned_tiles`` for this consumer's d tiles ``owned`` (the part's; 8 parts: one, a
        run-time value)."""
        weights_base = c.sK_base + SPLIT_WEIGHTS_OFFSET
        out_base = mOut.iterator.toint()
        own_rows = rows.head_rows - 2 * c.quad_lane
        for j in cutlass.range_constexpr(B_H // 8):
            head = 8 * j + 2 * c.quad_lane  # and head + 1: values 4j, 4j + 2 and 4j + 1, 4j + 3
            weights = [
                [
                    w
                    for quad in range(-(-splits // 4))
                    for w in ptx.ld_shared_v4_f32(
                        weights_base + (head + e) * SPLIT_WEIGHTS_ROW_BYTES + quad * 16
                    )
                ]
                for e in range(2)
            ]
            own_scales = (c.s_out_scale[head, c.index], c.s_out_scale[head + 1, c.index])
            for mt in owned:
                merged = [Float32(0.0)] * 4
                for p in cutlass.range_constexpr(splits):
                    if const_expr(splits <= D_TILES_PER_CONSUMER and p == part):
                        values = [c.acc_o[mt][4 * j + k] * own_scales[k % 2] for k in range(4)]
                    else:
                        received = ptx.ld_shared_f16x4_as_f32(
                            self.fragment_address(c, splits, p, part, mt, j)
                        )
                        values = [value * kv_scale for value in received]
                    for k in cutlass.range_constexpr(4):
                        merged[k] = merged[k] + weights[k % 2][p] * values[k]
                d = (c.index * D_TILES_PER_CONSUMER + mt) * 64 + c.warp * 16 + 2 * c.quad_row
                for e in cutlass.range_constexpr(2):
                    addr = out_base + (Int64(rows.q_row + head + e) * D_V + d) * 2
                    store = Int32(8 * j + e < own_rows)
                    ptx.st_global_u32(addr, ptx.pack_bf16x2(merged[e], merged[e + 2]), store)

    @cute.jit
    def merge_weights(self, c: Consumer, row, rows, flags, mSink, mMaxLogits, mLse):
        """Split, one thread per row: from every part's (max_logits, lse) of ``row`` (statistics table), the
        weights exp(lse_p - L) / (t + exp(sink - L)) of the parts into the weights table ([row][part], 0 for a
        part without a valid slot and for every part of a row without one); part 0 writes the row's
        max_logits and lse (see ``merge_parts``)."""
        splits = cute.arch.grid_dim()[1]
        stats_base = c.sK_base + SPLIT_STATS_OFFSET
        lse_max = -Float32.inf
        max_logits = -Float32.inf
        for p in cutlass.range_constexpr(max(SPLIT_PARTS)):
            if p < splits:
                part_max, part_lse = ptx.ld_shared_v2_f32(stats_base + (p * B_H + row) * 8)
                max_logits = cute.arch.fmax(max_logits, part_max)
                if part_max > -Float32.inf:
                    lse_max = cute.arch.fmax(lse_max, part_lse)
        terms = cute.make_rmem_tensor((max(SPLIT_PARTS),), Float32)
        terms.fill(0.0)
        total = Float32(0.0)
        for p in cutlass.range_constexpr(max(SPLIT_PARTS)):
            if p < splits:
                part_max, part_lse = ptx.ld_shared_v2_f32(stats_base + (p * B_H + row) * 8)
                if part_max > -Float32.inf:
                    terms[p] = cute.math.exp2((part_lse - lse_max) * LOG2_E, fastmath=True)
                    total += terms[p]
        scale = Float32(0.0)
        if lse_max > -Float32.inf:
            denom = total
            if (flags & SINK_FLAG) != 0:
                sink_head = rows.first_head + cutlass.min(row, rows.head_rows - 1)
                denom += cute.math.exp2((mSink[sink_head] - lse_max) * LOG2_E, fastmath=True)
            scale = 1.0 / denom
        weights = [terms[p] * scale for p in range(max(SPLIT_PARTS))]
        for quad in cutlass.range_constexpr(max(SPLIT_PARTS) // 4):
            address = c.sK_base + SPLIT_WEIGHTS_OFFSET + row * SPLIT_WEIGHTS_ROW_BYTES + quad * 16
            ptx.st_shared_v4_f32(address, *weights[4 * quad : 4 * quad + 4])
        if cute.arch.block_idx()[1] == 0:
            if row < rows.head_rows:
                lse = Float32.inf
                if lse_max > -Float32.inf:
                    lse = (lse_max * LOG2_E + cute.math.log2(total, fastmath=True)) * LN_2
                mMaxLogits[rows.q_row + row] = max_logits
                mLse[rows.q_row + row] = lse

    @cute.jit
    def fragment_address(self, c: Consumer, splits: cutlass.Constexpr, sender, owner, mt, j):
        """Split: where, in the KV tiles of part ``owner``, part ``sender`` stores (and the owner's thread of
        the same consumer and index reads) this thread's values 4j .. 4j + 3 of d tile ``mt``: its fragment's
        slot (``fragment_slot``), then [j][thread] in 8-byte units, so that a warp's 8-byte accesses are
        contiguous."""
        slot = fragment_slot(splits, sender, owner, c.index, mt)
        return c.sK_base + ((slot * (B_H // 8) + j) * THREADS_PER_WG + c.warp * 32 + c.lane) * 8
