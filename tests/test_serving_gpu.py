"""The paged serving path on an H100/H200 (``gpu`` marker; skipped elsewhere).

- The CuTe DSL gather is bit-exact with its PyTorch reference (any NaN matches any NaN: the kernel
  writes canonical NaNs) for every layout (V3.2, V4, V4.1, V4.1 FP4), both output types, page sizes 64
  and 256, int32 and int64 page tables, extra rows, reused outputs, caches of random bytes (every bit
  pattern) and of producer-quantised values.
- The slot-index kernel is bit-exact with its PyTorch reference (int32 and int64 tables and seqlens, every
  compress ratio, entries outside the table).
- ``SparsePrefill.forward`` (and ``forward_merged`` over two caches) matches the float64 ground truth
  decoded from the cache bytes for every compress ratio, with the tolerances of ``test_kernel_gpu.py`` (the
  kernel rounds P to e4m3), on both FP8 paths (straight from the cache, and through the workspace), and can
  be captured in a CUDA graph. Its FP8 backend hands the kernel the bfloat16 Q (quantised per row in the
  kernel, as the ground truth does): its results are the public call's on that Q
  (``sparse_mla_q8kv8_paged_fwd``, or ``sparse_mla_q8kv8_prefill_fwd`` on the workspace), bit for bit.
- The bf16 backend runs once ``q8kv8.kernels.launch_sparse_prefill_bf16`` exists (skipped before).
"""

import math

import pytest
import torch
from paged_cache import (
    expected_rows,
    fill_quantized,
    ground_truth,
    last_query,
    make_batch,
    random_bytes_cache,
    same_bits,
    to_device,
    union_ground_truth,
)
from reference_checks import assert_outputs_match

from q8kv8 import sparse_mla_q8kv8_paged_fwd, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import LOGITS_IN_FLOAT32, pad_topk, padded_num_heads
from q8kv8.paged_gather import gather_dequant_paged, gather_dequant_requant_fp8_paged
from q8kv8.query import cast_q_fp8, dynamic_q_scale
from q8kv8.reference import gather_dequant_paged_reference, slot_indices_reference
from q8kv8.serving import CacheRows, SparsePrefill, cuda_kernels, topk_length_for
from q8kv8.workspace import SparsePrefillWorkspace

pytestmark = pytest.mark.gpu

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
OUT_TOLERANCE = 4e-2  # the kernel rounds P to e4m3 (test_kernel_gpu.py)
STAT_TOLERANCE = 1e-2
SM_SCALE = 0.06
GATHER_LAYOUTS = ["model1", "v32", "v41", "v41_fp4"]


def gpu_gather(cache, slots, page_size, layout, out_dtype, extra_rows=0, out=None):
    result = gather_dequant_paged(cache, slots, page_size, layout, out_dtype, extra_rows, out)
    torch.cuda.synchronize()
    return result


# ------------------------------------------------------------------------------------------------
# Gather: bit-exact with the reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("extra_rows", [0, 5])
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("layout", GATHER_LAYOUTS)
def test_gather_bit_exact_on_random_bytes(generator, layout, page_size, extra_rows, out_dtype, slot_dtype):
    cache = random_bytes_cache(layout, 6, page_size, generator, extra_page_bytes=48)
    num_slots = 6 * page_size
    slots = torch.randint(0, num_slots, (3000,), generator=generator)
    slots[::7] = slots[3::7][: len(slots[::7])]  # duplicates
    slots[::97] = -1
    slots[5], slots[11] = num_slots, -(2**31)
    want = gather_dequant_paged_reference(
        cache, slots.to(slot_dtype), page_size, layout, out_dtype, extra_rows
    )
    got = gpu_gather(
        to_device(cache, "cuda"), slots.to(slot_dtype).cuda(), page_size, layout, out_dtype, extra_rows
    )
    assert got.shape == want.shape and got.dtype == out_dtype and got.is_contiguous()
    assert same_bits(got.cpu(), want)


