"""Row views of the sparse prefill's global tensors, shared by the FP8 and bf16 attention kernels.

The kernels address query rows as (token, head) pairs: ``q`` [s_q, h, d_qk] becomes [s_q * h, d_qk]
(row-major, the source of the Q tiles), ``max_logits`` and ``lse`` [s_q, h] become [s_q * h]; ``kv``
[s_kv, 1, d_qk] and ``indices`` [s_q, 1, topk] drop their middle mode and keep their (dynamic) row strides.
``load_q_tile`` loads one CTA's e4m3 Q tile from the q view by TMA. A bf16 Q tile is stored in e4m3 by
the threads of the consumer warpgroups, each row with its own power-of-two scale (``store_quantized_rows``),
from rows they load from global memory (``quantize_q_tile``) or from rows bulk-copied into shared memory
(``stage_q_rows``, then ``quantize_staged_q_tile``).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync

from cute_kernels import ptx
from cute_kernels.sm90.row_gather import swizzle_offset

E4M3_MAX_EXPONENT = 8  # 448 = 1.75 * 2^8, the largest e4m3 value
E4M3_MAX_MANTISSA_BITS = 0x600000  # 1.75 as the 23 mantissa bits of a float32
F32_MIN_EXPONENT = -126  # row scales stay normal float32 numbers
STAGED_ROWS_PER_TILE = 32  # bf16 Q rows staged in one [64, d_qk] e4m3 block tile (twice the bytes a row)
Q_THREADS_PER_ROW = 4  # consumer threads that quantise one row: 16 values of every 64-column tile each


class RowViews(NamedTuple):
    rows: object  # s_q * h, the number of query rows (64 per CTA)
    q: cute.Tensor  # [rows, d_qk]
    kv: cute.Tensor  # [s_kv, d_qk], kv's row stride
    indices: cute.Tensor  # [s_q, topk], indices' row stride
    max_logits: cute.Tensor  # [rows]
    lse: cute.Tensor  # [rows]


def make_row_views(mQ, mKV, mIdx, mMaxLogits, mLse, d_qk: int) -> RowViews:
    """The row views of a launch's tensors (called while tracing a ``@cute.jit`` function)."""
    rows = cute.size(mQ, mode=[0]) * cute.size(mQ, mode=[1])
    return RowViews(
        rows=rows,
        q=cute.make_tensor(mQ.iterator, cute.make_layout((rows, d_qk), stride=(d_qk, 1))),
        kv=cute.make_tensor(
            mKV.iterator, cute.make_layout((cute.size(mKV, mode=[0]), d_qk), stride=(mKV.stride[0], 1))
        ),
        indices=cute.make_tensor(
            mIdx.iterator,
            cute.make_layout(
                (cute.size(mIdx, mode=[0]), cute.size(mIdx, mode=[2])), stride=(mIdx.stride[0], 1)
            ),
        ),
        max_logits=cute.make_tensor(mMaxLogits.iterator, cute.make_layout(rows)),
        lse=cute.make_tensor(mLse.iterator, cute.make_layout(rows)),
    )


