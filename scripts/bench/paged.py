"""Attention straight from the paged FP8 cache on an SM90 GPU: chunked prefill, decode, the precisions.

- **Chunked prefill** (``prefill_rows``): one request of ``prefix`` tokens (32k, 128k) in a DeepSeek V3.2
  or V4.1 cache (pages of 64 tokens at random slots, quantised with power-of-two scales), a chunk of s_q
  queries (256, 1024, 4096) at its end, h 16 / 64 / 128, topk 2048 distinct random rows. Arms,
  timed in interleaved rounds (L2 flushed before each call): the kernel on a ready workspace (``kernel``: the
  prefill kernel on the layer's bf16 Q and the gathered rows), the paged call alone (``paged``), the layer
  on the paged path (``layer``) and on the workspace path (``layer ws``), the gather alone, the gather then
  the kernel (``g+k``: the workspace path's two launches without the layer); and the layer's host time per
  call (issuing 50 calls, no sync).
- **Decode** (``decode_rows``): batch x (1-4 queries) of 64k-token requests, each query attending topk slots
  of its own request (10% -1), timed as decode runs: CUDA-graph replay, warm L2. Arms: the paged call, the
  kernel on the selected rows already gathered (``kernel``), and the gather of the selected rows + kernel
  (``ws``). V3.2 (h 128, 64, 16), V4 / MODEL1 and V4.1 rows (h 128, 64, 32, 16), topk 512 to 2048; V4 and
  V4.1 rows of one seed hold the same tokens.
- **Extra cache** (``extra_rows``): decode with a second cache in the same softmax (V4.1's FP4 cache next
  to its main cache, or two caches of one layout, as V4's compressed and SWA rows): both against the main
  cache alone; then the serving layer's step over both (``layer_rows``: ``SparsePrefill.forward_merged``,
  page tables of every token, the indices request-local rows) against the paged call on the same slots.
- **Precisions** (``precision_rows``): against float64 on the exactly dequantised cache (V3.2, V4, V4.1),
  with rows whose largest logit is 20-30: ``||out - ref|| / ||ref||`` and the worst relative error (with its
  sign) of max_logits and lse, for every precision, the paged call and the workspace path, 64 heads (tiles
  of 64) and 16 (the small-head kernel).

Called by ``python -m scripts.bench`` (``--no-paged`` skips it); alone: ``python -m scripts.bench.paged``.
"""

from __future__ import annotations

import sys

import torch

from q8kv8 import sparse_mla_q8kv8_paged_fwd, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import PRECISIONS
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.reference import dequantize_paged_cache, sparse_mla_paged_reference
from q8kv8.serving import CacheRows, SparsePrefill
from scripts.bench.common import host_us, measured_rows, random_indices, section_args, time_interleaved_ms

