"""Rows of a paged FP8 KV cache (DeepSeek V3.2, V4 / MODEL1 and V4.1), gathered straight into the attention
kernel's block tiles, and the block scales that come with them.

Producer (``PagedRowGather``, ``copy_paged_row``): a row's token slot s is position s % page_size of page
s // page_size. Its e4m3 nope bytes are copied as they are (16-byte ``cp.async``) into the block tile's
column tiles; its 64 bf16 RoPE values (128 bytes) are staged, half into the tile's RoPE column tile and half
into a staging tile beside it (the P buffer's second term); its raw scale record (V3.2: four float32, one per
128 nope values; V4: seven UE8M0 bytes, one per 64, and a pad byte; V4.1: sixteen UE8M0 bytes, one per 32, and
no RoPE to stage) goes to the block's scale table. An
invalid slot's copies are zero-filled (nothing is read). The copies carry no L2 cache policy: with one, ptxas
has addressed them through uniform registers that nothing writes (``tests/test_kernel_build.py`` checks the
SASS of every variant).

The block's owner, before its QK product, in one of two ways:

- ``convert_rope`` (V3.2, whose float32 scales need not be powers of two, and S summed in float32): the staged
  RoPE of each row to two e4m3 terms with a power-of-two scale of its own (``shared_row_scale``): hi in place
  in the RoPE column tile, the residual lo = e4m3(x - hi) into the staging tile (about 8 significant bits
  together, as many as bf16 has); and the row's V scale 2^E (``v_row_exponent``). Then S = sum over scale
  groups g of sigma[row, g] * (Q_g . K_g^T), the RoPE a group of its own (its row scale, hi and lo), each
  group's product summed in float32 (``scale_slots``); the row's V factors sigma_g 2^-E go to a table
  (``store_v_factors``) by which the PV products scale V's fragments (``scale_v_fragment``).
- ``convert_row`` (V4 and V4.1: their UE8M0 scales are powers of two; V4.1's RoPE is
  e4m3 already, among its 16 groups of 32 values): each row rescaled in place to
  one power-of-two scale 2^E of its own (every group's bytes times sigma_g 2^-E, the RoPE's two terms at
  2^-E), so that S = 2^E_s (Q . K_s^T) is one WGMMA chain, as on gathered rows, scaled per slot after it.

Either way the PV product reads V'' = V / 2^E_s, and P carries each slot's 2^E_s (``docs/kernel.md``): V's
values stay in e4m3's normal range whatever the cache's magnitude, exact for power-of-two scales (FlashMLA's
V3.2 quantiser, V4's UE8M0) but for groups more than 2^6 / 448 below the row's largest, rounded once otherwise
(float32 scales: the V3.2 quantisers of vLLM and SGLang). V's RoPE dims (V4: V is the whole row) are hi alone:
P of two terms keeps the staging tile for its lo term.

Constraints: page_size a power of two, cache base and page stride 16-byte aligned, num_pages * page_size <
2^31.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from cute_kernels import ptx
from cute_kernels.sm90.paged_kv import LAYOUTS, e8m0_to_f32_bits
from cute_kernels.sm90.row_gather import (
    CHUNK_BYTES,
    SlotBounds,
    in_extra_cache,
    slot_valid_flag,
    swizzle_offset,
)
from cute_kernels.sm90.row_views import shared_row_scale

COLUMN_BYTES = 64  # a column tile's row: the e4m3 K tile's 64-byte swizzle
COLUMN_TILE_BYTES = 64 * COLUMN_BYTES  # a block tile's column tile: 64 rows
RAW_SCALE_ENTRY_BYTES = 16  # a row's entry of the raw scale table (its record: V3.2 16 bytes, V4 8)
ROW_MAX_EXPONENT = 126  # a row's scale 2^E and its inverse stay normal float32 numbers
# ... and at least this: as P carries 2^E, the row sums are taken relative to the max of x + E, so their
# terms reach 2^(-E + 9); a row under 2^-51 (an all-zero row: its scales and RoPE zero) has its nope bytes
# shifted to zero, a negligible share of any row above it
ROW_MIN_EXPONENT = -60
ROW_SCALE = "row"  # scale_slots: the rows' scales 2^E
RESCALE_COLUMNS_IN_FLIGHT = 3  # rescale_nope: column tiles whose chunks are loaded before any is stored


class CacheGeometry(NamedTuple):
    """The kernel's view of one paged cache layout (derived from ``paged_kv.LAYOUTS``)."""

    d_qk: int
    nope_columns: int  # 64-byte column tiles of e4m3 values with block scales (7 or 8)
    rope_column: int | None  # the column tile of the bf16 RoPE (7 or 8; V4.1: None, its RoPE is e4m3)
    groups: int  # scale groups of the e4m3 values (7, 4 or 16)
    group_ksteps: int  # 32-column k-steps of one scale group (2, 4 or 1)
    token_bytes: int  # from a token's data to the next one's inside a page
    rope_offset: int  # the RoPE's bf16 values inside a token's data
    scale_offset: int  # V3.2, V4.1: the scales inside a token's record; V4: -1 (the page's scale region)
    raw_scale_bytes: int  # the raw scale record a row's table entry holds (16: four float32, sixteen UE8M0
    # bytes; 8: seven UE8M0 bytes and a pad)
    scale_bytes: int  # a scale's bytes: 4 (float32) or 1 (UE8M0)


