"""Test helpers for the paged KV caches: build caches byte by byte, quantise values as the producers do,
decode them independently.

The byte offsets here are written out from the format descriptions (FlashMLA ``tests/quant.py``,
``flash_mla_interface.py``; for V4.1, the 528- and 288-byte formats of docs/kernel.md), not taken from
``q8kv8.kv_layout``, so the tests check the package's layout tables rather than repeat them.
"""

import math
import struct

import torch

# name: (d_nope, d_rope, values per scale, bytes per token in the [pages, page_size, 1, B] view)
FORMATS = {
    "model1": (448, 64, 64, 584),
    "v32": (512, 64, 128, 656),
    "v41": (512, 0, 32, 528),
    "v41_fp4": (512, 0, 16, 288),
}
V41_VALUE_BYTES = {"v41": 512, "v41_fp4": 256}  # then the scale bytes, to the end of the token's record
E2M1_MAX, E4M3_TINY = 6.0, 2.0**-9  # the largest e2m1 value, the smallest positive e4m3 one


def page_bytes(layout: str, page_size: int) -> int:
    """Bytes per page as the producers allocate them (MODEL1 pads pages to a multiple of 576)."""
    raw = page_size * FORMATS[layout][3]
    return -(-raw // 576) * 576 if layout == "model1" else raw


def empty_cache(layout: str, num_pages: int, page_size: int, extra_page_bytes: int = 0) -> torch.Tensor:
    """A zeroed uint8 cache viewed as [num_pages, page_size, 1, bytes_per_token] with a page stride of
    ``page_bytes + extra_page_bytes`` (as FlashMLA's tests do for non-contiguous caches)."""
    stride = page_bytes(layout, page_size) + extra_page_bytes
    storage = torch.zeros(num_pages, stride, dtype=torch.uint8)
    per_token = FORMATS[layout][3]
    return storage[:, : page_size * per_token].view(num_pages, page_size, 1, per_token)


def to_device(cache: torch.Tensor, device) -> torch.Tensor:
    """``cache`` on ``device`` with the same strides (moves the whole underlying buffer)."""
    base = cache._base if cache._base is not None else cache
    moved = base.to(device)
    offset = cache.storage_offset() - base.storage_offset()
    return moved.as_strided(cache.shape, cache.stride(), moved.storage_offset() + offset)


def random_bytes_cache(layout: str, num_pages: int, page_size: int, generator, extra_page_bytes=0):
    """A cache of uniformly random bytes: every e4m3, UE8M0, float32 and bf16 pattern, NaN and inf too."""
    cache = empty_cache(layout, num_pages, page_size, extra_page_bytes)
    base = cache._base
    base.copy_(torch.randint(0, 256, base.shape, generator=generator, dtype=torch.uint8))
    return cache


def _page(cache: torch.Tensor, page: int) -> torch.Tensor:
    """The flat bytes of one page (a view)."""
    return cache[page].reshape(-1)


def write_token(cache, slot, page_size, layout, nope_bytes, scales, rope_bf16) -> None:
    """Store one token: ``nope_bytes`` uint8 [d_nope] (e4m3 bit patterns; V4.1 FP4: [256], two e2m1 codes a
    byte, the even value's in the low nibble), ``scales`` (MODEL1: uint8 UE8M0 bytes [7]; V3.2: float32 [4];
    V4.1: UE8M0 bytes [16]; V4.1 FP4: e4m3 bytes [32]), ``rope_bf16`` bfloat16 [64] (V4.1: None)."""
    page, pos = divmod(slot, page_size)
    flat = _page(cache, page)
    if layout in V41_VALUE_BYTES:
        token, value_bytes = FORMATS[layout][3], V41_VALUE_BYTES[layout]
        flat[pos * token : pos * token + value_bytes] = nope_bytes
        flat[pos * token + value_bytes : (pos + 1) * token] = scales
        return
    rope = rope_bf16.contiguous().view(torch.uint8)
    if layout == "model1":
        flat[pos * 576 : pos * 576 + 448] = nope_bytes
        flat[pos * 576 + 448 : pos * 576 + 576] = rope
        flat[page_size * 576 + pos * 8 : page_size * 576 + pos * 8 + 7] = scales
    else:
        base = pos * 656
        flat[base : base + 512] = nope_bytes
        flat[base + 512 : base + 528] = scales.to(torch.float32).contiguous().view(torch.uint8)
        flat[base + 528 : base + 656] = rope


def fill_random(cache, page_size, layout, generator, *, scale_bytes=(120, 134), finite=True) -> None:
    """Random tokens in every slot: e4m3 nope bytes (NaN patterns excluded when ``finite``) or random e2m1
    codes (V4.1 FP4), UE8M0 scale bytes in ``scale_bytes`` (MODEL1, V4.1), random positive float32 scales
    (V3.2) or positive e4m3 scales of 2^-7 to 2^4 (V4.1 FP4), bf16 RoPE."""
    d_nope, d_rope, group, _ = FORMATS[layout]
    num_slots = cache.shape[0] * page_size
    for slot in range(num_slots):
        nope = torch.randint(
            0, 256, (d_nope * _value_bits(layout) // 8,), generator=generator, dtype=torch.uint8
        )
        if finite and layout != "v41_fp4":
            nope[(nope & 0x7F) == 0x7F] = 0x3C  # 0x7f / 0xff are NaN in e4m3fn
        if layout == "v41_fp4":
            scales = torch.randint(0x10, 0x60, (d_nope // group,), generator=generator).to(torch.uint8)
            write_token(cache, slot, page_size, layout, nope, scales, None)
            continue
        if layout in ("model1", "v41"):
            scales = torch.randint(scale_bytes[0], scale_bytes[1], (d_nope // group,), generator=generator)
            scales = scales.to(torch.uint8)
        else:
            scales = torch.rand(d_nope // group, generator=generator) * 0.02 + 1e-3
        rope = (torch.randn(d_rope, generator=generator) * 3).to(torch.bfloat16)
        write_token(cache, slot, page_size, layout, nope, scales, rope)


def _value_bits(layout: str) -> int:
    return 4 if layout == "v41_fp4" else 8


def fill_quantized(cache, page_size, layout, generator, std=1.0) -> None:
    """Every slot holds normal(0, std) values quantised the producers' way (FlashMLA ``quantize_k_cache``):
    per scale group, scale = max|x| / 448 (a power of two rounded up for MODEL1's UE8M0, the exact
    float32 quotient for V3.2), nope = e4m3(x / scale), RoPE = bf16(x); V4.1: ``quantize_v41``'s rules."""
    d_nope, d_rope, group, _ = FORMATS[layout]
    for slot in range(cache.shape[0] * page_size):
        x = torch.randn(d_nope + d_rope, generator=generator) * std
        if layout in V41_VALUE_BYTES:  # quantize_v41's rules
            values, scale_field = quantize_v41(x[None], layout)
            write_token(cache, slot, page_size, layout, values[0], scale_field[0], None)
            continue
        tiles = x[:d_nope].view(-1, group)
        scales = tiles.abs().amax(dim=1).clamp_min(1e-4) / 448.0
        if layout == "model1":
            exponents = torch.ceil(torch.log2(scales))
            scales, scale_field = torch.exp2(exponents), (exponents + 127).to(torch.uint8)
        else:
            scale_field = scales
        nope = (tiles / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).flatten()
        write_token(cache, slot, page_size, layout, nope, scale_field, x[d_nope:].to(torch.bfloat16))


def quantized_cache(
    layout: str, num_pages: int, page_size: int, generator, *, pow2_scales: bool, std=1.0, extra_page_bytes=64
) -> torch.Tensor:
    """A cache whose every slot holds normal(0, std) values quantised as the producers quantise them, built
    with whole-tensor operations (``fill_quantized`` writes one slot at a time): per scale group scale =
    max|x| / 448, rounded up to a power of two (``pow2_scales``: FlashMLA's V3.2 quantiser and V4's UE8M0) or
    the exact float32 quotient (V3.2 as SGLang's quantiser writes it); nope = e4m3(x / scale), RoPE = bf16(x).
    V4.1 and V4.1 FP4 caches: ``quantize_v41``'s tokens (``pow2_scales`` has no say).
    ``std``: one for every value, or a [d_qk] tensor of each column's.
    """
    d_nope, d_rope, group, _ = FORMATS[layout]
    cache = empty_cache(layout, num_pages, page_size, extra_page_bytes)
    slots = num_pages * page_size
    x = torch.randn(slots, d_nope + d_rope, generator=generator) * std
    if layout in V41_VALUE_BYTES:
        values, scales = quantize_v41(x, layout)
        token = FORMATS[layout][3]
        data = cache._base.view(num_pages, -1)[:, : page_size * token].view(num_pages, page_size, token)
        data[...] = torch.cat([values, scales], dim=1).view(num_pages, page_size, token)
        return cache
    tiles = x[:, :d_nope].reshape(slots, -1, group)
    scales = tiles.abs().amax(dim=2).clamp_min(1e-4) / 448.0
    if pow2_scales or layout == "model1":
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    nope = (tiles / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    rope = x[:, d_nope:].to(torch.bfloat16).view(torch.uint8)
    pages = cache._base.view(num_pages, -1)
    token = 576 if layout == "model1" else 656
    data = pages[:, : page_size * token].view(num_pages, page_size, token)
    data[..., :d_nope] = nope.view(num_pages, page_size, d_nope)
    if layout == "model1":
        data[..., 448:576] = rope.view(num_pages, page_size, 128)
        scale_bytes = (torch.log2(scales).round() + 127).to(torch.uint8).view(num_pages, page_size, 7)
        region = pages[:, page_size * 576 : page_size * 584].view(num_pages, page_size, 8)
        region[..., :7] = scale_bytes
    else:
        data[..., 512:528] = scales.to(torch.float32).view(torch.uint8).view(num_pages, page_size, 16)
        data[..., 528:656] = rope.view(num_pages, page_size, 128)
    return cache


def pow2_fp4_scales(cache: torch.Tensor, generator) -> torch.Tensor:
    """A V4.1 FP4 cache's e4m3 scales (bytes 256 to 287 of each token) replaced, in place, by powers of two
    from 2^-4 to 2^2: its values times their scales are then exact in e4m3. Returns ``cache``."""
    exponents = torch.randint(-4, 3, (*cache.shape[:3], 32), generator=generator)
    cache[..., 256:] = torch.exp2(exponents.float()).to(torch.float8_e4m3fn).view(torch.uint8)
    return cache


def quantize_v41(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``x`` [n, 512] (float32) quantised to a V4.1 cache's records: ``(value bytes, scale bytes)``,
    uint8 [n, 512] and [n, 16] ("v41") or [n, 256] and [n, 32] ("v41_fp4").

    "v41", the rule of FlashMLA ``tests/quant.py`` for UE8M0 scales (``_cast_scale_inv_to_ue8m0``) on
    groups of 32: scale = 2^ceil(log2(max(max|x| / 448, 1e-4))), its byte log2(scale) + 127; value =
    e4m3(x / scale) rounded to nearest even (|x / scale| <= 448: never saturates).
    "v41_fp4", groups of 16: scale = max|x| / 6 clamped to [2^-9, 448] and rounded to nearest even into
    e4m3 (so |x / scale| may reach 6.4); value = x / scale saturated to +-6 and rounded to the nearest e2m1
    value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even code (0, 1, 2, 4); the code is sign << 3 | index of
    the magnitude, value 2 i in the low nibble of byte i.
    """
    n = x.shape[0]
    if layout == "v41":
        tiles = x.float().view(n, 16, 32)
        scales = torch.exp2(torch.ceil(torch.log2((tiles.abs().amax(dim=2) / 448.0).clamp_min(1e-4))))
        values = (tiles / scales[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
        return values, (torch.log2(scales).round() + 127).to(torch.uint8)
    tiles = x.float().view(n, 32, 16)
    scales = (tiles.abs().amax(dim=2) / E2M1_MAX).clamp(E4M3_TINY, 448.0).to(torch.float8_e4m3fn)
    y = (tiles / scales.float()[..., None]).clamp(-E2M1_MAX, E2M1_MAX).flatten(1)
    a = y.abs()
    index = (a > 0.25).int() + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    codes = (index + 8 * torch.signbit(y).int()).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales.view(torch.uint8)


def _ue8m0_value(byte: int) -> float:
    """The value of a UE8M0 scale byte: 2^(byte - 127), NaN for 255."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def _e2m1_value(code: int) -> float:
    """The value of a 4-bit e2m1 code: sign, two exponent bits (bias 1), one mantissa bit."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else math.ldexp(1.0 + mantissa * 0.5, exponent - 1)
    return -magnitude if code & 8 else magnitude


def decode_token_f64(cache, slot, page_size, layout) -> list[float]:
    """The exact (float64) dequantised values of one token: nope * scale, then RoPE."""
    d_nope, d_rope, group, _ = FORMATS[layout]
    page, pos = divmod(slot, page_size)
    flat = _page(cache, page)
    if layout == "v41_fp4":
        record = flat[pos * 288 : pos * 288 + 288].tolist()
        values = [_e2m1_value(code) for byte in record[:256] for code in (byte & 15, byte >> 4)]
        scales = torch.tensor(record[256:], dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
        return [v * scales[i // group] for i, v in enumerate(values)]
    rope = flat[:0]
    if layout == "v41":
        nope = flat[pos * 528 : pos * 528 + 512]
        scales = [_ue8m0_value(b) for b in flat[pos * 528 + 512 : pos * 528 + 528].tolist()]
    elif layout == "model1":
        nope = flat[pos * 576 : pos * 576 + 448]
        rope = flat[pos * 576 + 448 : pos * 576 + 576]
        scale_bytes = flat[page_size * 576 + pos * 8 : page_size * 576 + pos * 8 + 7].tolist()
        scales = [_ue8m0_value(b) for b in scale_bytes]
    else:
        nope = flat[pos * 656 : pos * 656 + 512]
        scales = list(struct.unpack("<4f", bytes(flat[pos * 656 + 512 : pos * 656 + 528].tolist())))
        rope = flat[pos * 656 + 528 : pos * 656 + 656]
    nope_values = nope.contiguous().view(torch.float8_e4m3fn).double().tolist()
    rope_values = rope.contiguous().view(torch.bfloat16).double().tolist()
    return [v * scales[i // group] for i, v in enumerate(nope_values)] + rope_values


def expected_rows(cache, slots, page_size, layout, out_dtype, extra_rows=0) -> torch.Tensor:
    """What the gather must produce, computed token by token from ``decode_token_f64``: the float32
    product (the exact product rounded once to float32), then e4m3 (RN, saturating) or bf16."""
    d_nope, d_rope, _, _ = FORMATS[layout]
    num_slots = cache.shape[0] * page_size
    rows = torch.zeros(len(slots) + extra_rows, 1, d_nope + d_rope, dtype=out_dtype)
    for r, slot in enumerate(slots):
        if not 0 <= slot < num_slots:
            continue
        values = torch.tensor(decode_token_f64(cache, slot, page_size, layout), dtype=torch.float64).float()
        if out_dtype == torch.float8_e4m3fn:
            rows[r, 0] = values.clamp(-448.0, 448.0).to(out_dtype)
        else:
            rows[r, 0] = values.to(out_dtype)
    return rows


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that any NaN matches any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(nan_a, nan_b):
        return False
    int_type = torch.uint8 if a.element_size() == 1 else torch.int16
    return bool(((a.view(int_type) == b.view(int_type)) | nan_a).all())


# ------------------------------------------------------------------------------------------------
# A synthetic serving batch for SparsePrefill.forward, and its float64 ground truth
# ------------------------------------------------------------------------------------------------
# compress ratio: (kv_len, extend_len) per request; the second request of each is a fresh prefill.
BATCH_SHAPES = {0: ((90, 9), (37, 37)), 4: ((90, 9), (45, 45)), 128: ((300, 12), (140, 140))}


def make_batch(layout, page_size, compress_ratio, h, topk, generator, *, garbage_tail=True) -> dict:
    """Two requests whose attended rows (tokens, or compressed rows for ratio r) sit at random slots
    of a random paged cache; indices are request-local picks plus the request's first row, left-packed,
    the rest -1 or (``garbage_tail``) random in-range rows that ``topk_length`` must hide."""
    requests = BATCH_SHAPES[compress_ratio]
    rows_per_request = [kv_len // compress_ratio if compress_ratio else kv_len for kv_len, _ in requests]
    num_rows = sum(rows_per_request)
    num_pages = -(-(num_rows + page_size // 2) // page_size) + 1  # some slots stay unused
    cache = empty_cache(layout, num_pages, page_size, extra_page_bytes=64)
    fill_quantized(cache, page_size, layout, generator)
    slots = torch.randperm(num_pages * page_size, generator=generator)[:num_rows]
    indices, seqlens, n_valid, first_row = [], [], [], 0
    for (kv_len, extend_len), rows in zip(requests, rows_per_request, strict=True):
        for position in range(kv_len - extend_len, kv_len):
            visible = (position + 1) // compress_ratio if compress_ratio else position + 1
            count = min(visible, topk)
            picks = torch.randperm(visible, generator=generator)[:count] + first_row
            tail = torch.full((topk - count,), -1, dtype=torch.int64)
            if garbage_tail and num_rows:
                tail = torch.randint(0, num_rows, (topk - count,), generator=generator)
            indices.append(torch.cat([picks, tail]))
            seqlens.append(position + 1)
            n_valid.append(count)
        first_row += rows
    s_q = len(seqlens)
    d_qk = FORMATS[layout][0] + FORMATS[layout][1]
    return {
        "q": (torch.randn(s_q, h, d_qk, generator=generator) * 0.5).to(torch.bfloat16),
        "cache": cache,
        "page_table": slots.to(torch.int32),
        "indices": torch.stack(indices).to(torch.int32),
        "seqlens": torch.tensor(seqlens, dtype=torch.int32),
        "compress_ratio": compress_ratio,
        "page_size": page_size,
        "n_valid": torch.tensor(n_valid),
    }


def last_query(batch: dict) -> dict:
    """``batch`` (``make_batch``) cut to its last query alone: a decode step over its request's rows."""
    return {**batch, **{name: batch[name][-1:] for name in ("q", "indices", "seqlens", "n_valid")}}


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()


def ground_truth(batch, layout, sm_scale, attn_sink=None, kv_format="f64", quantize_q=False):
    """Float64 attention of every query over the rows it may see (its first ``n_valid`` indices).

    ``kv_format``: "f64" (exact dequantised cache), "e4m3" or "bf16" (rounded as the gather's output
    is). ``quantize_q``: each (token, head) row of q rounded to e4m3 with its own power-of-two scale, the
    smallest 2^e with max |row| <= 448 * 2^e (as the FP8 kernel quantises a bfloat16 q)."""
    return union_ground_truth(batch["q"], [batch], layout, sm_scale, attn_sink, kv_format, quantize_q)


def union_ground_truth(q, batches, layout, sm_scale, attn_sink=None, kv_format="f64", quantize_q=False):
    """``ground_truth`` of ``q`` over the union of the rows each batch (a cache of its own) lets a query see:
    one softmax over them all. ``layout`` and ``kv_format``: the caches', or a list of each batch's."""
    from q8kv8.reference import sparse_mla_prefill_reference

    layouts = [layout] * len(batches) if isinstance(layout, str) else layout
    kv_formats = [kv_format] * len(batches) if isinstance(kv_format, str) else kv_format
    rows, indices = [], []
    for batch, layout, kv_format in zip(batches, layouts, kv_formats, strict=True):
        slots = batch["page_table"].tolist()
        kv = torch.tensor(
            [decode_token_f64(batch["cache"], s, batch["page_size"], layout) for s in slots],
            dtype=torch.float64,
        ).reshape(len(slots), FORMATS[layout][0] + FORMATS[layout][1])
        if kv_format == "e4m3":
            kv = e4m3_round(kv.float())
        elif kv_format == "bf16":
            kv = kv.float().to(torch.bfloat16).double()
        topk = batch["indices"].shape[1]
        valid = torch.arange(topk)[None, :] < batch["n_valid"][:, None]
        first = sum(len(r) for r in rows)
        indices.append(torch.where(valid, batch["indices"].long() + first, -1))
        rows.append(kv)
    kv = torch.cat(rows).reshape(-1, 1, rows[0].shape[1])
    q = q.double()
    if quantize_q:
        amax = q.abs().amax(dim=-1, keepdim=True)
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448.0, min=2.0**-126))))
        scale = torch.where(amax == 0, 1.0, scale)
        q = e4m3_round(q / scale) * scale
    indices = torch.cat(indices, dim=1)
    return sparse_mla_prefill_reference(q, kv, indices[:, None, :], sm_scale, 1.0, 1.0, 512, attn_sink)
