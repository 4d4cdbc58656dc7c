"""The layout helpers: head padding, top-k padding and per-row lengths from sequence lengths."""

import pytest
import torch

from q8kv8 import pad_topk, padded_num_heads, topk_length_from_seqlens
from q8kv8.reference import sparse_mla_prefill_reference


@pytest.mark.parametrize(
    ("h_q", "expected"), [(1, 64), (16, 64), (48, 64), (64, 64), (65, 128), (96, 128), (128, 128), (129, 192)]
)
def test_padded_num_heads_rounds_up_to_64(h_q, expected):
    assert padded_num_heads(h_q) == expected


@pytest.mark.parametrize("h_q", [0, -64])
def test_padded_num_heads_rejects_no_heads(h_q):
    with pytest.raises(ValueError, match=f"h_q: expected at least 1 head, got {h_q}"):
        padded_num_heads(h_q)


@pytest.mark.parametrize(("topk", "padded"), [(1, 128), (100, 128), (129, 256), (2000, 2048)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pad_topk_appends_minus_one_up_to_a_multiple_of_128(generator, topk, padded, dtype):
    indices = torch.randint(0, 1000, (3, 1, topk), generator=generator).to(dtype)
    result = pad_topk(indices)
    assert result.shape == (3, 1, padded)
    assert (result.dtype, result.device) == (dtype, indices.device)
    assert torch.equal(result[..., :topk], indices)
    assert torch.equal(result[..., topk:], torch.full((3, 1, padded - topk), -1, dtype=dtype))


@pytest.mark.parametrize("topk", [128, 256])
def test_pad_topk_returns_aligned_indices_unchanged(generator, topk):
    indices = torch.randint(0, 1000, (2, 1, topk), generator=generator, dtype=torch.int32)
    assert pad_topk(indices) is indices


def test_pad_topk_turns_empty_topk_into_one_block_of_padding():
    result = pad_topk(torch.zeros(4, 1, 0, dtype=torch.int32))
    assert torch.equal(result, torch.full((4, 1, 128), -1, dtype=torch.int32))


def test_topk_length_from_seqlens_clamps_to_0_topk_as_int32():
    seqlens = torch.tensor([-2, 0, 5, 256, 300, 2**40], dtype=torch.int64)
    lengths = topk_length_from_seqlens(seqlens, 256)
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == [0, 0, 5, 256, 256, 256]


def test_topk_length_from_seqlens_rejects_float_seqlens_and_negative_topk():
    with pytest.raises(TypeError, match="seqlens: expected an integer tensor, got dtype torch.float32"):
        topk_length_from_seqlens(torch.ones(3), 128)
    with pytest.raises(ValueError, match="topk: expected a non-negative slot count, got -1"):
        topk_length_from_seqlens(torch.ones(3, dtype=torch.int32), -1)


def test_left_packed_indices_with_seqlen_lengths_match_minus_one_padding(make_inputs):
    """A serving engine's layout: valid indices first, then anything; topk_length skips the tail. The two
    float64 computations see the same rows in different allocations, which a BLAS may round differently in
    the last bits (seen with one torch build, not another): equal to float64 rounding, sentinels exactly."""
    s_q, s_kv, topk = 6, 300, 128
    args = make_inputs(s_q=s_q, h_q=4, s_kv=s_kv, d_qk=64, topk=topk, invalid_fraction=0.0, with_sink=True)
    args["d_v"] = 32
    seqlens = torch.tensor([0, 1, 17, 127, 128, 500])
    past_seqlen = torch.arange(topk) >= seqlens[:, None]
    garbage_tail = args["indices"].clone()  # tail slots hold valid-looking indices that must be skipped
    minus_one_tail = args["indices"].masked_fill(past_seqlen[:, None, :], -1)

    with_lengths = sparse_mla_prefill_reference(
        **args | {"indices": garbage_tail, "topk_length": topk_length_from_seqlens(seqlens, topk)}
    )
    without_lengths = sparse_mla_prefill_reference(**args | {"indices": minus_one_tail})
    for got, expected in zip(with_lengths, without_lengths, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0.0)
    assert (with_lengths[2][0] == float("inf")).all()  # seqlen 0: no valid slot, lse +inf