@pytest.mark.parametrize("out_dtype", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("layout", GATHER_LAYOUTS)
def test_gather_bit_exact_on_quantized_cache(generator, layout, out_dtype):
    cache = random_bytes_cache(layout, 4, 64, generator)
    fill_quantized(cache, 64, layout, generator, std=3.0)
    slots = torch.randperm(256, generator=generator).to(torch.int32)
    want = gather_dequant_paged_reference(cache, slots, 64, layout, out_dtype)
    got = gpu_gather(to_device(cache, "cuda"), slots.cuda(), 64, layout, out_dtype).cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.isnan(got.float()).any()
    assert same_bits(want, expected_rows(cache, slots.tolist(), 64, layout, out_dtype))


@pytest.mark.parametrize("layout", GATHER_LAYOUTS)
def test_gather_reuses_out_and_rezeroes_extra_rows(generator, layout):
    cache = random_bytes_cache(layout, 3, 64, generator)
    slots = torch.randint(-2, 200, (100,), generator=generator)
    d_qk = 576 if layout == "v32" else 512
    out = torch.full((107, 1, d_qk), 0x7E, dtype=torch.uint8, device="cuda").view(E4M3)
    for _ in range(2):  # the second call finds the first one's rows in place
        got = gather_dequant_requant_fp8_paged(to_device(cache, "cuda"), slots.cuda(), 64, layout, 7, out)
        torch.cuda.synchronize()
        assert got is out
        assert (out[100:].view(torch.uint8) == 0).all()
        assert same_bits(out.cpu(), gather_dequant_paged_reference(cache, slots, 64, layout, E4M3, 7))
        out[100:].view(torch.uint8).fill_(0x7E)


def test_gather_float8_view_int64_high_words_and_empty_tables(generator):
    cpu_cache = random_bytes_cache("v32", 2, 64, generator)
    cache = to_device(cpu_cache, "cuda")
    slots = torch.tensor([2**32 + 1, 1, 2**31, -(2**40), 127], dtype=torch.int64)
    got = gpu_gather(cache.view(E4M3), slots.cuda(), 64, "v32", E4M3).cpu()
    assert (got[[0, 2, 3]].view(torch.uint8) == 0).all()
    assert same_bits(got, gather_dequant_paged_reference(cpu_cache, slots, 64, "v32"))
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    assert gpu_gather(cache, empty, 64, "v32", E4M3).shape == (0, 1, 576)
    landing = gpu_gather(cache, empty, 64, "v32", BF16, extra_rows=3)
    assert landing.shape == (3, 1, 576) and (landing.view(torch.int16) == 0).all()


def test_gather_many_rows_and_pages(generator):
    """200k rows (25k CTAs) from 4096 pages of 64 tokens, compared in chunks."""
    cache = torch.randint(0, 256, (4096, 64 * 656), generator=generator, dtype=torch.uint8)
    cache = cache.view(4096, 64, 1, 656)
    slots = torch.randint(0, 4096 * 64, (200_000,), generator=generator, dtype=torch.int32)
    got = gpu_gather(cache.cuda(), slots.cuda(), 64, "v32", E4M3, extra_rows=1).cpu()
    for start in range(0, 200_000, 25_000):
        chunk = slots[start : start + 25_000]
        assert same_bits(got[start : start + 25_000], gather_dequant_paged_reference(cache, chunk, 64, "v32"))
    assert (got[-1].view(torch.uint8) == 0).all()


@pytest.mark.parametrize("d", [512, 576])
@pytest.mark.parametrize("h", [1, 64, 70, 128])
def test_cast_q_fp8_kernel_matches_torch(generator, h, d):
    q = (torch.randn(33, h, d, generator=generator) * 50).to(BF16)
    q[0, 0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 1e30])
    for scale in (torch.tensor([0.3]), dynamic_q_scale(q[1:])):
        want = cast_q_fp8(q, scale)  # PyTorch, on CPU
        out = torch.full(want.shape, 0x7E, dtype=torch.uint8, device="cuda").view(E4M3)  # stale padding
        got = cast_q_fp8(q.cuda(), scale.cuda(), out=out)
        torch.cuda.synchronize()
        assert got is out and same_bits(got.cpu(), want)
        assert (got[:, h:].view(torch.uint8) == 0).all()


