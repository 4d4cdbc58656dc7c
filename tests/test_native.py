"""The C++ fast path (``q8kv8.native``, ``csrc/native.cc``) on a CPU-only machine: built for real, run on CPU
tensors.

A CPU "device" is registered in place of a GPU and the kernel variants are recording TVM-FFI functions, so
every check of the extension runs here. Its verdicts are compared with the Python contract's: the fast path
must launch exactly what the Python path launches (same variant, same arguments, same schedule) for the
calls it takes, and decline (launch nothing, raise nothing) every call the contract rejects and every call
that needs the Python path (padding, copies, empty extents, unregistered devices and variants, tensors and
scalars it does not read with certainty).
"""

import itertools
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paged_cache import empty_cache  # noqa: E402
from test_contract import (  # noqa: E402
    BF16_Q_VIOLATIONS,
    VIOLATIONS,
    every_other_in_last_dim,
    offset_by,
    violation_cases,
)

from q8kv8 import (  # noqa: E402
    contract,
    eager,
    kernels,
    native,
    paged,
    schedule,
    sparse_mla_q8kv8_paged_fwd,
    sparse_mla_q8kv8_prefill_fwd,
)
from q8kv8.metadata import (  # noqa: E402
    D_V,
    HEAD_ALIGNMENT,
    LOGITS_IN_FLOAT32,
    PRECISIONS,
    SMALL_HEAD_COUNTS,
    SUPPORTED_D_QK,
)
from q8kv8.prefill_call import PagedCall, PrefillCall  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler"
)

S_Q, H_Q, S_KV, D_QK, TOPK = 4, 64, 32, 576, 128
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CPU = torch.device("cpu")
SM_COUNT = 2  # a small stand-in multiprocessor count, so that small calls reach the persistent schedule
DECLINED = -1


@pytest.fixture
def fast(monkeypatch):
    """The built extension, configured, with the CPU registered (as a GPU of ``SM_COUNT`` SMs) and recording
    kernel variants loaded for every (d_qk, precision, schedule kind) and q dtype (e4m3, bfloat16);
    ``fast.calls`` lists ``(variant key, arguments)`` of each launch, from either path. Restored to nothing
    registered afterwards."""
    import tvm_ffi

    extension = native.load()
    assert extension is not None, "the C++ fast path did not build (see the warning)"
    native.disable()
    calls = []

    def recorder(key):
        # The tensors are views valid during the call only: recorded as (address, shape, strides, dtype).
        return tvm_ffi.convert(lambda *args: calls.append((key, normalized(args))))

    variants = {}  # kernels' table: VariantKey -> a recording variant

    def add(key: kernels.VariantKey, recorded_key: tuple) -> None:
        variants[key] = types.SimpleNamespace(function=recorder(recorded_key), name="recorder", d_qk=key.d_qk)

    for d_qk in SUPPORTED_D_QK:
        for precision in PRECISIONS:
            for heads, q_dtype in itertools.product(SMALL_HEAD_COUNTS, (FP8, BF16)):
                key = kernels.VariantKey(d_qk, precision, schedule.PERSISTENT, q_dtype, heads)
                add(key, (d_qk, precision, heads, str(q_dtype)))
            for q_dtype in (FP8, BF16):
                add(
                    kernels.VariantKey(d_qk, precision, schedule.SPLIT, q_dtype),
                    (d_qk, precision, "split", str(q_dtype)),
                )
            for persistent in (False, True):
                kind = schedule.PERSISTENT if persistent else schedule.ONE_TILE
                add(kernels.VariantKey(d_qk, precision, kind), (d_qk, precision, persistent))
                add(kernels.VariantKey(d_qk, precision, kind, BF16), (d_qk, precision, persistent, "bf16 q"))
    for (layout, d_qk), precision, q_dtype in itertools.product(
        kernels.CACHE_LAYOUTS.items(), PRECISIONS, (FP8, BF16)
    ):
        for kind in (schedule.ONE_TILE, schedule.PERSISTENT, schedule.SPLIT):
            key = kernels.VariantKey(d_qk, precision, kind, q_dtype, HEAD_ALIGNMENT, layout)
            add(key, (layout, precision, kind, str(q_dtype)))
        for heads in SMALL_HEAD_COUNTS:
            key = kernels.VariantKey(d_qk, precision, schedule.PERSISTENT, q_dtype, heads, layout)
            add(key, (layout, precision, heads, str(q_dtype)))
    monkeypatch.setattr(kernels, "_variants", variants)
    native.register_device(CPU, SM_COUNT)
    monkeypatch.setattr(schedule, "_sm_counts", {0: SM_COUNT, None: SM_COUNT, -1: SM_COUNT})
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)  # CPU tensors pass it
    monkeypatch.setattr(contract, "_memo", {})
    yield types.SimpleNamespace(extension=extension, calls=calls, variants=variants)
    native.disable()


