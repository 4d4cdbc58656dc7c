"""The input contract on a CPU-only machine: every violation raises its own message, and nothing launches.

Shape and dtype checks run before device checks, so each violation below is built from CPU tensors and
still gets its own error; the device and GPU-generation checks are tested with fake devices and a patched
capability lookup.
"""

import math

import pytest
import torch

from q8kv8 import checks, contract, schedule, sparse_mla_q8kv8_prefill_fwd
from q8kv8.contract import InputTypeError, Problem, check_device, check_inputs
from q8kv8.metadata import PRECISIONS, small_heads
from q8kv8.prefill_call import PrefillCall

S_Q, H_Q, S_KV, D_QK, D_V, TOPK = 4, 16, 32, 576, 512, 128
FP8 = torch.float8_e4m3fn


def fp8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=FP8)


def int32(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int32)


def every_other_in_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``tensor`` whose last dim has stride 2."""
    spread = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    return spread[..., ::2]


def overlapping_float32(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous float32 tensor of ``shape`` over the first bytes of ``tensor``'s memory."""
    size = math.prod(shape)
    return tensor.reshape(-1).view(torch.uint8)[: 4 * size].view(torch.float32).view(shape)


@pytest.fixture
def valid_args(make_valid_args) -> dict:
    """Keyword arguments of a valid call on CPU tensors, with a sink, topk_length and output buffers."""
    return make_valid_args(S_Q, H_Q, S_KV, D_QK, TOPK)


@pytest.fixture
def valid_bf16_q_args(make_valid_args) -> dict:
    """``valid_args`` with a bfloat16 q (``q_scale`` None)."""
    return make_valid_args(S_Q, H_Q, S_KV, D_QK, TOPK, q_dtype=torch.bfloat16)


@pytest.fixture
def tripwire_kernels(fake_kernels):
    """A fake kernels module that fails the test if anything is launched."""

    def launch_sparse_prefill(*args):
        raise AssertionError("the kernel was launched for arguments that break the contract")

    return fake_kernels(launch_sparse_prefill)


def scale_violations(name: str, id_prefix: str = "") -> list:
    """The violations of a one-element float32 scale argument ``name`` (as ``VIOLATIONS``): a float, a
    float64 tensor, a tensor of two elements."""
    case = id_prefix + name.replace("_", "-")
    return [
        (
            f"{case}-float",
            lambda a: {name: 1.0},
            InputTypeError,
            f"{name}: expected a torch.Tensor, got float",
        ),
        (
            f"{case}-dtype",
            lambda a: {name: torch.ones(1, dtype=torch.float64)},
            InputTypeError,
            f"{name}: expected dtype torch.float32, got torch.float64",
        ),
        (
            f"{case}-two-elements",
            lambda a: {name: torch.ones(2)},
            ValueError,
            f"{name}: expected a tensor with exactly one element ({name} must be a scalar tensor), got "
            "shape [2]",
        ),
    ]


def stats_buffer_violations(name: str, wrong_shape: tuple[int, ...], wrong_dtype: torch.dtype) -> list:
    """The violations of an ``[s_q, h_q]`` float32 output buffer ``name`` (as ``VIOLATIONS``): a buffer of
    ``wrong_shape``, one of ``wrong_dtype``, a transposed one."""
    case = name.replace("_", "-")
    return [
        (
            f"{case}-shape",
            lambda a: {name: torch.empty(wrong_shape)},
            ValueError,
            f"{name}: expected shape [s_q, h_q] = [{S_Q}, {H_Q}], got {list(wrong_shape)}",
        ),
        (
            f"{case}-dtype",
            lambda a: {name: torch.empty(S_Q, H_Q, dtype=wrong_dtype)},
            InputTypeError,
            f"{name}: expected dtype torch.float32, got {wrong_dtype}",
        ),
        (
            f"{case}-not-contiguous",
            lambda a: {name: torch.empty(H_Q, S_Q).t()},
            ValueError,
            f"{name}: expected a contiguous tensor",
        ),
    ]