def test_cast_q_fp8_kernel_strided_and_misaligned_q(generator):
    big = (torch.randn(9, 130, 576, generator=generator) * 3).to(BF16)
    want = cast_q_fp8(big[:, 3:73], 0.25)
    strided = big.cuda()[:, 3:73]  # row strides 130 * 576 and 576: read in place
    assert same_bits(cast_q_fp8(strided, 0.25).cpu(), want)
    flat = torch.empty(big[:, 3:73].numel() + 1, dtype=BF16, device="cuda")
    misaligned = flat[1:].view(9, 70, 576)
    misaligned.copy_(big[:, 3:73])
    assert same_bits(cast_q_fp8(misaligned, 0.25).cpu(), want)
    assert cast_q_fp8(torch.zeros(0, 5, 576, dtype=BF16, device="cuda"), 1.0).shape == (0, 64, 576)


# ------------------------------------------------------------------------------------------------
# SparsePrefill.forward on the GPU
# ------------------------------------------------------------------------------------------------
def cuda_batch(batch: dict) -> dict:
    moved = dict(batch)
    for name in ("q", "page_table", "indices", "seqlens"):
        moved[name] = batch[name].cuda()
    moved["cache"] = to_device(batch["cache"], "cuda")
    return moved


def forward(prefill, batch, sink=None):
    result = prefill.forward(
        batch["q"],
        batch["cache"],
        batch["page_table"],
        batch["indices"],
        batch["seqlens"],
        batch["compress_ratio"],
        SM_SCALE,
        sink,
    )
    torch.cuda.synchronize()
    return result


def assert_matches(got, truth, out_tol=OUT_TOLERANCE, stat_tol=STAT_TOLERANCE):
    assert_outputs_match(tuple(t.cpu() for t in got), truth, out_tol, stat_tol)


@pytest.mark.parametrize("s_q, topk, topk_pad", [(700, 1000, 1024), (33, 5, 128), (3, 2100, 2176)])
@pytest.mark.parametrize("compress_ratio", [0, 4, 128])
@pytest.mark.parametrize("word_dtype", [torch.int32, torch.int64])
def test_slot_indices_kernel_is_the_reference(generator, word_dtype, compress_ratio, s_q, topk, topk_pad):
    """Every entry of the padded top-k, across the CTAs of a row (512 entries each), from a row-strided
    indices view."""
    table = torch.randint(0, 100000, (3000,), generator=generator).to(word_dtype)
    if word_dtype == torch.int64:
        table[::101] = 2**31 + 5  # outside int32: -1
    rows = torch.randint(-10, 3010, (s_q, topk + 3), generator=generator, dtype=torch.int32)
    seqlens = torch.randint(-3, 5000, (s_q,), generator=generator).to(word_dtype)
    want = slot_indices_reference(rows[:, 1 : topk + 1], table, seqlens, compress_ratio, topk_pad)
    indices = rows.cuda()[:, 1 : topk + 1]
    got = cuda_kernels().slot_indices(indices, table.cuda(), seqlens.cuda(), compress_ratio, topk_pad)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("path", ["paged", "workspace"])
