"""Kernel outputs against float64 reference outputs: the checks every kernel's GPU tests share, and the
invalid-index case they share."""

import math

import pytest
import torch

from cute_kernels.interface import PRECISIONS
from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.reference import sparse_mla_prefill_reference

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def out_tolerances(one_term: float, two_terms: float) -> dict[str, float]:
    """A bound on ``out`` per precision: ``two_terms`` where P is kept as two e4m3 terms, else
    ``one_term``."""
    return {name: two_terms if p.p_terms == 2 else one_term for name, p in PRECISIONS.items()}


def logit_tolerances(fast: float, float32_sums: float) -> dict[str, float]:
    """A bound on ``max_logits`` and ``lse`` per precision: ``float32_sums`` where S is summed in float32,
    else ``fast`` (the tensor cores' own accumulation)."""
    return {name: float32_sums if p.qk_in_float32 else fast for name, p in PRECISIONS.items()}


SAME_LOGITS = {"accurate_out": "default", "accurate_logits": "accurate"}
"""Precisions that compute S as another one does, so give its ``max_logits`` and ``lse`` bit for bit."""
OUT_TOLERANCE = out_tolerances(4e-2, 5e-3)
"""The one-tile kernel's ``||out - ref|| / ||ref||`` bound per precision (``test_kernel_gpu``)."""
STAT_TOLERANCE = 1e-2
"""Its bound on max_logits and lse, relative (absolute below 1)."""


def with_every_invalid_index_kind(indices: torch.Tensor, s_kv: int, generator) -> torch.Tensor:
    """``indices`` [s_q, 1, topk] (a new tensor on its device) with about 40% of the slots replaced by invalid
    indices of every kind (-1, -5, s_kv, s_kv + 1 and the int32 extremes), slots 10-19 of every row
    duplicates of slot 5 (valid or not) and row 3 attending the same kv row topk times."""
    device = indices.device
    indices = indices.cpu()
    bad_values = torch.tensor([-1, -5, s_kv, s_kv + 1, INT32_MIN, INT32_MAX], dtype=torch.int32)
    picks = torch.randint(0, len(bad_values), indices.shape, generator=generator)
    bad = torch.rand(indices.shape, generator=generator) < 0.4
    indices = torch.where(bad, bad_values[picks], indices)
    indices[:, :, 10:20] = indices[:, :, 5:6]
    indices[3] = 7
    return indices.to(device)


def assert_outputs_match(outputs, reference, out_tolerance: float, stat_tolerance: float) -> float:
    """No NaN; rows with no valid slot (reference lse +inf) hold exactly out 0, max_logits -inf,
    lse +inf; ``||out - ref|| / ||ref|| <= out_tolerance``; max_logits and lse within
    ``stat_tolerance`` relative (absolute below 1). Returns ``||out - ref|| / ||ref||``."""
    out, max_logits, lse = outputs
    ref_out, ref_max, ref_lse = reference
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(max_logits).any() and not torch.isnan(lse).any(), "NaN in max_logits/lse"
    empty = torch.isinf(ref_lse) & (ref_lse > 0)  # rows with no valid slot
    assert torch.equal(torch.isinf(lse) & (lse > 0), empty), "sentinel rows differ"
    assert (out[empty] == 0).all(), "out of an empty row is not exactly 0"
    assert (max_logits[empty] == -math.inf).all(), "max_logits of an empty row is not -inf"

    rel = 0.0
    ref_norm = ref_out.norm()
    if ref_norm > 0:
        rel = ((out.double() - ref_out).norm() / ref_norm).item()
        assert rel <= out_tolerance, f"||out - ref|| / ||ref|| = {rel:.3e}"
    full = ~empty
    for name, got, want in (("max_logits", max_logits, ref_max), ("lse", lse, ref_lse)):
        err = (got.double()[full] - want[full]).abs() / want[full].abs().clamp(min=1.0)
        if err.numel():
            assert err.max().item() <= stat_tolerance, f"{name}: max relative error {err.max().item():.3e}"
    return rel


def reference_grid(test):
    """``test`` parametrized over the kernels' grid of reference cases: ``extras`` ("plain" or
    "sink_and_topk_length"), ``d_qk``, ``h_q``, ``topk`` and ``s_kv_kind`` (``grid_s_kv``)."""
    test = pytest.mark.parametrize("extras", ["plain", "sink_and_topk_length"])(test)
    test = pytest.mark.parametrize("d_qk", [512, 576])(test)
    test = pytest.mark.parametrize("h_q", [64, 128])(test)
    test = pytest.mark.parametrize("topk", [128, 512, 2048])(test)
    return pytest.mark.parametrize("s_kv_kind", ["below_topk", "64k"])(test)


def grid_s_kv(topk: int, s_kv_kind: str) -> int:
    """The s_kv of a ``reference_grid`` case: below topk (``topk // 2 + 3``) or 64k."""
    return topk // 2 + 3 if s_kv_kind == "below_topk" else 65536


def run_and_sync(inputs: dict, **kwargs):
    """``sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs)``, waited for."""
    outputs = sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs)
    torch.cuda.synchronize()
    return outputs


def assert_matches_float64_reference(outputs, inputs: dict, precision: str = "default") -> float:
    """``assert_outputs_match`` against the float64 reference of ``inputs`` with the one-tile kernel's
    tolerances for ``precision``."""
    reference = sparse_mla_prefill_reference(**inputs, chunk_rows=32)
    return assert_outputs_match(outputs, reference, OUT_TOLERANCE[precision], STAT_TOLERANCE)
