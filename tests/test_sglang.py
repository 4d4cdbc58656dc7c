"""``q8kv8.sglang``: SGLang's serving-helper names and signatures on q8kv8, and the contract's errors as
SGLang's tests catch them (ValueError, SGLang's phrases).

CPU: head padding, the Q cast (PyTorch path; bit-exact with a plain e4m3 cast of the clamped values), the
cache-layout inference and every argument error. GPU (``gpu`` marker): the gather through SGLang's
signature is bit-exact with ``gather_dequant_paged_reference`` for each cache shape engines pass, and the
Q cast kernel with the PyTorch cast.
"""

import pytest
import torch
from paged_cache import random_bytes_cache, same_bits, to_device

import q8kv8
from q8kv8 import sglang
from q8kv8.kv_layout import MODEL1, V32, V41, V41_FP4
from q8kv8.reference import gather_dequant_paged_reference

E4M3 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# Heads and the Q cast
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "padded"), [(1, 64), (16, 64), (64, 64), (65, 128), (128, 128), (130, 192)]
)
def test_padded_num_heads(heads, padded):
    assert sglang.q8kv8_padded_num_heads(heads) == padded


@pytest.mark.parametrize("heads", [0, -3, 2.0, True])
def test_padded_num_heads_rejects_non_positive(heads):
    with pytest.raises(ValueError, match="num_heads must be positive"):
        sglang.q8kv8_padded_num_heads(heads)


def plain_cast(q: torch.Tensor, padded: int) -> torch.Tensor:
    """What the cast must give: scale 1.0, values clamped to +-448, rounded to e4m3; zero padding heads."""
    want = torch.zeros(q.shape[0], padded, q.shape[2], dtype=E4M3)
    want[:, : q.shape[1]] = q.float().clamp(-448, 448).to(E4M3)
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("heads", "padded"), [(16, None), (16, 128), (64, None), (80, 128)])
def test_cast_q_is_a_unit_scale_e4m3_cast_into_padded_heads(generator, dtype, heads, padded):
    q = (torch.randn(5, heads, 512, generator=generator) * 200).to(dtype)
    q[0, 0, :3] = torch.tensor([1000.0, -1000.0, 1e-3])  # saturates, saturates, rounds
    q_fp8, q_scale = sglang.cast_q_fp8_for_q8kv8_prefill(q, padded)
    expected_heads = padded or q8kv8.padded_num_heads(heads)
    assert q_fp8.shape == (5, expected_heads, 512) and q_fp8.dtype == E4M3
    assert torch.equal(q_fp8.view(torch.uint8), plain_cast(q, expected_heads).view(torch.uint8))
    assert q_scale.shape == () and q_scale.dtype == torch.float32 and q_scale.item() == 1.0


def test_cast_q_writes_a_dirty_out_buffer(generator):
    q = torch.randn(3, 16, 576, generator=generator).to(torch.bfloat16)
    out = torch.full((3, 64, 576), 0x7E, dtype=torch.uint8).view(E4M3)
    q_fp8, _ = sglang.cast_q_fp8_for_q8kv8_prefill(q, out=out)
    assert q_fp8 is out and torch.equal(out.view(torch.uint8), plain_cast(q, 64).view(torch.uint8))


@pytest.mark.parametrize(
    ("q", "kwargs", "error", "message"),
    [
        (torch.zeros(2, 16, 512, dtype=E4M3), {}, TypeError, "q must be a floating-point tensor"),
        (torch.zeros(2, 16, 512, dtype=torch.int32), {}, ValueError, "q must be a floating-point tensor"),
        (torch.zeros(2, 512), {}, ValueError, r"q must have shape \(num_tokens, num_heads, head_dim\)"),
        (torch.zeros(2, 80, 512), {"padded_num_heads": 64}, ValueError, "invalid padded_num_heads=64"),
        (torch.zeros(2, 16, 512), {"padded_num_heads": 96}, ValueError, "invalid padded_num_heads=96"),
        (
            torch.zeros(2, 16, 512),
            {"out": torch.zeros(2, 128, 512, dtype=E4M3)},
            ValueError,
            "Q8KV8 Q output",
        ),
        (torch.zeros(2, 16, 512), {"out": torch.zeros(2, 64, 512)}, ValueError, "Q8KV8 Q output"),
    ],
)
def test_cast_q_rejects(q, kwargs, error, message):
    with pytest.raises(error, match=message):
        sglang.cast_q_fp8_for_q8kv8_prefill(q, **kwargs)