def make_q_tma_atom(q_view, sQ_layout, q_shape):
    """The TMA atom and tensor that load ``q_shape`` (rows, d_qk) tiles of the q view into ``sQ_layout``."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q_view, sQ_layout, q_shape)


def load_q_tile(
    tma_atom_q, mQ_tma, sQ, mbar_q, first_row, tile_rows: int, d_qk: int, tile_bytes: int
) -> None:
    """Queue the TMA copy of the Q tile of rows ``first_row`` .. ``first_row + tile_rows - 1`` of the
    [rows, d_qk] view ``mQ_tma`` (rows past its end read as zeros) into ``sQ``, completing on ``mbar_q``
    (one elected thread arms it with ``tile_bytes``). Called by one warp while tracing the kernel."""
    gQ = cute.local_tile(cute.domain_offset((first_row, 0), mQ_tma), (tile_rows, d_qk), (0, 0))
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
    )
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, tile_bytes)
    cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=mbar_q)


@cute.jit
def quantize_q_tile(
    q_view, first_row, thread, sQ_base, row_scale_base, tile_rows: cutlass.Constexpr, d_qk: cutlass.Constexpr
) -> None:
    """Rows ``first_row`` .. ``first_row + tile_rows - 1`` of the bf16 q view ([rows, d_qk] row-major,
    16-byte aligned) into the e4m3 Q tile at shared address ``sQ_base`` (``store_quantized_rows``), with
    ``tile_rows * 4`` threads (``thread``: 0 .. tile_rows * 4 - 1): four per row, each 16 values of every
    64-column tile, loaded from global memory."""
    row = thread // Q_THREADS_PER_ROW
    part = thread % Q_THREADS_PER_ROW
    row_addr = q_view.iterator.toint() + Int64(first_row + row) * (d_qk * 2) + part * 32
    words = []
    for col_tile in cutlass.range_constexpr(d_qk // 64):  # every load in flight before the first use
        words.append(
            ptx.ld_global_nc_v4(row_addr + col_tile * 128)
            + ptx.ld_global_nc_v4(row_addr + col_tile * 128 + 16)
        )
    store_quantized_rows(words, row, part, sQ_base, row_scale_base, tile_rows)


@cute.jit
def stage_q_rows(
    q_view, first_row, last_row, tile_first_row, thread, tile_base, mbar_full, d_qk: cutlass.Constexpr
) -> None:
    """One of the 64 threads that fill a block tile with staged bf16 Q rows: rows ``tile_first_row`` ..
    ``tile_first_row + 31`` of the Q tile whose first row is ``first_row`` of the q view (a row past
    ``last_row`` read from ``last_row``), stored row-major (``d_qk * 2`` bytes a row: 32 rows fill a
    [64, d_qk] e4m3 block tile) at shared address ``tile_base``, by bulk copies (the TMA unit) whose bytes
    complete ``mbar_full`` (the tile's ``kv_full``, 64 arrivals). When all 32 rows lie in q, ``thread`` 0
    copies them at once and the others only arrive (one copy: the producer's warps are not held issuing
    64); else ``thread`` (0-63) copies half of row ``tile_first_row + thread // 2``."""
    half_bytes = d_qk  # half a row of bf16
    rows = STAGED_ROWS_PER_TILE
    first = first_row + tile_first_row
    if first + rows - 1 <= last_row:
        if thread == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_full, rows * 2 * half_bytes)
            ptx.cp_async_bulk_to_shared(
                tile_base,
                q_view.iterator.toint() + Int64(first) * (2 * half_bytes),
                rows * 2 * half_bytes,
                mbar_full.toint(),
            )
        else:
            cute.arch.mbarrier_arrive(mbar_full)
    else:
        row = thread // 2
        source_row = cutlass.min(first + row, last_row)
        offset = row * (2 * half_bytes) + (thread % 2) * half_bytes
        cute.arch.mbarrier_arrive_and_expect_tx(mbar_full, half_bytes)
        ptx.cp_async_bulk_to_shared(
            tile_base + offset,
            q_view.iterator.toint() + Int64(source_row) * (2 * half_bytes) + (thread % 2) * half_bytes,
            half_bytes,
            mbar_full.toint(),
        )


