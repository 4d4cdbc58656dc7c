"""Which kernel schedule a call runs: one tile per CTA, the persistent kernel walking several, or the split
kernel computing each tile as several CTAs.

The persistent kernel (``cute_kernels/sm90/sparse_prefill.py``, ``persistent=True``: each CTA walks up to four
(token, 64 heads) tiles (a token of h_q heads has ceil(h_q / 64)); its producer loads the next tile's Q and
gathers its first rows during the current tile's tail, and the current tile's out stores drain during the next
tile's math) pays on short tiles and costs on long ones (docs/perf-notes.md has the measurements). So it runs,
for every precision, when topk <= 512 or topk_length is given (short rows are what topk_length is for), with
min(4, tiles // (4 * SMs)) tiles per CTA when that is at least 2 (the grid keeps four waves of CTAs or more).
Results are bitwise those of the one-tile kernel, so the choice only ever changes the time.

A short grid (at most half as many tiles as SMs: a short prefill chunk) leaves SMs idle. Then each tile is
split into ``splits`` ranges of index slots, one CTA each (``sparse_prefill.py``, ``split=True``), the
tile's CTAs a cluster that merges their results through shared memory: ``splits`` is the largest p of 2,
4 and 8 (the part counts that divide the eight d tiles of out) with tiles * ``SPLIT_CLUSTER_SMS[p]`` <= SMs
and p * 128 <= topk, so that all clusters run at once and each range keeps one pair of blocks or more. A
cluster's CTAs run in one GPC, one per SM (each takes all of an SM's shared memory), and a GPC's SMs need
not be a multiple of 4: on the 132-SM H200 28 clusters of 4 ran at once and 32 did not, so a tile split
in 4 is counted as 5 SMs, and one split in 8 as 11 (at most 12 clusters of 8, 96 CTAs, fewer than the 112
that ran in clusters of 4). The merge is in a fixed order, so results are the same bits on every run (not
those of the one-tile kernel).

A longer one-tile grid ends in a partial wave: its last tiles % SMs tiles. When those, rounded up to whole
tokens, would be split by the rule above and topk >= ``SPLIT_TAIL_MIN_TOPK``, the call runs in two
launches: the one-tile kernel on the tokens before them (whole waves), then the split kernel on theirs (the
split tail: the partial wave in a fraction of a tile's time). ``split_from`` is the first token of the split
launch: 0 when the whole grid is split.

A call with 8, 16 or 32 heads (``q8kv8.metadata.small_heads``) runs the small-head kernel
(``sparse_prefill.py``, ``heads=h_q``: a tile is one token's heads), always
persistent: a tile gathers as many rows as a 64-head one for a fraction of its math, so the per-CTA fixed cost
(Q load, the first gather's latency, the epilogue) is a large share of it, and a CTA that walks several tokens
overlaps it with the next token's gather. ``small_head_tiles_per_cta`` tokens per CTA: the count up to 8 that
keeps the fewest tokens in a row on an SM (waves of CTAs times tokens per CTA; ties: more tokens per CTA).
The small-head kernel runs one CTA a token: a few tokens (a decode step of a small batch) would leave most
SMs idle. When the split rule splits a grid of one tile a token in ``SMALL_HEAD_SPLIT_MIN_PARTS`` (4) or
more, the call runs tiles of 64 heads (the token's h heads and the next tokens' heads beside them, computed
and not written) split that way instead: 4-8x the CTAs for about 1.4x a small-head tile's math (padded to 64,
8-32 heads cost 1.05-1.19x the h_q 64 time against the small-head kernel's 0.65-0.93x).

The contract computes the choice once per call signature (``contract.Problem.tiles_per_cta``, memoised
with the rest of the verdict), so a repeated call pays nothing for it.

Every rule depends on the GPU's SM count, queried from the CUDA device (``sm_count``). ``choose``,
``describe`` and the rules take ``num_sms=`` to answer for a given count instead (132 on an H100 SXM or an
H200), with or without a GPU; without one and without ``num_sms`` they raise a ``RuntimeError`` that says so.
"""

from typing import NamedTuple

import torch

from q8kv8.metadata import SPLIT_PARTS, head_groups, small_heads

ONE_TILE, PERSISTENT, SPLIT = 0, 1, 2
"""The schedule kinds (a launch's kernel variant): one tile per CTA, persistent, split."""