@pytest.fixture
def valid_args(make_valid_args) -> dict:
    """A valid call on CPU tensors that the fast path takes: 64 heads, sink, topk_length, buffers."""
    return make_valid_args(S_Q, H_Q, S_KV, D_QK, TOPK)


@pytest.fixture
def valid_bf16_q_args(make_valid_args) -> dict:
    """``valid_args`` with a bfloat16 q and no q_scale."""
    return make_valid_args(S_Q, H_Q, S_KV, D_QK, TOPK, q_dtype=BF16)


def normalized(arguments: tuple) -> list:
    """Launch arguments with each TVM-FFI tensor as (address, shape, strides, dtype), for comparison."""
    result = []
    for value in arguments:
        if isinstance(value, (int, float, str)):
            result.append(value)
        else:  # a tvm_ffi.Tensor (read its fields: it is a view of the caller's DLTensor)
            result.append((value.data_ptr(), tuple(value.shape), tuple(value.strides), str(value.dtype)))
    return result


def python_path_launches(fast, args: dict):
    """What the Python path launches for ``args``: its schedule ``(tiles per CTA, splits, split_from)`` and
    its ``(variant key, arguments)`` launches (two for a split tail)."""
    problem = contract.check_inputs(PrefillCall(**args))
    assert problem.launch_ready
    # The schedule the contract gives a CUDA device (for CPU tensors it says 0), on the stand-in SM count.
    chosen = schedule.choose(problem.s_q, problem.h_q, problem.topk, args["topk_length"] is not None, 0)
    kernels.launch_sparse_prefill(
        args["q"], args["kv"], args["indices"], args["topk_length"], args["attn_sink"], args["q_scale"],
        args["kv_scale"], float(args["sm_scale"]), args["out"], args["max_logits"], args["lse"],
        args["precision"], chosen.tiles_per_cta, True, chosen.splits, chosen.split_from,
    )  # fmt: skip
    launches = list(fast.calls)
    fast.calls.clear()
    return tuple(chosen), launches