@pytest.mark.parametrize("h", [20, 64, 128])
@pytest.mark.parametrize("compress_ratio", [0, 4, 128])
@pytest.mark.parametrize("layout", ["model1", "v32"])
def test_forward_fp8_matches_float64_ground_truth(generator, layout, compress_ratio, h, path):
    batch = make_batch(layout, 64, compress_ratio, h=h, topk=16, generator=generator)
    sink = torch.randn(h, generator=generator) if h != 64 else None
    prefill = SparsePrefill("fp8", path=path)
    got = forward(prefill, cuda_batch(batch), None if sink is None else sink.cuda())
    assert got[0].shape == (batch["q"].shape[0], h, 512) and prefill.last_path == path
    kv_format = "e4m3" if path == "workspace" else "f64"  # the paged path reads the cache as it is
    assert_matches(got, ground_truth(batch, layout, SM_SCALE, sink, kv_format=kv_format, quantize_q=True))
    assert_matches(got, ground_truth(batch, layout, SM_SCALE, sink), out_tol=8e-2, stat_tol=0.15)


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("path", ["paged", "workspace"])
def test_forward_merged_attends_two_caches_as_one_softmax(generator, path, precision):
    """V4's compressed rows and window rows, in two caches, attended as one softmax with the sink applied once
    (``forward_merged``), against the float64 attention over the union of the rows."""
    compressed = make_batch("model1", 64, 4, h=20, topk=16, generator=generator)
    window = make_batch("model1", 64, 4, h=20, topk=8, generator=generator)  # a second cache, same queries
    sink = torch.randn(20, generator=generator)
    prefill = SparsePrefill("fp8", precision=precision, path=path)
    parts = [
        CacheRows(b["cache"], b["page_table"], b["indices"], b["seqlens"], b["compress_ratio"])
        for b in map(cuda_batch, (compressed, window))
    ]
    got = prefill.forward_merged(compressed["q"].cuda(), parts, SM_SCALE, sink.cuda())
    torch.cuda.synchronize()
    assert prefill.last_path == ("paged" if path == "paged" else "workspace+workspace")  # one paged call
    kv_format = "e4m3" if path == "workspace" else "f64"
    q = compressed["q"]
    assert_matches(
        got, union_ground_truth(q, [compressed, window], "model1", SM_SCALE, sink, kv_format, True)
    )


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("path", ["auto", "paged"])
def test_forward_merged_reads_a_v41_fp4_cache_in_the_v41_paged_call(generator, path, precision):
    """A decode step over a V4.1 cache and its FP4 cache: ``forward_merged`` is one paged call with the FP4
    cache as its extra cache, the public call's result bit for bit (the slots its indices select through
    each page table, their topk_length, the layer's precision), and matches the float64 attention over the
    union of the rows within the bounds of FP4 values rounded to V4.1's records (test_paged_extra_gpu.py)."""
    # the last query alone: a decode step, which "auto" runs paged
    main = last_query(make_batch("v41", 64, 0, h=20, topk=16, generator=generator))
    fp4 = last_query(make_batch("v41_fp4", 64, 0, h=20, topk=8, generator=generator))  # the same query
    sink = torch.randn(20, generator=generator)
    prefill = SparsePrefill("fp8", precision=precision, path=path)
    on_gpu = [cuda_batch(b) for b in (main, fp4)]
    parts = [CacheRows(b["cache"], b["page_table"], b["indices"], b["seqlens"], 0) for b in on_gpu]
    got = prefill.forward_merged(on_gpu[0]["q"], parts, SM_SCALE, sink.cuda())
    assert prefill.last_path == "paged"
    (slots, topk_length), (extra_slots, extra_topk_length) = (
        slot_indices_reference(b["indices"], b["page_table"], b["seqlens"], 0, 128) for b in on_gpu
    )
    want = sparse_mla_q8kv8_paged_fwd(
        on_gpu[0]["q"], on_gpu[0]["cache"], slots, SM_SCALE, None, 512, sink.cuda(), topk_length,
        precision=precision, extra_cache=on_gpu[1]["cache"], extra_indices=extra_slots,
        extra_topk_length=extra_topk_length,
    )  # fmt: skip
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    truth = union_ground_truth(main["q"], [main, fp4], ["v41", "v41_fp4"], SM_SCALE, sink, "f64", True)
    assert_matches(got, truth, out_tol=8e-2, stat_tol=0.15)


@pytest.mark.parametrize("compress_ratio", [0, 4, 128])
@pytest.mark.parametrize("layout", ["model1", "v32"])
def test_forward_bf16_matches_float64_ground_truth(generator, layout, compress_ratio):
    batch = make_batch(layout, 64, compress_ratio, h=20, topk=16, generator=generator)
    sink = torch.randn(20, generator=generator)
    got = forward(SparsePrefill("bf16"), cuda_batch(batch), sink.cuda())
    assert_matches(got, ground_truth(batch, layout, SM_SCALE, sink, kv_format="bf16"), 2e-2, 1e-2)
    assert_matches(got, ground_truth(batch, layout, SM_SCALE, sink), 2e-2, 1e-2)


