"""The launch wrapper ``kernels.launch_sparse_prefill`` on CPU: what reaches the compiled function.

The compiled function is replaced by a recorder (every variant key gets it), so these run without a GPU
or a compiled kernel: placeholders and flags for absent options, the scale folded with log2(e),
re-alignment copies, and the device switch that only several GPUs need.
"""

import contextlib
import math
import types

import pytest
import torch

from q8kv8 import eager, kernels, schedule
from q8kv8.metadata import LOGITS_IN_FLOAT32, PRECISIONS

S_Q, H, S_KV, D_QK, D_V, TOPK = 3, 64, 40, 576, 512, 128
FP8 = torch.float8_e4m3fn
FUNCTION_PARAMETERS = (
    "q",
    "kv",
    "indices",
    "topk_length",
    "attn_sink",
    "q_scale",
    "kv_scale",
    "out",
    "max_logits",
    "lse",
    "extra_cache",
    "scale_log2",
    "flags",
    "tiles_per_cta",
    "extra_from",
)


class EveryKey(dict):
    """A variant registry that hands out one variant whatever the key."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def get(self, key, default=None):
        return self.variant

    def __getitem__(self, key):
        return self.variant


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    recorded = []

    def function(*args):
        recorded.append(dict(zip(FUNCTION_PARAMETERS, args, strict=True)))

    variant = types.SimpleNamespace(function=function, name="recorder", d_qk=D_QK)
    monkeypatch.setattr(kernels, "_variants", EveryKey(variant))
    monkeypatch.setattr(schedule, "_sm_counts", EveryKey(132))
    monkeypatch.setattr(kernels, "_gpu_count", 1)
    return recorded


@pytest.fixture
def stand_in_loads(monkeypatch) -> tuple[list, list]:
    """No variant loaded, and ``kernels.load`` a stand-in that builds nothing: ``(loaded, launched)``, the
    keys it was asked for and those whose function the launches called."""
    loaded, launched = [], []

    def load(key):
        loaded.append(key)
        variant = types.SimpleNamespace(function=lambda *args: launched.append(key), name=key.name)
        kernels._variants[key] = variant
        return variant

    monkeypatch.setattr(kernels, "_variants", {})
    monkeypatch.setattr(kernels, "load", load)
    monkeypatch.setattr(kernels, "_gpu_count", 1)
    return loaded, launched


def launch_args(**changes) -> dict:
    args = {
        "q": torch.zeros(S_Q, H, D_QK, dtype=torch.float8_e4m3fn),
        "kv": torch.zeros(S_KV, 1, D_QK, dtype=torch.float8_e4m3fn),
        "indices": torch.zeros(S_Q, 1, TOPK, dtype=torch.int32),
        "topk_length": None,
        "attn_sink": None,
        "q_scale": torch.ones(1),
        "kv_scale": torch.ones(1),
        "sm_scale": 0.125,
        "out": torch.empty(S_Q, H, D_V, dtype=torch.bfloat16),
        "max_logits": torch.empty(S_Q, H),
        "lse": torch.empty(S_Q, H),
        "precision": "default",
    }
    return args | changes


def test_absent_options_get_placeholders_and_flags_0(calls):
    args = launch_args()
    launched = kernels.launch_sparse_prefill(*args.values())
    assert launched == ((schedule.ONE_TILE, kernels._variants.variant),)  # the variant launched
    [call] = calls
    assert call["flags"] == 0
    assert call["topk_length"].dtype == torch.int32 and call["topk_length"].shape == (1,)
    assert call["attn_sink"].dtype == torch.float32 and call["attn_sink"].shape == (1,)
    assert call["scale_log2"] == pytest.approx(0.125 * math.log2(math.e), rel=1e-15)
    for name in ("q", "kv", "indices", "q_scale", "kv_scale", "out", "max_logits", "lse"):
        assert call[name] is args[name], name  # aligned, valid tensors pass untouched (no copies)


@pytest.mark.parametrize("with_topk_length", [False, True])
@pytest.mark.parametrize("split_from", [0, 1, 2])
def test_a_split_tail_launches_the_one_tile_variant_then_the_split_one_on_their_tokens(
    calls, split_from, with_topk_length
):
    """splits 2 from token ``split_from``: the one-tile launch on the rows before it (schedule count 1), then
    the split launch on the others (count 2), as views of the call's tensors (no copies), both with the
    split-tail flag; 0: one split launch on all of them. kv, the scales and the placeholders are the
    call's."""
    topk_length = torch.tensor([5, 6, 7], dtype=torch.int32) if with_topk_length else None
    args = launch_args(topk_length=topk_length)
    launched = kernels.launch_sparse_prefill(**args, schedule=0, splits=2, split_from=split_from)
    variant = kernels._variants.variant
    kinds = (schedule.ONE_TILE, schedule.SPLIT) if split_from else (schedule.SPLIT,)
    assert launched == tuple((kind, variant) for kind in kinds)
    token_ranges = [(0, split_from), (split_from, S_Q)] if split_from else [(0, S_Q)]
    assert len(calls) == len(token_ranges)
    for call, (first, end), count in zip(calls, token_ranges, (1, 2) if split_from else (2,), strict=True):
        assert call["tiles_per_cta"] == count
        per_token = ["q", "indices", "out", "max_logits", "lse"] + (
            ["topk_length"] if with_topk_length else []
        )
        for name in per_token:
            assert call[name].shape[0] == end - first, name
            assert call[name].data_ptr() == args[name][first:].data_ptr(), name  # a view: no copy
        for name in ("kv", "q_scale", "kv_scale"):
            assert call[name] is args[name], name
        tail = kernels.SPLIT_TAIL_FLAG if split_from else 0  # the two launches overlap
        assert call["flags"] == (kernels.TOPK_LENGTH_FLAG if with_topk_length else 0) | tail
        if not with_topk_length:
            assert call["topk_length"].shape == (1,)  # the placeholder, whole