@cute.jit
def quantize_staged_q_tile(
    staging_base, thread, sQ_base, row_scale_base, tile_rows: cutlass.Constexpr, d_qk: cutlass.Constexpr
) -> None:
    """``quantize_q_tile`` from the bf16 rows ``stage_q_rows`` put in shared memory at ``staging_base``
    (row-major, ``d_qk * 2`` bytes a row). The two rows of a quarter warp read their 32 bytes in opposite
    orders: rows a multiple of 128 bytes apart share banks."""
    row = thread // Q_THREADS_PER_ROW
    part = thread % Q_THREADS_PER_ROW
    row_addr = staging_base + row * (d_qk * 2) + part * 32
    words = []
    for col_tile in cutlass.range_constexpr(d_qk // 64):
        words.append(ptx.ld_shared_v4x2(row_addr + col_tile * 128, row % 2))
    store_quantized_rows(words, row, part, sQ_base, row_scale_base, tile_rows)


@cute.jit
def shared_row_scale(words, lanes: cutlass.Constexpr, zero_exponent: cutlass.Constexpr = 0):
    """The e4m3 scale 2^e of a row of bf16 values held by several lanes, each of them ``words`` (a list of
    tuples of 32-bit words, two bf16 each): e the least integer with max |value| <= 448 * 2^e, at least -126
    (e = ``zero_exponent`` for a zero row). ``lanes``: the butterfly offsets that join the row's lanes
    (``(1, 2)`` for four neighbouring lanes). Returns ``(e, 2^-e as bf16 in both halves of a word)``; finite
    values only."""
    amax = Uint32(0)
    for group in words:
        for word in group:
            amax = ptx.max_abs_bf16x2(amax, word)
    amax = amax & Uint32(0x7FFF7FFF)  # bf16 magnitude bits
    amax = ptx.max_u32(amax & Uint32(0xFFFF), amax >> Uint32(16))
    for offset in lanes:
        amax = ptx.max_u32(amax, Uint32(cute.arch.shuffle_sync_bfly(Int32(amax), offset=offset)))
    amax_bits = Int32(amax) << 16  # as float32 bits: m * 2^E
    exponent = Int32(zero_exponent)
    if amax_bits != 0:
        # E - 8 when 448 * 2^(E - 8) >= amax (m <= 1.75), else E - 7
        exponent = (amax_bits >> 23) - (127 + E4M3_MAX_EXPONENT)
        if (amax_bits & 0x7FFFFF) > E4M3_MAX_MANTISSA_BITS:
            exponent = exponent + 1
        if exponent < F32_MIN_EXPONENT:
            exponent = Int32(F32_MIN_EXPONENT)
    inverse = Uint32((127 - exponent) << 7)  # 2^-e in bf16
    return exponent, inverse | (inverse << Uint32(16))  # in both halves


@cute.jit
def store_quantized_rows(words, row, part, sQ_base, row_scale_base, tile_rows: cutlass.Constexpr) -> None:
    """This thread's part of row ``row`` of a Q tile, ``words`` (per 64-column tile the eight 32-bit words of
    its 16 bf16 values), stored in e4m3 at shared address ``sQ_base`` (64-byte-swizzled, K-major: the
    layout the TMA of an e4m3 tile writes); the row's four threads (``part`` 0-3, neighbouring lanes) agree
    on its scale.

    Row r is stored as e4m3(q_r / s_r) with s_r = 2^e, e the least integer with max|q_r| <= 448 * 2^e
    (at least -126; e = 0 for a zero row): exact scaling, no saturation. s_r goes to the float32 table at
    ``row_scale_base`` (one thread per row writes it). Finite q only."""
    exponent, inverse = shared_row_scale(words, (1, 2))  # the row's four threads
    if part == 0:
        ptx.st_shared_u32(row_scale_base + row * 4, Uint32((127 + exponent) << 23))
    for col_tile in cutlass.range_constexpr(len(words)):
        w = words[col_tile]
        ptx.st_shared_v4(
            sQ_base + col_tile * (tile_rows * 64) + swizzle_offset(row, part, 64),
            ptx.scale_bf16x4_to_e4m3x4(w[0], w[1], inverse),
            ptx.scale_bf16x4_to_e4m3x4(w[2], w[3], inverse),
            ptx.scale_bf16x4_to_e4m3x4(w[4], w[5], inverse),
            ptx.scale_bf16x4_to_e4m3x4(w[6], w[7], inverse),
        )