PERSISTENT_MAX_TOPK = 512
PERSISTENT_MAX_TILES_PER_CTA = 4
PERSISTENT_MIN_WAVES = 4
SMALL_HEAD_MAX_TILES_PER_CTA = 8
SMALL_HEAD_SPLIT_MIN_PARTS = 4  # small heads run split tiles of 64 heads from this many parts (see above)
SPLIT_MIN_SLOTS = 128  # index slots per range: one pair of blocks (decode of 4-16 requests, h 64 / 128: parts
# of 128-144 slots 3-8% faster than of 256 on gathered rows at topk 512-1152, H200, kernels of 2d16466, and
# 9-17% from a paged cache, H100, kernels of 3d1b433; docs/perf-notes.md, "Paged cache")
SMALL_HEAD_SPLIT_MIN_SLOTS = 256  # the small-head rule's: two pairs (split tiles of 64 heads not timed below)
SPLIT_CLUSTER_SMS = (2, 5, 11)  # SMs counted for a tile split in SPLIT_PARTS[i] (see above)
SPLIT_TAIL_MIN_TOPK = 1024  # the split tail's second launch pays for itself from here (docs/perf-notes.md)

_sm_counts: dict[int, int] = {}  # multiprocessors per CUDA device index

forced: int | None = None
"""Set by ``q8kv8.eager.forced_tiles_per_cta`` (tests, experiments): the answer of ``tiles_per_cta`` for
every launch (0 the one-tile kernel, k >= 1 the persistent one with k tiles per CTA) instead of the rule's."""
forced_splits: tuple[int, int] | None = None
"""Set by ``q8kv8.eager.forced_splits`` (tests, experiments): the answer ``(splits, split_from)`` of
``split_tokens`` for every launch of the one-tile schedule (``(1, 0)``: not split)."""


