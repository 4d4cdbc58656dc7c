"""Which kernel schedule a call runs: one tile per CTA, or the persistent kernel walking several.

The persistent kernel (``cute_kernels/sm90/sparse_prefill.py``, ``persistent=True``: each CTA walks up to
four (token, 64 heads) tiles; its producer loads the next tile's Q and gathers its first rows during the
current tile's tail, and the current tile's out stores drain during the next tile's math) pays on short
tiles and costs on long ones (docs/perf-notes.md has the measurements). So it runs, for either precision,
when topk <= 512 or topk_length is given (short rows are what topk_length is for), with
min(4, tiles // (4 * SMs)) tiles per CTA when that is at least 2 (the grid keeps four waves of CTAs or
more). Results are bitwise those of the one-tile kernel, so the choice only ever changes the time.

The contract computes the choice once per call signature (``contract.Problem.tiles_per_cta``, memoised
with the rest of the verdict), so a repeated call pays nothing for it.
"""

import torch

PERSISTENT_PRECISIONS = ("default", "accurate")
PERSISTENT_MAX_TOPK = 512
PERSISTENT_MAX_TILES_PER_CTA = 4
PERSISTENT_MIN_WAVES = 4

_sm_counts: dict[int, int] = {}  # multiprocessors per CUDA device index

forced: int | None = None
"""Set by ``q8kv8.eager.forced_tiles_per_cta`` (tests, experiments): the answer of ``tiles_per_cta`` for
every launch (0 the one-tile kernel, k >= 1 the persistent one with k tiles per CTA) instead of the rule's."""


def tiles_per_cta(num_tiles: int, topk: int, has_topk_length: bool, precision: str, device_index: int) -> int:
    """The schedule of a launch of ``num_tiles`` (token, 64 heads) tiles on CUDA device ``device_index``:
    0 selects the one-tile kernel, k >= 2 the persistent one with k tiles per CTA."""
    if forced is not None:
        return forced
    if precision not in PERSISTENT_PRECISIONS or not (has_topk_length or topk <= PERSISTENT_MAX_TOPK):
        return 0
    sms = _sm_counts.get(device_index)
    if sms is None:
        sms = _sm_counts[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    tiles = min(PERSISTENT_MAX_TILES_PER_CTA, num_tiles // (PERSISTENT_MIN_WAVES * sms))
    return tiles if tiles >= 2 else 0
