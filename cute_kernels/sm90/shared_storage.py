"""Shared-memory tiles of the attention kernels: Q, the ring of gathered KV block tiles and P.

Every tile is K-major with a WGMMA swizzle (a [rows x 64-byte or 128-byte] atom, tiled rows first,
then columns, then the tile index). A kernel's SharedStorage struct places its barriers and row
statistics first and the three tile regions after them, each 1024-byte aligned; the struct's size is
the CTA's dynamic shared memory.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

TILE_ALIGN = 1024  # bytes: a tile region starts on a swizzle-pattern boundary


def tile_region(dtype, shape):
    """The struct member of a tile of ``shape`` elements of ``dtype``."""
    return cute.struct.Align[cute.struct.MemRange[dtype, math.prod(shape)], TILE_ALIGN]


def tile_layouts(atom_kind, dtype, shapes):
    """The swizzled layouts of tiles of ``shapes`` ((rows, cols) or (rows, cols, tiles)) from the WGMMA
    shared-memory atom ``atom_kind``."""
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    return tuple(cute.tile_to_shape(atom, shape, tuple(range(len(shape)))) for shape in shapes)


def tile_tensor(region, layout):
    """The tensor of a tile region of an allocated SharedStorage, with its swizzled layout."""
    return region.get_tensor(layout.outer, swizzle=layout.inner)


def allocate_shared_storage(shared_storage):
    """The kernel's SharedStorage struct in dynamic shared memory."""
    return cutlass.memory.SmemAllocator().allocate(shared_storage)