# (test id, changes to the valid arguments: a function of them, expected exception, message fragment)
VIOLATIONS = [
    ("q-not-a-tensor", lambda a: {"q": [[0.0]]}, InputTypeError, "q: expected a torch.Tensor, got list"),
    ("kv-not-a-tensor", lambda a: {"kv": None}, InputTypeError, "kv: expected a torch.Tensor, got NoneType"),
    (
        "indices-not-a-tensor",
        lambda a: {"indices": (1, 2)},
        InputTypeError,
        "indices: expected a torch.Tensor",
    ),
    (
        "q-rank",
        lambda a: {"q": fp8(S_Q, H_Q * D_QK)},
        ValueError,
        "q: expected a 3-D tensor [s_q, h_q, d_qk], got shape [4, 9216]",
    ),
    (
        "kv-rank",
        lambda a: {"kv": fp8(S_KV, D_QK)},
        ValueError,
        "kv: expected a 3-D tensor [s_kv, h_kv, d_qk], got shape [32, 576]",
    ),
    (
        "indices-rank",
        lambda a: {"indices": int32(S_Q, TOPK)},
        ValueError,
        "indices: expected a 3-D tensor [s_q, 1, topk], got shape [4, 128]",
    ),
    (
        "q-dtype",
        lambda a: {"q": a["q"].to(torch.float16)},
        InputTypeError,
        "q: expected dtype torch.float8_e4m3fn or torch.bfloat16, got torch.float16 (q must be "
        "torch.float8_e4m3fn)",
    ),
    (
        "q-dtype-e5m2",
        lambda a: {"q": a["q"].to(torch.float8_e5m2), "q_scale": None},
        InputTypeError,
        "q: expected dtype torch.float8_e4m3fn or torch.bfloat16, got torch.float8_e5m2",
    ),
    (
        "q-bf16-with-q-scale",
        lambda a: {"q": a["q"].to(torch.bfloat16)},
        InputTypeError,
        "q_scale: expected None for a torch.bfloat16 q, got Tensor (q_scale must be None for bfloat16 q: "
        "the kernel scales each row itself)",
    ),
    (
        "q-bf16-with-float-q-scale",
        lambda a: {"q": a["q"].to(torch.bfloat16), "q_scale": 1.0},
        InputTypeError,
        "q_scale: expected None for a torch.bfloat16 q, got float",
    ),
    (
        "q-e4m3-without-q-scale",
        lambda a: {"q_scale": None},
        InputTypeError,
        "q_scale: expected a torch.Tensor, got NoneType (q_scale may be None only for a torch.bfloat16 q; "
        "a torch.float8_e4m3fn q needs its scale)",
    ),
    (
        "kv-dtype",
        lambda a: {"kv": a["kv"].to(torch.float8_e5m2)},
        InputTypeError,
        "kv: expected dtype torch.float8_e4m3fn, got torch.float8_e5m2",
    ),
    (
        "indices-dtype",
        lambda a: {"indices": a["indices"].long()},
        InputTypeError,
        "indices: expected dtype torch.int32, got torch.int64",
    ),
    (
        "q-last-dim-strided",
        lambda a: {"q": every_other_in_last_dim(a["q"])},
        ValueError,
        "q: expected a contiguous last dimension (stride 1), got stride 2",
    ),
    (
        "kv-last-dim-strided",
        lambda a: {"kv": every_other_in_last_dim(a["kv"])},
        ValueError,
        "kv: expected a contiguous last dimension (stride 1), got stride 2",
    ),
    (
        "indices-last-dim-strided",
        lambda a: {"indices": every_other_in_last_dim(a["indices"])},
        ValueError,
        "indices: expected a contiguous last dimension (stride 1), got stride 2",
    ),
    ("no-heads", lambda a: {"q": fp8(S_Q, 0, D_QK)}, ValueError, "q: expected at least 1 head"),
    ("h-kv-2", lambda a: {"kv": fp8(S_KV, 2, D_QK)}, ValueError, "kv: expected h_kv = kv.shape[1] = 1"),
    (
        "d-qk-unsupported",
        lambda a: {"q": fp8(S_Q, H_Q, 256), "kv": fp8(S_KV, 1, 256)},
        ValueError,
        "q: expected d_qk = q.shape[2] in (512, 576), got 256",
    ),
    (
        "kv-d-qk-differs-from-q",
        lambda a: {"kv": fp8(S_KV, 1, 512)},
        ValueError,
        "kv: expected kv.shape[2] = 576 (d_qk of q), got 512",
    ),
    ("d-v-256", lambda a: {"d_v": 256}, ValueError, "d_v: expected the integer 512, got 256"),
    ("d-v-float", lambda a: {"d_v": 512.0}, ValueError, "d_v: expected the integer 512, got 512.0"),
    (
        "indices-rows-differ-from-s-q",
        lambda a: {"indices": int32(S_Q + 1, 1, TOPK)},
        ValueError,
        "indices: expected shape [s_q, 1, topk] with s_q = 4, got [5, 1, 128]",
    ),
    (
        "indices-dim-1-not-1",
        lambda a: {"indices": int32(S_Q, 2, TOPK)},
        ValueError,
        "indices: expected shape [s_q, 1, topk] with s_q = 4, got [4, 2, 128]",
    ),
    (
        "topk-not-multiple-of-128",
        lambda a: {"indices": int32(S_Q, 1, 100)},
        ValueError,
        "a positive multiple of 128, got 100; pad it with q8kv8.pad_topk(indices)",
    ),
    (
        "topk-zero",
        lambda a: {"indices": int32(S_Q, 1, 0)},
        ValueError,
        "a positive multiple of 128, got 0; pad it with q8kv8.pad_topk(indices)",
    ),
    (
        "sm-scale-bool",
        lambda a: {"sm_scale": True},
        InputTypeError,
        "sm_scale: expected a Python real number, got bool",
    ),
    (
        "sm-scale-tensor",
        lambda a: {"sm_scale": torch.tensor(0.1)},
        InputTypeError,
        "sm_scale: expected a Python real number, got Tensor",
    ),
    (
        "sm-scale-str",
        lambda a: {"sm_scale": "0.1"},
        InputTypeError,
        "sm_scale: expected a Python real number, got str",
    ),
    (
        "sm-scale-nan",
        lambda a: {"sm_scale": math.nan},
        ValueError,
        "sm_scale: expected a finite number, got nan",
    ),
    (
        "sm-scale-inf",
        lambda a: {"sm_scale": -math.inf},
        ValueError,
        "sm_scale: expected a finite number, got -inf",
    ),
    *scale_violations("q_scale"),
    (
        "kv-scale-float",
        lambda a: {"kv_scale": 1.0},
        InputTypeError,
        "kv_scale: expected a torch.Tensor, got float",
    ),
    (
        "kv-scale-dtype",
        lambda a: {"kv_scale": torch.ones((), dtype=torch.bfloat16)},
        InputTypeError,
        "kv_scale: expected dtype torch.float32, got torch.bfloat16",
    ),
    (
        "kv-scale-empty",
        lambda a: {"kv_scale": torch.ones(0)},
        ValueError,
        "kv_scale: expected a tensor with exactly one element (kv_scale must be a scalar tensor), got "
        "shape [0]",
    ),
    (
        "precision-unknown",
        lambda a: {"precision": "fast"},
        ValueError,
        f"precision: expected one of {PRECISIONS}, got 'fast'",
    ),
    (
        "sink-not-a-tensor",
        lambda a: {"attn_sink": [0.0] * H_Q},
        InputTypeError,
        "attn_sink: expected a torch.Tensor",
    ),
    (
        "sink-dtype",
        lambda a: {"attn_sink": a["attn_sink"].to(torch.bfloat16)},
        InputTypeError,
        "attn_sink: expected dtype torch.float32, got torch.bfloat16",
    ),
    (
        "sink-shape",
        lambda a: {"attn_sink": torch.zeros(H_Q + 1)},
        ValueError,
        "attn_sink: expected shape [h_q] = [16], got [17]",
    ),
    (
        "topk-length-dtype",
        lambda a: {"topk_length": a["topk_length"].long()},
        InputTypeError,
        "topk_length: expected dtype torch.int32, got torch.int64",
    ),
    (
        "topk-length-shape",
        lambda a: {"topk_length": int32(S_Q, 1)},
        ValueError,
        "topk_length: expected shape [s_q] = [4], got [4, 1]",
    ),
    ("out-not-a-tensor", lambda a: {"out": 0}, InputTypeError, "out: expected a torch.Tensor, got int"),
    (
        "out-shape",
        lambda a: {"out": torch.empty(S_Q, H_Q, D_QK, dtype=torch.bfloat16)},
        ValueError,
        "out: expected shape [s_q, h_q, d_v] = [4, 16, 512], got [4, 16, 576]",
    ),
    (
        "out-dtype",
        lambda a: {"out": torch.empty(S_Q, H_Q, D_V)},
        InputTypeError,
        "out: expected dtype torch.bfloat16, got torch.float32",
    ),
    (
        "out-not-contiguous",
        lambda a: {"out": torch.empty(S_Q, D_V, H_Q, dtype=torch.bfloat16).transpose(1, 2)},
        ValueError,
        "out: expected a contiguous tensor",
    ),
    *stats_buffer_violations("max_logits", (S_Q, H_Q + 1), torch.float64),
    *stats_buffer_violations("lse", (S_Q * H_Q,), torch.bfloat16),
    (
        "lse-is-max-logits",
        lambda a: {"lse": a["max_logits"]},
        ValueError,
        "lse: expected memory of its own, got memory overlapping max_logits",
    ),
    (
        "lse-inside-out",
        lambda a: {"lse": overlapping_float32(a["out"], (S_Q, H_Q))},
        ValueError,
        "lse: expected memory of its own, got memory overlapping out",
    ),
    (
        "max-logits-inside-q",
        lambda a: {"max_logits": overlapping_float32(a["q"], (S_Q, H_Q))},
        ValueError,
        "max_logits: expected memory of its own, got memory overlapping q",
    ),
    (
        "lse-inside-indices",
        lambda a: {"lse": overlapping_float32(a["indices"], (S_Q, H_Q))},
        ValueError,
        "lse: expected memory of its own, got memory overlapping indices",
    ),
    (
        "out-over-kv",
        lambda a: {"kv": a["out"].reshape(-1).view(FP8)[: S_KV * D_QK].view(S_KV, 1, D_QK)},
        ValueError,
        "out: expected memory of its own, got memory overlapping kv",
    ),
    (
        "max-logits-over-kv-scale",
        lambda a: {"kv_scale": a["max_logits"][1, 3:4]},
        ValueError,
        "max_logits: expected memory of its own, got memory overlapping kv_scale",
    ),
    (
        "lse-over-attn-sink",
        lambda a: {"attn_sink": a["lse"][S_Q - 1]},
        ValueError,
        "lse: expected memory of its own, got memory overlapping attn_sink",
    ),
    (
        "max-logits-over-topk-length",
        lambda a: {"topk_length": a["max_logits"][0].view(torch.int32)[:S_Q]},
        ValueError,
        "max_logits: expected memory of its own, got memory overlapping topk_length",
    ),
]