def cache_geometry(layout: str) -> CacheGeometry:
    lay = LAYOUTS[layout]
    nope_columns = lay.d_nope // COLUMN_BYTES
    groups = lay.d_nope // lay.scale_group
    page_scales = lay.scale_offset < 0  # V4: the page's scale region
    scale_bytes = 4 if lay.scale_type == "float32" else 1
    return CacheGeometry(
        d_qk=lay.d_nope + lay.d_rope,
        nope_columns=nope_columns,
        rope_column=nope_columns if lay.d_rope else None,
        groups=groups,
        group_ksteps=lay.scale_group // 32,
        token_bytes=lay.token_bytes,
        rope_offset=lay.rope_offset,
        scale_offset=lay.scale_offset,
        raw_scale_bytes=lay.scale_record_bytes if page_scales else scale_bytes * groups,
        scale_bytes=scale_bytes,
    )


class PagedCache(NamedTuple):
    """One paged cache as the producer addresses it (trace-time bundle of run-time values)."""

    base: Int64  # the first page's address
    page_stride: Int64  # bytes from a page to the next
    page_size: Int32  # tokens a page, a power of two
    page_shift: Int32  # log2(page_size)


def paged_cache(mCache: cute.Tensor) -> PagedCache:
    """``mCache`` ([num_pages, page_size, bytes per token] uint8, page stride a multiple of 16 bytes)."""
    page_size = cute.size(mCache, mode=[1])
    return PagedCache(
        mCache.iterator.toint(), Int64(mCache.stride[0]), page_size, ptx.floor_log2_u32(page_size)
    )


def slot_bounds(mCache: cute.Tensor, mExtraCache: cute.Tensor, extra_from: Int32) -> SlotBounds:
    """The token slots of a cache and its extra cache, the extra cache's from index slot ``extra_from`` on."""
    return SlotBounds(
        cute.size(mCache, mode=[0]) * cute.size(mCache, mode=[1]),
        cute.size(mExtraCache, mode=[0]) * cute.size(mExtraCache, mode=[1]),
        extra_from,
    )