def test_a_bf16_q_gets_kv_scale_in_q_scales_place(calls):
    """A bfloat16 q has no q_scale: the kernel does not read that argument, which gets kv_scale (and
    kv_scale's bytes are the absent topk_length's placeholder)."""
    args = launch_args(q=torch.zeros(S_Q, H, D_QK, dtype=torch.bfloat16), q_scale=None)
    kernels.launch_sparse_prefill(*args.values())
    [call] = calls
    assert (
        call["q"] is args["q"]
        and call["q_scale"] is args["kv_scale"]
        and call["kv_scale"] is args["kv_scale"]
    )
    assert (
        call["topk_length"].dtype == torch.int32
        and call["topk_length"].data_ptr() == args["kv_scale"].data_ptr()
    )
    assert call["attn_sink"] is args["kv_scale"] and call["flags"] == 0


@pytest.mark.parametrize("tiles", [0, 2])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_bf16_q_launches_its_own_variant(stand_in_loads, precision, tiles):
    """The variant for a bfloat16 q: looked up by its key (q's dtype included), built on first use
    (``kernels.load``, replaced here by a stand-in: nothing is compiled)."""
    loaded, launched = stand_in_loads
    args = launch_args(q=torch.zeros(S_Q, H, D_QK, dtype=torch.bfloat16), q_scale=None, precision=precision)
    kind = schedule.PERSISTENT if tiles else schedule.ONE_TILE
    key = kernels.VariantKey(D_QK, precision, kind, torch.bfloat16)
    for _ in range(2):
        assert kernels.launch_sparse_prefill(**args, schedule=tiles) == ((kind, kernels._variants[key]),)
    assert loaded == [key]  # built (or loaded) once
    assert launched == [key] * 2


