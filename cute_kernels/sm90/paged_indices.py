"""A serving layer's top-k rows -> the paged cache's token slots, and each query's valid slot count.

``topk_length[i] = min(max(seqlens[i] // ratio, 0), topk)`` (``seqlens[i]`` itself for ratio 0): the rows a
query of a compressed (ratio r) or uncompressed cache sees, of the top-k the caller gave;
``slots[i, 0, j] = page_table[indices[i, j]]`` for ``j < topk_length[i]`` and ``0 <= indices[i, j] <
num_rows`` (an int64 table's entries at or above 2^31 count as outside), else -1, for every ``j`` of the
padded top-k of ``slots``: a row of slots is valid without its length (two rows joined, one cache's after
the other's, need no mask). One launch for what a layer would otherwise compute in several PyTorch
operations.

Latency-bound (two dependent loads an entry): CTA (i, c) covers entries ``c * ENTRIES_PER_CTA ..`` of query
row i, and each thread loads its ``ENTRIES_PER_THREAD`` indices before it looks any of them up, so a CTA
waits for two memory round trips, not two per entry.

Constraints: indices' last dim contiguous.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

THREADS = 128
ENTRIES_PER_THREAD = 4
ENTRIES_PER_CTA = THREADS * ENTRIES_PER_THREAD


class PagedIndicesSm90:
    """No compile-time configuration: the table's words (1: int32, 2: int64) are a runtime extent."""

    @cute.jit
    def __call__(
        self,
        mIndices: cute.Tensor,  # [s_q, topk] int32, row stride dynamic
        mTable: cute.Tensor,  # [num_rows, words] int32: an int32 table, or an int64 one's (lo, hi) words
        mSeqlens: cute.Tensor,  # [s_q, words] int32: int32 or int64 seqlens, as the table
        mSlots: cute.Tensor,  # [s_q, 1, topk_pad] int32, row-major
        mTopkLength: cute.Tensor,  # [s_q] int32
        ratio: Int32,  # 0: uncompressed
        stream,
    ):
        column_ctas = (cute.size(mSlots, mode=[2]) + ENTRIES_PER_CTA - 1) // ENTRIES_PER_CTA
        self.kernel(mIndices, mTable, mSeqlens, mSlots, mTopkLength, ratio).launch(
            grid=[cute.size(mSlots, mode=[0]), column_ctas, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mIndices, mTable, mSeqlens, mSlots, mTopkLength, ratio: Int32):
        thread, _, _ = cute.arch.thread_idx()
        row, column_cta, _ = cute.arch.block_idx()
        topk = cute.size(mIndices, mode=[1])
        topk_pad = cute.size(mSlots, mode=[2])
        num_rows = cute.size(mTable, mode=[0])
        wide = cute.size(mTable, mode=[1]) > 1
        first = column_cta * ENTRIES_PER_CTA + thread
        indices = [Int32(-1)] * ENTRIES_PER_THREAD
        for k in cutlass.range_constexpr(ENTRIES_PER_THREAD):  # every load issued before any is used
            j = first + k * THREADS
            if j < topk:
                indices[k] = mIndices[row, j]
        length = self.topk_length(mSeqlens, row, ratio, topk)  # every thread, its loads beside the indices'
        slots = [Int32(-1)] * ENTRIES_PER_THREAD
        for k in cutlass.range_constexpr(ENTRIES_PER_THREAD):  # every lookup issued before any store
            index = indices[k]
            if (index >= 0) & (index < num_rows):
                slot = mTable[index, 0]
                if wide:
                    if mTable[index, 1] != 0:
                        slot = Int32(-1)
                slots[k] = cutlass.max(slot, Int32(-1))  # negative (int64: from 2^31 on): -1
        for k in cutlass.range_constexpr(ENTRIES_PER_THREAD):
            j = first + k * THREADS
            if j < topk_pad:
                slot = slots[k]
                if j >= length:
                    slot = Int32(-1)
                mSlots[row, 0, j] = slot
        if (thread == 0) & (column_cta == 0):
            mTopkLength[row] = length

    @cute.jit
    def topk_length(self, mSeqlens, row, ratio: Int32, topk) -> Int32:
        """Row ``row``'s ``min(max(seqlens // ratio, 0), topk)`` (an int64 seqlens at or beyond 2^31 counts as
        2^31 - 1, a negative one as 0)."""
        seen = mSeqlens[row, 0]
        if cute.size(mSeqlens, mode=[1]) > 1:  # int64: its high word
            high = mSeqlens[row, 1]
            if high < 0:
                seen = Int32(0)
            elif (high > 0) | (seen < 0):
                seen = Int32(2**31 - 1)
        if ratio > 0:
            seen = seen // ratio
        return cutlass.min(cutlass.max(seen, 0), topk)
