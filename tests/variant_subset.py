"""The kernel variants that ``make test`` runs the per-variant build checks on.

A per-variant check (marked ``variants``: it builds variants and reads their PTX, ptxas report or SASS) runs
in ``make test`` on the representative variants below, one or more of each family, schedule, q dtype, head
count, cache layout and precision, and each of its code paths; ``make test-variants`` (``pytest
--all-variants -m variants``) runs every such check on every variant. A parametrised check's cases whose
variants are not all representative are marked ``all_variants`` (``cases``): ``make test`` deselects them.
A check of the listings (``python -m q8kv8.compile``, ``q8kv8.info()``) takes the ``listing`` fixture: the
representative variants, or every one with ``--all-variants``."""

import pytest

from q8kv8 import kernels
from q8kv8.schedule import ONE_TILE, PERSISTENT, SPLIT

FP8, BF16_Q = kernels.FP8, kernels.BF16_Q
_V = kernels.VariantKey

REPRESENTATIVE = frozenset(
    [
        *kernels.IMPORT_KEYS,  # e4m3 q, 64 heads: one tile, persistent; default, accurate; d_qk 512, 576
        _V(576, "accurate_out"),  # the single purchases, one tile
        _V(576, "accurate_logits"),
        _V(576, "default", SPLIT),
        *(_V(512, "accurate", kind, BF16_Q) for kind in (ONE_TILE, PERSISTENT, SPLIT)),  # bf16 q
        _V(512, "accurate", PERSISTENT, BF16_Q, 16),  # small heads
        _V(576, "default", PERSISTENT, FP8, 8),
        _V(576, "default", ONE_TILE, FP8, 64, "v32"),  # paged: scale groups summed
        _V(512, "accurate", PERSISTENT, BF16_Q, 64, "model1"),  # paged: S promoted, within the spills
        _V(512, "default", PERSISTENT, FP8, 32, "model1"),  # paged: rows rescaled, small heads
        _V(512, "default", ONE_TILE, FP8, 64, "v41"),  # paged: e4m3 values only, rows rescaled
        _V(512, "accurate", PERSISTENT, BF16_Q, 64, "v41"),  # paged: rows rescaled, S promoted
        *kernels.SERVING_KEYS[: 1 + 1 + 6],  # the slot indices, the merge and six gathers (small kernels)
        kernels.Bf16AttentionKey(512),  # the bf16 kernel
        kernels.Bf16AttentionKey(576),
    ]
)


def listed_keys() -> list[kernels.KernelKey]:
    """The representative variants in the listings' order (those of the import first)."""
    return [key for key in kernels.LISTED_KEYS if key in REPRESENTATIVE]


def cases(values, keys_of, ids=None) -> list:
    """``values`` as ``pytest.param``s for ``parametrize``: marked ``all_variants`` where ``keys_of(value)``
    (the variants the case builds) are not all representative."""
    params = []
    for index, value in enumerate(values):
        value = value if isinstance(value, tuple) else (value,)
        representative = all(key in REPRESENTATIVE for key in keys_of(*value))
        marks = () if representative else (pytest.mark.all_variants,)
        params.append(pytest.param(*value, marks=marks, id=None if ids is None else ids[index]))
    return params