PAGE_SIZE = 64
TOPK = 2048
# (layout, prefix, s_q, h)
PREFIX_SHAPES = [
    (layout, prefix, s_q, h)
    for layout in ("v32", "v41")
    for prefix in (32768, 131072)
    for s_q in (256, 1024, 4096)
    for h in (16, 64, 128)
]
LIGHT_PREFIX_SHAPES = [
    ("v32", 32768, 256, 16),
    ("v32", 32768, 256, 128),
    ("v32", 131072, 1024, 128),
    ("v32", 131072, 4096, 64),
    ("v32", 131072, 4096, 128),
    ("v41", 131072, 1024, 64),
    ("v41", 131072, 4096, 64),
    ("v41", 131072, 4096, 128),
]
# (layout, batch, queries per request, h, topk)
DECODE_SHAPES = [
    ("v32", 64, 1, 128, 2048),
    ("v32", 128, 1, 128, 2048),
    ("v32", 32, 2, 128, 2048),
    ("v32", 64, 1, 64, 2048),
    ("v32", 128, 1, 16, 2048),
    ("v32", 32, 4, 16, 2048),
    ("v32", 8, 1, 16, 2048),
    ("v32", 8, 1, 128, 2048),
    ("v32", 8, 1, 64, 2048),
    ("v32", 64, 1, 128, 512),
    ("model1", 64, 1, 128, 512),
    ("model1", 64, 1, 64, 512),
    ("model1", 128, 1, 16, 512),
    ("model1", 64, 1, 64, 1152),
    ("v41", 64, 1, 128, 512),
    ("v41", 64, 1, 64, 512),
    ("v41", 128, 1, 16, 512),
    ("v41", 64, 1, 64, 1152),
    ("v41", 8, 1, 64, 1152),
    ("v41", 128, 1, 32, 2048),
    ("v41", 32, 1, 64, 1024),
    ("model1", 32, 1, 64, 1024),
    ("v41", 128, 1, 8, 1024),
    ("model1", 128, 1, 8, 1024),
]
DECODE_CONTEXT = 65536
# (main layout, extra layout, batch, h, topk, extra topk): one query a request
EXTRA_SHAPES = [
    ("v41", "v41_fp4", 64, 64, 512, 128),
    ("v41", "v41_fp4", 64, 64, 1024, 512),
    ("v41", "v41", 64, 64, 512, 128),
    ("model1", "model1", 64, 64, 512, 128),
    ("v41", "v41_fp4", 128, 16, 512, 128),
]
EXTRA_CONTEXT = 8192
# (main layout, extra layout, batch, h, topk, extra topk): the serving layer's decode step over two caches
LAYER_EXTRA_SHAPES = [
    ("v41", "v41_fp4", 64, 64, 512, 128),
    ("v41", "v41_fp4", 128, 16, 512, 128),
    ("model1", "model1", 64, 64, 512, 128),
]
LAYER_HOST_CALLS = 50  # a layer call's host time: this many calls issued without a sync
# d_qk, bytes a token, values a scale group, scale groups (V3.2 and V4: of the nope; V4.1: of all 512 values)
LAYOUTS = {"v32": (576, 656, 128, 4), "model1": (512, 584, 64, 7), "v41": (512, 528, 32, 16)}