@pytest.mark.parametrize("cache", [None, "model1"])
@pytest.mark.parametrize("s_q, h_q, splits", [(3, 64, 1), (2, 128, 4), (40, 16, 1)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_sink_sums_the_logits_in_float32_in_every_launch(
    stand_in_loads, precision, s_q, h_q, splits, cache
):
    """A call with a sink launches its precision's variants with S summed in float32 (``LOGITS_IN_FLOAT32``:
    the sink weighs out by exp(lse)), on kv rows and a paged cache, in every schedule (one tile, split with
    its tail, small heads); without a sink, the precision's own."""
    _, launched = stand_in_loads
    d_qk = 512 if cache else D_QK
    kv = torch.zeros(4, 64, 584, dtype=torch.uint8) if cache else torch.zeros(S_KV, 1, d_qk, dtype=FP8)
    for sink, want in ((None, precision), (torch.zeros(h_q), LOGITS_IN_FLOAT32[precision])):
        launched.clear()
        args = launch_args(
            q=torch.zeros(s_q, h_q, d_qk, dtype=FP8),
            kv=kv,
            indices=torch.zeros(s_q, 1, TOPK, dtype=torch.int32),
            attn_sink=sink,
            out=torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16),
            max_logits=torch.empty(s_q, h_q),
            lse=torch.empty(s_q, h_q),
            precision=precision,
        )
        split_from = 1 if splits > 1 else 0
        kernels.launch_sparse_prefill(
            **args, schedule=0, ready=True, splits=splits, split_from=split_from, cache=cache
        )
        assert launched and all(key.precision == want for key in launched), (sink is None, launched)
        assert len(launched) == (2 if splits > 1 else 1)


@pytest.mark.parametrize("h_q, kind, heads", [(48, schedule.ONE_TILE, 64), (16, schedule.PERSISTENT, 16)])
def test_a_paged_cache_launches_its_own_variant_with_the_cache_as_kv(calls, monkeypatch, h_q, kind, heads):
    """``cache``: the paged variant of the layout (64-head tiles for 48 heads, the small-head kernel for 16),
    the cache view passed as kv untouched (never re-aligned: the contract checked it)."""
    keys = []
    registry = kernels._variants
    monkeypatch.setattr(
        kernels, "_variants", types.SimpleNamespace(get=lambda key: keys.append(key) or registry.variant)
    )
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)[:, :, 8:]  # base 8 bytes off 16: not copied
    args = launch_args(q=torch.zeros(S_Q, h_q, D_QK, dtype=torch.bfloat16), q_scale=None, kv=cache)
    args |= {"out": torch.empty(S_Q, h_q, D_V, dtype=torch.bfloat16), "max_logits": torch.empty(S_Q, h_q)}
    args["lse"] = torch.empty(S_Q, h_q)
    kernels.launch_sparse_prefill(**args, schedule=0, cache="v32")
    assert keys == [kernels.VariantKey(D_QK, "default", kind, torch.bfloat16, heads, "v32")]
    assert calls[0]["kv"] is cache


def test_variant_names_and_keys():
    assert kernels.VariantKey(576, q_dtype=torch.bfloat16).name == "sparse_prefill_sm90_d576_bf16q"
    assert (
        kernels.VariantKey(512, "accurate", schedule.PERSISTENT, torch.bfloat16).name
        == "sparse_prefill_sm90_d512_bf16q_accurate_persistent"
    )
    assert (
        kernels.VariantKey(576, "accurate", schedule.PERSISTENT).name
        == "sparse_prefill_sm90_d576_accurate_persistent"
    )
    assert kernels.VariantKey(512, schedule=schedule.SPLIT, cache="model1").name == (
        "sparse_prefill_sm90_d512_paged_model1_split"
    )
    assert kernels.VariantKey(576, schedule=schedule.PERSISTENT, heads=16).name == (
        "sparse_prefill_sm90_d576_h16_persistent"
    )
    assert kernels.VariantKey(512, "accurate", schedule.PERSISTENT, torch.bfloat16, 8, "model1").name == (
        "sparse_prefill_sm90_d512_h8_paged_model1_bf16q_accurate_persistent"
    )
    for bad in (
        kernels.VariantKey(576, heads=16),  # small heads are persistent
        kernels.VariantKey(576, heads=16, cache="v32"),
        kernels.VariantKey(512, cache="v32"),  # V3.2 is d_qk 576
        kernels.VariantKey(576, cache="v41"),  # V4.1 is d_qk 512
        kernels.VariantKey(512, cache="v41_fp4"),  # V4.1 FP4 caches are read by the gather only
    ):
        with pytest.raises(ValueError, match="no attention kernel variant"):
            bad.check()
    names = [key.name for key in kernels.LISTED_KEYS]
    # the attention variants (60 a precision: 24 on gathered rows, 12 a paged layout), the serving path's
    # kernels (9 of them gathers: 4 layouts to e4m3 and bf16, the FP4 one also to V4.1 records)
    assert len(names) == len(set(names)) == 60 * len(PRECISIONS) + 15
    assert kernels.LISTED_KEYS[: len(kernels.IMPORT_KEYS)] == kernels.IMPORT_KEYS
    assert set(kernels.SERVING_KEYS) < set(kernels.LISTED_KEYS)


