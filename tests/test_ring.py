"""Ring positions (cute_kernels/sm90/ring.py), on CPU: a ring's buffer index and barrier phase follow the
position as defined (``%`` and ``//``), also where a power-of-two ring computes the phase by a shift and,
with ``index_by_mask``, the index by a mask."""

import pytest

pytest.importorskip("cutlass")

from cute_kernels.sm90.ring import Ring  # noqa: E402


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_index_and_phase_follow_the_position(size):
    ring = Ring(size)
    for position in range(300):
        assert ring.index(position) == position % size
        assert ring.phase(position) == (position // size) % 2
        assert ring.index_before(position) == (position - 1) % size


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_index_by_mask_is_the_same_index(size):
    ring, masked = Ring(size), Ring(size, index_by_mask=True)
    for position in range(300):
        assert masked.index(position) == ring.index(position)
        assert masked.index_before(position) == ring.index_before(position)
        assert masked.phase(position) == ring.phase(position)
