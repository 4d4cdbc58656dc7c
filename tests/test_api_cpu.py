"""The entry point's plumbing on CPU: head counts, output buffers and what reaches the kernel.

The device check is patched to accept CPU tensors, and ``q8kv8.kernels`` is a fake whose launch checks
the launch interface and fills the outputs from the float64 reference. Outputs are compared with the
reference on the caller's (unpadded) inputs, within bf16 rounding for ``out`` (relative 2**-8) and
float32 rounding for ``max_logits`` and ``lse`` (relative 2**-23).
"""

import inspect
import math

import pytest
import torch
from reference_launch import launch_arguments, write_reference_outputs

from q8kv8 import contract, sparse_mla_q8kv8_prefill_fwd
from q8kv8.prefill_call import PrefillCall
from q8kv8.reference import sparse_mla_prefill_reference

S_Q, S_KV, D_QK, D_V, TOPK = 5, 200, 576, 512, 128


def reference_launch(*args):
    """A stand-in for ``q8kv8.kernels.launch_sparse_prefill`` that checks its promised arguments."""
    launch = launch_arguments(args)
    q, out, max_logits, lse = launch["q"], launch["out"], launch["max_logits"], launch["lse"]
    s_q, h_kernel, _ = q.shape
    assert out.shape == (s_q, h_kernel, D_V) and max_logits.shape == lse.shape == (s_q, h_kernel)
    assert launch["attn_sink"] is None or launch["attn_sink"].shape == (h_kernel,)
    assert q.dtype in (torch.float8_e4m3fn, torch.bfloat16)
    if q.dtype == torch.bfloat16:  # the kernel scales each row itself
        assert launch["q_scale"] is None and launch["kv_scale"].numel() == 1
    else:
        assert launch["q_scale"].numel() == launch["kv_scale"].numel() == 1
    assert type(launch["sm_scale"]) is float
    assert launch["schedule"] == 0  # the contract's choice; CPU tensors: one tile per CTA
    assert launch["splits"] == 1 and launch["split_from"] == 0  # not split
    for name in ("q", "topk_length", "attn_sink", "out", "max_logits", "lse"):
        if launch[name] is not None:
            assert launch[name].is_contiguous(), name
    for name in ("kv", "indices"):  # row strides are the kernel's business; rows must be contiguous
        assert launch[name].stride(-1) == 1, name
    if launch["ready"]:  # the launch will not check alignment: the contract promised it
        assert q.data_ptr() % 16 == 0 and out.data_ptr() % 4 == 0
        assert launch["kv"].data_ptr() % 16 == 0 and launch["kv"].stride(0) % 16 == 0
    write_reference_outputs(launch)
    return launch


@pytest.fixture
def launches(monkeypatch, fake_kernels) -> list[dict]:
    """Accept CPU tensors and launch ``reference_launch``; returns the list of launches' arguments."""
    recorded = []
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    fake_kernels(lambda *args: recorded.append(reference_launch(*args)))
    return recorded


@pytest.fixture
def no_launch(monkeypatch, fake_kernels):
    """Accept CPU tensors and fail the test if anything is launched."""
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)

    def launch_sparse_prefill(*args):
        raise AssertionError("nothing should have been launched")

    fake_kernels(launch_sparse_prefill)


def assert_matches_reference(results, args):
    out, max_logits, lse = results
    expected_out, expected_max_logits, expected_lse = sparse_mla_prefill_reference(**args)
    assert out.dtype == torch.bfloat16 and max_logits.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(max_logits.double(), expected_max_logits, rtol=2**-23, atol=1e-6)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=2**-23, atol=1e-6)


def assert_own_contiguous_memory(tensor: torch.Tensor):
    assert tensor.is_contiguous()
    assert tensor.storage_offset() == 0
    assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("h_q", [16, 48, 64, 96, 128])
