"""``merge_attention`` of two bfloat16 parts on an H100/H200 (``gpu`` marker): the merge kernel
(``cute_kernels/sm90/attention_merge.py``) against the float64 attention over the union of the parts' rows.

Tolerances: out within 5e-3 (``||out - ref|| / ||ref||``: each part's out rounded to bf16 before the merge and
the merged row once more, about 2^-9 relative each), max_logits exactly the larger part's, lse within 2e-6
(float32 with the fast exp2 and log2).
"""

import math

import pytest
import torch

from q8kv8 import merge
from q8kv8.merge import merge_attention
from q8kv8.reference import sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

SM_SCALE = 0.05


def split_rows(generator, s_q: int, kv_rows: int, topk: int, first: int):
    """Each query's ``topk`` distinct rows, split into a first part of ``first`` and a second of the rest;
    query 3 only in the second, query 4 only in the first, query 7 in neither."""
    indices = torch.stack([torch.randperm(kv_rows, generator=generator)[:topk] for _ in range(s_q)])
    parts = indices[:, :first].clone(), indices[:, first:].clone()
    parts[0][3], parts[1][4] = -1, -1
    parts[0][7], parts[1][7] = -1, -1
    return parts


@pytest.mark.parametrize("with_sink", [True, False], ids=["sink", "no sink"])
@pytest.mark.parametrize("h", [5, 64])
def test_two_parts_are_one_softmax(generator, h, with_sink):
    """Two parts (some rows empty in one, one row in both), merged on the GPU with and without a sink (one
    head's sink -inf, one +inf), against the float64 attention over the union."""
    s_q, d = 12, 576
    q = torch.randn(s_q, h, d, generator=generator, dtype=torch.float64)
    kv = torch.randn(300, 1, d, generator=generator, dtype=torch.float64)
    first, second = split_rows(generator, s_q, 300, 40, 25)
    sink = None
    if with_sink:
        sink = torch.randn(h, generator=generator, dtype=torch.float64)
        sink[0], sink[1] = -math.inf, math.inf
    want = sparse_mla_prefill_reference(
        q, kv, torch.cat([first, second], dim=1)[:, None], SM_SCALE, 1.0, 1.0, 512, sink
    )
    parts = []
    for rows in (first, second):
        out, max_logits, lse = sparse_mla_prefill_reference(q, kv, rows[:, None], SM_SCALE, 1.0, 1.0, 512)
        parts.append((out.to(torch.bfloat16).cuda(), max_logits.float().cuda(), lse.float().cuda()))
    cuda_sink = None if sink is None else sink.float().cuda()
    assert merge._one_launch(parts, cuda_sink)
    got = [t.cpu() for t in merge_attention(parts, cuda_sink)]
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (s_q, h, 512)
    assert (got[0][7] == 0).all() and (got[1][7] == -math.inf).all() and (got[2][7] == math.inf).all()
    if with_sink:
        assert (got[0][:, 1] == 0).all()  # a sink of +inf takes the whole row
    rows = [i for i in range(s_q) if i != 7]
    error = (got[0][rows].double() - want[0][rows]).norm() / want[0][rows].norm()
    assert error < 5e-3, error
    assert torch.equal(got[1], want[1].float())
    assert torch.allclose(got[2][rows].double(), want[2][rows], rtol=2e-6, atol=2e-6)
