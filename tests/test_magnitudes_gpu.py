"""bfloat16 q rows of every magnitude, on an H100/H200 (``gpu`` marker): rows scaled by 2^-133 (bfloat16
subnormals) to 2^127 (up to the largest finite bfloat16) in one call, in both precisions and on every
schedule (one tile per CTA, persistent, split, small heads).

Whenever a row's float64 logits (in the exp2 domain the kernel works in) fit in float32, its results are
finite and match the float64 reference on the quantised rows: at logits of 2^22 and more a rounded product
of a logit and its scale is off the exact one by at least half a unit, and the softmax must still see the
row's largest logit at an exponent of 0 to 8.75 (``exp2_relative``). (The rows' softmaxes are flat or led by
one slot: at logits of hundreds and more, a race between two slots within the logits' relative error is
decided by that error in any float32 softmax.) out within the usual tolerances; max_logits and lse within
1.2e-2 (default: a row led by one slot sums same-sign products, which the FP8 tensor cores' truncating
accumulation over all 18 k-steps leaves low by up to ~1%, measured 7.4e-3 to 8.4e-3) and 1e-3 (accurate:
measured up to 5.6e-4). A row whose logits do not fit in float32 gets unspecified results (README, "bf16
queries"), and no other row changes by a bit.
"""

import math

import pytest
import torch
from reference_checks import assert_outputs_match

from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.eager import forced_splits, forced_tiles_per_cta
from q8kv8.reference import sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
EXPONENTS = (-133, -130, -126, -100, -64, -20, 0, 10, 20, 22, 23, 24, 30, 64, 100, 127)
OUT_TOLERANCE = {"default": 4e-2, "accurate": 5e-3}
STAT_TOLERANCE = {"default": 1.2e-2, "accurate": 1e-3}
# schedule -> (heads, how it is forced): the rule's own choice for 16 heads is the small-head kernel
SCHEDULES = {
    "one_tile": (64, lambda: forced_tiles_per_cta(0)),
    "persistent": (64, lambda: forced_tiles_per_cta(2)),
    "split": (64, lambda: forced_splits(2)),
    "small_heads": (16, None),
}


def rows_of_every_magnitude(generator, kv: torch.Tensor, indices: torch.Tensor, h_q: int) -> torch.Tensor:
    """[s_q, h_q, d_qk] bfloat16: row (i, h) is kv's row of token i's first slot plus a tenth of noise (one
    slot dominates the row's logits: its softmax is flat at small magnitudes and one slot at large ones, never
    a close race that the logits' own rounding would decide), divided by its max |value| and multiplied by
    2^EXPONENTS[(i * h_q + h) % len]: its max |value| is exactly that power of two."""
    s_q, d_qk = indices.shape[0], kv.shape[2]
    dominant = kv[indices[:, 0, 0].long(), 0].double()  # [s_q, d_qk]
    q = dominant[:, None, :] + 0.1 * torch.randn(s_q, h_q, d_qk, generator=generator, dtype=torch.float64)
    q = q / q.abs().amax(dim=-1, keepdim=True)
    exponents = torch.tensor(EXPONENTS, dtype=torch.float64)
    rows = torch.arange(s_q * h_q).reshape(s_q, h_q) % len(EXPONENTS)
    return (q * torch.exp2(exponents[rows])[..., None]).to(BF16)


def magnitude_inputs(make_inputs, generator, heads: int, **kwargs) -> dict:
    inputs = make_inputs(12, heads, 6000, 576, 512, device="cpu", q_dtype=BF16, **kwargs)
    inputs["indices"][:, 0, 0] = torch.randint(0, 6000, (12,), generator=generator, dtype=torch.int32)
    inputs["q"] = rows_of_every_magnitude(generator, inputs["kv"].float(), inputs["indices"], heads)
    return {
        name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()
    }


def run(inputs, precision, schedule):
    forced = SCHEDULES[schedule][1]
    if forced is None:
        outputs = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
    else:
        with forced():
            outputs = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
    torch.cuda.synchronize()
    return outputs


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_row_magnitude_matches_the_reference(make_inputs, generator, schedule, precision):
    heads = SCHEDULES[schedule][0]
    inputs = magnitude_inputs(make_inputs, generator, heads, with_topk_length=True)
    inputs["sm_scale"] = 0.002
    inputs["topk_length"][0] = 512
    outputs = run(inputs, precision, schedule)
    reference = sparse_mla_prefill_reference(**inputs, chunk_rows=32)
    # the precondition: every logit (exp2 domain) fits in float32
    assert (reference[1][torch.isfinite(reference[1])].abs() * math.log2(math.e)).max() < 2.0**127
    assert torch.isfinite(outputs[0]).all()
    valid = torch.isfinite(reference[2])
    assert torch.isfinite(outputs[1][valid]).all() and torch.isfinite(outputs[2][valid]).all()
    assert_outputs_match(outputs, reference, OUT_TOLERANCE[precision], STAT_TOLERANCE[precision])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_row_beyond_float32_changes_no_other_row(make_inputs, generator, schedule):
    """sm_scale 2^10 puts the 2^127 rows' logits past float32's range: every other row is bitwise what it is
    when those rows are zero instead."""
    heads = SCHEDULES[schedule][0]
    inputs = magnitude_inputs(make_inputs, generator, heads, with_sink=True)
    q = inputs["q"]
    huge = q.float().abs().amax(dim=-1) == 2.0**127
    assert huge.any()
    inputs["sm_scale"] = 2.0**10
    with_huge = run(inputs | {"q": q}, "default", schedule)
    without = run(inputs | {"q": q.masked_fill(huge[..., None], 0.0)}, "default", schedule)
    for got, want in zip(with_huge, without, strict=True):
        assert torch.equal(got[~huge], want[~huge])
