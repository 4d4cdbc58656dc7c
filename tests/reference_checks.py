"""Kernel outputs against float64 reference outputs: the checks every kernel's GPU tests share."""

import math

import torch


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