@pytest.mark.parametrize("with_sink", [True, False], ids=["sink", "no sink"])
@pytest.mark.parametrize("precision", ["default", "accurate"])
def test_forward_fp8_paged_is_the_public_paged_call(generator, precision, with_sink):
    """The layer's paged result is ``sparse_mla_q8kv8_paged_fwd`` on the bfloat16 Q, the slots its indices
    select through the page table and their topk_length, in the layer's precision (with a sink, S summed
    in float32: ``LOGITS_IN_FLOAT32``), bit for bit."""
    batch = cuda_batch(make_batch("model1", 64, 0, h=64, topk=200, generator=generator))
    sink = torch.randn(64, generator=generator).cuda() if with_sink else None
    got = forward(SparsePrefill("fp8", precision=precision, path="paged"), batch, sink)
    slots, topk_length = slot_indices_reference(
        batch["indices"], batch["page_table"], batch["seqlens"], 0, 256
    )
    kernel_precision = LOGITS_IN_FLOAT32[precision] if with_sink else precision
    want = sparse_mla_q8kv8_paged_fwd(
        batch["q"], batch["cache"], slots, SM_SCALE, None, 512, sink, topk_length, precision=kernel_precision
    )
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("h", [128, 20])
@pytest.mark.parametrize("topk", [200, 256])
def test_forward_fp8_is_the_public_call_on_the_bf16_q(generator, h, topk):
    """The layer's FP8 result on the workspace path is ``sparse_mla_q8kv8_prefill_fwd`` on the bfloat16 Q
    (zero heads appended up to a multiple of 64), the gathered rows, ``q_scale=None`` and kv_scale 1.0, with
    the sink's S summed in float32 (``LOGITS_IN_FLOAT32["default"]``), bit for bit (indices padded to a
    multiple of 128 by the layer, or taken as they are)."""
    batch = cuda_batch(make_batch("v32", 64, 4, h=h, topk=topk, generator=generator))
    sink = torch.randn(h, generator=generator).cuda()
    prefill = SparsePrefill("fp8", path="workspace")
    got = forward(prefill, batch, sink)
    q = batch["q"]
    h_pad = padded_num_heads(h)
    q_padded = torch.cat([q, q.new_zeros(q.shape[0], h_pad - h, q.shape[2])], dim=1)
    sink_padded = torch.cat([sink, sink.new_full((h_pad - h,), -math.inf)])
    kv = prefill.workspace.get(batch["page_table"].shape[0], E4M3)
    indices = pad_topk(batch["indices"][:, None, :])
    topk_length = topk_length_for(batch["seqlens"], 4, indices.shape[2])
    one = torch.ones(1, device="cuda")
    want = sparse_mla_q8kv8_prefill_fwd(
        q_padded,
        kv,
        indices,
        SM_SCALE,
        None,
        one,
        512,
        sink_padded,
        topk_length,
        precision=LOGITS_IN_FLOAT32["default"],
    )
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b[:, :h])


@pytest.mark.parametrize("path", ["paged", "workspace"])
def test_forward_replays_in_a_cuda_graph(generator, path):
    batch = cuda_batch(make_batch("v32", 64, 4, h=80, topk=200, generator=generator))
    sink = torch.randn(80, generator=generator).cuda()
    prefill = SparsePrefill("fp8", path=path, extra_rows=3)
    eager = [t.clone() for t in forward(prefill, batch, sink)]
    pointer = prefill.workspace.get(1, E4M3).data_ptr() if path == "workspace" else None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prefill.forward(
            batch["q"],
            batch["cache"],
            batch["page_table"],
            batch["indices"],
            batch["seqlens"],
            4,
            SM_SCALE,
            sink,
        )
    for tensor in captured:
        tensor.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)
    if path == "workspace":
        assert prefill.workspace.get(1, E4M3).data_ptr() == pointer and prefill.workspace.allocations == 1
    else:
        assert prefill.workspace is None


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda"), "cuda:0", None])
def test_workspace_on_cuda_keeps_its_buffer(device):
    """However the device is named ("cuda" is what users write; None means "cuda"), the workspace
    allocates once and hands out views of that buffer (a stable address for CUDA graphs)."""
    workspace = SparsePrefillWorkspace(device)
    first = workspace.get(64, E4M3)
    for rows in (64, 10, 64):
        assert workspace.get(rows, E4M3).data_ptr() == first.data_ptr()
    assert workspace.allocations == 1
