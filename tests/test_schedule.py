"""The alternating block schedule of the FP8 kernel (cute_kernels/sm90/sparse_prefill.py), on CPU:
each consumer owns every other block, and its steps accumulate every block of the tile exactly once,
in order; a step without an own block happens only for the consumer that does not own the last one. And
the split rule's part counts, and the rules answered for a given SM count without a GPU."""

import pytest
import torch

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
    """2, 4 or 8 parts (the eight d tiles of out are shared among the parts), the most that let every cluster
    run at once (a tile in 4 parts counted as 5 SMs, in 8 as 11) and the one-pair-per-range minimum allow;
    3 is never chosen nor forced."""
    assert all(8 % parts == 0 for parts in schedule.SPLIT_PARTS)
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    tiles = (1, 12, 13, 26, 27, 33, 34, 66, 67)
    assert [schedule.splits(t, 2048, 0) for t in tiles] == [8, 8, 4, 4, 2, 2, 2, 2, 1]
    assert [schedule.splits(1, topk, 0) for topk in (128, 256, 512, 768, 1024)] == [1, 2, 4, 4, 8]
    with pytest.raises(ValueError, match="parts: expected 1 or one of"):
        eager.forced_splits(3)


def test_the_last_partial_wave_is_split_after_whole_waves_of_one_tile(monkeypatch):
    """A one-tile grid longer than a wave: the tokens of its last tiles % SMs tiles (rounded up to whole
    tokens) are split when the one-wave rule splits them and topk >= SPLIT_TAIL_MIN_TOPK; a grid of at most
    a wave is split whole (split_from 0) by the same rule."""
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    assert schedule.SPLIT_TAIL_MIN_TOPK == 1024
    cases = {
        (437, 1, 2048): (2, 396),  # 41 tiles left after 3 waves: 4 parts would need 205 SMs
        (150, 1, 2048): (4, 132),  # 18 tiles: 90 SMs in 4 parts
        (437, 1, 1024): (2, 396),
        (437, 1, 512): (1, 0),  # below the tail's topk: not split
        (64, 1, 2048): (2, 0),  # under a wave: all split
        (64, 1, 512): (2, 0),
        (132, 1, 2048): (1, 0),  # exactly a wave
        (1024, 1, 2048): (1, 0),  # 100 tiles left: 200 SMs in 2 parts
        (67, 2, 2048): (8, 66),  # 134 tiles: the last token's 2
        (70, 2, 2048): (8, 66),  # 140 tiles: 8 left, 4 tokens
        (100, 2, 2048): (1, 0),  # 68 tiles left
    }
    for (s_q, groups, topk), expected in cases.items():
        assert schedule.split_tokens(s_q, groups, topk, 0) == expected, (s_q, groups, topk)
    assert schedule.describe(437, 64, 2048) == "one tile per CTA, 41 split in 2"
    assert schedule.describe(64, 64, 2048) == "split in 2"
    assert schedule.describe(132, 64, 2048) == "one tile per CTA"
    assert schedule.choose(437, 64, 2048, False, 0) == (0, 2, 396)
    assert schedule.choose(437, 64, 2048, True, 0) == (0, 2, 396)  # not 4 waves: no persistent
    with eager.forced_splits(2, 5):
        assert schedule.split_tokens(437, 1, 2048, 0) == (2, 5)
    with eager.forced_splits(1, 5):
        assert schedule.split_tokens(437, 1, 2048, 0) == (1, 0)
    with pytest.raises(ValueError, match="split_from: expected"):
        eager.forced_splits(2, -1)
    with eager.forced_splits(2, 437), pytest.raises(ValueError, match="expected less than s_q 437"):
        schedule.split_tokens(437, 1, 2048, 0)


def test_describe_answers_for_a_given_sm_count_and_names_that_argument_without_a_gpu(monkeypatch):
    """``describe`` and ``choose`` with ``num_sms=`` answer for that many SMs without asking a device; with
    no CUDA device visible and no ``num_sms``, a RuntimeError names the argument (not torch's own error)."""

    def no_device(*args, **kwargs):
        raise AssertionError("the device was queried")

    monkeypatch.setattr(schedule, "_sm_counts", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device)
    with pytest.raises(RuntimeError, match=r"no CUDA device is visible; pass num_sms= "):
        schedule.describe(437, 64, 2048)
    assert schedule.describe(437, 64, 2048, num_sms=132) == "one tile per CTA, 41 split in 2"
    assert schedule.describe(437, 64, 2048, num_sms=114) == "one tile per CTA"  # 95 tiles left: too many
    assert schedule.describe(64, 64, 2048, num_sms=132) == "split in 2"
    assert schedule.describe(4096, 64, 512, num_sms=132) == "persistent, 4 tiles per CTA"
    assert schedule.describe(200, 16, 2048, num_sms=132) == "small heads, 2 tokens per CTA"
    assert schedule.choose(437, 64, 2048, False, 0, num_sms=132) == (0, 2, 396)
    assert schedule._sm_counts == {}  # nothing remembered for the device
    with pytest.raises(ValueError, match="num_sms: expected at least 1, got 0"):
        schedule.describe(437, 64, 2048, num_sms=0)


def test_small_decode_batches_split_into_ranges_of_one_pair(monkeypatch):
    """A split range may be one pair of blocks (``SPLIT_MIN_SLOTS``): a small decode batch at topk 512 or 1152
    splits in as many parts as its clusters fit; small heads keep ranges of two pairs
    (``SMALL_HEAD_SPLIT_MIN_SLOTS``), so 8-16 of their tokens at topk 512 run the small-head kernel."""
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    assert schedule.SPLIT_MIN_SLOTS == 128 and schedule.SMALL_HEAD_SPLIT_MIN_SLOTS == 256
    cases = {  # (s_q, h_q, topk): parts
        (8, 64, 512): 4,
        (8, 128, 512): 4,  # 16 tiles in 4 parts: 80 SMs
        (8, 64, 1152): 8,
        (16, 64, 1152): 4,  # 8 parts would need 176 SMs
        (32, 64, 512): 2,  # 4 parts would need 160 SMs
        (1, 64, 256): 2,
        (64, 64, 2048): 2,
        (8, 64, 2048): 8,
    }
    for (s_q, h_q, topk), parts in cases.items():
        assert schedule.choose(s_q, h_q, topk, False, 0).splits == parts, (s_q, h_q, topk)
    for s_q in (8, 16):
        assert schedule.describe(s_q, 16, 512, num_sms=132) == "small heads, 1 token per CTA"
    assert schedule.describe(8, 64, 512, num_sms=132) == "split in 4"