def sm_count(device_index: int, num_sms: int | None = None) -> int:
    """``num_sms`` when given, else the multiprocessors of CUDA device ``device_index`` (queried once per
    device; a ``RuntimeError`` naming ``num_sms=`` when no CUDA device is visible)."""
    if num_sms is not None:
        if num_sms < 1:
            raise ValueError(f"num_sms: expected at least 1, got {num_sms}")
        return num_sms
    sms = _sm_counts.get(device_index)
    if sms is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "q8kv8.schedule: the schedule depends on the GPU's SM count and no CUDA device is visible; "
                "pass num_sms= to answer for a given count (132 on an H100 SXM or an H200)"
            )
        sms = _sm_counts[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms


def tiles_per_cta(
    num_tiles: int,
    topk: int,
    has_topk_length: bool,
    device_index: int,
    num_sms: int | None = None,
) -> int:
    """The schedule of a launch of ``num_tiles`` (token, 64 heads) tiles on CUDA device ``device_index``
    (or on ``num_sms`` SMs): 0 selects the one-tile kernel, k >= 2 the persistent one with k tiles per CTA."""
    if forced is not None:
        return forced
    if not (has_topk_length or topk <= PERSISTENT_MAX_TOPK):
        return 0
    sms = sm_count(device_index, num_sms)
    tiles = min(PERSISTENT_MAX_TILES_PER_CTA, num_tiles // (PERSISTENT_MIN_WAVES * sms))
    return tiles if tiles >= 2 else 0


def small_head_tiles_per_cta(s_q: int, device_index: int, num_sms: int | None = None) -> int:
    """The tokens each CTA of a small-head launch of ``s_q`` tokens walks on CUDA device ``device_index``
    (or on ``num_sms`` SMs; >= 1: the small-head variants are persistent)."""
    if forced is not None:
        return max(forced, 1)
    sms = sm_count(device_index, num_sms)

    def token_rounds(tiles: int) -> tuple[int, int]:  # an SM's tokens in a row: waves of CTAs x tiles
        return ((s_q + tiles - 1) // tiles + sms - 1) // sms * tiles, -tiles

    return min(range(1, SMALL_HEAD_MAX_TILES_PER_CTA + 1), key=token_rounds)


def splits(
    num_tiles: int,
    topk: int,
    device_index: int,
    num_sms: int | None = None,
    min_slots: int = SPLIT_MIN_SLOTS,
) -> int:
    """The parts each tile of a one-tile launch of ``num_tiles`` tiles is split into on CUDA device
    ``device_index`` (or on ``num_sms`` SMs; 1: not split), each of ``min_slots`` index slots or more."""
    if forced_splits is not None:
        return forced_splits[0]
    sms, tiles = sm_count(device_index, num_sms), max(num_tiles, 1)
    fitting = [p for p, need in zip(SPLIT_PARTS, SPLIT_CLUSTER_SMS, strict=True) if tiles * need <= sms]
    return max((p for p in fitting if p * min_slots <= topk), default=1)


def split_tokens(
    s_q: int,
    groups: int,
    topk: int,
    device_index: int,
    num_sms: int | None = None,
    min_slots: int = SPLIT_MIN_SLOTS,
) -> tuple[int, int]:
    """``(splits, split_from)`` of a one-tile launch of ``s_q`` tokens of ``groups`` tiles each on CUDA device
    ``device_index`` (or on ``num_sms`` SMs): the tokens from ``split_from`` on run split in ``splits``
    parts, those before it one tile per CTA; ``(1, 0)``: nothing split. The split covers the last, partial
    wave (all of a grid shorter than a wave) when ``splits`` splits it (see above)."""
    if forced_splits is not None:
        if forced_splits[1] >= s_q:
            raise ValueError(f"forced split_from {forced_splits[1]}: expected less than s_q {s_q}")
        return forced_splits
    tail_tokens = -(-(s_q * groups % sm_count(device_index, num_sms)) // groups)
    split_from = s_q - tail_tokens
    if tail_tokens == 0 or (split_from > 0 and topk < SPLIT_TAIL_MIN_TOPK):
        return 1, 0
    parts = splits(tail_tokens * groups, topk, device_index, num_sms, min_slots)
    return (parts, split_from) if parts > 1 else (1, 0)


class Schedule(NamedTuple):
    """A call's schedule (``choose``): tiles per CTA (0: one tile per CTA; small heads: tokens per CTA), and
    for a one-tile launch the parts of its split tokens (1: none) and the first of them."""

    tiles_per_cta: int
    splits: int = 1
    split_from: int = 0


def choose(
    s_q: int,
    h_q: int,
    topk: int,
    has_topk_length: bool,
    device_index: int,
    num_sms: int | None = None,
) -> Schedule:
    """The ``Schedule`` of a call of ``s_q`` tokens, ``h_q`` heads (ceil(h_q / 64) tiles a token) and
    ``topk`` slots on CUDA device ``device_index`` (or on a GPU of ``num_sms`` SMs): the small-head rule for
    small heads (split tiles of 64 heads when the split rule, with ranges of ``SMALL_HEAD_SPLIT_MIN_SLOTS``,
    gives ``SMALL_HEAD_SPLIT_MIN_PARTS`` or more), else the persistent rule first, the split rule for a
    one-tile launch."""
    if small_heads(h_q):
        # a grid of one tile a token
        parts = splits(s_q, topk, device_index, num_sms, SMALL_HEAD_SPLIT_MIN_SLOTS)
        if parts < SMALL_HEAD_SPLIT_MIN_PARTS:
            return Schedule(small_head_tiles_per_cta(s_q, device_index, num_sms))
        return Schedule(0, parts)
    groups = head_groups(h_q)
    tiles = tiles_per_cta(s_q * groups, topk, has_topk_length, device_index, num_sms)
    if tiles:
        return Schedule(tiles)
    return Schedule(0, *split_tokens(s_q, groups, topk, device_index, num_sms))


def describe(
    s_q: int,
    h_q: int,
    topk: int,
    has_topk_length: bool = False,
    device_index: int = 0,
    num_sms: int | None = None,
) -> str:
    """``choose``'s answer in words: "one tile per CTA", "small heads, k tokens per CTA", "persistent, k
    tiles per CTA", "split in n" or "one tile per CTA, t split in n" (a split tail of t tokens).

    The answer depends on the GPU's SM count: that of CUDA device ``device_index``, or ``num_sms`` when
    given (132 on an H100 SXM or an H200), which answers without a GPU. Without a CUDA device and without
    ``num_sms`` it raises a ``RuntimeError`` naming ``num_sms=``."""
    tiles, parts, split_from = choose(s_q, h_q, topk, has_topk_length, device_index, num_sms)
    if small_heads(h_q) and tiles:
        return f"small heads, {tiles} token{'s' if tiles > 1 else ''} per CTA"
    if tiles:
        return f"persistent, {tiles} tiles per CTA"
    if parts == 1:
        return "one tile per CTA"
    return f"one tile per CTA, {s_q - split_from} split in {parts}" if split_from else f"split in {parts}"