@pytest.mark.parametrize("q_dtype", [FP8, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    ("s_q", "h_q", "topk", "with_sink", "with_topk_length"),
    [
        (4, 64, 128, False, False),
        (3, 128, 256, True, False),
        (2, 64, 2048, False, True),
        (16, 64, 512, True, True),  # 16 tiles on 2 stand-in SMs: the persistent schedule (2 tiles per CTA)
        (40, 128, 2048, False, True),  # 80 tiles: 4 per CTA
        (40, 128, 2048, True, False),  # full rows: the one-tile kernel
        (1, 64, 2048, True, True),  # 1 tile on 2 stand-in SMs: split in 2, merged in the cluster
        (1, 64, 512, False, False),
        (5, 48, 256, True, True),  # a token's heads in one partly filled tile
        (20, 48, 512, True, True),  # 20 tiles: 2 per CTA
        (3, 96, 512, True, False),  # two tiles a token, the second partly filled
        (6, 16, 512, True, True),  # the small-head kernel: 3 tokens per CTA on 2 stand-in SMs
        (40, 8, 2048, False, True),  # 8 tokens per CTA
        (1, 32, 2048, True, False),  # one token: never split
        (3, 64, 2048, True, True),  # 3 tiles on 2 stand-in SMs: the last token a split tail in 2
        (7, 48, 1024, False, False),  # the same, from the split tail's smallest topk
        (3, 64, 512, False, False),  # below it: one tile per CTA
    ],
)
def test_launches_what_the_python_path_launches(
    fast, make_valid_args, q_dtype, d_qk, precision, s_q, h_q, topk, with_sink, with_topk_length
):
    """Same variant, schedule and arguments (for a bfloat16 q: the bfloat16-q variant, with kv_scale in
    q_scale's place and, without topk_length, kv_scale's bytes as its placeholder; a split schedule: the
    split variant, with the part count as its schedule count; a split tail: the one-tile variant on the tokens
    before split_from, then the split variant on the others)."""
    args = make_valid_args(
        s_q, h_q, S_KV, d_qk, topk, with_sink=with_sink, with_topk_length=with_topk_length, q_dtype=q_dtype
    )
    args["precision"] = precision
    expected_schedule, expected_launches = python_path_launches(fast, args)
    tiles, splits, split_from = expected_schedule
    small = h_q in SMALL_HEAD_COUNTS
    assert (splits > 1) == (not small and (s_q == 1 or (s_q % 2 == 1 and topk >= 1024)))
    assert (split_from > 0) == (splits > 1 and s_q > 1)
    token_ranges = [(0, split_from), (split_from, s_q)] if split_from else [(0, s_q)]
    assert len(expected_launches) == len(token_ranges)
    for (key, arguments), (first, end) in zip(expected_launches, token_ranges, strict=True):
        split = splits > 1 and first == split_from
        assert arguments[-2] == (splits if split else max(tiles, 1))
        assert arguments[-1] == 0  # extra_from: not read on kv rows
        assert (key[2] == "split") == split
        assert arguments[0][1][0] == end - first  # the launch's tokens
        if small:  # the small-head variant of the q dtype; with a sink, S summed in float32
            launched = LOGITS_IN_FLOAT32[precision] if with_sink else precision
            assert key == (d_qk, launched, h_q, str(q_dtype)) and tiles >= 1
        else:
            assert split or (len(key) == 4) == (q_dtype == BF16)  # the bfloat16-q variant
        if q_dtype == BF16:
            kv_scale = (args["kv_scale"].data_ptr(), (1,), (1,))
            assert arguments[5][:3] == kv_scale  # in q_scale's place
            assert with_topk_length or arguments[3][:3] == kv_scale  # as int32: the placeholder
    call = PrefillCall(**args)
    assert fast.extension.plan(call) == expected_schedule
    assert fast.extension.decline_reason(call) == ""
    buffers = args["out"], args["max_logits"], args["lse"]
    returned = fast.extension.launch(call)
    assert all(a is b for a, b in zip(returned, buffers, strict=True))
    assert fast.calls == expected_launches
    fast.calls.clear()
    # Allocating: the same launches on three new outputs, which the extension returns.
    allocating = call._replace(out=None, max_logits=None, lse=None)
    assert fast.extension.plan(allocating) == expected_schedule
    out, max_logits, lse = fast.extension.launch(allocating)
    assert (out.shape, out.dtype, max_logits.shape, max_logits.dtype, lse.shape, lse.dtype) == (
        (s_q, h_q, D_V), torch.bfloat16, (s_q, h_q), torch.float32, (s_q, h_q), torch.float32,
    )  # fmt: skip
    assert len(fast.calls) == len(expected_launches)
    for (key, arguments), (expected_key, expected_arguments), (first, end) in zip(
        fast.calls, expected_launches, token_ranges, strict=True
    ):
        new_outputs = [
            (t[first:end].data_ptr(), (end - first, *t.shape[1:]), t.stride()) for t in (out, max_logits, lse)
        ]
        assert (key, arguments[:7], [a[:3] for a in arguments[7:10]], arguments[10:]) == (
            expected_key, expected_arguments[:7], new_outputs, expected_arguments[10:],
        )  # fmt: skip
        assert [a[3] for a in arguments[7:10]] == [a[3] for a in expected_arguments[7:10]]  # dtypes


PAGES, PAGE_SIZE = 4, 64


def paged_call(
    layout, s_q, h_q, topk, q_dtype, with_sink, with_topk_length, generator, **changes
) -> PagedCall:
    """A valid ``sparse_mla_q8kv8_paged_fwd`` call on CPU tensors (but for the device check), with buffers."""
    d_qk = kernels.CACHE_LAYOUTS[layout]
    q = torch.randn(s_q, h_q, d_qk, generator=generator).to(q_dtype)
    slots = PAGES * PAGE_SIZE
    call = PagedCall(
        q,
        empty_cache(layout, PAGES, PAGE_SIZE),
        torch.randint(-2, slots + 2, (s_q, 1, topk), generator=generator, dtype=torch.int32),
        0.07,
        torch.tensor([0.75]) if q_dtype == FP8 else None,
        D_V,
        torch.randn(h_q, generator=generator) if with_sink else None,
        torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
        if with_topk_length
        else None,
        torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16),
        torch.empty(s_q, h_q),
        torch.empty(s_q, h_q),
    )
    return call._replace(**changes)


def without_extra_address(launches: list) -> list:
    """Recorded launches with the extra cache's address left out (a view of no pages, never read: the Python
    path's reaches TVM-FFI as a null pointer, the extension's as the cache's)."""
    return [(key, [*arguments[:10], arguments[10][1:], *arguments[11:]]) for key, arguments in launches]