def test_every_head_count_reaches_the_kernel_as_it_is(make_inputs, launches, h_q, q_dtype):
    """Any head count: the caller's q, sink and buffers reach the kernel as they are (no padding heads, no
    copies); 16 heads run the small-head kernel."""
    args = make_inputs(S_Q, h_q, S_KV, D_QK, TOPK, with_sink=True, with_topk_length=True, q_dtype=q_dtype)
    results = sparse_mla_q8kv8_prefill_fwd(**args)

    assert_matches_reference(results, args)
    out, max_logits, lse = results
    assert out.shape == (S_Q, h_q, D_V) and max_logits.shape == lse.shape == (S_Q, h_q)
    for tensor in results:
        assert_own_contiguous_memory(tensor)
    [launch] = launches
    assert launch["q"] is args["q"] and launch["attn_sink"] is args["attn_sink"]
    assert launch["out"] is out and launch["max_logits"] is max_logits and launch["lse"] is lse
    assert launch["ready"]


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("h_q", [48, 64])
def test_given_buffers_are_written_and_returned(make_inputs, launches, h_q, q_dtype):
    args = make_inputs(S_Q, h_q, S_KV, D_QK, TOPK, with_sink=True, q_dtype=q_dtype)
    out = torch.full((S_Q, h_q, D_V), math.nan, dtype=torch.bfloat16)
    max_logits = torch.full((S_Q, h_q), math.nan)
    lse = torch.full((S_Q, h_q), math.nan)

    results = sparse_mla_q8kv8_prefill_fwd(**args, out=out, max_logits=max_logits, lse=lse)

    assert results[0] is out and results[1] is max_logits and results[2] is lse
    assert_matches_reference(results, args)
    [launch] = launches
    assert launch["out"] is out and launch["lse"] is lse and launch["ready"]


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_strided_inputs_reach_the_kernel_in_a_layout_it_takes(make_inputs, launches, randn_fp8, q_dtype):
    args = make_inputs(S_Q, 64, S_KV, D_QK, TOPK, q_dtype=q_dtype)
    strided = args | {
        "q": args["q"].transpose(0, 1).contiguous().transpose(0, 1),
        "kv": torch.cat([args["kv"], randn_fp8(S_KV, 1, D_QK)], dim=1)[:, :1],
        "indices": torch.cat([args["indices"], args["indices"]], dim=1)[:, :1],
    }
    assert not any(strided[name].is_contiguous() for name in ("q", "kv", "indices"))

    results = sparse_mla_q8kv8_prefill_fwd(**strided)

    assert_matches_reference(
        results, args
    )  # the reference on the contiguous originals; the fake checked layouts
    [launch] = launches
    assert launch["ready"] is False  # q was made contiguous here; kv's row stride is the launch's to check


def test_scalars_precision_and_missing_options_reach_the_kernel(make_inputs, launches):
    args = make_inputs(S_Q, 64, S_KV, 512, TOPK) | {"sm_scale": 1, "q_scale": torch.tensor(0.5)}
    sparse_mla_q8kv8_prefill_fwd(**args, precision="accurate")
    [launch] = launches
    assert launch["sm_scale"] == 1.0
    assert launch["q_scale"].reshape(-1).tolist() == [0.5]
    assert launch["precision"] == "accurate"
    assert launch["attn_sink"] is None and launch["topk_length"] is None


def test_topk_length_out_of_range_is_passed_on_for_the_kernel_to_clamp(make_inputs, launches, monkeypatch):
    monkeypatch.delenv(contract.CHECK_RANGES_ENV, raising=False)
    args = make_inputs(S_Q, 64, S_KV, D_QK, TOPK)
    args["topk_length"] = torch.tensor([-4, 0, 7, TOPK, TOPK + 9], dtype=torch.int32)
    results = sparse_mla_q8kv8_prefill_fwd(**args)
    [launch] = launches
    assert torch.equal(launch["topk_length"], args["topk_length"])
    assert_matches_reference(results, args | {"topk_length": args["topk_length"].clamp(0, TOPK)})


def test_check_ranges_env_rejects_out_of_range_topk_length_before_launch(make_inputs, no_launch, monkeypatch):
    monkeypatch.setenv(contract.CHECK_RANGES_ENV, "1")
    args = make_inputs(S_Q, 64, S_KV, D_QK, TOPK)
    args["topk_length"] = torch.tensor([0, 1, 2, 3, TOPK + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"topk_length: expected values in \[0, {TOPK}\]"):
        sparse_mla_q8kv8_prefill_fwd(**args)


def test_empty_query_returns_empty_outputs_without_launch(make_inputs, no_launch):
    out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(**make_inputs(0, 48, S_KV, D_QK, TOPK))
    assert (out.shape, max_logits.shape, lse.shape) == ((0, 48, D_V), (0, 48), (0, 48))


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("given_buffers", [False, True])
def test_empty_kv_gives_sentinels_without_launch(make_inputs, no_launch, given_buffers, q_dtype):
    args = make_inputs(S_Q, 48, 0, D_QK, TOPK, with_sink=True, with_topk_length=True, q_dtype=q_dtype)
    buffers = {}
    if given_buffers:
        buffers = {
            "out": torch.full((S_Q, 48, D_V), math.nan, dtype=torch.bfloat16),
            "max_logits": torch.full((S_Q, 48), math.nan),
            "lse": torch.full((S_Q, 48), math.nan),
        }
    out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(**args, **buffers)
    assert torch.equal(out, torch.zeros(S_Q, 48, D_V, dtype=torch.bfloat16))
    assert torch.equal(max_logits, torch.full((S_Q, 48), -math.inf))
    assert torch.equal(lse, torch.full((S_Q, 48), math.inf))
    if given_buffers:
        assert out is buffers["out"] and max_logits is buffers["max_logits"] and lse is buffers["lse"]


def test_the_public_parameters_are_the_call_structures_fields():
    """``sparse_mla_q8kv8_prefill_fwd`` builds its ``PrefillCall`` from its parameters in order: they are the
    structure's fields, with the same defaults."""
    parameters = inspect.signature(sparse_mla_q8kv8_prefill_fwd).parameters
    assert list(parameters) == list(PrefillCall._fields)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == PrefillCall._field_defaults
