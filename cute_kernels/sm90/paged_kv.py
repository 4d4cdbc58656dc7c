"""Paged KV cache -> contiguous KV workspace: gather, dequantise, requantise (or widen to bf16).

``out[r] = convert(cache token slot slots[r])`` for ``r < num_tokens``; zeros for the ``extra_rows``
rows after them and for any slot outside ``[0, num_pages * page_size)``. Cache layouts MODEL1
(d_qk 512, UE8M0 scales), V3.2 (d_qk 576, float32 scales), V4.1 (d_qk 512, e4m3 values with UE8M0
scales, no bf16 RoPE) and V4.1 FP4 (d_qk 512, e2m1 values with e4m3 scales); ``out`` [rows, 1, d_qk]
e4m3 or bf16, bit-exact with ``q8kv8.reference.gather_dequant_paged_reference``. Each value times its
block scale in float32 (exact but for float32 subnormals), rounded once to the output type; e2m1 values
are first widened to the e4m3 values they equal (a byte permute). One thread per 16-byte output chunk.
From a V4.1 FP4 cache ``out`` may instead be [rows, 528] uint8, each row a record of V4.1's layout,
bit-exact with ``q8kv8.reference.fp4_rows_as_v41``: per 32 values (two FP4 scale blocks) the
UE8M0 scale 2^E, E the least with 6 * (the larger block scale) <= 448 * 2^E (0 for zero scales), each
value times its block scale times 2^-E rounded once to e4m3; and ``rows`` [num_tokens] int32 the record each
slot went to, r, or -1 for a slot outside the cache (the paged kernel's index slots of the records). Layouts
and conversion: docs/kernel.md.

Constraints: cache base and page stride 16-byte aligned, ``out`` 16-byte aligned and row-major,
``num_pages * page_size < 2^31``.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_kernels import ptx
from cute_kernels.ptx import (
    bf16x4_to_e4m3x4,
    inline_asm,
    ld_global_nc_b32,
    ld_global_nc_u8,
    ld_global_nc_v2,
    ld_global_nc_v4,
    st_global_v4,
)

CHUNK_BYTES = 16  # bytes per thread per row: one vector store
ROWS_PER_CTA_E4M3 = 8  # rows per CTA for an e4m3 output (half as many for bf16): 256 or 288 threads


class Layout(NamedTuple):
    """Byte layout of one token (mirrors ``q8kv8.kv_layout``; a CPU test checks they agree)."""

    d_nope: int
    d_rope: int
    scale_group: int  # nope values per scale
    token_bytes: int  # stride between tokens' data inside a page
    rope_offset: int  # RoPE offset inside the token's data
    scale_offset: int  # scales inside the record (V3.2, V4.1); MODEL1: -1 (page scale region)
    scale_record_bytes: int  # MODEL1: bytes per token in the scale region
    value_bits: int  # 8: e4m3 values; 4: e2m1 values, two a byte (low nibble first)
    scale_type: str  # "float32", "ue8m0" or "e4m3"


LAYOUTS = {
    "model1": Layout(448, 64, 64, 576, 448, -1, 8, 8, "ue8m0"),
    "v32": Layout(512, 64, 128, 656, 528, 512, 0, 8, "float32"),
    "v41": Layout(512, 0, 32, 528, 512, 512, 0, 8, "ue8m0"),
    "v41_fp4": Layout(512, 0, 16, 288, 256, 256, 0, 4, "e4m3"),
}


# ------------------------------------------------------------------------------------------
# Inline PTX: the conversions (explicit rounding, no FMA, no FTZ)
# ------------------------------------------------------------------------------------------
@dsl_user_op
def e8m0_to_f32_bits(byte, *, loc=None, ip=None) -> Uint32:
    """The float32 bits of the UE8M0 value 2^(byte - 127): byte 0 -> 2^-127 (subnormal), 255 -> NaN."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(byte).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .pred zero, nan;\n\t.reg .b32 bits;\n\t"
            "shl.b32 bits, $1, 23;\n\t"
            "setp.eq.u32 zero, $1, 0;\n\t"
            "setp.eq.u32 nan, $1, 255;\n\t"
            "selp.b32 bits, 0x00400000, bits, zero;\n\t"
            "selp.b32 $0, 0x7fc00000, bits, nan;\n\t}",
            "=r,r",
            False,
        )
    )


