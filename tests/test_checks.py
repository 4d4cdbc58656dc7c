"""The shared building blocks of the argument checks (``q8kv8.checks``), on CPU: memos, a paged cache's
geometry and alignment, and the signature of a cache's token slots."""

import pytest
import torch

from q8kv8 import checks
from q8kv8.kv_layout import MODEL1, V32


def test_memos_are_bounded_and_cleared_together():
    first, second = checks.memo(), checks.memo()
    for key in range(5):
        assert checks.remember(first, key, str(key), 3) == str(key)
        assert 1 <= len(first) <= 3
    checks.remember(second, "key", "verdict", 3)
    checks.clear_memos()
    assert first == {} and second == {}


@pytest.mark.parametrize(("bytes_per_token", "layout"), [(656, V32), (584, MODEL1)])
def test_cache_geometry_finds_the_layout_by_bytes_per_token(bytes_per_token, layout):
    cache = torch.zeros(3, 64, 1, bytes_per_token, dtype=torch.uint8)
    assert checks.cache_geometry(cache) == (layout, cache.shape)


@pytest.mark.parametrize(
    ("cache", "error", "message"),
    [
        ([0], checks.InputTypeError, "^extra_cache: expected a torch.Tensor, got list$"),
        (torch.zeros(3, 64, 656, dtype=torch.uint8), ValueError, r"^extra_cache: expected shape \[num_pages"),
        (torch.zeros(3, 64, 1, 600, dtype=torch.uint8), ValueError, "bytes_per_token in"),
    ],
)
def test_cache_geometry_names_the_cache(cache, error, message):
    with pytest.raises(error, match=message):
        checks.cache_geometry(cache, "extra_cache")


def test_aligned_pages():
    checks.require_aligned_pages("cache", 32, 2, 64 * 656)
    checks.require_aligned_pages("cache", 0, 1, 7)  # one page: its stride is never read
    with pytest.raises(ValueError, match="^cache: expected a 16-byte aligned base and page stride"):
        checks.require_aligned_pages("cache", 8, 1, 64)
    with pytest.raises(ValueError, match="got page stride 41992 bytes and base offset 0$"):
        checks.require_aligned_pages("cache", 0, 2, 41992)


def test_rows_signature_describes_contiguous_rows_without_memory():
    device = torch.device("cpu")
    rows = checks.rows_signature(10, 576, device)
    tensor = torch.empty(10, 1, 576, dtype=checks.FP8)
    assert rows[: checks.DATA_PTR] == checks.signature(tensor)[: checks.DATA_PTR]
    assert rows[checks.DATA_PTR] == 0
    scale = checks.scalar_signature(device)
    assert scale[: checks.DATA_PTR] == checks.signature(torch.ones(1))[: checks.DATA_PTR]