def make_cache(num_slots: int, layout: str, std: float = 0.5, device="cuda") -> torch.Tensor:
    """``[num_pages, 64, 1, bytes_per_token]`` uint8: normal(0, std) tokens quantised with power-of-two
    scales per scale group (FlashMLA's V3.2 quantiser, V4's and V4.1's UE8M0), RoPE in bf16 (V3.2, V4) or
    e4m3 like the rest (V4.1). The same seed gives V4 and V4.1 caches of the same tokens."""
    d_qk, token_bytes, group, groups = LAYOUTS[layout]
    num_pages = -(-num_slots // PAGE_SIZE)
    page_bytes = PAGE_SIZE * token_bytes
    if layout == "model1":
        page_bytes = -(-page_bytes // 576) * 576
    pages = torch.zeros(num_pages, page_bytes, dtype=torch.uint8, device=device)
    step = 1 << 12
    for first in range(0, num_pages, step):
        count = min(step, num_pages - first)
        x = torch.randn(count * PAGE_SIZE, d_qk, device=device) * std
        d_nope = d_qk if layout == "v41" else d_qk - 64
        tiles = x[:, :d_nope].reshape(-1, groups, group)
        scales = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(dim=-1).clamp_min(1e-4) / 448.0)))
        nope = (tiles / scales[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, d_nope)
        rope = x[:, d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        chunk = pages[first : first + count]
        if layout == "v41":
            data = chunk.view(count * PAGE_SIZE, token_bytes)
            data[:, :512] = nope
            data[:, 512:] = (torch.log2(scales).round() + 127).to(torch.uint8)
        elif layout == "v32":
            data = chunk.view(count * PAGE_SIZE, token_bytes)
            data[:, :512] = nope
            data[:, 512:528] = scales.float().contiguous().view(torch.uint8)
            data[:, 528:] = rope
        else:
            data = chunk[:, : PAGE_SIZE * 576].unflatten(1, (PAGE_SIZE, 576))  # views: written in place
            data[..., :448] = nope.view(count, PAGE_SIZE, 448)
            data[..., 448:] = rope.view(count, PAGE_SIZE, 128)
            exponents = (torch.log2(scales).round() + 127).to(torch.uint8)
            region = chunk[:, PAGE_SIZE * 576 : PAGE_SIZE * 584].unflatten(1, (PAGE_SIZE, 8))
            region[..., :7] = exponents.view(count, PAGE_SIZE, 7)
    return pages[:, : PAGE_SIZE * token_bytes].view(num_pages, PAGE_SIZE, 1, token_bytes)


def prefill_rows(rep_ms: int, full: bool) -> list[dict]:
    shapes = PREFIX_SHAPES if full else LIGHT_PREFIX_SHAPES
    print(
        f"\npaged cache, chunked prefill (V3.2 and V4.1, pages of {PAGE_SIZE}, topk {TOPK}; L2 flushed): ms; "
        "kernel: on a ready workspace; x: over the kernel; host: the layer's host time per call"
    )
    print(
        f"{'layout':>6s} {'prefix':>7s} {'s_q':>5s} {'h':>4s} | {'kernel':>7s} | {'paged':>7s} {'x':>5s} | "
        f"{'layer':>7s} {'x':>5s} | {'layer ws':>8s} {'x':>5s} | {'gather':>7s} {'g+k':>7s} | "
        f"{'host us':>7s} {'ws':>7s} | auto"
    )
    rows = []
    cache, cache_layout = None, None
    for layout, prefix, s_q, h in shapes:
        if cache is None or cache_layout != layout or cache.shape[0] * PAGE_SIZE < prefix + prefix // 4:
            cache, cache_layout = None, layout
            cache = make_cache(prefix + prefix // 4, layout)
        row = prefill_row(cache, layout, prefix, s_q, h, rep_ms)
        k = row["kernel"]
        print(
            f"{layout:>6s} {prefix:7d} {s_q:5d} {h:4d} | {k:7.3f} | {row['paged']:7.3f} "
            f"{row['paged'] / k:5.2f} | {row['layer']:7.3f} {row['layer'] / k:5.2f} | {row['layer_ws']:8.3f} "
            f"{row['layer_ws'] / k:5.2f} | {row['gather']:7.3f} {row['gather_kernel']:7.3f} | "
            f"{row['host_us']:7.1f} "
            f"{row['host_ws_us']:7.1f} | {row['auto']}",
            flush=True,
        )
        rows.append(row)
    return rows


def prefill_row(cache, layout: str, prefix: int, s_q: int, h: int, rep_ms: int) -> dict:
    """One chunked-prefill row: a request of ``prefix`` tokens at random slots of ``cache`` (``layout``)."""
    torch.manual_seed(0)
    d_qk = LAYOUTS[layout][0]
    page_table = torch.randperm(cache.shape[0] * PAGE_SIZE, device="cuda")[:prefix].to(torch.int32)
    q = (torch.randn(s_q, h, d_qk, device="cuda") * 0.5).to(torch.bfloat16)
    sm_scale = d_qk**-0.5
    inputs = {
        "q": q,
        "cache": cache,
        "page_table": page_table,
        "indices": random_indices(s_q, prefix, TOPK, "cuda"),
        "seqlens": torch.arange(prefix - s_q + 1, prefix + 1, dtype=torch.int32, device="cuda"),
        "compress_ratio": 0,
        "sm_scale": sm_scale,
    }
    layer, workspace = SparsePrefill("fp8", path="paged"), SparsePrefill("fp8", path="workspace")
    layer.forward(**inputs)
    workspace.forward(**inputs)
    kv = workspace.workspace.get(prefix, torch.float8_e4m3fn, d_qk)
    slots, topk_length = layer.kernels.slot_indices(inputs["indices"], page_table, inputs["seqlens"], 0, TOPK)
    one = torch.ones(1, device="cuda")
    indices = inputs["indices"][:, None, :]
    arms = {
        "kernel": lambda: sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, sm_scale, None, one, 512, None, topk_length
        ),
        "paged": lambda: sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale, None, 512, None, topk_length),
        "layer": lambda: layer.forward(**inputs),
        "layer_ws": lambda: workspace.forward(**inputs),
        "gather": lambda: gather_dequant_paged(
            cache, page_table, PAGE_SIZE, layout, torch.float8_e4m3fn, 0, kv
        ),
    }
    arms["gather_kernel"] = lambda: (arms["gather"](), arms["kernel"]())
    row = {"layout": layout, "prefix": prefix, "s_q": s_q, "h": h, **time_interleaved_ms(arms, rep_ms)}
    row["host_us"] = host_us(lambda: layer.forward(**inputs), LAYER_HOST_CALLS)
    row["host_ws_us"] = host_us(lambda: workspace.forward(**inputs), LAYER_HOST_CALLS)
    auto = SparsePrefill("fp8")
    auto.forward(**inputs)
    row["auto"] = auto.last_path
    return row


def decode_inputs(layout: str, batch: int, queries: int, h: int, topk: int) -> dict:
    """A decode step's inputs: ``batch`` requests of ``DECODE_CONTEXT`` tokens at random pages of one cache,
    ``queries`` new tokens each attending ``topk`` distinct slots of its request (10% -1)."""
    torch.manual_seed(0)
    d_qk = LAYOUTS[layout][0]
    pages_per_request = DECODE_CONTEXT // PAGE_SIZE
    cache = make_cache(batch * DECODE_CONTEXT, layout)
    page_order = torch.randperm(cache.shape[0], device="cuda").view(batch, pages_per_request)
    s_q = batch * queries
    local = random_indices(s_q, DECODE_CONTEXT, topk, "cuda").long()
    request = torch.arange(s_q, device="cuda") // queries
    slots = page_order[request[:, None], local // PAGE_SIZE] * PAGE_SIZE + local % PAGE_SIZE
    slots = torch.where(torch.rand(slots.shape, device="cuda") < 0.1, -1, slots).to(torch.int32)
    q = (torch.randn(s_q, h, d_qk, device="cuda") * 0.5).to(torch.bfloat16)
    return {"q": q, "cache": cache, "indices": slots[:, None, :], "sm_scale": d_qk**-0.5}


def graph_ms(call, replays: int = 50) -> float:
    """Median CUDA-graph replay time of ``call`` (warm L2: replays back to back)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_rows() -> list[dict]:
    print(
        f"\npaged cache, decode ({DECODE_CONTEXT}-token requests, CUDA-graph replay, warm L2): ms; paged: "
        "the call from the cache; kernel: on the selected rows already gathered; ws: gather + kernel; err: "
        "out vs "
        "float64 (default / accurate)"
    )
    print(
        f"{'layout':>6s} {'batch':>5s} {'q':>2s} {'h':>4s} {'topk':>5s} | {'paged':>7s} {'acc':>7s} | "
        f"{'kernel':>7s} {'ws':>7s} | {'err':>17s}"
    )
    return measured_rows(DECODE_SHAPES, decode_row, decode_line)


def decode_line(shape: tuple, row: dict) -> str:
    layout, batch, queries, h, topk = shape
    errors = row["out_error"]
    return (
        f"{layout:>6s} {batch:5d} {queries:2d} {h:4d} {topk:5d} | {row['paged']:7.4f} "
        f"{row['paged_accurate']:7.4f} | {row['kernel']:7.4f} {row['ws']:7.4f} | "
        f"{errors[0]:8.2e} {errors[1]:8.2e}"
    )


def decode_row(layout: str, batch: int, queries: int, h: int, topk: int) -> dict:
    inputs = decode_inputs(layout, batch, queries, h, topk)
    q, cache, slots, sm_scale = inputs["q"], inputs["cache"], inputs["indices"], inputs["sm_scale"]
    s_q = q.shape[0]
    selected = slots.view(-1)
    buffers = {
        "out": torch.empty(s_q, h, 512, dtype=torch.bfloat16, device="cuda"),
        "max_logits": torch.empty(s_q, h, device="cuda"),
        "lse": torch.empty(s_q, h, device="cuda"),
    }
    kv = gather_dequant_paged(cache, selected, PAGE_SIZE, layout, torch.float8_e4m3fn)
    rows_of = torch.arange(s_q * topk, device="cuda", dtype=torch.int32).view(s_q, 1, topk)
    rows_of = torch.where(slots >= 0, rows_of, -1)
    one = torch.ones(1, device="cuda")
    row = {"layout": layout, "batch": batch, "queries": queries, "h": h, "topk": topk}
    row["paged"] = graph_ms(lambda: sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale, **buffers))
    row["paged_accurate"] = graph_ms(
        lambda: sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale, precision="accurate", **buffers)
    )
    row["kernel"] = graph_ms(
        lambda: sparse_mla_q8kv8_prefill_fwd(q, kv, rows_of, sm_scale, None, one, **buffers)
    )

    def gather_and_kernel():
        gather_dequant_paged(cache, selected, PAGE_SIZE, layout, torch.float8_e4m3fn, 0, kv)
        sparse_mla_q8kv8_prefill_fwd(q, kv, rows_of, sm_scale, None, one, **buffers)

    row["ws"] = graph_ms(gather_and_kernel)
    errors = []
    check = slice(0, min(s_q, 16))
    for precision in ("default", "accurate"):
        got = sparse_mla_q8kv8_paged_fwd(q[check], cache, slots[check], sm_scale, precision=precision)
        ref = sparse_mla_paged_reference(q[check], cache, slots[check], sm_scale, None, chunk_rows=4)
        errors.append(((got[0].double() - ref[0]).norm() / ref[0].norm()).item())
    row["out_error"] = errors
    return row


def precision_rows() -> list[dict]:
    """Errors against float64 on the dequantised cache, rows with a dominant logit of 20-30."""
    print(
        "\nprecisions against float64 (paged V3.2, V4 and V4.1 caches, topk 2048, a dominant logit of 20-30 "
        "per row): out rel err; max_logits / lse: worst relative error, signed"
    )
    print(
        f"{'layout':>6s} {'h':>3s} {'path':>9s} {'precision':>15s} | {'out':>8s} | {'max_logits':>10s} | "
        f"{'lse':>10s}"
    )
    rows = []
    for layout in ("v32", "model1", "v41"):
        cache = make_cache(32768, layout)
        all_slots = torch.arange(32768, device="cuda", dtype=torch.int32)
        kv = gather_dequant_paged(cache, all_slots, PAGE_SIZE, layout)
        rows_kv = dequantize_paged_cache(cache)
        rows += [row for h in (64, 16) for row in precision_rows_of(cache, kv, rows_kv, h, layout)]
    return rows


def precision_rows_of(
    cache: torch.Tensor, kv: torch.Tensor, rows_kv: torch.Tensor, h: int, layout: str = "v32"
) -> list[dict]:
    """``precision_rows``' rows for ``h`` heads: the cache (``layout``), its gathered e4m3 rows and its
    exactly dequantised rows given."""
    torch.manual_seed(1)
    s_q = 64
    d_qk = LAYOUTS[layout][0]
    slots = random_indices(s_q, 32768, TOPK, "cuda")[:, None, :]
    q = torch.randn(s_q, h, d_qk, device="cuda", dtype=torch.float64) * 0.3
    sm_scale = d_qk**-0.5
    for token in range(s_q):
        row = rows_kv[slots[token, 0, 0], 0].to("cuda")
        target = 20.0 + 10.0 * torch.rand(h, device="cuda", dtype=torch.float64)
        q[token] += row[None, :] * (target / (row.square().sum() * sm_scale))[:, None]
    q = q.to(torch.bfloat16)
    reference = sparse_mla_paged_reference(q, cache, slots, sm_scale, None, chunk_rows=8)
    one = torch.ones(1, device="cuda")
    results = []
    for path in ("paged", "workspace"):
        for precision in PRECISIONS:
            if path == "paged":
                got = sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale, precision=precision)
            else:
                got = sparse_mla_q8kv8_prefill_fwd(q, kv, slots, sm_scale, None, one, precision=precision)
            out_error = ((got[0].double() - reference[0]).norm() / reference[0].norm()).item()
            signed = []
            for got_stat, want in zip(got[1:], reference[1:], strict=True):
                relative = (got_stat.double() - want) / want.abs()
                signed.append(relative.view(-1)[relative.abs().argmax()].item())
            row = {"layout": layout, "h": h, "path": path, "precision": precision}
            results.append(row | {"out": out_error, "logits": signed})
            print(
                f"{layout:>6s} {h:3d} {path:>9s} {precision:>15s} | {out_error:8.2e} | {signed[0]:+10.2e} | "
                f"{signed[1]:+10.2e}",
                flush=True,
            )
    return results


def fp4_cache(num_slots: int, device="cuda") -> torch.Tensor:
    """A V4.1 FP4 cache (``[num_pages, 64, 1, 288]``) of random e2m1 values (every code) times random e4m3
    scales of 0.05-0.15 per 16 values: values of about the main caches' magnitude."""
    tokens = -(-num_slots // PAGE_SIZE) * PAGE_SIZE
    values = torch.randint(0, 256, (tokens, 256), dtype=torch.uint8, device=device)
    scales = (0.05 + 0.1 * torch.rand(tokens, 32, device=device)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, scales], dim=1).view(-1, PAGE_SIZE, 1, 288)


def extra_rows() -> list[dict]:
    """Decode with an extra cache in the same softmax (V4.1's FP4 cache, or a second cache of the main
    cache's layout, as V4's SWA rows beside its compressed ones): the call with both caches against the main
    cache alone."""
    print(
        f"\npaged cache with an extra cache, decode ({DECODE_CONTEXT}-token requests, extra caches of "
        f"{EXTRA_CONTEXT} tokens a request, CUDA-graph replay): ms; main: the main cache alone; +extra: both "
        "caches in one softmax; err: out vs float64 (default)"
    )
    print(f"{TWO_CACHES_HEADER}{'main':>7s} {'+extra':>7s} {'x':>5s} | {'err':>8s}")
    return measured_rows(EXTRA_SHAPES, extra_row, extra_line)


TWO_CACHES_HEADER = f"{'layout':>6s} {'extra':>7s} {'batch':>5s} {'h':>4s} {'topk':>5s} {'extra':>5s} | "


def two_caches(row: dict) -> str:
    """A two-cache row's shape, as ``TWO_CACHES_HEADER`` heads it."""
    return (
        f"{row['layout']:>6s} {row['extra_layout']:>7s} {row['batch']:5d} {row['h']:4d} {row['topk']:5d} "
        f"{row['extra_topk']:5d} | "
    )


def extra_line(shape: tuple, row: dict) -> str:
    return (
        f"{two_caches(row)}{row['main']:7.4f} {row['extra']:7.4f} {row['extra'] / row['main']:5.2f} | "
        f"{row['out_error']:8.2e}"
    )


def extra_row(layout: str, extra_layout: str, batch: int, h: int, topk: int, extra_topk: int) -> dict:
    inputs = decode_inputs(layout, batch, 1, h, topk)
    q, cache, slots, sm_scale = inputs["q"], inputs["cache"], inputs["indices"], inputs["sm_scale"]
    num_slots = batch * EXTRA_CONTEXT
    extra = fp4_cache(num_slots) if extra_layout == "v41_fp4" else make_cache(num_slots, extra_layout)
    request = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None] * EXTRA_CONTEXT
    extra_slots = (random_indices(batch, EXTRA_CONTEXT, extra_topk, "cuda") + request)[
        :, None, :
    ].contiguous()
    both = {"extra_cache": extra, "extra_indices": extra_slots}
    row = {"layout": layout, "extra_layout": extra_layout, "batch": batch, "h": h, "topk": topk}
    row["extra_topk"] = extra_topk
    row["main"] = graph_ms(lambda: sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale))
    row["extra"] = graph_ms(lambda: sparse_mla_q8kv8_paged_fwd(q, cache, slots, sm_scale, **both))
    check = slice(0, min(batch, 16))
    checked = {"extra_cache": extra, "extra_indices": extra_slots[check]}
    got = sparse_mla_q8kv8_paged_fwd(q[check], cache, slots[check], sm_scale, **checked)
    ref = sparse_mla_paged_reference(q[check], cache, slots[check], sm_scale, None, chunk_rows=4, **checked)
    row["out_error"] = ((got[0].double() - ref[0]).norm() / ref[0].norm()).item()
    return row