def test_every_family_is_one_table_of_keys():
    """The serving path's kernels are keyed in the same table as the attention variants: names, checks,
    and keys of different families with equal fields kept apart."""
    assert kernels.PagedGatherKey("v32").name == "paged_kv_gather_sm90_v32_e4m3"
    assert kernels.PagedGatherKey("model1", torch.bfloat16).name == "paged_kv_gather_sm90_model1_bf16"
    assert kernels.PagedGatherKey("v41_fp4", torch.uint8).name == "paged_kv_gather_sm90_v41_fp4_v41"
    assert kernels.QCastKey(576).name == "cast_q_fp8_sm90_d576"
    assert kernels.SlotIndicesKey().name == "paged_indices_sm90"
    assert kernels.MergeKey().name == "attention_merge_sm90"
    assert kernels.Bf16AttentionKey(512).name == "sparse_prefill_bf16_sm90_d512"
    table = {kernels.QCastKey(512): "cast", kernels.Bf16AttentionKey(512): "bf16"}
    assert len(table) == 2 and kernels.QCastKey(512) != kernels.Bf16AttentionKey(512)
    for bad, message in (
        (kernels.PagedGatherKey("v4"), "layout: expected one of"),
        (kernels.PagedGatherKey("v32", torch.float16), "out_dtype: expected one of"),
        (kernels.PagedGatherKey("v41", torch.uint8), "out_dtype: uint8 .V4.1 records. from a v41_fp4 cache"),
        (kernels.QCastKey(128), "d: expected one of"),
        (kernels.Bf16AttentionKey(128), "d_qk: expected one of"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.load(bad)
        assert bad not in kernels._variants


def test_given_options_are_passed_and_flagged(calls):
    topk_length, sink = torch.zeros(S_Q, dtype=torch.int32), torch.zeros(H)
    kernels.launch_sparse_prefill(*launch_args(topk_length=topk_length, attn_sink=sink).values())
    kernels.launch_sparse_prefill(*launch_args(attn_sink=sink).values())
    assert calls[0]["topk_length"] is topk_length and calls[0]["attn_sink"] is sink
    assert [call["flags"] for call in calls] == [3, 2]


def test_zero_dim_scales_are_passed_as_one_element_vectors(calls):
    kernels.launch_sparse_prefill(
        *launch_args(q_scale=torch.tensor(0.5), kv_scale=torch.tensor(2.0)).values()
    )
    [call] = calls
    assert call["q_scale"].shape == (1,) and call["q_scale"].item() == 0.5
    assert call["kv_scale"].shape == (1,) and call["kv_scale"].item() == 2.0


def test_misaligned_tensors_are_copied_to_aligned_ones(calls):
    q_bytes = torch.arange(S_Q * H * D_QK + 1, dtype=torch.int32).to(torch.uint8)
    q = q_bytes[1:].view(torch.float8_e4m3fn).view(S_Q, H, D_QK)  # 1 byte off 16
    kv_rows = torch.arange(S_KV * (D_QK + 8), dtype=torch.int32).to(torch.uint8).view(S_KV, 1, D_QK + 8)
    kv = kv_rows[:, :, :D_QK].view(torch.float8_e4m3fn)  # row stride 584 bytes: not a multiple of 16
    out_bytes = torch.zeros(S_Q * H * D_V + 1, dtype=torch.bfloat16)
    out = out_bytes[1:].view(S_Q, H, D_V)  # 2 bytes off 4
    assert q.data_ptr() % 16 and kv.stride(0) % 16 and out.data_ptr() % 4

    def fill_out(*args):
        call = dict(zip(FUNCTION_PARAMETERS, args, strict=True))
        calls.append(call)
        call["out"].fill_(7.0)

    kernels._variants.variant.function = fill_out
    kernels.launch_sparse_prefill(*launch_args(q=q, kv=kv, out=out).values())
    [call] = calls
    assert call["q"].data_ptr() % 16 == 0 and torch.equal(call["q"].view(torch.uint8), q.view(torch.uint8))
    q_bf16 = torch.empty(S_Q * H * D_QK + 4, dtype=torch.bfloat16)[4:].view(S_Q, H, D_QK)  # 8 bytes off 16
    q_bf16.copy_(torch.randn(S_Q, H, D_QK))
    assert q_bf16.data_ptr() % 16 == 8
    kernels.launch_sparse_prefill(*launch_args(q=q_bf16, q_scale=None, out=out).values())
    assert calls[-1]["q"].data_ptr() % 16 == 0 and torch.equal(calls[-1]["q"], q_bf16)
    assert call["kv"].data_ptr() % 16 == 0 and call["kv"].stride(0) % 16 == 0
    assert torch.equal(call["kv"].view(torch.uint8), kv.view(torch.uint8))
    assert call["out"] is not out and call["out"].data_ptr() % 4 == 0
    assert (out == 7.0).all()  # written back into the caller's buffer


@pytest.mark.parametrize(("gpu_count", "current", "switches"), [(1, 5, False), (2, -1, False), (2, 5, True)])
def test_the_device_is_switched_only_when_another_is_current(
    calls, monkeypatch, gpu_count, current, switches
):
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(kernels, "_gpu_count", gpu_count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", device)
    args = launch_args()
    kernels.launch_sparse_prefill(*args.values())  # CPU tensors: q.get_device() is -1
    assert entered == ([args["q"].get_device()] if switches else [])
    assert len(calls) == 1


def test_bf16_launcher_passes_placeholders_and_flags(monkeypatch):
    """The bf16 kernel's launcher (serving path) on CPU: placeholders for absent options, the scale
    folded with log2(e), flags."""
    recorded = []
    variant = types.SimpleNamespace(function=lambda *args: recorded.append(args), name="recorder")
    monkeypatch.setattr(kernels, "_variants", EveryKey(variant))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU tensors: no device switch
    q = torch.zeros(S_Q, H, D_QK, dtype=torch.bfloat16)
    kv = torch.zeros(S_KV, 1, D_QK, dtype=torch.bfloat16)
    indices = torch.zeros(S_Q, 1, TOPK, dtype=torch.int32)
    out = torch.empty(S_Q, H, D_V, dtype=torch.bfloat16)
    max_logits, lse = torch.empty(S_Q, H), torch.empty(S_Q, H)
    kernels.launch_sparse_prefill_bf16(q, kv, indices, None, None, 0.125, out, max_logits, lse)
    topk_length = torch.full((S_Q,), 7, dtype=torch.int32)
    sink = torch.zeros(H)
    kernels.launch_sparse_prefill_bf16(q, kv, indices, topk_length, sink, 0.125, out, max_logits, lse)
    (first, second) = recorded
    assert first[3] is not topk_length and first[4] is not sink and first[-1] == 0
    assert second[3] is topk_length and second[4] is sink and second[-1] == 3
    assert first[5] is out and first[6] is max_logits and first[7] is lse
    assert math.isclose(first[-2], 0.125 * math.log2(math.e))


@pytest.mark.parametrize(
    "s_q, topk, with_topk_length, precision, expected",
    [
        (4096, 512, False, "default", 4),  # short rows: persistent, 4 tiles per CTA
        (4096, 2048, True, "default", 4),  # topk_length given: persistent
        (4096, 2048, False, "default", 0),  # full 2048-slot rows: one tile per CTA
        (4096, 512, False, "accurate", 4),  # the accurate mode too
        (1024, 512, False, "default", 0),  # fewer than 2 x 4 waves of tiles: one tile per CTA
        (1100, 512, False, "default", 2),
    ],
)
def test_schedule_choice(calls, s_q, topk, with_topk_length, precision, expected):
    """tiles_per_cta: the persistent kernel (>= 2 tiles per CTA, four waves of CTAs or more) for
    short rows, else 0 (the one-tile kernel); what the launch passes."""
    assert kernels.tiles_per_cta(s_q, topk, with_topk_length, 0) == expected
    args = launch_args(
        q=torch.zeros(s_q, H, D_QK, dtype=torch.float8_e4m3fn),
        indices=torch.zeros(s_q, 1, topk, dtype=torch.int32),
        topk_length=torch.zeros(s_q, dtype=torch.int32) if with_topk_length else None,
        out=torch.empty(s_q, H, D_V, dtype=torch.bfloat16),
        max_logits=torch.empty(s_q, H),
        lse=torch.empty(s_q, H),
        precision=precision,
    )
    kernels.launch_sparse_prefill(**args)
    assert calls[-1]["tiles_per_cta"] == max(expected, 1)


def test_forced_schedule(calls):
    for forced in (0, 1, 3):
        with eager.forced_tiles_per_cta(forced):
            kernels.launch_sparse_prefill(**launch_args())
        assert calls[-1]["tiles_per_cta"] == max(forced, 1)
    assert schedule.forced is None
