"""The contract's memo of valid calls (CPU): a repeated call skips the checks, anything the checks read
that changes (even in place, on the same tensor objects) is checked again, and errors are never memoised.

The device check is replaced by a recorder: on CPU tensors the real one rejects every call.
"""

import math
import re

import pytest
import torch

from q8kv8 import checks, contract
from q8kv8.contract import check_inputs
from q8kv8.metadata import PRECISIONS
from q8kv8.prefill_call import PrefillCall

S_Q, H_Q, S_KV, D_QK, D_V, TOPK = 4, 16, 32, 576, 512, 128


@pytest.fixture
def device_checks(monkeypatch) -> list:
    """Accept CPU tensors; returns the list of device checks run (one per call that ran the checks)."""
    calls = []
    monkeypatch.setattr(contract, "check_device", calls.append)
    monkeypatch.setattr(contract, "_memo", {})
    return calls


@pytest.fixture
def args(make_valid_args) -> dict:
    return make_valid_args(S_Q, H_Q, S_KV, D_QK, TOPK)


def test_repeated_call_is_answered_from_the_memo(args, device_checks):
    first = check_inputs(PrefillCall(**args))
    second = check_inputs(PrefillCall(**args))
    assert first == second and (first.s_q, first.h_q, first.topk) == (S_Q, H_Q, TOPK)
    assert len(device_checks) == 1
    check_inputs(PrefillCall(**args | {"out": None, "max_logits": None, "lse": None}))
    assert len(device_checks) == 2  # another signature: checked


def test_equal_metadata_on_new_tensors_is_checked_again(args, device_checks):
    check_inputs(PrefillCall(**args))
    check_inputs(PrefillCall(**args | {"out": torch.empty_like(args["out"])}))  # same shape, another address
    assert len(device_checks) == 2


def test_in_place_change_to_an_overlapping_buffer_is_caught(args, device_checks):
    check_inputs(PrefillCall(**args))
    args["lse"].set_(args["max_logits"].untyped_storage(), 0, (S_Q, H_Q), (H_Q, 1))  # same object
    with pytest.raises(
        ValueError, match="^lse: expected memory of its own, got memory overlapping max_logits$"
    ):
        check_inputs(PrefillCall(**args))


def test_in_place_change_to_a_strided_buffer_is_caught(args, device_checks):
    check_inputs(PrefillCall(**args))
    args["out"].as_strided_((S_Q, H_Q, D_V), (H_Q * D_V, 1, H_Q))  # same storage, transposed strides
    with pytest.raises(ValueError, match="^out: expected a contiguous tensor"):
        check_inputs(PrefillCall(**args))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sm_scale": True}, "sm_scale: expected a Python real number, got bool"),  # == 1 and 1.0
        ({"sm_scale": math.inf}, "sm_scale: expected a finite number, got inf"),
        ({"d_v": 512.0}, "d_v: expected the integer 512, got 512.0"),  # == 512
        ({"precision": "fast"}, "precision: expected one of"),
    ],
)
def test_scalars_are_part_of_the_signature(args, device_checks, changes, message):
    check_inputs(PrefillCall(**args | {"sm_scale": 1}))
    check_inputs(PrefillCall(**args | {"sm_scale": 1.0}))
    assert len(device_checks) == 2  # 1 and 1.0 are separate signatures
    with pytest.raises((TypeError, ValueError), match=message):
        check_inputs(PrefillCall(**args | changes))


def test_errors_are_never_memoised(args, device_checks):
    bad = args | {"indices": args["indices"][:, :, :100]}
    for _ in range(2):
        with pytest.raises(ValueError, match="a positive multiple of 128, got 100"):
            check_inputs(PrefillCall(**bad))
    assert contract._memo == {}


def test_a_replaced_device_check_is_not_answered_from_the_memo(args, monkeypatch):
    monkeypatch.setattr(contract, "_memo", {})
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    check_inputs(PrefillCall(**args))
    monkeypatch.undo()  # the real device check again, which rejects CPU tensors
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu$"):
        check_inputs(PrefillCall(**args))


def test_unhashable_arguments_are_checked_without_the_memo(args, device_checks):
    with pytest.raises(ValueError, match=re.escape(f"precision: expected one of {PRECISIONS}, got ['x']")):
        check_inputs(PrefillCall(**args | {"precision": ["x"]}))
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        check_inputs(PrefillCall(**args | {"q": [[0.0]]}))
    assert contract._memo == {}


def test_the_memo_is_bounded(args, device_checks, monkeypatch):
    monkeypatch.setattr(contract, "_MEMO_ENTRIES", 3)
    monkeypatch.setattr(contract, "_MEMO_ENTRIES_PER_Q", 2)
    alive = []  # so that every call's tensors have addresses of their own
    for _ in range(7):  # new q tensors: new first-level keys
        alive.append(args["q"].clone())
        check_inputs(PrefillCall(**args | {"q": alive[-1]}))
        assert 1 <= len(contract._memo) <= 3
    for _ in range(5):  # one q, new buffers: entries under one key
        alive.append(torch.empty_like(args["out"]))
        check_inputs(PrefillCall(**args | {"out": alive[-1]}))
        assert len(contract._memo[args["q"].data_ptr()]) <= 2
    assert len(device_checks) == 12


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(4, 16, 8),
        lambda: torch.empty(1, 16, 8).as_strided((1, 16, 8), (7, 8, 1)),  # size-1 dim, any stride
        lambda: torch.empty(16, 1, 8).as_strided((16, 1, 8), (8, 3, 1)),
        lambda: torch.empty(4, 8, 16).transpose(1, 2),
        lambda: torch.empty(4, 16, 16)[:, :, :8],
        lambda: torch.empty(0, 16, 8).as_strided((0, 16, 8), (1, 1, 2)),  # empty: contiguous
        lambda: torch.empty(()),
        lambda: torch.empty(8).expand(4, 8),
    ],
)
def test_signature_contiguity_and_span_match_torch(make):
    tensor = make()
    signature = checks.signature(tensor)
    assert checks.is_contiguous(signature[checks.SHAPE], signature[checks.STRIDES]) == (
        tensor.is_contiguous()
    )
    span = checks.span(signature)
    if tensor.numel() == 0:
        assert span is None
    else:
        offsets = torch.as_strided(torch.arange(10**4), tensor.shape, tensor.stride()).reshape(-1)
        start = tensor.data_ptr()
        assert span == (start, start + (int(offsets.max()) + 1) * tensor.element_size())
        if tensor.is_contiguous():
            assert span == (start, start + tensor.nbytes)


def test_a_tensor_scalar_is_never_compared_with_memoised_values(args, device_checks):
    check_inputs(PrefillCall(**args))  # memoised, with a float sm_scale
    for sm_scale in (torch.tensor(0.1), torch.tensor([0.1, 0.2])):  # == with a float: a tensor, or an error
        with pytest.raises(TypeError, match="^sm_scale: expected a Python real number, got Tensor$"):
            check_inputs(PrefillCall(**args | {"sm_scale": sm_scale}))
