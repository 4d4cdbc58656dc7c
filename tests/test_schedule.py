"""The alternating block schedule of the FP8 kernel (cute_kernels/sm90/sparse_prefill.py), on CPU:
each consumer owns every other block, and its steps accumulate every block of the tile exactly once,
in order; a step without an own block happens only for the consumer that does not own the last one. And
the split rule's part counts."""

import pytest

pytest.importorskip("cutlass")

from cute_kernels.sm90.sparse_prefill import consumer_steps  # noqa: E402
from q8kv8 import eager, schedule  # noqa: E402


@pytest.mark.parametrize("num_blocks", range(1, 70))
@pytest.mark.parametrize("consumer", [0, 1])
def test_each_consumer_accumulates_every_block_once_and_owns_alternate_blocks(num_blocks, consumer):
    steps = consumer_steps(num_blocks, consumer)
    owned, accumulated, steps_without_own = [], [], []
    for step in range(steps):
        own = 2 * step + consumer
        if own < num_blocks:
            owned.append(own)
        else:
            steps_without_own.append(step)
        accumulated += [b for b in (own - 1, own) if 0 <= b < num_blocks]
    assert owned == list(range(consumer, num_blocks, 2))
    assert accumulated == list(range(num_blocks))  # each block once, in order
    # Only the last step may lack an own block, and only when the last block is the other's.
    last_is_other = (num_blocks - 1) % 2 != consumer
    assert steps_without_own == ([steps - 1] if last_is_other else [])
    # Every step has something to accumulate (no empty steps).
    assert steps == len(owned) + len(steps_without_own)


def test_split_parts_are_the_kernels_and_divide_its_d_tiles(monkeypatch):
    """2 or 4 parts (a consumer's four d tiles of out are shared among the parts), the most that let every
    cluster run at once (a tile in 4 parts counted as 5 SMs) and the two-pairs-per-range minimum allow; 3
    is never chosen nor forced."""
    assert all(4 % parts == 0 for parts in schedule.SPLIT_PARTS)
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    tiles = (1, 26, 27, 33, 34, 66, 67)
    assert [schedule.splits(t, 2048, 0) for t in tiles] == [4, 4, 2, 2, 2, 2, 1]
    assert [schedule.splits(1, topk, 0) for topk in (256, 512, 768, 1024)] == [1, 2, 2, 4]
    with pytest.raises(ValueError, match="parts: expected 1 or one of"):
        eager.forced_splits(3)