def layer_rows() -> list[dict]:
    """The serving layer's decode step over a cache and its extra cache (``forward_merged``: one paged call
    where both parts go paged), against the paged call with the extra cache on the same slots."""
    print(
        f"\nserving layer, decode over two caches ({DECODE_CONTEXT}-token requests, extra caches of "
        f"{EXTRA_CONTEXT} tokens a request, a sink, CUDA-graph replay): ms; layer: forward_merged; call: "
        "the paged call on the same slots; same: its outputs bit for bit the layer's"
    )
    print(f"{TWO_CACHES_HEADER}{'layer':>7s} {'call':>7s} {'x':>5s} | {'path':>6s} {'same':>5s}")
    return measured_rows(LAYER_EXTRA_SHAPES, layer_row, layer_line)


def layer_line(shape: tuple, row: dict) -> str:
    return (
        f"{two_caches(row)}{row['layer']:7.4f} {row['call']:7.4f} {row['layer'] / row['call']:5.2f} | "
        f"{row['path']:>6s} {str(row['same']):>5s}"
    )


def layer_part(cache: torch.Tensor, batch: int, context: int, topk: int) -> CacheRows:
    """One query a request over ``context`` tokens of its own: the page table every token's slot (rows are
    slots), ``topk`` distinct rows of the request a query."""
    first_row = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None] * context
    return CacheRows(
        cache,
        torch.arange(batch * context, device="cuda", dtype=torch.int32),
        (random_indices(batch, context, topk, "cuda") + first_row).contiguous(),
        torch.full((batch,), context, device="cuda", dtype=torch.int32),
        0,
    )


