"""Rings of shared buffers guarded by mbarriers, addressed by position.

A ring of ``size`` buffers is used in order by positions g = 0, 1, 2, ...: position g uses buffer
``g % size`` and phase ``(g // size) % 2`` of that buffer's barriers (each barrier completes once per
use of its buffer, so its phase alternates). A producer waits on a buffer's *empty* barrier with the
phase flipped: the first wait of each buffer passes at once. Positions are plain integers (Python or
DSL Int32, never negative), so a loop needs no state carried across its back edge. For a power-of-two
size the phase is a shift and a mask: on a signed Int32, ``//`` and ``%`` round toward minus infinity and
cost a dependent chain of sign fix-ups on every wait. The index is a mask too where a kernel asks for it
(``index_by_mask``): the small-head kernel does; in the 64-head persistent variants a mask moves ptxas's
register allocation and they spill, so they keep ``%``.
"""

from typing import NamedTuple

import cutlass.cute as cute


class Ring(NamedTuple):
    size: int  # buffers in the ring
    index_by_mask: bool = False  # a power-of-two ring's index as ``position & (size - 1)``

    def index(self, position):
        """The buffer position ``position`` uses."""
        if self.index_by_mask and self.size & (self.size - 1) == 0:
            return position & (self.size - 1)
        return position % self.size

    def index_before(self, position):
        """The buffer of ``position - 1`` (for position 0: the ring's last buffer)."""
        return (position + self.size - 1) % self.size

    def phase(self, position):
        """The phase of the buffer's barriers that position ``position`` waits on."""
        if self.size & (self.size - 1) == 0:
            return (position >> (self.size.bit_length() - 1)) & 1
        return (position // self.size) % 2

    def wait(self, mbar, position) -> None:
        """Wait for position ``position``'s completion of its buffer's barrier (``mbar`` is the ring's
        first barrier)."""
        cute.arch.mbarrier_wait(mbar + self.index(position), self.phase(position))

    def wait_empty(self, mbar, position) -> None:
        """Producer side: wait until the consumers released the buffer's previous use."""
        cute.arch.mbarrier_wait(mbar + self.index(position), self.phase(position) ^ 1)

    def arrive(self, mbar, position) -> None:
        """Arrive on the buffer's barrier for position ``position``."""
        cute.arch.mbarrier_arrive(mbar + self.index(position))