def violation_cases(violations: list):
    """``pytest.mark.parametrize`` of a test's ``changes``, ``exception`` and ``message`` over
    ``violations`` (as ``VIOLATIONS``), with their ids."""
    return pytest.mark.parametrize(
        ("changes", "exception", "message"),
        [case[1:] for case in violations],
        ids=[case[0] for case in violations],
    )


def assert_raises_before_any_launch(valid: dict, changes, exception, message) -> None:
    """The call of the valid arguments ``valid`` with ``changes`` raises ``exception`` (that very type)
    with ``message`` in its text (the kernels are a tripwire)."""
    valid.update(changes(valid))
    with pytest.raises(exception) as error:
        sparse_mla_q8kv8_prefill_fwd(**valid)
    assert type(error.value) is exception and message in str(error.value)


@violation_cases(VIOLATIONS)
def test_violation_raises_before_any_launch(valid_args, tripwire_kernels, changes, exception, message):
    assert_raises_before_any_launch(valid_args, changes, exception, message)


# Violations of calls with a bfloat16 q (``valid_bf16_q_args``), as ``VIOLATIONS``.
BF16_Q_VIOLATIONS = [
    (
        "bf16-q-scale-tensor",
        lambda a: {"q_scale": torch.ones(1)},
        InputTypeError,
        "q_scale: expected None for a torch.bfloat16 q, got Tensor (q_scale must be None for bfloat16 q: "
        "the kernel scales each row itself)",
    ),
    *scale_violations("kv_scale", "bf16-"),
    (
        "bf16-kv-dtype",
        lambda a: {"kv": a["kv"].to(torch.bfloat16)},
        InputTypeError,
        "kv: expected dtype torch.float8_e4m3fn, got torch.bfloat16",
    ),
    (
        "bf16-q-last-dim-strided",
        lambda a: {"q": every_other_in_last_dim(a["q"])},
        ValueError,
        "q: expected a contiguous last dimension (stride 1), got stride 2",
    ),
    (
        "bf16-d-qk-unsupported",
        lambda a: {"q": torch.zeros(S_Q, H_Q, 256, dtype=torch.bfloat16), "kv": fp8(S_KV, 1, 256)},
        ValueError,
        "q: expected d_qk = q.shape[2] in (512, 576), got 256",
    ),
    (
        "bf16-no-heads",
        lambda a: {"q": torch.zeros(S_Q, 0, D_QK, dtype=torch.bfloat16)},
        ValueError,
        "q: expected at least 1 head",
    ),
    (
        "bf16-max-logits-inside-q",
        lambda a: {"max_logits": overlapping_float32(a["q"], (S_Q, H_Q))},
        ValueError,
        "max_logits: expected memory of its own, got memory overlapping q",
    ),
    (
        "bf16-out-is-q-memory",
        lambda a: {"out": a["q"].reshape(-1)[: S_Q * H_Q * D_V].view(S_Q, H_Q, D_V)},
        ValueError,
        "out: expected memory of its own, got memory overlapping q",
    ),
    (
        "bf16-out-dtype",
        lambda a: {"out": torch.empty(S_Q, H_Q, D_V)},
        InputTypeError,
        "out: expected dtype torch.bfloat16, got torch.float32",
    ),
]