@dsl_user_op
def record_exponent(scale_bits, *, loc=None, ip=None) -> Int32:
    """The least E with 6 * s <= 448 * 2^E for the positive float32 s (an e4m3 scale) given by its bits: with
    c = ceil(log2(6 s)), c - 9, or c - 8 when 6 s > 1.75 * 2^(c - 1) (every step exact)."""
    return Int32(
        inline_asm(
            T.i32(),
            [Uint32(scale_bits).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .f32 b, t;\n\t.reg .b32 bits, e, m;\n\t.reg .pred p, q;\n\t"
            "mov.b32 b, $1;\n\tmul.rn.f32 b, b, 0f40C00000;\n\t"  # 6 s
            "mov.b32 bits, b;\n\tbfe.u32 e, bits, 23, 8;\n\tand.b32 m, bits, 0x7fffff;\n\t"
            "setp.ne.u32 p, m, 0;\n\t@p add.s32 e, e, 1;\n\t"  # c + 127
            "sub.s32 m, e, 1;\n\tshl.b32 m, m, 23;\n\tor.b32 m, m, 0x600000;\n\tmov.b32 t, m;\n\t"
            "setp.gt.f32 q, b, t;\n\tsub.s32 e, e, 136;\n\t@q add.s32 e, e, 1;\n\tmov.b32 $0, e;\n\t}",
            "=r,r",
            False,
        )
    )


@dsl_user_op
def pow2_scaled_bits(scale_bits, exponent, *, loc=None, ip=None) -> Uint32:
    """The float32 bits of s * 2^-E (exact) for the float32 s given by its bits and -126 <= -E <= 127."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(scale_bits).ir_value(loc=loc, ip=ip), Int32(exponent).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .f32 a, b;\n\t.reg .b32 e;\n\tmov.b32 a, $1;\n\tsub.s32 e, 127, $2;\n\t"
            "shl.b32 e, e, 23;\n\tmov.b32 b, e;\n\tmul.rn.f32 a, a, b;\n\tmov.b32 $0, a;\n\t}",
            "=r,r,r",
            False,
        )
    )


@dsl_user_op
def e4m3_to_f32_bits(byte, *, loc=None, ip=None) -> Uint32:
    """The float32 bits of the e4m3 value of ``byte`` (exact; 0x7f and 0xff -> NaN)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(byte).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b16 b;\n\t.reg .b32 h;\n\t.reg .f16 lo, hi;\n\t.reg .f32 f;\n\t"
            "cvt.u16.u32 b, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 h, b;\n\t"
            "mov.b32 {lo, hi}, h;\n\t"
            "cvt.f32.f16 f, lo;\n\t"
            "mov.b32 $0, f;\n\t}",
            "=r,r",
            False,
        )
    )


# The e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5 (low word) and 2, 3, 4, 6 (high word).
E2M1_AS_E4M3 = (0x3C383000, 0x4C484440)


@dsl_user_op
def e2m1x4_to_e4m3x4(word, high: bool, *, loc=None, ip=None) -> Uint32:
    """Four e2m1 values (the low or ``high`` 16 bits of ``word``, lowest nibble first) as the four e4m3 bytes
    of the same values (exact): each magnitude's byte picked by ``prmt``, its sign bit moved to bit 7."""
    source = "shr.b32 w, $1, 16;\n\t" if high else "mov.b32 w, $1;\n\t"
    signs = "".join(
        f"and.b32 t, w, {0x8 << (4 * i)};\n\tshl.b32 t, t, {4 * (i + 1)};\n\tor.b32 s, s, t;\n\t"
        for i in range(4)
    )
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(word).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 w, lo, hi, sel, mag, s, t;\n\t"
            + source
            + f"mov.b32 lo, {E2M1_AS_E4M3[0]};\n\tmov.b32 hi, {E2M1_AS_E4M3[1]};\n\t"
            "and.b32 sel, w, 0x7777;\n\t"
            "prmt.b32 mag, lo, hi, sel;\n\t"
            "mov.b32 s, 0;\n\t" + signs + "or.b32 $0, mag, s;\n\t}",
            "=r,r",
            False,
        )
    )