class PagedRowGather:
    """One producer lane's part of the paged gather (trace-time object; its integers stay Python values)."""

    def __init__(
        self,
        mCache: cute.Tensor,
        mExtraCache: cute.Tensor,
        extra_from: Int32,
        geometry: CacheGeometry,
        sK_base,
        lo_base,
        scale_base,
        lane,
    ):
        """From ``mCache`` and ``mExtraCache`` (each [num_pages, page_size, bytes per token] uint8 of the same
        layout, page stride a multiple of 16 bytes; the extra cache's token slots are the index slots from
        ``extra_from`` on, ``slot_bounds``) into the block tiles at shared address ``sK_base``, their RoPE
        staging tiles at ``lo_base`` and their raw scale tables at ``scale_base``; ``lane`` copies chunk
        ``lane % 4`` of each 64-byte column."""
        self.geometry = geometry
        self.main = paged_cache(mCache)
        self.extra = paged_cache(mExtraCache)
        self.bounds = slot_bounds(mCache, mExtraCache, extra_from)
        self.sK_base: Int32 = sK_base
        self.lo_base: Int32 = lo_base
        self.scale_base: Int32 = scale_base
        self.chunk16: Int32 = lane % (COLUMN_BYTES // CHUNK_BYTES)

    def locate(self, slot, index, valid_len):
        """``(valid, where)`` of token slot ``slot`` at index position ``index`` (``RowGather.locate``):
        ``where`` is ``(page, position, in_extra)`` (0, 0, 0 for an invalid slot)."""
        valid = slot_valid_flag(slot, index, self.bounds, valid_len)
        return valid, page_and_position(self, slot * valid, in_extra_cache(self.bounds, index) * valid)

    def copy_row(self, tile, tile_base, row, where, valid):
        """Queue the copies of the token ``where`` (``locate``'s) into row ``row`` of block tile ``tile``
        (``copy_paged_row``; ``tile_base`` unused here), zeros where ``valid`` is 0."""
        copy_paged_row(self, tile, row, where, valid)


def page_and_position(gather: PagedRowGather, slot, in_extra):
    """``(page, position, in_extra)`` of token slot ``slot`` of the main cache (``in_extra`` 0) or of the
    extra one (1)."""
    shift = gather.main.page_shift + in_extra * (gather.extra.page_shift - gather.main.page_shift)
    return slot >> shift, slot & ((Int32(1) << shift) - 1), in_extra


@cute.jit
def copy_paged_row(gather: PagedRowGather, tile: Int32, row, where, valid):
    """Queue the copies of one row (``where``: its ``(page, position, in_extra)``; zero-filled when ``valid``
    is 0) into row ``row`` of block tile ``tile``: this lane's chunk of each nope column tile, of each half of
    the staged RoPE and (lane 0 of the row's four) the row's scale record. Row sizes and addresses follow
    ``CacheGeometry``."""
    geo = gather.geometry
    page, position, in_extra = where
    main, extra = gather.main, gather.extra
    wide = Int64(in_extra)
    cache_base = main.base + wide * (extra.base - main.base)
    page_stride = main.page_stride + wide * (extra.page_stride - main.page_stride)
    tile_bytes = 64 * geo.d_qk
    col_tile_bytes = 64 * COLUMN_BYTES
    # Per-thread bases (see row_gather.copy_rows: with a warp-uniform one ptxas may address a copy as
    # [R + UR] and read uniform registers that nothing writes).
    tile_base = cute.arch.shuffle_sync(gather.sK_base + tile * tile_bytes, 0)
    lo_base = cute.arch.shuffle_sync(gather.lo_base + tile * col_tile_bytes, 0)
    scale_base = cute.arch.shuffle_sync(gather.scale_base + tile * (64 * RAW_SCALE_ENTRY_BYTES), 0)
    page_addr = cache_base + Int64(page) * page_stride
    token_addr = page_addr + Int64(position * geo.token_bytes)
    chunk = gather.chunk16
    dest = tile_base + swizzle_offset(row, chunk, COLUMN_BYTES)
    source = token_addr + chunk * CHUNK_BYTES
    size = valid * CHUNK_BYTES
    for column in cutlass.range_constexpr(geo.nope_columns):
        ptx.cp_async_16_zfill(dest + column * col_tile_bytes, source + column * COLUMN_BYTES, size, False)
    if const_expr(geo.rope_column is not None):
        # RoPE values 16 chunk .. + 7 into the RoPE column, 16 chunk + 8 .. + 15 into the staging tile
        rope = token_addr + geo.rope_offset + chunk * 2 * CHUNK_BYTES
        ptx.cp_async_16_zfill(dest + geo.rope_column * col_tile_bytes, rope, size, False)
        lo_dest = lo_base + swizzle_offset(row, chunk, COLUMN_BYTES)
        ptx.cp_async_16_zfill(lo_dest, rope + CHUNK_BYTES, size, False)
    # The scale record, 4 bytes a lane (V4's 8: lanes 2 and 3 zero-fill the entry's unused half)
    scale_dest = scale_base + row * RAW_SCALE_ENTRY_BYTES + chunk * 4
    if const_expr(geo.scale_offset >= 0):
        ptx.cp_async_4_zfill(scale_dest, token_addr + geo.scale_offset + chunk * 4, valid * 4)
    else:  # V4: the page's scale region, after page_size tokens' data
        page_size = main.page_size + in_extra * (extra.page_size - main.page_size)
        record = page_addr + Int64(page_size * geo.token_bytes + position * geo.raw_scale_bytes)
        ptx.cp_async_4_zfill(scale_dest, record + chunk * 4, valid * (chunk < 2) * 4)


class BlockScaleTables(NamedTuple):
    """Shared-memory byte addresses of the paged kernel's per-block-tile tables (trace-time bundle)."""

    raw: Int32  # [tile][row] the raw scale records (``RAW_SCALE_ENTRY_BYTES`` each)
    rope: Int32  # [tile][row] float32: the RoPE's row scales (``convert_rope``)
    lo: Int32  # the RoPE staging tiles ([tile] 64 rows x 64 bytes, 64-byte swizzle), then the lo terms
    row_scale: Int32  # [tile][row] float32: the rows' scales 2^E (P carries them; V'' = V / 2^E)
    exponent: Int32  # [tile][row] float32: the rows' exponents E
    v_factors: Int32 = None  # [tile][V group][row] f16: sigma_g 2^-E, V's factors (``convert_rope``'s path)


def raw_scale(tables: BlockScaleTables, tile, row, group) -> Float32:
    """sigma[row, group] of nope group ``group`` of block tile ``tile``, from its raw record of float32 scales
    (V3.2: the caches summed per scale group; UE8M0 records are read whole, ``scale_record``)."""
    return ptx.ld_shared_f32(_raw_scale_address(tables, tile, row, group))


def rope_scale(tables: BlockScaleTables, tile, row) -> Float32:
    """The RoPE's row scale of ``row`` of block tile ``tile`` (``convert_rope``)."""
    return ptx.ld_shared_f32(tables.rope + (tile * 64 + row) * 4)


def row_scale(tables: BlockScaleTables, tile, row) -> Float32:
    """The row scale 2^E of ``row`` of block tile ``tile``."""
    return ptx.ld_shared_f32(tables.row_scale + (tile * 64 + row) * 4)


def store_row_exponent(tables: BlockScaleTables, tile, row, exponent):
    """Row ``row``'s 2^E and E (float32) into the tables of block tile ``tile``."""
    entry = (tile * 64 + row) * 4
    ptx.st_shared_u32(tables.row_scale + entry, Uint32((127 + exponent) << 23))
    ptx.st_shared_u32(tables.exponent + entry, ptx.s32_to_f32_bits(exponent))


def v_row_exponent(geo: CacheGeometry, record, rope_exponent=None) -> Int32:
    """E of a row whose scale ``record`` is given (``scale_record``): the least exponent that holds each of
    its nope groups' scales (and ``rope_exponent``, the RoPE's, when given), within [``ROW_MIN_EXPONENT``,
    ``ROW_MAX_EXPONENT``]. A UE8M0 scale is 2^(byte - 127): the largest byte's (its exponent is
    ``ceil_log2_f32_bits`` of the scale but for byte 0, -127 for -126, and 255, NaN: 128 for 129, all beyond
    the clamp)."""
    exponent = Int32(ROW_MIN_EXPONENT) if rope_exponent is None else rope_exponent
    if const_expr(geo.scale_bytes == 1):
        exponent = cutlass.max(exponent, Int32(ptx.max_u8(record)) - 127)
    else:
        for group in range(geo.groups):
            exponent = cutlass.max(exponent, ptx.ceil_log2_f32_bits(record[group]))
    return cutlass.max(cutlass.min(exponent, Int32(ROW_MAX_EXPONENT)), Int32(ROW_MIN_EXPONENT))


def scale_record(geo: CacheGeometry, tables: BlockScaleTables, tile, row) -> list:
    """Row ``row``'s scales of block tile ``tile`` as 32-bit words, one 16-byte load of its raw record: V3.2's
    float32 scales a word each; UE8M0 bytes four a word, group 0 in the lowest byte (V4's pad byte zeroed)."""
    words_per_record = geo.groups if geo.scale_bytes == 4 else (geo.groups + 3) // 4
    words = ptx.ld_shared_v4(tables.raw + (tile * 64 + row) * RAW_SCALE_ENTRY_BYTES)[:words_per_record]
    if const_expr(geo.scale_bytes == 1 and geo.groups % 4):
        words = [*words[:-1], words[-1] & Uint32((1 << (8 * (geo.groups % 4))) - 1)]
    return words


def ue8m0_byte(record, group: int, offset=0) -> Uint32:
    """Scale byte ``group + offset`` of a row's ``record`` (``scale_record``); ``offset`` (a run-time value
    or 0) keeps it in group ``group``'s word."""
    return ptx.prmt(record[group // 4], 0, 0x4440 + group % 4 + offset)


@cute.jit
def convert_rope(geo: CacheGeometry, tables: BlockScaleTables, tile_rope, tile, thread):
    """The owner warpgroup's thread ``thread`` (0-127) of block tile ``tile`` (its RoPE column tile at
    shared address ``tile_rope``): half of row ``thread // 2``'s staged RoPE to two e4m3 terms with the row's
    scale 2^e, hi in place and the lo residual into the staging tile; 2^e into the RoPE scale table; the row's
    V scale 2^E (``v_row_exponent`` of its nope groups) into the row tables. The block's QK product reads all
    of it after a fence for the async proxy and a barrier of the warpgroup. (V3.2: the caches whose rows are
    summed per scale group, ``qk_products.qk_paged``; V is its nope values.)"""
    assert geo.scale_bytes == 4, "float32 scales (V3.2); UE8M0 rows are rescaled by convert_row"
    row, chunks, lo_tile, words = load_staged_rope(tables, tile_rope, tile, thread)
    # the row's two threads; a zero RoPE (whose terms stay zero) leaves V's exponent to the nope groups
    exponent, inverse = shared_row_scale(words, (1,), zero_exponent=ROW_MIN_EXPONENT)
    store_rope_terms(tile_rope, lo_tile, row, chunks, words, inverse)
    if (thread & 1) == 0:
        rope_bits = Uint32((127 + exponent) << 23)
        ptx.st_shared_u32(tables.rope + (tile * 64 + row) * 4, rope_bits)
        record = scale_record(geo, tables, tile, row)  # one load: none of the stores below waits for another
        v_exponent = v_row_exponent(geo, record)
        store_row_exponent(tables, tile, row, v_exponent)
        store_v_factors(geo, tables, tile, row, v_exponent, record)


def store_v_factors(geo: CacheGeometry, tables: BlockScaleTables, tile, row, exponent, record):
    """Row ``row``'s factors of V's groups, sigma_g 2^-E in f16 (sigma_g from its float32 scale ``record``),
    into the table the PV products scale V's fragments by (``scale_v_fragment``): the bytes as
    ``rescale_nope`` would leave them in place, without a pass over the tile."""
    inverse_bits = Uint32((127 - exponent) << 23)  # 2^-E
    table = tables.v_factors + tile * (geo.groups * 64 * 2) + row * 2
    for group in range(geo.groups):
        factor = ptx.f32_product_to_f16x2(record[group], inverse_bits)
        ptx.st_shared_u16(table + group * 64 * 2, factor)


@cute.jit
def scale_v_fragment(geo: CacheGeometry, tables: BlockScaleTables, words, ks, tile, group, half, quad_lane):
    """k-step ``ks`` of a V^T A fragment (``words[4 ks .. 4 ks + 3]``, slots 32 ``half`` .. + 31 of block
    tile ``tile``, the slot order of ``load_v_fragment``: a0 and a1 hold slots 2t, 2t + 1, 8 + 2t, 9 + 2t, a2
    and a3 the same + 16) times V group ``group``'s factors of their slots (``store_v_factors``), rounded to
    e4m3: the same bytes as ``rescale_nope`` writes, so P carrying 2^E finds V as on the other paths."""
    base = tables.v_factors + ((tile * geo.groups + group) * 64 + 32 * half + 2 * quad_lane) * 2
    factors = [ptx.ld_shared_u32(base + 2 * slot) for slot in (0, 8, 16, 24)]
    for i in cutlass.range_constexpr(4):
        pair = (i // 2) * 2  # a0, a1: slots 0 and 8 from 2t; a2, a3: slots 16 and 24
        words[4 * ks + i] = ptx.scale_e4m3x4_f16(words[4 * ks + i], factors[pair], factors[pair + 1])


def row_and_chunks(thread):
    """The owner warpgroup's thread ``thread`` (0-127): ``(row, chunks)``, its row ``thread // 2`` of a block
    tile and its two 16-byte chunks of each of the row's 64-byte column tiles (the row's other thread holds
    the other two)."""
    return thread >> 1, [(thread & 1) * 2 + k for k in range(2)]


def load_staged_rope(tables: BlockScaleTables, tile_rope, tile, thread):
    """The owner warpgroup's thread ``thread`` (0-127): ``(row, chunks, lo_tile, words)``, its row and chunks
    (``row_and_chunks``) of block tile ``tile`` (RoPE column tile at ``tile_rope``, staging tile at
    ``lo_tile``), and per chunk the RoPE column's then the staging tile's words (values 16 chunk .. + 7, then
    + 8 .. + 15)."""
    row, chunks = row_and_chunks(thread)
    lo_tile = tables.lo + tile * (64 * COLUMN_BYTES)
    words = []
    for chunk in chunks:
        offset = swizzle_offset(row, chunk, COLUMN_BYTES)
        words.append(ptx.ld_shared_v4(tile_rope + offset) + ptx.ld_shared_v4(lo_tile + offset))
    return row, chunks, lo_tile, words


def store_rope_terms(tile_rope, lo_tile, row, chunks, words, inverse):
    """Row ``row``'s RoPE values of ``chunks`` (``words``: per chunk the RoPE column's then the staging
    tile's 16 bytes of bf16) times ``inverse`` (2^-e in both bf16 halves) as two e4m3 terms: hi in place in
    the RoPE column tile at ``tile_rope``, lo = e4m3(x - hi) into the staging tile at ``lo_tile``."""
    for k in range(len(chunks)):
        offset = swizzle_offset(row, chunks[k], COLUMN_BYTES)
        scaled = [ptx.mul_bf16x2(w, inverse) for w in words[k]]  # exact: a power of two
        hi = [ptx.bf16x4_to_e4m3x4(scaled[2 * i], scaled[2 * i + 1]) for i in range(4)]
        ptx.st_shared_v4(tile_rope + offset, *hi)
        lo = [ptx.e4m3x4_residual(scaled[2 * i], scaled[2 * i + 1], hi[i]) for i in range(4)]
        ptx.st_shared_v4(lo_tile + offset, *lo)


@cute.jit
def convert_row(geo: CacheGeometry, tables: BlockScaleTables, tile_base, tile, thread):
    """Power-of-two scales (UE8M0: V4, V4.1): the owner warpgroup's thread ``thread`` (0-127) rescales half of
    row ``thread // 2`` of block tile ``tile`` (at shared address ``tile_base``) to one power-of-two scale 2^E
    of the row, E the least exponent that holds every scale group and a bf16 RoPE: each group's bytes times
    sigma_g 2^-E in place (``rescale_nope``), a staged bf16 RoPE (V4) to two e4m3 terms at 2^-E; 2^E and E
    into the row tables. Then S = 2^E_s (Q . K_s^T) is one WGMMA chain (or summed in float32 in chunks).
    The block's QK product reads it all after a fence for the async proxy and a barrier of the warpgroup."""
    if const_expr(geo.rope_column is None):  # V4.1: every value e4m3 with its group's scale
        row, chunks = row_and_chunks(thread)
        record = scale_record(geo, tables, tile, row)
        exponent = v_row_exponent(geo, record)
    else:
        tile_rope = tile_base + geo.rope_column * COLUMN_TILE_BYTES
        row, chunks, lo_tile, words = load_staged_rope(tables, tile_rope, tile, thread)
        rope_exponent, _ = shared_row_scale(words, (1,), zero_exponent=ROW_MIN_EXPONENT)  # the row's threads
        record = scale_record(geo, tables, tile, row)
        exponent = v_row_exponent(geo, record, rope_exponent)
        inverse = Uint32((127 - exponent) << 7)  # 2^-E in bf16
        store_rope_terms(tile_rope, lo_tile, row, chunks, words, inverse | (inverse << Uint32(16)))
    rescale_nope(geo, record, tile_base, row, chunks, exponent)
    if (thread & 1) == 0:
        store_row_exponent(tables, tile, row, exponent)


@cute.jit
def rescale_nope(geo: CacheGeometry, record, tile_base, row, chunks, exponent):
    """``chunks`` of row ``row`` of each nope column tile of the block tile at ``tile_base`` times sigma_g
    2^-E (its scale group's, from the row's UE8M0 ``record``), rounded to e4m3 in place: exact but for values
    that fall below e4m3's normal range (under 2^-6 / 448 of the row's largest); a group at the row's scale
    is multiplied by 1 (the same bytes). ``chunks`` lie in one scale group of each column (a half column:
    V4.1's groups of 32 values). The chunks of ``RESCALE_COLUMNS_IN_FLIGHT`` column tiles are loaded before
    any of them is stored back, with no branch between: a shared load that follows a store waits for it, so
    a column at a time would wait out every load's latency."""
    inverse_bits = Uint32((127 - exponent) << 23)  # 2^-E
    groups_per_column = geo.groups // geo.nope_columns  # V4: 1 (a group a column); V4.1: 2 (half a column)
    assert groups_per_column * geo.nope_columns == geo.groups, "UE8M0 groups of a column or half a column"
    half = 0  # the chunks' group within each column: their half's (V4.1)
    if const_expr(groups_per_column > 1):
        half = chunks[0] // (COLUMN_BYTES // CHUNK_BYTES // groups_per_column)
    factors = []  # per nope column: its group's sigma_g 2^-E in f16 (both halves)
    for column in cutlass.range_constexpr(geo.nope_columns):
        byte = ue8m0_byte(record, column * groups_per_column, half)
        factors.append(ptx.f32_product_to_f16x2(e8m0_to_f32_bits(byte), inverse_bits))
    offsets = [swizzle_offset(row, chunk, COLUMN_BYTES) for chunk in chunks]
    for first in cutlass.range_constexpr(0, geo.nope_columns, RESCALE_COLUMNS_IN_FLIGHT):
        columns = range(first, min(first + RESCALE_COLUMNS_IN_FLIGHT, geo.nope_columns))
        column_tiles = [tile_base + column * COLUMN_TILE_BYTES for column in columns]
        addresses = [column_tile + offset for column_tile in column_tiles for offset in offsets]
        nope = [ptx.ld_shared_v4(address) for address in addresses]
        for i, address in enumerate(addresses):
            factor = factors[columns[i // len(offsets)]]
            ptx.st_shared_v4(address, *[ptx.scale_e4m3x4_f16(w, factor, factor) for w in nope[i]])


def _raw_scale_address(tables: BlockScaleTables, tile, row, group):
    return tables.raw + (tile * 64 + row) * RAW_SCALE_ENTRY_BYTES + group * 4


def slot_scales(geo, tables, tile, group, slots) -> list:
    """sigma[slot, group] of each of ``slots`` (rows of block tile ``tile``), one shared load each; ``group``
    == ``geo.groups``: the RoPE's row scales; ``ROW_SCALE``: the rows' scales 2^E. Loaded before the wait for
    the product they scale, their latency runs with it."""
    if isinstance(group, str) and group == ROW_SCALE:
        return [row_scale(tables, tile, slot) for slot in slots]
    if isinstance(group, int) and group == geo.groups:
        return [rope_scale(tables, tile, slot) for slot in slots]
    return [raw_scale(tables, tile, slot, group) for slot in slots]


def scale_slots(total, part, scales, first: bool):
    """``total`` += sigma * ``part``, ``scales`` being ``(sigmas, slot_of)``: element i's sigma is
    ``sigmas[slot_of(i)]`` (``slot_scales``; ``first``: total = sigma * total, ``part`` unused). (Unrolled
    while tracing.)"""
    sigmas, slot_of = scales
    for i in range(cute.size(total)):
        sigma = sigmas[slot_of(i)]
        total[i] = total[i] * sigma if first else total[i] + sigma * part[i]