@violation_cases(BF16_Q_VIOLATIONS)
def test_bf16_q_violation_raises_before_any_launch(
    valid_bf16_q_args, tripwire_kernels, changes, exception, message
):
    assert_raises_before_any_launch(valid_bf16_q_args, changes, exception, message)


def assert_fails_only_the_device_check(valid: dict) -> None:
    """The call of the valid arguments ``valid``, on CPU tensors, fails the device check alone."""
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu$"):
        sparse_mla_q8kv8_prefill_fwd(**valid)


def checked_with_devices_seen(valid: dict, monkeypatch) -> tuple[Problem, dict]:
    """``check_inputs``'s problem for the call of ``valid`` and the devices it handed the device check, by
    tensor name."""
    seen = {}
    monkeypatch.setattr(contract, "check_device", seen.update)
    return check_inputs(PrefillCall(**valid)), seen


def test_bf16_q_without_q_scale_fails_only_the_device_check(valid_bf16_q_args, tripwire_kernels):
    assert_fails_only_the_device_check(valid_bf16_q_args)


def test_bf16_q_hands_every_tensor_but_the_absent_q_scale_to_the_device_check(valid_bf16_q_args, monkeypatch):
    problem, seen = checked_with_devices_seen(valid_bf16_q_args, monkeypatch)
    assert problem == Problem(S_Q, H_Q, S_KV, D_QK, D_V, TOPK, torch.device("cpu"), launch_ready=True)
    assert list(seen) == [
        "q", "kv", "indices", "kv_scale", "attn_sink", "topk_length", "out", "max_logits", "lse",
    ]  # fmt: skip