def layer_row(layout: str, extra_layout: str, batch: int, h: int, topk: int, extra_topk: int) -> dict:
    torch.manual_seed(0)
    main = layer_part(make_cache(batch * DECODE_CONTEXT, layout), batch, DECODE_CONTEXT, topk)
    num_slots = batch * EXTRA_CONTEXT
    extra_cache = fp4_cache(num_slots) if extra_layout == "v41_fp4" else make_cache(num_slots, extra_layout)
    extra = layer_part(extra_cache, batch, EXTRA_CONTEXT, extra_topk)
    d_qk = LAYOUTS[layout][0]
    q = (torch.randn(batch, h, d_qk, device="cuda") * 0.5).to(torch.bfloat16)
    sink, sm_scale = torch.randn(h, device="cuda"), d_qk**-0.5
    layer = SparsePrefill("fp8")
    row = {"layout": layout, "extra_layout": extra_layout, "batch": batch, "h": h, "topk": topk}
    row["extra_topk"] = extra_topk
    row["layer"] = graph_ms(lambda: layer.forward_merged(q, [main, extra], sm_scale, sink))
    row["path"] = layer.last_path
    both = {"extra_cache": extra.cache, "extra_indices": extra.indices[:, None, :]}
    slots = main.indices[:, None, :]
    row["call"] = graph_ms(
        lambda: sparse_mla_q8kv8_paged_fwd(q, main.cache, slots, sm_scale, None, 512, sink, **both)
    )
    got = layer.forward_merged(q, [main, extra], sm_scale, sink)
    want = sparse_mla_q8kv8_paged_fwd(q, main.cache, slots, sm_scale, None, 512, sink, **both)
    row["same"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return row


def run(rep_ms: int = 40, full: bool = False) -> dict:
    return {
        "prefill": prefill_rows(rep_ms, full),
        "decode": decode_rows(),
        "extra": extra_rows(),
        "layer": layer_rows(),
        "precisions": precision_rows(),
    }


def main() -> int:
    args = section_args(__doc__, 40, "--full", "every chunked-prefill shape", "paged")
    if args is None:
        return 2
    run(args.rep, args.full)
    return 0


if __name__ == "__main__":
    sys.exit(main())