# Four e4m3 (one word, lowest byte first) -> four f32 products with the scale, in f0..f3.
_DEQUANT_E4M3X4 = (
    ".reg .b16 lo, hi;\n\t.reg .b32 h01, h23;\n\t.reg .f16 a0, a1, a2, a3;\n\t"
    ".reg .f32 s, f0, f1, f2, f3;\n\t"
    "mov.b32 {lo, hi}, $IN;\n\t"
    "cvt.rn.f16x2.e4m3x2 h01, lo;\n\t"
    "cvt.rn.f16x2.e4m3x2 h23, hi;\n\t"
    "mov.b32 {a0, a1}, h01;\n\t"
    "mov.b32 {a2, a3}, h23;\n\t"
    "mov.b32 s, $SCALE;\n\t"
    "cvt.f32.f16 f0, a0;\n\tcvt.f32.f16 f1, a1;\n\tcvt.f32.f16 f2, a2;\n\tcvt.f32.f16 f3, a3;\n\t"
    "mul.rn.f32 f0, f0, s;\n\tmul.rn.f32 f1, f1, s;\n\tmul.rn.f32 f2, f2, s;\n\tmul.rn.f32 f3, f3, s;\n\t"
)


@dsl_user_op
def requant_e4m3x4(word, scale_bits, *, loc=None, ip=None) -> Uint32:
    """Four e4m3 times a float32 scale, each product rounded (RN, saturating) back to e4m3."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(word).ir_value(loc=loc, ip=ip), Uint32(scale_bits).ir_value(loc=loc, ip=ip)],
            "{\n\t" + _DEQUANT_E4M3X4.replace("$IN", "$1").replace("$SCALE", "$2") + ".reg .b16 o01, o23;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 o01, f1, f0;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 o23, f3, f2;\n\t"
            "mov.b32 $0, {o01, o23};\n\t}",
            "=r,r,r",
            False,
        )
    )


@dsl_user_op
def dequant_e4m3x4_bf16(word, scale_bits, *, loc=None, ip=None):
    """Four e4m3 times a float32 scale, rounded (RN) to bf16: two bf16x2 words, lowest first."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Uint32(word).ir_value(loc=loc, ip=ip), Uint32(scale_bits).ir_value(loc=loc, ip=ip)],
        "{\n\t"
        + _DEQUANT_E4M3X4.replace("$IN", "$2").replace("$SCALE", "$3")
        + "cvt.rn.bf16x2.f32 $0, f1, f0;\n\t"
        "cvt.rn.bf16x2.f32 $1, f3, f2;\n\t}",
        "=r,=r,r,r",
        False,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2))


# ------------------------------------------------------------------------------------------
GATHER_OUTPUTS = ("e4m3", "bf16", "v41")
"""The gather's outputs: e4m3 rows (scale 1), bf16 rows, or V4.1 records (from a V4.1 FP4 cache only)."""
V41_RECORD_BYTES = LAYOUTS["v41"].token_bytes  # 512 e4m3 values, then 16 UE8M0 scales