def test_the_q_dtype_is_part_of_the_memoised_signature(valid_args, monkeypatch):
    """A valid e4m3 call's verdict is never given to a bfloat16 q of the same shape at the same address (nor
    the reverse): the dtype is in the signature, and the q_scale rule is checked again."""
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    monkeypatch.setattr(contract, "_memo", {})
    storage = torch.zeros(S_Q * H_Q * D_QK * 2, dtype=torch.uint8)
    q8 = storage[: S_Q * H_Q * D_QK].view(FP8).view(S_Q, H_Q, D_QK)
    q16 = storage.view(torch.bfloat16).view(S_Q, H_Q, D_QK)
    assert q8.data_ptr() == q16.data_ptr()
    check_inputs(PrefillCall(**valid_args | {"q": q8}))
    with pytest.raises(InputTypeError, match="q_scale: expected None for a torch.bfloat16 q"):
        check_inputs(PrefillCall(**valid_args | {"q": q16}))
    check_inputs(PrefillCall(**valid_args | {"q": q16, "q_scale": None}))
    with pytest.raises(InputTypeError, match="q_scale: expected a torch.Tensor, got NoneType"):
        check_inputs(PrefillCall(**valid_args | {"q": q8, "q_scale": None}))


@pytest.mark.parametrize("caught", [TypeError, ValueError])
def test_type_and_dtype_errors_are_caught_as_type_and_value_errors(valid_args, tripwire_kernels, caught):
    """Code written for SGLang's function (ValueError for a wrong dtype) and code written for Python's
    convention (TypeError) both catch them."""
    for changes in (
        {"q": valid_args["q"].float()},
        {"kv_scale": valid_args["kv_scale"].half()},
        {"q_scale": 1.0},
    ):
        with pytest.raises(caught, match="expected"):
            sparse_mla_q8kv8_prefill_fwd(**{**valid_args, **changes})