# ------------------------------------------------------------------------------------------------
# Cache layout from the bytes per token
# ------------------------------------------------------------------------------------------------
def test_layout_of_the_decode_view_and_flat_token_records():
    v4 = torch.zeros(3, 64, 1, 584, dtype=torch.uint8)
    pages, page_size, layout = sglang.paged_kv_layout(v4, 64)
    assert layout is MODEL1 and page_size == 64 and pages.shape == v4.shape
    v32 = torch.zeros(3, 64, 1, 656, dtype=torch.uint8)
    pages, page_size, layout = sglang.paged_kv_layout(v32.view(E4M3), 64)
    assert layout is V32 and page_size == 1 and pages.shape == (192, 656) and pages.dtype == torch.uint8
    flat = torch.zeros(300, 1, 656, dtype=torch.uint8)
    assert sglang.paged_kv_layout(flat, 64)[1:] == (1, V32)


def test_layout_of_a_pool_of_pages_any_dtype():
    padded_v4_page = 65 * 576  # 64 tokens x 584 bytes, padded to a multiple of 576
    pool = torch.zeros(4, padded_v4_page // 2, dtype=torch.bfloat16)  # pools are often typed bf16
    pages, page_size, layout = sglang.paged_kv_layout(pool, 64)
    assert layout is MODEL1 and page_size == 64 and pages.shape == (4, padded_v4_page)
    assert pages.dtype == torch.uint8
    assert sglang.paged_kv_layout(torch.zeros(4, 64 * 584, dtype=torch.uint8), 64)[2] is MODEL1
    assert sglang.paged_kv_layout(torch.zeros(4, 64 * 656, dtype=torch.uint8), 64)[1:] == (1, V32)
    assert sglang.paged_kv_layout(torch.zeros(40, 656, dtype=torch.uint8), 64)[1:] == (1, V32)


@pytest.mark.parametrize("layout", [V41, V41_FP4], ids=lambda layout: layout.name)
def test_layout_of_v41_caches_read_as_token_records(layout):
    bytes_per_token = layout.bytes_per_token
    view = torch.zeros(3, 64, 1, bytes_per_token, dtype=torch.uint8)
    pages, page_size, found = sglang.paged_kv_layout(view.view(E4M3), 64)
    assert found is layout and page_size == 1 and pages.shape == (192, bytes_per_token)
    assert pages.dtype == torch.uint8
    pool = torch.zeros(4, 64 * bytes_per_token // 2, dtype=torch.bfloat16)
    assert sglang.paged_kv_layout(pool, 64)[1:] == (1, layout)
    assert sglang.paged_kv_layout(torch.zeros(40, bytes_per_token, dtype=torch.uint8), 64)[1:] == (1, layout)
    strided = torch.zeros(3, 64, 1, bytes_per_token + 16, dtype=torch.uint8)[..., :bytes_per_token]
    pages, page_size, found = sglang.paged_kv_layout(strided, 64)
    assert found is layout and page_size == 64 and pages.shape == strided.shape


@pytest.mark.parametrize(
    ("cache", "page_size", "message"),
    [
        (torch.zeros(4, 64 * 500, dtype=torch.uint8), 64, "500 bytes per token"),
        (torch.zeros(4, 64 * 528 + 64, dtype=torch.uint8), 64, "529 bytes per token"),
        (torch.zeros(4, 64, 1, 600, dtype=torch.uint8), 64, "bytes_per_token 584"),
        (torch.zeros(4, 32, 1, 584, dtype=torch.uint8), 64, r"shape\[1\] == page_size"),
        (torch.zeros(100, dtype=torch.uint8), 64, "at least 2-D"),
        (torch.zeros(4, 64 * 584, dtype=torch.uint8), 0, "page_size must be a positive integer"),
    ],
)
def test_layout_rejects(cache, page_size, message):
    with pytest.raises(ValueError, match=message):
        sglang.paged_kv_layout(cache, page_size)


def test_gather_names_its_device_on_cpu():
    with pytest.raises(ValueError, match="cache: expected a CUDA tensor"):
        slots = torch.zeros(3, dtype=torch.int32)
        sglang.gather_dequant_requant_fp8_paged(torch.zeros(2, 64, 1, 584, dtype=torch.uint8), slots, 64)


# ------------------------------------------------------------------------------------------------
# The kernel entry point's errors, as SGLang's tests catch them
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (lambda a: {"q": a["q"].float()}, "q must be torch.float8_e4m3fn"),
        (lambda a: {"kv": a["kv"].float()}, "kv must be torch.float8_e4m3fn"),
        (lambda a: {"indices": a["indices"].long()}, "indices must be int32"),
        (lambda a: {"q_scale": torch.ones(2)}, "q_scale must be a scalar tensor"),
        (lambda a: {"kv_scale": torch.ones((), dtype=torch.float16)}, "kv_scale must be float32"),
        (
            lambda a: {"out": torch.empty(4, 64, 512, dtype=torch.float16)},
            "out must have dtype torch.bfloat16",
        ),
        (lambda a: {"indices": a["indices"][..., :64]}, "positive multiple of 128"),
        (lambda a: {"d_v": 256}, "d_v"),
    ],
)
def test_contract_errors_are_value_errors_with_sglangs_phrases(make_inputs, change, phrase):
    args = make_inputs(4, 64, 256, 512, 128)
    args.update(change(args))
    with pytest.raises(ValueError, match=phrase):
        sglang.sparse_mla_q8kv8_prefill_fwd(**args)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _cache_views(layout: str, cache: torch.Tensor) -> dict:
    """The shapes engines hand over for one cache (a [num_pages, page_size, 1, bytes_per_token] view)."""
    base = cache._base
    views = {"decode view": cache, "pool of pages": base, "pool as bf16": base.view(torch.bfloat16)}
    if layout == "v32":
        views["token records"] = base.view(-1, 1, 656)
    return views


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["model1", "v32"])
def test_gather_through_sglangs_signature_is_bit_exact(generator, layout):
    page_size = 64
    cache = random_bytes_cache(layout, 5, page_size, generator)
    slots = torch.randint(-1, 5 * page_size, (700,), generator=generator, dtype=torch.int32)
    want = gather_dequant_paged_reference(cache, slots, page_size, layout, E4M3, 3)
    device_cache = to_device(cache, "cuda")
    for name, view in _cache_views(layout, device_cache).items():
        got = sglang.gather_dequant_requant_fp8_paged(view, slots.cuda(), page_size, extra_rows=3)
        assert got.shape == want.shape, name
        assert same_bits(got.cpu(), want), name
        out = torch.full_like(got.view(torch.uint8), 0x7E).view(E4M3)
        assert sglang.gather_dequant_requant_fp8_paged(view, slots.cuda().long(), page_size, 3, out) is out
        assert same_bits(out.cpu(), want), name


@pytest.mark.gpu
def test_cast_q_kernel_matches_the_pytorch_cast(generator):
    q = (torch.randn(33, 128, 576, generator=generator) * 300).to(torch.bfloat16)
    got, q_scale = sglang.cast_q_fp8_for_q8kv8_prefill(q.cuda())
    assert torch.equal(got.cpu().view(torch.uint8), plain_cast(q, 128).view(torch.uint8))
    assert q_scale.device == got.device
