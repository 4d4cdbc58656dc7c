"""Gather of KV rows into K-major, swizzled shared-memory block tiles (16-byte ``cp.async``, zero fill).

A block tile holds ``tile_rows`` gathered rows as column tiles of [tile_rows x row_bytes] bytes, one
after another (row_bytes 64 or 128: the WGMMA 64- or 128-byte swizzle). A lane copies one 16-byte chunk
of a row in every column tile. Slot s of a query token's index row is valid when its index lies in
[0, s_kv) and s is below the row's valid length; the row of an invalid slot is zero-filled (``src-size``
0: nothing is read from global memory).
"""

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_kernels import ptx

CHUNK_BYTES = 16  # bytes per cp.async


class SlotBounds(NamedTuple):
    """A paged call's token slots (trace-time bundle of run-time values): the index slots below
    ``extra_from`` hold token slots of the cache (valid below ``main_slots``), those from it on token slots
    of the extra cache (valid below ``extra_slots``)."""

    main_slots: Int32
    extra_slots: Int32
    extra_from: Int32


def in_extra_cache(bounds: SlotBounds, slot) -> Int32:
    """1 when index slot ``slot`` holds a token slot of the extra cache, else 0."""
    return Int32(slot >= bounds.extra_from)


def slot_valid(kv_row, slot, s_kv, valid_len):
    """Whether ``slot`` (its index ``kv_row``) is read: the index in [0, s_kv) and the slot below
    ``valid_len``. ``s_kv``: kv's rows, or a paged call's ``SlotBounds``."""
    if isinstance(s_kv, SlotBounds):
        s_kv = s_kv.main_slots + in_extra_cache(s_kv, slot) * (s_kv.extra_slots - s_kv.main_slots)
    return (kv_row >= 0) & (kv_row < s_kv) & (slot < valid_len)


@cute.jit
def slot_valid_flag(kv_row, slot, s_kv, valid_len):
    """``slot_valid`` as Int32 1 or 0 (a factor of the row's source address and byte count)."""
    valid = Int32(0)
    if slot_valid(kv_row, slot, s_kv, valid_len):
        valid = Int32(1)
    return valid


def swizzle_offset(row, chunk16, row_bytes: int):
    """Byte offset of 16-byte chunk ``chunk16`` of ``row`` inside a [rows x ``row_bytes``] column tile
    with the WGMMA swizzle of that width: 64 bytes, Swizzle<2,4,3> (chunk ^= (row >> 1) & 3); 128 bytes,
    Swizzle<3,4,3> (chunk ^= row & 7)."""
    if row_bytes == 64:
        return row * 64 + ((chunk16 ^ ((row >> 1) & 3)) << 4)
    assert row_bytes == 128, row_bytes
    return row * 128 + ((chunk16 ^ (row & 7)) << 4)


class RowGather:
    """One producer lane's part of the gather (a trace-time object, read-only inside the kernel's
    loops: its integers stay Python values, unlike a tuple's, which a dynamic loop carries)."""

    def __init__(self, mKV: cute.Tensor, sK: cute.Tensor, d_qk: int, lane, row_bytes: int, tile_rows: int):
        """The gather from ``mKV`` ([s_kv, d_qk], rows 16-byte aligned) into the block tiles ``sK``
        (``tile_rows`` rows, column tiles ``row_bytes`` wide); ``lane`` copies chunk
        ``lane % (row_bytes // 16)`` of each column tile."""
        elem_bytes = mKV.element_type.width // 8
        self.s_kv: Int32 = cute.size(mKV, mode=[0])
        kv_row_stride = Int64(mKV.stride[0])
        if elem_bytes != 1:
            kv_row_stride = kv_row_stride * elem_bytes
        self.kv_row_stride: Int64 = kv_row_stride  # bytes between kv rows
        self.kv_base: Int64 = mKV.iterator.toint()  # global address of kv row 0
        self.sK_base: Int32 = sK.iterator.toint()  # shared address of the first block tile
        self.chunk16: Int32 = lane % (row_bytes // CHUNK_BYTES)
        self.row_bytes = row_bytes
        self.tile_rows = tile_rows
        self.col_tiles = d_qk * elem_bytes // row_bytes

    # The FP8 kernel's producer reads any KV source through ``locate`` and ``copy_row`` (``PagedRowGather``
    # has the same two).
    def locate(self, kv_row, slot, valid_len):
        """``(valid, where)`` of index ``kv_row`` at ``slot``: ``slot_valid_flag``, and the values a row copy
        needs, which the producer hands from lane to lane: ``(kv_row,)``."""
        return slot_valid_flag(kv_row, slot, self.s_kv, valid_len), (kv_row,)

    def copy_row(self, tile, tile_base, row, where, valid):
        """Queue the copies of the row ``where`` (``locate``'s) into row ``row`` of the block tile at shared
        address ``tile_base`` (``tile``: its index, unused here), zeros where ``valid`` is 0."""
        copy_rows(self, tile_base, row, ((0, where[0], valid),))


def copy_rows(gather: RowGather, tile_base, first_row, rows) -> None:
    """Queue the copies of ``rows``, each ``(offset, kv_row, valid)``: kv row ``kv_row`` into row
    ``first_row + offset`` of the block tile at shared address ``tile_base`` (``valid`` 1), or zeros
    there (``valid`` 0). The copies of all rows go one column tile after another.

    ``tile_base`` is first passed through a shuffle: with a warp-uniform base ptxas may address the copies
    as [R + UR] beside the cache-policy descriptor's UR, and it has emitted that form reading uniform
    registers that nothing writes (an illegal instruction at run time; ``tests/test_kernel_build.py`` checks
    every variant's SASS for it). A per-thread base keeps the whole address in a vector register."""
    tile_base = cute.arch.shuffle_sync(tile_base, 0)
    sources = [
        gather.kv_base + Int64(kv_row * valid) * gather.kv_row_stride + gather.chunk16 * CHUNK_BYTES
        for _, kv_row, valid in rows
    ]
    dests = [
        tile_base
        + swizzle_offset(first_row + offset if offset else first_row, gather.chunk16, gather.row_bytes)
        for offset, _, _ in rows
    ]
    col_tile_bytes = gather.tile_rows * gather.row_bytes
    for col_tile in range(gather.col_tiles):
        for dest, source, (_, _, valid) in zip(dests, sources, rows, strict=True):
            ptx.cp_async_16_zfill(
                dest + col_tile * col_tile_bytes, source + col_tile * gather.row_bytes, valid * CHUNK_BYTES
            )
