"""Which (token, head group) tiles a CTA computes: one tile, several (persistent), or a part of one (split).

Tiles run over the head groups of token 0, then token 1, ...: tile t is rows [n t, n t + n) of the
(token, head) rows, n = 64 (or the small-head kernel's head count). One-tile scheduling launches a CTA per
tile. Persistent scheduling launches ``ceil(tiles / tiles_per_cta)`` CTAs and CTA b walks tiles b, b + grid,
b + 2 grid, ... Split scheduling
launches a [tiles, splits] grid (``splits`` from the row count of the outputs it is given, ``splits`` times
q's): CTA (t, p) computes tile t over the p-th of ``splits`` equal ranges of index slots (whole pairs) and
writes the partial result as output tile p * tiles + t. A tile's work (``TileWork``) is its position, the
range of index slots to consider (``topk_length`` bounds it) and the count of KV blocks and pairs that
covers it.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir import ir

from cute_kernels.interface import TOPK_LENGTH_FLAG
from cute_kernels.sm90.cta import B_H


@cute.jit
def valid_slot_count(mTopkLen, token, topk, flags):
    """The leading slots of ``token``'s row to consider (warp-uniform): ``topk_length[token]`` clamped
    to [0, topk] when the flags say topk_length is given, else ``topk``."""
    valid_len = topk
    if (flags & TOPK_LENGTH_FLAG) != 0:
        valid_len = cutlass.min(cutlass.max(mTopkLen[token], 0), topk)
    return cute.arch.make_warp_uniform(valid_len)


def plain_int32(value) -> Int32:
    """``value`` (a dynamic integer from layout arithmetic, which the DSL keeps as a CuTe integer
    tuple) as a plain Int32: arithmetic on it is integer arithmetic, like on the kernels' other
    scalars."""
    return Int32(ir.Value(value.ir_value()).maybe_downcast())


class CtaTiles(NamedTuple):
    """The tiles one CTA walks, and what ``TileScheduler.work`` reads for each (trace-time bundle)."""

    first: Int32  # the CTA's block index: its first tile
    count: Int32  # how many tiles (1 unless persistent)
    mIdx: cute.Tensor  # [s_q, topk] indices
    mTopkLen: cute.Tensor
    mOut: cute.Tensor  # [s_q, h, d_v] (split: [splits * s_q, h, d_v]): the tile count
    flags: Int32


class TileWork(NamedTuple):
    """One work tile of a CTA (trace-time bundle of runtime values)."""

    tile: Int32  # output row tile [64 * tile, 64 * tile + 64) (of the partial rows when split)
    q_tile: Int32  # row tile of the (token, head) rows of q (tile unless split)
    token: Int32
    head_group: Int32
    slot_base: Int32  # the first index slot of the work (0 unless split: a multiple of the pair rows)
    valid_len: Int32  # slots below it are considered: topk_length clamped to [0, topk] (topk when not
    # given), split: also to the end of the work's range
    num_blocks: Int32  # blocks from slot_base that cover the slots below valid_len
    num_pairs: Int32  # pairs from slot_base that cover them
    block_base: Int32  # the CTA's block count before this tile (0 unless persistent): the tile's
    # block b has ring position block_base + b


class TileScheduler:
    """One tile per CTA, or ``persistent``: ``tiles_per_cta`` (a launch argument) per CTA, or ``split``: a
    part of a tile per CTA. Blocks are ``block_rows`` index slots, pairs two blocks."""

    def __init__(self, persistent: bool, block_rows: int, split: bool = False, tile_rows: int = B_H):
        self.persistent = persistent
        self.split = split
        self.block_rows = block_rows
        self.tile_rows = tile_rows  # query rows (heads of one token) per tile

    def grid(self, num_tiles, out_tiles=None, tiles_per_cta=None):
        """The [x, y] grid of CTAs to launch for ``num_tiles`` tiles (split: ``out_tiles`` output tiles)."""
        if const_expr(self.persistent):
            return [(num_tiles + tiles_per_cta - 1) // tiles_per_cta, 1]
        if const_expr(self.split):
            return [num_tiles, out_tiles // num_tiles]
        return [num_tiles, 1]

    def cta_tiles(self, bid, mIdx, mTopkLen, mOut, flags, tiles_per_cta=None) -> CtaTiles:
        """The tiles of CTA ``bid`` (called while tracing the kernel)."""
        tile_count = 1
        if const_expr(self.persistent):
            num_tiles = cute.size(mOut, mode=[0]) * (cute.size(mOut, mode=[1]) // self.tile_rows)
            grid = self.grid(num_tiles, tiles_per_cta=tiles_per_cta)[0]
            tile_count = (num_tiles - bid + grid - 1) // grid
        return CtaTiles(bid, tile_count, mIdx, mTopkLen, mOut, flags)

    def work(self, tiles: CtaTiles, tile_iter, block_base) -> TileWork:
        """Iteration ``tile_iter`` of the CTA's tile loop: its tile, token, head group and valid slot
        count (reads ``topk_length[token]``)."""
        tile = tiles.first
        if const_expr(self.persistent):  # block and grid indices re-read: nothing kept live for them
            tile = cute.arch.block_idx()[0] + tile_iter * cute.arch.grid_dim()[0]
        topk = cute.size(tiles.mIdx, mode=[1])
        num_head_groups = cute.size(tiles.mOut, mode=[1]) // self.tile_rows
        pair_rows = 2 * self.block_rows
        q_tile = tile
        slot_base = 0
        if const_expr(self.split):  # block (tile, part) of a [tiles, splits] grid
            _, part, _ = cute.arch.block_idx()
            splits = cute.arch.grid_dim()[1]
            tile = part * cute.arch.grid_dim()[0] + q_tile
            pairs_per_part = (topk + splits * pair_rows - 1) // (splits * pair_rows)
            slot_base = cute.arch.make_warp_uniform(part * pairs_per_part * pair_rows)
        token = q_tile // num_head_groups
        valid_len = valid_slot_count(tiles.mTopkLen, token, topk, tiles.flags)
        slot_count = valid_len
        if const_expr(self.split):
            valid_len = cutlass.min(valid_len, slot_base + pairs_per_part * pair_rows)
            slot_count = cutlass.max(valid_len - slot_base, 0)
        return TileWork(
            tile=tile,
            q_tile=q_tile,
            token=token,
            head_group=plain_int32(q_tile - token * num_head_groups),  # indexes attn_sink
            slot_base=slot_base,
            valid_len=valid_len,
            num_blocks=(slot_count + self.block_rows - 1) // self.block_rows,
            num_pairs=(slot_count + pair_rows - 1) // pair_rows,
            block_base=block_base,
        )
