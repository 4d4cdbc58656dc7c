"""The alternating block schedule of the FP8 kernel (cute_kernels/sm90/sparse_prefill.py), on CPU:
each consumer owns every other block, and its steps accumulate every block of the tile exactly once,
in order; a step without an own block happens only for the consumer that does not own the last one."""

import pytest

pytest.importorskip("cutlass")

from cute_kernels.sm90.sparse_prefill import consumer_steps  # noqa: E402


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