@pytest.mark.parametrize("q_dtype", [FP8, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("layout", sorted(kernels.CACHE_LAYOUTS))
@pytest.mark.parametrize(
    ("s_q", "h_q", "topk", "with_sink", "with_topk_length", "precision"),
    [
        (4, 64, 128, False, False, "default"),
        (3, 128, 256, True, False, "accurate_out"),
        (16, 64, 512, True, True, "accurate_logits"),  # the persistent schedule
        (1, 64, 2048, True, True, "default"),  # split in 2, merged in the cluster
        (3, 64, 2048, False, True, "accurate"),  # a split tail
        (5, 48, 256, True, True, "default"),  # a token's heads in one partly filled tile
        (6, 16, 512, False, True, "default"),  # the small-head kernel
    ],
)
def test_paged_calls_launch_what_the_python_path_launches(
    fast, monkeypatch, generator, layout, q_dtype, s_q, h_q, topk, with_sink, with_topk_length, precision
):
    """A paged call: the same variant, schedule and arguments as the Python path's (``eager.run_paged``): the
    cache as ``[num_pages, page_size, bytes per token]`` uint8, the extra cache that view of no pages, the
    constant 1.0 as kv_scale (and, for a bfloat16 q, in q_scale's place)."""
    checked = paged.check_paged_inputs

    def on_a_gpu(call):  # the schedule the contract gives a CUDA device (for CPU tensors it says 0)
        problem, layout, view = checked(call)
        chosen = schedule.choose(problem.s_q, problem.h_q, problem.topk, call.topk_length is not None, 0)
        return problem._replace(tiles_per_cta=chosen[0], splits=chosen[1], split_from=chosen[2]), layout, view

    monkeypatch.setattr(paged, "check_paged_inputs", on_a_gpu)
    call = paged_call(
        layout, s_q, h_q, topk, q_dtype, with_sink, with_topk_length, generator, precision=precision
    )
    with native.suspended():
        eager.run_paged(call)  # the Python path, recorded
    expected = list(fast.calls)
    fast.calls.clear()
    assert expected and all(key[0] == layout for key, _ in expected)
    unit = paged.unit_kv_scale(CPU)
    cache_view = expected[0][1][1]
    assert cache_view[0] == call.cache.data_ptr() and cache_view[3] == "uint8" and len(cache_view[1]) == 3
    assert expected[0][1][6][:3] == (unit.data_ptr(), (1,), (1,))  # kv_scale
    assert fast.extension.decline_reason(call) == ""
    returned = fast.extension.launch(call)
    assert all(a is b for a, b in zip(returned, call[-4:-1], strict=True))
    assert without_extra_address(fast.calls) == without_extra_address(expected)
    fast.calls.clear()
    allocating = call._replace(out=None, max_logits=None, lse=None)
    out, max_logits, lse = fast.extension.launch(allocating)
    assert (out.shape, max_logits.shape, lse.shape) == ((s_q, h_q, D_V), (s_q, h_q), (s_q, h_q))
    assert [(key, arguments[:7]) for key, arguments in fast.calls] == [
        (key, arguments[:7]) for key, arguments in expected
    ]


def test_paged_calls_the_fast_path_declines(fast, generator, monkeypatch):
    """A paged call the Python path must take: its error, a copy for the launch, an empty cache, some
    buffers; and the public call on the fast path, then without it."""
    call = paged_call("v41", 2, 64, 128, BF16, True, True, generator)
    assert fast.extension.decline_reason(call) == ""
    offset_q = torch.empty(call.q.numel() + 1, dtype=BF16)[1:].view(call.q.shape)
    for changes, reason in (
        ({"sm_scale": 1}, "sm_scale is not a Python float"),
        ({"d_v": 256}, "the Python path raises ValueError: d_v: expected the integer 512, got 256"),
        ({"cache": call.cache[:, :, :, :100]}, "the Python path raises ValueError: cache"),
        ({"q": offset_q}, "q is not 16-byte aligned"),  # the plan of the valid call's key checks it
        ({"cache": call.cache[:0]}, "s_q or s_kv is 0"),
        ({"lse": None}, "only some of out, max_logits, lse are given"),
        ({"out": call.cache.view(-1)[: 2 * 64 * D_V * 2].view(BF16).view(2, 64, D_V)}, "out shares memory"),
    ):
        assert fast.extension.decline_reason(call._replace(**changes)).startswith(reason), changes
    assert not fast.calls
    monkeypatch.setattr(native, "launch", fast.extension.launch)
    monkeypatch.setattr(paged, "check_paged_inputs", None)  # the Python path would fail the test
    returned = sparse_mla_q8kv8_paged_fwd(*call[:8], out=call.out, max_logits=call.max_logits, lse=call.lse)
    assert all(a is b for a, b in zip(returned, call[-4:-1], strict=True)) and len(fast.calls) == 1


def test_schedule_is_the_python_rule_over_a_grid(fast, monkeypatch, generator):
    """The plans the extension memoises carry the Python rules' schedule (``schedule.choose``, on the
    registered device's SM count) over a grid of extents, head counts, SM counts, top-k, topk_length and
    precisions: its key tells apart every call whose schedule differs."""
    compared = split = tail = small = 0
    for s_q, h_q, topk in itertools.product(
        (1, 2, 7, 8, 9, 16, 17, 40, 150, 263, 437), (8, 16, 32, 48, 64, 128, 192), (128, 512, 640, 1024, 2048)
    ):
        q = torch.zeros(s_q, h_q, 512, dtype=torch.float8_e4m3fn)
        kv = torch.zeros(2, 1, 512, dtype=torch.float8_e4m3fn)
        indices = torch.zeros(s_q, 1, topk, dtype=torch.int32)
        call = PrefillCall(q, kv, indices, 0.1, torch.ones(1), torch.ones(1))
        for sm_count, with_topk_length, precision in itertools.product(
            (1, 2, 3, 5, 132), (False, True), PRECISIONS
        ):
            native.register_device(CPU, sm_count)
            monkeypatch.setattr(schedule, "_sm_counts", {0: sm_count})
            topk_length = torch.zeros(s_q, dtype=torch.int32) if with_topk_length else None
            tiles, splits, split_from = schedule.choose(s_q, h_q, topk, with_topk_length, 0)
            assert fast.extension.plan(call._replace(topk_length=topk_length, precision=precision)) == (
                tiles,
                splits,
                split_from,
            )
            compared += 1 if tiles else 0
            split += 1 if splits > 1 else 0
            tail += 1 if split_from > 0 else 0
            small += 1 if tiles > 1 and h_q in SMALL_HEAD_COUNTS else 0
    assert compared > 100  # the grid reaches the persistent schedule, not only the one-tile kernel
    assert split > 20  # and the split one
    assert tail > 20  # and split tails
    assert small > 100  # and small-head launches of several tokens per CTA


def assert_declined(fast, valid: dict, changes, exception) -> None:
    """The fast path takes the call of the valid arguments ``valid`` and declines it with ``changes``, which
    the contract rejects with ``exception``: it says why, launches nothing and raises nothing."""
    assert fast.extension.plan(PrefillCall(**valid)) != DECLINED
    valid.update(changes(valid))
    call = PrefillCall(**valid)
    with pytest.raises(exception):
        contract.check_inputs(call)
    assert fast.extension.plan(call) == DECLINED
    assert fast.extension.decline_reason(call)  # says why
    assert fast.extension.launch(call) is None  # never raises for its arguments
    assert not fast.calls


@violation_cases(VIOLATIONS)
def test_declines_every_contract_violation(fast, valid_args, changes, exception, message):
    assert_declined(fast, valid_args, changes, exception)


@violation_cases(BF16_Q_VIOLATIONS)
def test_declines_every_contract_violation_of_a_bf16_q_call(
    fast, valid_bf16_q_args, changes, exception, message
):
    assert_declined(fast, valid_bf16_q_args, changes, exception)


def _declined_cases(args: dict, randn_fp8) -> dict:
    """Valid calls (or calls outside the C++ checks' scope) that the fast path must leave to Python."""
    return {
        "q misaligned": {**args, "q": offset_by(args["q"], 1)},
        "q strided": {**args, "q": args["q"].transpose(0, 1).contiguous().transpose(0, 1)},
        "kv misaligned": {**args, "kv": offset_by(args["kv"], 8)},
        "kv row stride": {
            **args,
            "kv": torch.cat([args["kv"], randn_fp8(S_KV, 1, 8)], dim=2)[:, :, :D_QK],
        },
        "out misaligned": {**args, "out": offset_by(args["out"], 2)},
        "topk_length strided": {**args, "topk_length": every_other_in_last_dim(args["topk_length"][None])[0]},
        "attn_sink strided": {**args, "attn_sink": every_other_in_last_dim(args["attn_sink"][None])[0]},
        "empty kv": {**args, "kv": args["kv"][:0]},
        "q_scale 0-d": {**args, "q_scale": args["q_scale"].reshape(())},
        "kv_scale [1, 1]": {**args, "kv_scale": args["kv_scale"].reshape(1, 1)},
        "sm_scale an int": {**args, "sm_scale": 1},
        "no out buffer": {**args, "out": None},
        "no lse buffer": {**args, "lse": None},
        "q on another device": {**args, "q": args["q"].to("meta")},
        "q a subclass": {**args, "q": args["q"].as_subclass(TensorSubclass)},
        "q_scale a negative view": {**args, "q_scale": torch._neg_view(args["q_scale"])},
        "attn_sink a negative view": {**args, "attn_sink": torch._neg_view(args["attn_sink"])},
        "sm_scale a float subclass": {**args, "sm_scale": FloatSubclass(args["sm_scale"])},
        "precision a str subclass": {**args, "precision": StrSubclass("default")},
        "d_v a bool": {**args, "d_v": True},
        "d_v too large for int64": {**args, "d_v": 2**70},
    }


class TensorSubclass(torch.Tensor):
    pass


class FloatSubclass(float):
    pass


class StrSubclass(str):
    pass


@pytest.mark.parametrize(
    "case",
    [
        "q misaligned", "q strided", "kv misaligned", "kv row stride", "out misaligned",
        "topk_length strided", "attn_sink strided", "empty kv", "q_scale 0-d", "kv_scale [1, 1]",
        "sm_scale an int", "no out buffer", "no lse buffer", "q on another device", "q a subclass",
        "q_scale a negative view", "attn_sink a negative view", "sm_scale a float subclass",
        "precision a str subclass", "d_v a bool", "d_v too large for int64",
    ],
)  # fmt: skip
def test_declines_what_needs_the_python_path(fast, valid_args, randn_fp8, case):
    call = PrefillCall(**_declined_cases(valid_args, randn_fp8)[case])
    assert fast.extension.plan(call) == DECLINED
    assert fast.extension.decline_reason(call)  # says why
    assert fast.extension.launch(call) is None
    assert not fast.calls


def _bf16_q_declined_cases(args: dict) -> dict:
    """Valid bfloat16-q calls that the fast path must leave to Python."""
    return {
        "q 8 bytes off 16": {**args, "q": offset_by(args["q"], 8)},
        "q strided": {**args, "q": args["q"].transpose(0, 1).contiguous().transpose(0, 1)},
        "q a negative view": {**args, "q": torch._neg_view(args["q"])},
        "q a subclass": {**args, "q": args["q"].as_subclass(TensorSubclass)},
        "empty kv": {**args, "kv": args["kv"][:0]},
        "no out buffer": {**args, "out": None},
    }


@pytest.mark.parametrize(
    "case",
    ["q 8 bytes off 16", "q strided", "q a negative view", "q a subclass", "empty kv",
     "no out buffer"],
)  # fmt: skip
def test_declines_bf16_q_calls_that_need_the_python_path(fast, valid_bf16_q_args, case):
    call = PrefillCall(**_bf16_q_declined_cases(valid_bf16_q_args)[case])
    assert fast.extension.plan(call) == DECLINED
    assert fast.extension.decline_reason(call)
    assert fast.extension.launch(call) is None
    assert not fast.calls


def test_q_scale_goes_with_e4m3_q_and_not_with_bf16_q(fast, valid_args, valid_bf16_q_args):
    """The q_scale rule is the contract's: the fast path declines both calls, with the contract's message."""
    e4m3_call, bf16_call = PrefillCall(**valid_args), PrefillCall(**valid_bf16_q_args)
    assert DECLINED not in (fast.extension.plan(e4m3_call), fast.extension.plan(bf16_call))
    with_scale = bf16_call._replace(q_scale=valid_args["q_scale"])
    without_scale = e4m3_call._replace(q_scale=None)
    for call, message in (
        (with_scale, "q_scale: expected None for a torch.bfloat16 q, got Tensor"),
        (without_scale, "q_scale: expected a torch.Tensor, got NoneType"),
    ):
        with pytest.raises(contract.InputTypeError, match=message) as error:
            contract.check_inputs(call)
        assert fast.extension.decline_reason(call) == f"the Python path raises InputTypeError: {error.value}"
        assert fast.extension.launch(call) is None
    assert not fast.calls


def test_declines_unregistered_devices_and_variants(fast, valid_args, monkeypatch):
    """A plan needs a registered device and the loaded (TVM-FFI) variants; a declined call is not memoised, so
    the call is planned again once they are there."""
    call = PrefillCall(**valid_args)
    fast.extension.reset()
    assert fast.extension.plan(call) == DECLINED  # not even configured
    assert fast.extension.decline_reason(call) == "the fast path is not configured"
    assert fast.extension.launch(call) is None
    fast.extension.configure(**native.constants())
    native.disable()
    native.register_device(torch.device("meta"), SM_COUNT)  # another device
    assert fast.extension.decline_reason(call) == "the device is not registered"
    native.register_device(CPU, SM_COUNT)
    one_tile = kernels.VariantKey(D_QK, LOGITS_IN_FLOAT32["default"])  # the call has a sink
    monkeypatch.setattr(kernels, "_variants", {})
    not_loaded = "the kernel variant is not loaded yet (its first launch on the Python path loads it)"
    assert fast.extension.plan(call) == DECLINED  # no variant loaded
    assert fast.extension.decline_reason(call) == not_loaded
    kernels._variants[one_tile] = types.SimpleNamespace(function=print)  # not a TVM-FFI function
    assert fast.extension.decline_reason(call) == "the kernel variant is not a TVM-FFI function"
    kernels._variants[one_tile] = fast.variants[one_tile]
    assert fast.extension.plan(call) == DECLINED  # a decline of every call of the key, memoised
    fast.extension.configure(**native.constants())
    assert fast.extension.plan(call) == (0, 1, 0)
    assert fast.extension.plan(call._replace(precision="accurate")) == DECLINED
    bf16_q_call = call._replace(q=valid_args["q"].to(BF16), q_scale=None)
    assert fast.extension.plan(bf16_q_call) == DECLINED  # the bfloat16-q variant is another one
    assert fast.extension.decline_reason(bf16_q_call) == not_loaded
    bf16_one_tile = kernels.VariantKey(D_QK, LOGITS_IN_FLOAT32["default"], q_dtype=BF16)
    kernels._variants[bf16_one_tile] = fast.variants[bf16_one_tile]
    assert fast.extension.plan(bf16_q_call) == (0, 1, 0)
    assert not fast.calls


def test_decline_reason_names_the_check(fast, valid_args, monkeypatch):
    reason = native.decline_reason
    call = PrefillCall(**valid_args)
    assert reason(call) == "no device registered yet (the first call on a GPU registers it)"
    monkeypatch.setattr(native, "launch", fast.extension.launch)
    assert reason(call) == ""
    assert reason(call._replace(d_v=256)) == (
        f"the Python path raises ValueError: d_v: expected the integer {D_V}, got 256"
    )
    assert reason(call._replace(lse=valid_args["max_logits"])) == "max_logits shares memory with lse"
    assert reason(call._replace(q=valid_args["q"].as_subclass(TensorSubclass))).startswith(
        "q is not a tensor"
    )
    with native.suspended():
        assert reason(call) == "the fast path is suspended (a forced schedule is active)"
    monkeypatch.setenv(contract.CHECK_RANGES_ENV, "1")
    assert reason(call) == f"{contract.CHECK_RANGES_ENV}=1: the range check runs in Python"


@pytest.fixture
def fast_entry_point(fast, monkeypatch):
    """The public call with the fast path on (as after a first launch on a GPU), for CPU tensors."""
    monkeypatch.setattr(native, "launch", fast.extension.launch)
    return fast


def test_entry_point_takes_the_fast_path_and_returns_the_buffers(fast_entry_point, valid_args, monkeypatch):
    monkeypatch.setattr(eager, "check_inputs", None)  # the Python path would fail the test
    buffers = valid_args["out"], valid_args["max_logits"], valid_args["lse"]
    result = sparse_mla_q8kv8_prefill_fwd(**valid_args)
    assert all(a is b for a, b in zip(result, buffers, strict=True))
    assert len(fast_entry_point.calls) == 1


def test_entry_point_takes_the_fast_path_for_a_bf16_q(fast_entry_point, valid_bf16_q_args, monkeypatch):
    monkeypatch.setattr(eager, "check_inputs", None)  # the Python path would fail the test
    buffers = valid_bf16_q_args["out"], valid_bf16_q_args["max_logits"], valid_bf16_q_args["lse"]
    result = sparse_mla_q8kv8_prefill_fwd(**valid_bf16_q_args)
    assert all(a is b for a, b in zip(result, buffers, strict=True))
    del valid_bf16_q_args["out"], valid_bf16_q_args["max_logits"], valid_bf16_q_args["lse"]
    out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(**valid_bf16_q_args)
    assert (out.shape, max_logits.shape, lse.shape) == ((S_Q, H_Q, D_V), (S_Q, H_Q), (S_Q, H_Q))
    keys = [key for key, _ in fast_entry_point.calls]
    assert keys == [(D_QK, LOGITS_IN_FLOAT32["default"], False, "bf16 q")] * 2  # a sink: S in float32
    q = valid_bf16_q_args["q"]
    for _, arguments in fast_entry_point.calls:
        assert arguments[0] == (q.data_ptr(), tuple(q.shape), q.stride(), "bfloat16")


def test_entry_point_allocates_the_buffers_for_the_fast_path(fast_entry_point, valid_args, monkeypatch):
    monkeypatch.setattr(eager, "check_inputs", None)  # the Python path would fail the test
    for name in ("out", "max_logits", "lse"):
        del valid_args[name]
    out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(**valid_args)
    assert (out.shape, max_logits.shape, lse.shape) == ((S_Q, H_Q, D_V), (S_Q, H_Q), (S_Q, H_Q))
    assert (out.dtype, max_logits.dtype, lse.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert len({out.data_ptr(), max_logits.data_ptr(), lse.data_ptr()}) == 3
    (key, arguments) = fast_entry_point.calls.pop()
    assert [argument[0] for argument in arguments[7:10]] == [t.data_ptr() for t in (out, max_logits, lse)]


def test_entry_point_falls_back_to_the_python_path(fast_entry_point, valid_args, monkeypatch):
    """A declined call takes the Python path: an invalid one gets the contract's message, nothing launched."""
    with pytest.raises(ValueError, match="d_v: expected the integer 512"):
        sparse_mla_q8kv8_prefill_fwd(**{**valid_args, "d_v": 256})
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        sparse_mla_q8kv8_prefill_fwd(**{**valid_args, "q": [[0.0]]})
    assert not fast_entry_point.calls
    python_path = []
    monkeypatch.setattr(
        eager, "check_inputs", lambda call: python_path.append(call) or contract.check_inputs(call)
    )
    monkeypatch.setenv("Q8KV8_CHECK_RANGES", "1")  # the range check runs in Python: no fast path
    sparse_mla_q8kv8_prefill_fwd(**valid_args)
    assert len(python_path) == 1 and len(fast_entry_point.calls) == 1


@pytest.mark.parametrize("raised", [RuntimeError, ValueError, TypeError, IndexError, LookupError])
def test_entry_point_reraises_an_error_of_the_launch_itself(fast_entry_point, valid_args, raised):
    """An error raised by the kernel's launch propagates once, as the Python exception of its TVM-FFI kind
    (RuntimeError for a kind TVM-FFI does not name): the call is not retried on the Python path."""
    import tvm_ffi

    attempts = []

    def failing_launch(*args):
        attempts.append(args)
        raise raised("launch failed")

    fast_entry_point.variants[kernels.VariantKey(D_QK, LOGITS_IN_FLOAT32["default"])] = types.SimpleNamespace(
        function=tvm_ffi.convert(failing_launch)
    )  # the call's variant: it has a sink
    valid_args["topk_length"] = None
    with pytest.raises(Exception, match="launch failed") as error:
        sparse_mla_q8kv8_prefill_fwd(**valid_args)
    assert type(error.value) is (RuntimeError if raised is LookupError else raised)
    assert len(attempts) == 1
    sparse_mla_q8kv8_prefill_fwd(**{**valid_args, "precision": "accurate"})  # another variant launches
    assert len(fast_entry_point.calls) == 1


def test_logit_scale_is_the_python_paths_double(fast, valid_args):
    """The scale the kernel gets is ``sm_scale * log2(e)`` rounded as Python rounds it."""
    valid_args["sm_scale"] = 0.1234567890123
    fast.extension.launch(PrefillCall(**valid_args))
    _, arguments = fast.calls.pop()
    # after the ten tensors and the extra cache's placeholder
    assert arguments[11] == 0.1234567890123 * math.log2(math.e)


def test_note_launch_registers_the_device_once_and_again_after_disable(fast, monkeypatch):
    """The Python path notes each launch on a GPU; the first on a device registers it (with its SM count),
    with one visible GPU only and never while suspended; ``disable`` forgets everything, so the next launch
    registers again."""
    native.disable()
    monkeypatch.setattr(schedule, "_sm_counts", {0: 132})
    monkeypatch.setattr(native, "_gpu_count", 2)
    native.note_launch(0)  # two GPUs: never
    monkeypatch.setattr(native, "_gpu_count", 1)
    native.note_launch(-1)  # a CPU tensor: never
    with native.suspended():
        native.note_launch(0)
    assert native.launch is None and not native._registered_devices and not native._devices
    for _ in range(2):
        native.note_launch(0)
        assert native.launch is native.load().launch
        assert native._registered_devices == {0}
        assert native._devices == {torch.device("cuda", 0): 132}
        with native.suspended():
            assert native.launch is None
        assert native.launch is native.load().launch
        native.disable()
        assert native.launch is None
        assert not native._registered_devices and not native._devices


def test_the_python_path_notes_its_gpu_launches(monkeypatch, fake_kernels, make_inputs):
    """``eager`` (not the kernels module) registers with the fast path, after a launch on a CUDA device whose
    capability the contract checked: the device's index."""
    fake_kernels(lambda *args: None)
    monkeypatch.setattr(native, "launch", None)
    args = make_inputs(S_Q, H_Q, S_KV, D_QK, TOPK)
    noted = []
    monkeypatch.setattr(native, "note_launch", lambda *args: noted.append(args))
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    sparse_mla_q8kv8_prefill_fwd(**args)
    assert noted == []  # a CPU launch
    problem = contract.check_inputs(PrefillCall(**args))
    monkeypatch.setattr(eager, "check_inputs", lambda call: problem._replace(device=torch.device("cuda", 0)))
    sparse_mla_q8kv8_prefill_fwd(**{**args, "q": args["q"].as_subclass(CudaLooking)}, precision="accurate")
    assert noted == [(0,)]


def test_the_paged_python_path_notes_its_gpu_launches(monkeypatch, fake_kernels, generator):
    """A paged call's Python path registers as ``eager.run``'s does (a CPU launch is not noted)."""
    fake_kernels(lambda *args, **kwargs: None)
    monkeypatch.setattr(native, "launch", None)
    noted = []
    monkeypatch.setattr(native, "note_launch", lambda *args: noted.append(args))
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    call = paged_call("v32", 2, 64, 128, BF16, False, False, generator)
    eager.run_paged(call)
    assert noted == []  # a CPU launch
    problem, layout, view = paged.check_paged_inputs(call)
    on_gpu = problem._replace(device=torch.device("cuda", 0)), layout, view
    monkeypatch.setattr(paged, "check_paged_inputs", lambda call: on_gpu)
    eager.run_paged(call._replace(q=call.q.as_subclass(CudaLooking)))
    assert noted == [(0,)]


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is a CUDA one (``is_cuda``), for the launch's bookkeeping."""

    @property
    def is_cuda(self):
        return True


def test_a_forced_schedule_suspends_the_fast_path(fast_entry_point, valid_args, monkeypatch):
    python_path = []
    monkeypatch.setattr(
        eager, "check_inputs", lambda call: python_path.append(call) or contract.check_inputs(call)
    )
    launch = native.launch
    with eager.forced_tiles_per_cta(3):
        assert schedule.tiles_per_cta(1, TOPK, False, 0) == 3
        sparse_mla_q8kv8_prefill_fwd(**valid_args)
        assert native.launch is None and len(python_path) == 1
    assert native.launch is launch and schedule.forced is None
    sparse_mla_q8kv8_prefill_fwd(**valid_args)
    assert len(python_path) == 1 and len(fast_entry_point.calls) == 2
