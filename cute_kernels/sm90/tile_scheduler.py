"""Which (token, head group) tiles a CTA computes: one tile, several (persistent), or a part of one (split).

Tiles run over the head groups of token 0, then token 1, ...: a token's h heads form ceil(h / n) groups of n =
64 heads (or the small-head kernel's head count, n = h), and tile t = token * groups + group is rows [token *
h + group * n, + n) of the (token, head) rows. When n does not divide h, a token's last group has fewer of its
heads (``TileRows.head_rows``): its other rows are the next token's first heads (zeros past the last row),
computed and not written. One-tile scheduling launches a CTA per tile. Persistent scheduling launches
``ceil(tiles / tiles_per_cta)`` CTAs and CTA b walks tiles b, b + grid, b + 2 grid, ... Split scheduling
launches a [tiles, splits] grid: CTA (t, p) computes tile t over the p-th of ``splits`` equal ranges of index
slots (whole pairs), and the tile's ``splits`` CTAs (a cluster) merge their results. A tile's work
(``TileWork``) is its position, the range of index slots to consider (``topk_length`` bounds it) and the
count of KV blocks and pairs that covers it.
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
    heads: Int32  # h, the heads of a token
    flags: Int32


class TileWork(NamedTuple):
    """One work tile of a CTA (trace-time bundle of runtime values). Its rows: ``TileScheduler.rows``."""

    tile: Int32  # the tile's index: token * head groups + head group
    token: Int32
    slot_base: Int32  # the first index slot of the work (0 unless split: a multiple of the pair rows)
    valid_len: Int32  # slots below it are considered: topk_length clamped to [0, topk] (topk when not
    # given), split: also to the end of the work's range
    num_blocks: Int32  # blocks from slot_base that cover the slots below valid_len
    num_pairs: Int32  # pairs from slot_base that cover them
    block_base: Int32  # the CTA's block count before this tile (0 unless persistent): the tile's
    # block b has ring position block_base + b


class TileRows(NamedTuple):
    """Where a tile's rows are (trace-time bundle of runtime values, computed where used: nothing of it
    stays live across a tile's blocks)."""

    q_row: Int32  # its first (token, head) row of q, out, max_logits and lse: token * h + group * tile rows
    first_head: Int32  # the head of its first row (indexes attn_sink)
    head_rows: Int32  # its rows that are heads of its token (the tile rows, fewer in a token's last group)


class TileScheduler:
    """One tile per CTA, or ``persistent``: ``tiles_per_cta`` (a launch argument) per CTA, or ``split``: a
    part of a tile per CTA. Blocks are ``block_rows`` index slots, pairs two blocks. ``whole_token``: a tile
    is all heads of a token (the small-head kernel, h = ``tile_rows``), else h is any head count."""

    def __init__(
        self, persistent: bool, block_rows: int, split: bool = False, tile_rows: int = B_H, whole_token=False
    ):
        self.persistent = persistent
        self.split = split
        self.block_rows = block_rows
        self.tile_rows = tile_rows  # query rows (heads of one token) per tile
        self.whole_token = whole_token

    def head_groups(self, heads):
        """Tiles per token: ceil(h / tile rows)."""
        if const_expr(self.whole_token):
            return 1
        return (heads + self.tile_rows - 1) // self.tile_rows

    def num_tiles(self, s_q, heads):
        """The tiles of s_q tokens of h heads."""
        return s_q * self.head_groups(heads)

    def grid(self, num_tiles, splits=1, tiles_per_cta=None):
        """The [x, y] grid of CTAs to launch for ``num_tiles`` tiles (split: each in ``splits`` parts)."""
        if const_expr(self.persistent):
            return [(num_tiles + tiles_per_cta - 1) // tiles_per_cta, 1]
        if const_expr(self.split):
            return [num_tiles, splits]
        return [num_tiles, 1]

    def cta_tiles(self, bid, mIdx, mTopkLen, heads, flags, tiles_per_cta=None) -> CtaTiles:
        """The tiles of CTA ``bid`` (called while tracing the kernel); ``heads``: h."""
        tile_count = 1
        heads = plain_int32(heads)
        if const_expr(self.persistent):
            num_tiles = self.num_tiles(plain_int32(cute.size(mIdx, mode=[0])), heads)
            grid = self.grid(num_tiles, tiles_per_cta=tiles_per_cta)[0]
            tile_count = (num_tiles - bid + grid - 1) // grid
        return CtaTiles(bid, tile_count, mIdx, mTopkLen, heads, flags)

    def first_row_and_head(self, tile, heads):
        """The first (token, head) row of q of tile ``tile`` of tokens of ``heads`` (h) heads, and its
        head."""
        if const_expr(self.whole_token):
            return tile * self.tile_rows, 0
        groups = self.head_groups(heads)
        token = tile // groups
        first_head = (tile - token * groups) * self.tile_rows
        return token * heads + first_head, first_head

    def first_q_row(self, tile, heads):
        """The first (token, head) row of q of tile ``tile`` of tokens of ``heads`` (h) heads."""
        return self.first_row_and_head(tile, heads)[0]

    def rows(self, tile, heads) -> TileRows:
        """The rows of tile ``tile`` of tokens of ``heads`` (h) heads."""
        q_row, first_head = self.first_row_and_head(tile, heads)
        head_rows = self.tile_rows
        if const_expr(not self.whole_token):
            head_rows = cutlass.min(heads - first_head, self.tile_rows)
        return TileRows(q_row, first_head, head_rows)

    def work(self, tiles: CtaTiles, tile_iter, block_base) -> TileWork:
        """Iteration ``tile_iter`` of the CTA's tile loop: its tile, token and valid slot count (reads
        ``topk_length[token]``)."""
        tile = tiles.first
        if const_expr(self.persistent):  # block and grid indices re-read: nothing kept live for them
            tile = cute.arch.block_idx()[0] + tile_iter * cute.arch.grid_dim()[0]
        topk = cute.size(tiles.mIdx, mode=[1])
        pair_rows = 2 * self.block_rows
        token = tile // self.head_groups(tiles.heads)
        slot_base = 0
        if const_expr(self.split):  # block (tile, part) of a [tiles, splits] grid
            _, part, _ = cute.arch.block_idx()
            splits = cute.arch.grid_dim()[1]
            pairs_per_part = (topk + splits * pair_rows - 1) // (splits * pair_rows)
            slot_base = cute.arch.make_warp_uniform(part * pairs_per_part * pair_rows)
        valid_len = valid_slot_count(tiles.mTopkLen, token, topk, tiles.flags)
        slot_count = valid_len
        if const_expr(self.split):
            valid_len = cutlass.min(valid_len, slot_base + pairs_per_part * pair_rows)
            slot_count = cutlass.max(valid_len - slot_base, 0)
        return TileWork(
            tile=tile,
            token=token,
            slot_base=slot_base,
            valid_len=valid_len,
            num_blocks=(slot_count + self.block_rows - 1) // self.block_rows,
            num_pairs=(slot_count + pair_rows - 1) // pair_rows,
            block_base=block_base,
        )