class PagedKvGatherSm90:
    """Compile-time configuration: the cache layout (a name of ``LAYOUTS``) and the output (one of
    ``GATHER_OUTPUTS``)."""

    def __init__(self, layout: str, out: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
        if out not in GATHER_OUTPUTS or (out == "v41" and layout != "v41_fp4"):
            raise ValueError(f"out must be one of {GATHER_OUTPUTS} (v41 from a v41_fp4 cache), got {out!r}")
        self.layout_name = layout
        self.layout = LAYOUTS[layout]
        self.out_bf16 = out == "bf16"
        self.out_records = out == "v41"
        self.d_qk = self.layout.d_nope + self.layout.d_rope
        self.out_elem_bytes = 2 if self.out_bf16 else 1
        self.chunks = self.d_qk * self.out_elem_bytes // CHUNK_BYTES  # threads per row
        self.out_row_bytes = V41_RECORD_BYTES if self.out_records else self.chunks * CHUNK_BYTES
        self.values_per_chunk = CHUNK_BYTES // self.out_elem_bytes  # 16 (e4m3) or 8 (bf16)
        self.nope_chunks = self.layout.d_nope // self.values_per_chunk
        self.rows_per_cta = ROWS_PER_CTA_E4M3 // self.out_elem_bytes  # whole warps: 256 or 288 threads
        assert self.layout.scale_group % self.values_per_chunk == 0

    @cute.jit
    def __call__(
        self,
        mCache: cute.Tensor,  # [num_pages, page_bytes] uint8, page stride dynamic (multiple of 16)
        mSlots: cute.Tensor,  # [num_tokens, words] int32: words 1 (int32 table) or 2 (int64, lo/hi)
        mOut: cute.Tensor,  # [num_tokens + extra_rows, 1, d_qk] e4m3 or bf16, row-major; v41: [rows, 528]
        mRows: cute.Tensor,  # v41: [num_tokens] int32, each slot's record (or -1); None otherwise
        page_size: Int32,
        stream,
    ):
        num_rows = cute.size(mOut, mode=[0])
        grid = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mCache, mSlots, mOut, mRows, page_size).launch(
            grid=[grid, 1, 1], block=[self.chunks, self.rows_per_cta, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mCache: cute.Tensor,
        mSlots: cute.Tensor,
        mOut: cute.Tensor,
        mRows: cute.Tensor,
        page_size: Int32,
    ):
        chunk, row_in_cta, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        row = bid * self.rows_per_cta + row_in_cta
        if row < cute.size(mOut, mode=[0]):
            out_addr = mOut.iterator.toint() + Int64(row) * self.out_row_bytes + chunk * CHUNK_BYTES
            slot = Int32(-1)
            if row < cute.size(mSlots, mode=[0]):
                slot = mSlots[row, 0]
                if cute.size(mSlots, mode=[1]) > 1:  # an int64 table: slots >= 2^31 are invalid
                    if mSlots[row, 1] != 0:
                        slot = Int32(-1)
            num_slots = cute.size(mCache, mode=[0]) * page_size
            if const_expr(self.out_records):
                if (chunk == 0) & (row < cute.size(mRows, mode=[0])):
                    record = Int32(-1)
                    if (slot >= 0) & (slot < num_slots):
                        record = row
                    mRows[row] = record
            if (slot >= 0) & (slot < num_slots):
                page = slot // page_size
                pos = slot - page * page_size
                page_addr = mCache.iterator.toint() + Int64(page) * Int64(mCache.stride[0])
                token_addr = page_addr + Int64(pos * self.layout.token_bytes)
                if const_expr(self.layout.d_rope == 0):
                    self.convert_nope(out_addr, page_addr, token_addr, pos, page_size, chunk)
                else:
                    if chunk < self.nope_chunks:
                        self.convert_nope(out_addr, page_addr, token_addr, pos, page_size, chunk)
                    else:
                        self.convert_rope(out_addr, token_addr, chunk - self.nope_chunks)
            else:
                st_global_v4(out_addr, Uint32(0), Uint32(0), Uint32(0), Uint32(0))
                if const_expr(self.out_records):  # the record's scales 2^0
                    self.store_record_scales(out_addr - chunk * CHUNK_BYTES, chunk, Int32(0))

    @cute.jit
    def scale_bits(self, page_addr, token_addr, pos, page_size, chunk):
        """float32 bits of the scale of nope chunk ``chunk``."""
        lay = self.layout
        group = chunk // (lay.scale_group // self.values_per_chunk)
        bits = Uint32(0)
        if const_expr(lay.scale_type == "float32"):
            bits = ld_global_nc_b32(token_addr + lay.scale_offset + group * 4)
        elif const_expr(lay.scale_type == "e4m3"):
            bits = e4m3_to_f32_bits(ld_global_nc_u8(token_addr + lay.scale_offset + group))
        elif const_expr(lay.scale_offset >= 0):
            bits = e8m0_to_f32_bits(ld_global_nc_u8(token_addr + lay.scale_offset + group))
        else:
            scale_addr = page_addr + Int64(page_size * lay.token_bytes + pos * lay.scale_record_bytes)
            bits = e8m0_to_f32_bits(ld_global_nc_u8(scale_addr + group))
        return bits

    @cute.jit
    def convert_nope(self, out_addr, page_addr, token_addr, pos, page_size, chunk):
        scale = self.scale_bits(page_addr, token_addr, pos, page_size, chunk)
        if const_expr(self.out_records):
            self.convert_e2m1_record(out_addr, token_addr, chunk, scale)
        elif const_expr(self.layout.value_bits == 4):
            self.convert_e2m1(out_addr, token_addr, chunk, scale)
        elif const_expr(self.out_bf16):
            w = ld_global_nc_v2(token_addr + chunk * 8)
            lo = dequant_e4m3x4_bf16(w[0], scale)
            hi = dequant_e4m3x4_bf16(w[1], scale)
            st_global_v4(out_addr, lo[0], lo[1], hi[0], hi[1])
        else:
            w = ld_global_nc_v4(token_addr + chunk * CHUNK_BYTES)
            st_global_v4(
                out_addr,
                requant_e4m3x4(w[0], scale),
                requant_e4m3x4(w[1], scale),
                requant_e4m3x4(w[2], scale),
                requant_e4m3x4(w[3], scale),
            )

    @cute.jit
    def convert_e2m1(self, out_addr, token_addr, chunk, scale):
        """A chunk of e2m1 values (two a byte): 8 (bf16 out) or 16 (e4m3 out) of them, times the scale."""
        if const_expr(self.out_bf16):
            w = ld_global_nc_b32(token_addr + chunk * 4)
            lo = dequant_e4m3x4_bf16(e2m1x4_to_e4m3x4(w, False), scale)
            hi = dequant_e4m3x4_bf16(e2m1x4_to_e4m3x4(w, True), scale)
            st_global_v4(out_addr, lo[0], lo[1], hi[0], hi[1])
        else:
            w = ld_global_nc_v2(token_addr + chunk * 8)
            st_global_v4(
                out_addr,
                requant_e4m3x4(e2m1x4_to_e4m3x4(w[0], False), scale),
                requant_e4m3x4(e2m1x4_to_e4m3x4(w[0], True), scale),
                requant_e4m3x4(e2m1x4_to_e4m3x4(w[1], False), scale),
                requant_e4m3x4(e2m1x4_to_e4m3x4(w[1], True), scale),
            )

    @cute.jit
    def convert_e2m1_record(self, out_addr, token_addr, chunk, scale):
        """FP4 block ``chunk`` of a row (its 16 values, ``scale`` its e4m3 scale's float32 bits) into a V4.1
        record: lanes 2g and 2g + 1 of the row's warp hold scale group g's 32 values, whose exponent E comes
        from the larger of their two block scales (``record_exponent``; 0 when both are zero); the values
        times scale * 2^-E (exact) rounded once to e4m3, and the record's scale bytes."""
        larger = ptx.max_u32(scale, cute.arch.shuffle_sync_bfly(scale, offset=1))  # positive floats' bits
        exponent = Int32(0)
        if larger != 0:
            exponent = record_exponent(larger)
        self.convert_e2m1(out_addr, token_addr, chunk, pow2_scaled_bits(scale, exponent))
        self.store_record_scales(out_addr - chunk * CHUNK_BYTES, chunk, exponent)

    @cute.jit
    def store_record_scales(self, record_addr, chunk, exponent):
        """The 16 UE8M0 bytes after a record's values: group g's (E + 127, lanes 2g and 2g + 1 alike) packed
        four a word by lanes 0, 8, 16 and 24 of the row's warp."""
        byte = Uint32(exponent + 127)
        word = byte
        for k in cutlass.range_constexpr(1, 4):
            word = word | (Uint32(cute.arch.shuffle_sync(byte, (chunk + 2 * k) % 32)) << (8 * k))
        if chunk % 8 == 0:
            ptx.st_global_u32(record_addr + self.d_qk + chunk // 2, word)

    @cute.jit
    def convert_rope(self, out_addr, token_addr, rope_chunk):
        rope_addr = token_addr + self.layout.rope_offset
        if const_expr(self.out_bf16):
            w = ld_global_nc_v4(rope_addr + rope_chunk * CHUNK_BYTES)
            st_global_v4(out_addr, w[0], w[1], w[2], w[3])
        else:
            a = ld_global_nc_v4(rope_addr + rope_chunk * 2 * CHUNK_BYTES)
            b = ld_global_nc_v4(rope_addr + rope_chunk * 2 * CHUNK_BYTES + CHUNK_BYTES)
            st_global_v4(
                out_addr,
                bf16x4_to_e4m3x4(a[0], a[1]),
                bf16x4_to_e4m3x4(a[2], a[3]),
                bf16x4_to_e4m3x4(b[0], b[1]),
                bf16x4_to_e4m3x4(b[2], b[3]),
            )
