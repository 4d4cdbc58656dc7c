"""The precisions that buy one of the accurate mode's two parts, on gathered rows, on an H100/H200 (``gpu``
marker; the paged cache's: ``test_paged_gpu``).

"accurate_out" keeps P as two e4m3 terms and computes S as "default" does; "accurate_logits" sums S in float32
as "accurate" does and rounds P to one e4m3 term. So on the same inputs and schedule each gives the
``max_logits`` and ``lse`` of the precision whose S it computes, bit for bit, and its ``out`` within the bound
of the precision whose P it stores: 5e-3 with two terms, 4e-2 with one. Logits reach ~30 (q and kv ~ N(0, 1),
sm_scale 0.25), where the QK product's accumulation shows: within 3e-3 from the tensor cores' own sums and
5e-4 summed in float32 (``test_kernel_gpu.LARGE_LOGIT_TOLERANCE``). Every schedule, small heads, a bf16 q.
"""

import contextlib

import pytest
import torch
from reference_checks import OUT_TOLERANCE, SAME_LOGITS, assert_outputs_match, logit_tolerances

from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.eager import forced_splits, forced_tiles_per_cta
from q8kv8.metadata import PRECISIONS
from q8kv8.reference import sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

LARGE_LOGIT_TOLERANCE = logit_tolerances(3e-3, 5e-4)
SCHEDULES = {  # h_q, q dtype, schedule
    "one tile": (64, torch.float8_e4m3fn, lambda: forced_tiles_per_cta(0)),
    "persistent": (64, torch.float8_e4m3fn, lambda: forced_tiles_per_cta(2)),
    "split": (64, torch.float8_e4m3fn, lambda: forced_splits(2)),
    "small heads": (16, torch.float8_e4m3fn, contextlib.nullcontext),
    "bf16 q one tile": (64, torch.bfloat16, lambda: forced_tiles_per_cta(0)),
    "bf16 q small heads": (32, torch.bfloat16, contextlib.nullcontext),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("d_qk", [512, 576])
def test_each_precision_buys_what_it_names(make_inputs, d_qk, schedule):
    h_q, q_dtype, forced = SCHEDULES[schedule]
    inputs = make_inputs(48, h_q, 4096, d_qk, 2048, device="cuda", invalid_fraction=0.0, q_dtype=q_dtype)
    one = torch.ones(1, device="cuda")
    inputs |= {"sm_scale": 0.25, "kv_scale": one, "q_scale": None if q_dtype == torch.bfloat16 else one}
    reference = sparse_mla_prefill_reference(**inputs, chunk_rows=32)
    assert reference[1].max() > 20, "logits not as large as meant"
    results, errors = {}, {}
    for precision in PRECISIONS:
        with forced():
            results[precision] = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
        torch.cuda.synchronize()
        errors[precision] = assert_outputs_match(
            results[precision], reference, OUT_TOLERANCE[precision], LARGE_LOGIT_TOLERANCE[precision]
        )
    for precision, same in SAME_LOGITS.items():
        assert torch.equal(results[precision][1], results[same][1]), precision
        assert torch.equal(results[precision][2], results[same][2]), precision
    assert errors["accurate_out"] < errors["default"] / 4, errors  # P's second term is what out pays for