def test_valid_cpu_inputs_fail_only_the_device_check(valid_args, tripwire_kernels):
    assert_fails_only_the_device_check(valid_args)


def test_check_inputs_hands_every_tensor_to_the_device_check(valid_args, monkeypatch):
    problem, seen = checked_with_devices_seen(valid_args, monkeypatch)
    assert problem == Problem(
        s_q=S_Q,
        h_q=H_Q,
        s_kv=S_KV,
        d_qk=D_QK,
        d_v=D_V,
        topk=TOPK,
        device=torch.device("cpu"),
        launch_ready=True,
    )
    assert list(seen) == [
        "q",
        "kv",
        "indices",
        "q_scale",
        "kv_scale",
        "attn_sink",
        "topk_length",
        "out",
        "max_logits",
        "lse",
    ]
    assert all(device == torch.device("cpu") for device in seen.values())


@pytest.mark.parametrize(("s_q", "s_kv"), [(0, S_KV), (S_Q, 0), (0, 0)])
def test_empty_query_or_kv_is_valid(make_inputs, monkeypatch, s_q, s_kv):
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    args = make_inputs(s_q, H_Q, s_kv, 512, 256, with_sink=True, with_topk_length=True)
    problem = check_inputs(PrefillCall(**args, out=None, max_logits=None, lse=None, precision="accurate"))
    assert (problem.s_q, problem.s_kv, problem.d_qk, problem.topk) == (s_q, s_kv, 512, 256)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(contract, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(contract, "_device_name", lambda device: "NVIDIA H200")


def cuda_devices(**overrides: str) -> dict:
    devices = dict.fromkeys(["q", "kv", "indices", "q_scale", "kv_scale", "out"], "cuda:0") | overrides
    return {name: torch.device(device) for name, device in devices.items()}


def test_one_sm90_device_passes(sm90):
    assert check_device(cuda_devices()) is None


def test_tensor_on_another_gpu_is_rejected(sm90):
    with pytest.raises(
        ValueError, match=r"^kv_scale: expected a tensor on cuda:0 \(the device of q\), got device cuda:1$"
    ):
        check_device(cuda_devices(kv_scale="cuda:1"))


def test_cpu_tensor_among_gpu_tensors_is_rejected(sm90):
    with pytest.raises(ValueError, match="^out: expected a CUDA tensor, got device cpu$"):
        check_device(cuda_devices(out="cpu"))


@pytest.mark.parametrize(
    ("capability", "name"), [((8, 0), "NVIDIA A100-SXM4-80GB"), ((10, 0), "NVIDIA B200")]
)
def test_non_sm90_gpu_is_rejected(monkeypatch, capability, name):
    monkeypatch.setattr(contract, "_device_capability", lambda device: capability)
    monkeypatch.setattr(contract, "_device_name", lambda device: name)
    with pytest.raises(ValueError) as error:
        check_device(cuda_devices())
    message = str(error.value)
    assert message.startswith("q: expected a GPU of compute capability 9.0")
    assert f"got {name} on cuda:0 with compute capability {capability[0]}.{capability[1]}" in message


def test_overlap_is_judged_by_byte_ranges():
    buffer = torch.zeros(64)
    first, second = buffer[:32], buffer[32:]
    assert not checks.overlaps(first, second)
    assert not checks.overlaps(second, first)
    assert checks.overlaps(buffer[:33], second)
    assert checks.overlaps(buffer[::2], buffer[1::2])  # interleaved views: conservatively overlapping
    assert checks.overlaps(buffer.view(torch.int32)[10:11], buffer[10:12])
    assert not checks.overlaps(buffer[:0], buffer)
    assert not checks.overlaps(torch.zeros(4), torch.zeros(4))


def test_check_ranges_is_enabled_only_by_env_value_1(monkeypatch):
    monkeypatch.delenv(contract.CHECK_RANGES_ENV, raising=False)
    assert not contract.check_ranges_enabled()
    monkeypatch.setenv(contract.CHECK_RANGES_ENV, "0")
    assert not contract.check_ranges_enabled()
    monkeypatch.setenv(contract.CHECK_RANGES_ENV, "1")
    assert contract.check_ranges_enabled()


def test_topk_length_in_range_passes():
    contract.check_topk_length_range(None, TOPK)
    contract.check_topk_length_range(torch.zeros(0, dtype=torch.int32), TOPK)
    contract.check_topk_length_range(torch.tensor([0, 5, TOPK], dtype=torch.int32), TOPK)


@pytest.mark.parametrize(("values", "low", "high"), [([0, -1, 3], -1, 3), ([TOPK + 1, 2], 2, TOPK + 1)])
def test_topk_length_out_of_range_raises(values, low, high):
    with pytest.raises(
        ValueError,
        match=rf"^topk_length: expected values in \[0, {TOPK}\] \(0 <= topk_length <= topk\), got values "
        rf"from {low} to {high}",
    ):
        contract.check_topk_length_range(torch.tensor(values, dtype=torch.int32), TOPK)


@pytest.mark.parametrize(
    "s_q, h_q, topk, with_topk_length, precision, expected",
    [
        (4096, 64, 512, False, "default", 4),
        (4096, 64, 2048, True, "default", 4),
        (4096, 64, 2048, False, "default", 0),
        (4096, 64, 512, False, "accurate", 4),
        (4096, 64, 2048, False, "accurate", 0),
        (1100, 48, 512, False, "default", 2),  # 48 heads: one tile of 64 rows a token
        (4096, 16, 512, False, "default", 8),  # the small-head kernel: 8 tokens per CTA
        (100, 16, 2048, False, "default", 1),  # and one for a short grid
        (1024, 64, 512, False, "default", 0),
    ],
)
def test_problem_carries_the_schedule_for_cuda_devices(
    make_inputs, monkeypatch, s_q, h_q, topk, with_topk_length, precision, expected
):
    """The verdict includes the kernel schedule (``q8kv8.schedule.tiles_per_cta``) for a CUDA ``q``: the
    signatures stand in for CUDA tensors, the SM count for an H100/H200's 132."""
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    args = make_inputs(s_q, h_q, 300, 576, topk, with_topk_length=with_topk_length)
    signatures = {
        name: None if value is None else checks.signature(value)
        for name, value in args.items()
        if name not in ("sm_scale", "d_v")
    }
    cuda = torch.device("cuda", 0)
    signatures = {
        name: None if sig is None else (*sig[: checks.DEVICE], cuda, *sig[checks.DEVICE + 1 :])
        for name, sig in signatures.items()
    }
    problem = contract.check_signatures(
        PrefillCall(**signatures, sm_scale=args["sm_scale"], d_v=args["d_v"], precision=precision)
    )
    assert problem.tiles_per_cta == expected


@pytest.mark.parametrize("h_q", [8, 16, 32])
def test_small_heads_run_the_persistent_small_head_kernel(monkeypatch, h_q):
    """8, 16 or 32 heads: the persistent small-head kernel, never split, with the tokens per CTA (up to 8)
    that leave an SM the fewest tokens in a row, the most of those on a tie; unless the split rule splits a
    grid of one tile a token in 4 parts or more: then split tiles of 64 heads. Other head counts below 64
    follow the rules of 64."""
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    assert schedule.SMALL_HEAD_MAX_TILES_PER_CTA == 8 and schedule.SMALL_HEAD_SPLIT_MIN_PARTS == 4
    # 4096 tokens: 32 in a row with 1, 2, 4 or 8 per CTA, 35 with 7 (5 waves of 586 CTAs); 200: 2 with 1 or 2;
    # 8 tokens at topk 512 and 27 at 2048: split in 2 at most with tiles of 64 heads.
    cases = ((4096, 512, 8), (8, 512, 1), (27, 2048, 1), (1, 256, 1), (200, 2048, 2), (10**6, 2048, 8))
    for s_q, topk, tiles in cases:
        assert schedule.choose(s_q, h_q, topk, False, 0) == (tiles, 1, 0)
        expected = "small heads, 1 token per CTA" if tiles == 1 else f"small heads, {tiles} tokens per CTA"
        assert schedule.describe(s_q, h_q, topk) == expected
    for s_q, topk, parts in ((8, 2048, 8), (12, 2048, 8), (13, 2048, 4), (26, 1024, 4), (1, 1024, 4)):
        assert schedule.choose(s_q, h_q, topk, False, 0) == (0, parts, 0)
        assert schedule.describe(s_q, h_q, topk) == f"split in {parts}"
    assert schedule.choose(4096, 64, 512, False, 0) == (4, 1, 0)
    assert schedule.choose(8, 64, 2048, False, 0) == (0, 8, 0)
    assert schedule.choose(8, h_q + 4, 2048, False, 0) == (0, 8, 0)
    assert small_heads(h_q) and not small_heads(h_q + 4) and not small_heads(64)


def offset_by(tensor: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A contiguous copy of ``tensor`` whose data starts ``offset_bytes`` into a fresh allocation."""
    raw = torch.zeros(tensor.numel() * tensor.element_size() + offset_bytes, dtype=torch.uint8)
    moved = raw[offset_bytes:].view(tensor.dtype).view(tensor.shape)
    moved.view(torch.uint8).copy_(tensor.view(torch.uint8))
    return moved


@pytest.mark.parametrize(
    "change",
    [
        None,
        "q misaligned",
        "q strided",
        "kv misaligned",
        "kv row stride",
        "out misaligned",
        "topk_length strided",
        "attn_sink strided",
    ],
)
def test_problem_says_whether_the_launch_may_skip_its_layout_checks(
    valid_args, monkeypatch, randn_fp8, change
):
    """``Problem.launch_ready``: True only when q is row-major and 16-byte aligned, kv's base and row
    stride are multiples of 16 bytes, out is 4-byte aligned and topk_length / attn_sink are contiguous."""
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    args = dict(valid_args)
    if change == "q misaligned":
        args["q"] = offset_by(args["q"], 1)
    elif change == "q strided":
        args["q"] = args["q"].transpose(0, 1).contiguous().transpose(0, 1)
    elif change == "kv misaligned":
        args["kv"] = offset_by(args["kv"], 8)
    elif change == "kv row stride":
        args["kv"] = torch.cat([args["kv"], randn_fp8(S_KV, 1, 8)], dim=2)[:, :, :D_QK]  # 584 bytes
    elif change == "out misaligned":
        args["out"] = offset_by(args["out"], 2)
    elif change == "topk_length strided":
        args["topk_length"] = every_other_in_last_dim(args["topk_length"][None])[0]
    elif change == "attn_sink strided":
        args["attn_sink"] = every_other_in_last_dim(args["attn_sink"][None])[0]
    assert check_inputs(PrefillCall(**args)).launch_ready == (change is None)


@pytest.mark.parametrize("change", [None, "q misaligned", "q 2 bytes off", "q strided"])
def test_problem_says_whether_a_bf16_q_meets_the_launchs_layout(valid_bf16_q_args, monkeypatch, change):
    """A bfloat16 q is launched in place only when it is row-major with a 16-byte aligned base."""
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    args = dict(valid_bf16_q_args)
    if change == "q misaligned":
        args["q"] = offset_by(args["q"], 8)
    elif change == "q 2 bytes off":
        args["q"] = offset_by(args["q"], 2)
    elif change == "q strided":
        args["q"] = args["q"].transpose(0, 1).contiguous().transpose(0, 1)
    assert check_inputs(PrefillCall(**args)).launch_ready == (change is None)
