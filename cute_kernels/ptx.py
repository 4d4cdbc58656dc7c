"""Inline-PTX helpers for the SM90 kernels.

Each helper wraps one or two PTX instructions whose operands the kernels compute by hand
(shared-memory byte addresses as 32-bit integers, global addresses as 64-bit integers), so
the address arithmetic stays explicit and testable instead of hidden in layout algebra.
"""

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# L2 cache-policy operand for "evict last" (the value CUTLASS uses for CacheHintSm90::EVICT_LAST):
# gathered KV rows are shared by neighbouring query tokens, so keep them in L2.
L2_EVICT_LAST = 0x14F0000000000000


def inline_asm(ret_type, operands, text, constraints, side_effects):
    """One inline-PTX statement (AT&T dialect): ``text`` with ``$i`` operands, LLVM ``constraints``."""
    return llvm.inline_asm(
        ret_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def cp_async_16_zfill(smem_addr, gmem_addr, src_bytes, evict_last: bool = True, *, loc=None, ip=None) -> None:
    """16-byte cp.async global -> shared (L2 evict-last unless ``evict_last`` is False: no cache-policy
    operand); bytes past ``src_bytes`` are zero-filled.

    ``src_bytes`` 0 reads nothing from global memory and writes 16 zero bytes.
    """
    operands = [
        Int32(smem_addr).ir_value(loc=loc, ip=ip),
        Int64(gmem_addr).ir_value(loc=loc, ip=ip),
        Int32(src_bytes).ir_value(loc=loc, ip=ip),
    ]
    if evict_last:
        operands.append(Int64(L2_EVICT_LAST).ir_value(loc=loc, ip=ip))
        inline_asm(
            None,
            operands,
            "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2, $3;",
            "r,l,r,l",
            True,
        )
    else:
        inline_asm(None, operands, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", True)


@dsl_user_op
def cp_async_4_zfill(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None) -> None:
    """4-byte cp.async global -> shared (both addresses 4-byte aligned; no cache-policy operand); bytes past
    ``src_bytes`` are zero-filled (0: nothing is read)."""
    inline_asm(
        None,
        [
            Int32(smem_addr).ir_value(loc=loc, ip=ip),
            Int64(gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.ca.shared.global [$0], [$1], 4, $2;",
        "r,l,r",
        True,
    )


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    inline_asm(None, [], "cp.async.wait_all;", "", True)


@dsl_user_op
def ldmatrix_x4_trans(smem_addr, *, loc=None, ip=None):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16``: four 8x8 b16 matrices, transposed.

    Lane L supplies the address of row L % 8 of matrix L // 8 (16 contiguous bytes).
    Returns the four 32-bit registers (one per matrix).
    """
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        True,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


def _b32_op(instruction: str, a, b, *, loc=None, ip=None) -> Uint32:
    """One PTX instruction on two 32-bit words (``$1``, ``$2``) giving one (``$0``)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
            instruction,
            "=r,r,r",
            False,
        )
    )


@dsl_user_op
def prmt(a, b, selector, *, loc=None, ip=None) -> Uint32:
    """``prmt.b32``: byte i of the result is byte ``(selector >> 4i) & 7`` of the pair {b:a} (``selector`` a
    Python int or a run-time 32-bit value)."""
    if isinstance(selector, int):
        return _b32_op(f"prmt.b32 $0, $1, $2, {selector:#x};", a, b, loc=loc, ip=ip)
    operands = [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, selector)]
    return Uint32(inline_asm(T.i32(), operands, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", False))


@dsl_user_op
def pack_e4m3x4(x0, x1, x2, x3, *, loc=None, ip=None) -> Uint32:
    """Round four f32 to e4m3 (RN, saturating to +-448) and pack them: x0 in the lowest byte."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)],
            "{\n\t.reg .b16 lo, hi;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
            "mov.b32 $0, {lo, hi};\n\t}",
            "=r,f,f,f,f",
            False,
        )
    )


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    """Round two f32 to bf16 (RN) and pack them: ``lo`` in the low half."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $2, $1;",
            "=r,f,f",
            False,
        )
    )


@dsl_user_op
def zero_f32(*, loc=None, ip=None) -> Float32:
    """0.0 from a volatile ``mov``: a constant the compiler cannot hoist. Accumulators zeroed from
    it are defined where this runs (after ``setmaxregister``), not in the kernel's prologue,
    where LLVM otherwise hoists constant zeros and ptxas then spills them under the prologue's
    register limit."""
    return Float32(inline_asm(T.f32(), [], "mov.b32 $0, 0f00000000;", "=f", True))


@dsl_user_op
def mul_rn_f32(a, b, *, loc=None, ip=None) -> Float32:
    """``a * b`` rounded to nearest (``mul.rn.f32``: its explicit rounding keeps ptxas from fusing it into a
    following add, so a later subtraction sees the rounded product)."""
    return Float32(
        inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            "mul.rn.f32 $0, $1, $2;",
            "=f,f,f",
            False,
        )
    )


@dsl_user_op
def st_shared_u32(smem_addr, value, *, loc=None, ip=None) -> None:
    inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)],
        "st.shared.b32 [$0], $1;",
        "r,r",
        True,
    )


@dsl_user_op
def st_shared_u16(smem_addr, value, *, loc=None, ip=None) -> None:
    """Store the low 16 bits of ``value``."""
    inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 h; cvt.u16.u32 h, $1; st.shared.b16 [$0], h; }",
        "r,r",
        True,
    )


def _ld_shared_b32(instruction: str, smem_addr, *, loc=None, ip=None) -> Uint32:
    """One shared-memory load into a 32-bit register."""
    operands = [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
    return Uint32(inline_asm(T.i32(), operands, f"{instruction} $0, [$1];", "=r,r", True))


@dsl_user_op
def ld_shared_u32(smem_addr, *, loc=None, ip=None) -> Uint32:
    return _ld_shared_b32("ld.shared.b32", smem_addr, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_u8(smem_addr, *, loc=None, ip=None) -> Uint32:
    return _ld_shared_b32("ld.shared.u8", smem_addr, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_f32(smem_addr, *, loc=None, ip=None) -> Float32:
    operands = [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
    return Float32(inline_asm(T.f32(), operands, "ld.shared.f32 $0, [$1];", "=f,r", True))


@dsl_user_op
def f32_from_bits(bits, *, loc=None, ip=None) -> Float32:
    """The float32 whose bit pattern is ``bits``."""
    return Float32(
        inline_asm(T.f32(), [Uint32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r", False)
    )


@dsl_user_op
def ld_shared_v4(smem_addr, *, loc=None, ip=None):
    """16-byte shared load: four 32-bit words."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        True,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def s32_to_f32_bits(value, *, loc=None, ip=None) -> Uint32:
    """The float32 bits of the signed integer ``value`` (``cvt.rn.f32.s32``)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Int32(value).ir_value(loc=loc, ip=ip)],
            "{ .reg .f32 f; cvt.rn.f32.s32 f, $1; mov.b32 $0, f; }",
            "=r,r",
            False,
        )
    )


@dsl_user_op
def f32_product_to_f16x2(a_bits, b_bits, *, loc=None, ip=None) -> Uint32:
    """The float32 product of two float32 (given by their bits), rounded (RN, saturating) to f16 and packed
    into both halves."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(a_bits).ir_value(loc=loc, ip=ip), Uint32(b_bits).ir_value(loc=loc, ip=ip)],
            "{ .reg .f32 a, b; .reg .b16 h; mov.b32 a, $1; mov.b32 b, $2; mul.rn.f32 a, a, b;\n\t"
            "cvt.rn.satfinite.f16.f32 h, a; mov.b32 $0, {h, h}; }",
            "=r,r,r",
            False,
        )
    )


@dsl_user_op
def ceil_log2_f32_bits(bits, *, loc=None, ip=None) -> Int32:
    """The least integer e with x <= 2^e for the positive float32 x given by its bits, at least -126 (zero
    and subnormals give -126)."""
    return Int32(
        inline_asm(
            T.i32(),
            [Uint32(bits).ir_value(loc=loc, ip=ip)],
            "{ .reg .b32 e, m; .reg .pred p;\n\t"
            "bfe.u32 e, $1, 23, 8; and.b32 m, $1, 0x7fffff; setp.ne.u32 p, m, 0;\n\t"
            "@p add.s32 e, e, 1; sub.s32 e, e, 127; max.s32 $0, e, -126; }",
            "=r,r",
            False,
        )
    )


@dsl_user_op
def scale_e4m3x4_f16(word, scales_lo, scales_hi, *, loc=None, ip=None) -> Uint32:
    """Four e4m3 (``word``, lowest byte first) times f16 scales: bytes 0 and 1 by the two halves of
    ``scales_lo``, bytes 2 and 3 by those of ``scales_hi``, each product (exact in f16 for a power-of-two
    scale) rounded to e4m3 (RN, saturating)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [
                Uint32(word).ir_value(loc=loc, ip=ip),
                Uint32(scales_lo).ir_value(loc=loc, ip=ip),
                Uint32(scales_hi).ir_value(loc=loc, ip=ip),
            ],
            "{\n\t.reg .b16 lo, hi;\n\t.reg .b32 flo, fhi;\n\t"
            "mov.b32 {lo, hi}, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 flo, lo;\n\t"
            "cvt.rn.f16x2.e4m3x2 fhi, hi;\n\t"
            "mul.rn.f16x2 flo, flo, $2;\n\t"
            "mul.rn.f16x2 fhi, fhi, $3;\n\t"
            "cvt.rn.satfinite.e4m3x2.f16x2 lo, flo;\n\t"
            "cvt.rn.satfinite.e4m3x2.f16x2 hi, fhi;\n\t"
            "mov.b32 $0, {lo, hi};\n\t}",
            "=r,r,r,r",
            False,
        )
    )


@dsl_user_op
def e4m3x4_residual(w01, w23, hi, *, loc=None, ip=None) -> Uint32:
    """Four bf16 (two words, lowest first) minus their e4m3 roundings ``hi`` (packed, lowest first), each
    difference (exact in float32) rounded to e4m3 (RN, saturating) and packed: the lo term of a two-term
    e4m3 split."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(w).ir_value(loc=loc, ip=ip) for w in (w01, w23, hi)],
            "{\n\t.reg .b32 t0, t1, t2, t3, h01, h23;\n\t.reg .b16 b01, b23, o01, o23;\n\t"
            ".reg .f16 a0, a1, a2, a3;\n\t.reg .f32 x0, x1, x2, x3, y0, y1, y2, y3;\n\t"
            "shl.b32 t0, $1, 16;\n\tand.b32 t1, $1, 0xffff0000;\n\t"
            "shl.b32 t2, $2, 16;\n\tand.b32 t3, $2, 0xffff0000;\n\t"
            "mov.b32 x0, t0;\n\tmov.b32 x1, t1;\n\tmov.b32 x2, t2;\n\tmov.b32 x3, t3;\n\t"
            "mov.b32 {b01, b23}, $3;\n\t"
            "cvt.rn.f16x2.e4m3x2 h01, b01;\n\tcvt.rn.f16x2.e4m3x2 h23, b23;\n\t"
            "mov.b32 {a0, a1}, h01;\n\tmov.b32 {a2, a3}, h23;\n\t"
            "cvt.f32.f16 y0, a0;\n\tcvt.f32.f16 y1, a1;\n\tcvt.f32.f16 y2, a2;\n\tcvt.f32.f16 y3, a3;\n\t"
            "sub.rn.f32 x0, x0, y0;\n\tsub.rn.f32 x1, x1, y1;\n\t"
            "sub.rn.f32 x2, x2, y2;\n\tsub.rn.f32 x3, x3, y3;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 o01, x1, x0;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 o23, x3, x2;\n\t"
            "mov.b32 $0, {o01, o23};\n\t}",
            "=r,r,r,r",
            False,
        )
    )


@dsl_user_op
def st_global_u32(gmem_addr, value, store=None, *, loc=None, ip=None) -> None:
    """Store 32 bits at ``gmem_addr``; with ``store`` (an Int32), only when it is non-zero (a predicated
    store, no branch)."""
    operands = [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)]
    if store is None:
        inline_asm(None, operands, "st.global.b32 [$0], $1;", "l,r", True)
    else:
        operands.append(Int32(store).ir_value(loc=loc, ip=ip))
        inline_asm(
            None,
            operands,
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.b32 [$0], $1; }",
            "l,r,r",
            True,
        )


@dsl_user_op
def pack_f16x2(x0, x1, *, loc=None, ip=None) -> Uint32:
    """Two f32 rounded to f16 (RN) and packed, x0 in the low half."""
    return Uint32(
        inline_asm(
            T.i32(),
            [Float32(x0).ir_value(loc=loc, ip=ip), Float32(x1).ir_value(loc=loc, ip=ip)],
            "cvt.rn.f16x2.f32 $0, $2, $1;",
            "=r,f,f",
            False,
        )
    )


@dsl_user_op
def split_e4m3x4_from_f16x2(h01, h23, *, loc=None, ip=None):
    """Two-term e4m3 split of four f16 values (two f16x2): ``hi = e4m3(h)`` and
    ``lo = e4m3(h - hi)`` (RN, saturating), each packed with the low half of ``h01`` in the lowest
    byte, so that ``hi + lo`` carries about 8 significant bits (the difference ``h - hi`` is exact in
    f16)."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Uint32(h01).ir_value(loc=loc, ip=ip), Uint32(h23).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b16 a, b, c, d;\n\t.reg .b32 ra, rb;\n\t"
        "cvt.rn.satfinite.e4m3x2.f16x2 a, $2;\n\t"
        "cvt.rn.satfinite.e4m3x2.f16x2 b, $3;\n\t"
        "mov.b32 $0, {a, b};\n\t"
        "cvt.rn.f16x2.e4m3x2 ra, a;\n\t"
        "cvt.rn.f16x2.e4m3x2 rb, b;\n\t"
        "sub.rn.f16x2 ra, $2, ra;\n\t"
        "sub.rn.f16x2 rb, $3, rb;\n\t"
        "cvt.rn.satfinite.e4m3x2.f16x2 c, ra;\n\t"
        "cvt.rn.satfinite.e4m3x2.f16x2 d, rb;\n\t"
        "mov.b32 $1, {c, d};\n\t}",
        "=r,=r,r,r",
        False,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def ld_global_nc_v4(gmem_addr, *, loc=None, ip=None):
    """16-byte read-only global load: four 32-bit words."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        True,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def ld_global_nc_v2(gmem_addr, *, loc=None, ip=None):
    """8-byte read-only global load: two 32-bit words."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.v2.b32 {$0, $1}, [$2];",
        "=r,=r,l",
        True,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def ld_global_nc_b32(gmem_addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(
        inline_asm(
            T.i32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.b32 $0, [$1];", "=r,l", True
        )
    )


@dsl_user_op
def ld_global_nc_u8(gmem_addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(
        inline_asm(
            T.i32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.u8 $0, [$1];", "=r,l", True
        )
    )


@dsl_user_op
def st_global_v4(gmem_addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
        + [Uint32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        True,
    )


@dsl_user_op
def max_abs_bf16x2(acc, w, *, loc=None, ip=None) -> Uint32:
    """Each 16-bit half of ``acc`` replaced by the bf16 of the larger magnitude of it and the same half of
    ``w`` (``max.xorsign.abs``: the result's sign bit is the xor of the inputs', so clear the sign bits of
    the final value; for finite bf16 the integer order of magnitude bits is the order of magnitudes)."""
    return _b32_op("max.xorsign.abs.bf16x2 $0, $1, $2;", acc, w, loc=loc, ip=ip)


@dsl_user_op
def floor_log2_u32(value, *, loc=None, ip=None) -> Int32:
    """The position of the highest set bit of ``value`` (``bfind.u32``: log2 of a power of two)."""
    operands = [Uint32(value).ir_value(loc=loc, ip=ip)]
    return Int32(inline_asm(T.i32(), operands, "bfind.u32 $0, $1;", "=r,r", False))


@dsl_user_op
def max_u32(a, b, *, loc=None, ip=None) -> Uint32:
    return _b32_op("max.u32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def max_u16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """Each 16-bit half: the larger unsigned value of ``a``'s and ``b``'s."""
    return _b32_op("max.u16x2 $0, $1, $2;", a, b, loc=loc, ip=ip)


def max_u8(words) -> Uint32:
    """The largest byte of ``words`` (32-bit each): their even and odd bytes spread to 16-bit halves
    (``prmt``), the halves' maxima, then the larger of the two halves."""
    halves = [prmt(w, 0, selector) for w in words for selector in (0x4240, 0x4341)]
    while len(halves) > 1:
        pairs = [max_u16x2(halves[i], halves[i + 1]) for i in range(0, len(halves) - 1, 2)]
        halves = pairs + halves[len(pairs) * 2 :]
    return max_u32(halves[0] >> Uint32(16), halves[0] & Uint32(0xFFFF))


def bf16x4_to_e4m3x4(w01, w23, operand_bits=None, op: str | None = None, *, loc=None, ip=None) -> Uint32:
    """Four bf16 (two words, lowest first), each combined with a float32 given by its bits by ``op`` (an f32
    PTX instruction taking (d, a, b), e.g. "mul.rn.f32" or "div.rn.f32"; None: as they are), rounded (RN,
    saturating) to e4m3 and packed, the lowest first."""
    words = (w01, w23) if op is None else (w01, w23, operand_bits)
    combine = (
        ""
        if op is None
        else f"mov.b32 s, $3;\n\t{op} f0, f0, s;\n\t{op} f1, f1, s;\n\t{op} f2, f2, s;\n\t{op} f3, f3, s;\n\t"
    )
    return Uint32(
        inline_asm(
            T.i32(),
            [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
            "{\n\t.reg .b32 t0, t1, t2, t3;\n\t"
            + (".reg .f32 f0, f1, f2, f3;" if op is None else ".reg .f32 s, f0, f1, f2, f3;")
            + "\n\t.reg .b16 o01, o23;\n\t"
            "shl.b32 t0, $1, 16;\n\tand.b32 t1, $1, 0xffff0000;\n\t"
            "shl.b32 t2, $2, 16;\n\tand.b32 t3, $2, 0xffff0000;\n\t"
            "mov.b32 f0, t0;\n\tmov.b32 f1, t1;\n\tmov.b32 f2, t2;\n\tmov.b32 f3, t3;\n\t"
            + combine
            + "cvt.rn.satfinite.e4m3x2.f32 o01, f1, f0;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 o23, f3, f2;\n\t"
            "mov.b32 $0, {o01, o23};\n\t}",
            "=r" + ",r" * len(words),
            False,
        )
    )


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """The two bf16 of ``a`` times those of ``b``, half by half (``mul.rn.bf16x2``)."""
    return _b32_op("mul.rn.bf16x2 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def scale_bf16x4_to_e4m3x4(w01, w23, scale_bf16x2, *, loc=None, ip=None) -> Uint32:
    """Four bf16 (two words, lowest first) times the bf16 in each half of ``scale_bf16x2`` (``mul_bf16x2``:
    exact for a power of two unless the product is below bf16's normal range, where e4m3 rounds it to zero
    anyway), rounded to e4m3 and packed (``bf16x4_to_e4m3x4``)."""
    return bf16x4_to_e4m3x4(
        mul_bf16x2(w01, scale_bf16x2, loc=loc, ip=ip),
        mul_bf16x2(w23, scale_bf16x2, loc=loc, ip=ip),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_shared_v4(smem_addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
        + [Uint32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        True,
    )


@dsl_user_op
def cp_async_bulk_to_shared(smem_addr, gmem_addr, size_bytes, mbar_addr, *, loc=None, ip=None) -> None:
    """Bulk copy (the TMA unit, no tensor map) of ``size_bytes`` (a multiple of 16; both addresses 16-byte
    aligned) from global to this CTA's shared memory, its bytes counted on the mbarrier at ``mbar_addr``."""
    inline_asm(
        None,
        [
            Int32(smem_addr).ir_value(loc=loc, ip=ip),
            Int64(gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(size_bytes).ir_value(loc=loc, ip=ip),
            Int32(mbar_addr).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        True,
    )


@dsl_user_op
def ld_shared_v4x2(smem_addr, swap, *, loc=None, ip=None):
    """The 32 bytes at ``smem_addr`` (32-byte aligned) as eight 32-bit words, lowest first. With ``swap``
    (0 or 1) nonzero the upper 16 bytes are read by the first of the two loads: a warp whose rows alternate
    ``swap`` reads rows 128 bytes apart without bank conflicts."""
    res = inline_asm(
        llvm.StructType.get_literal([T.i32()] * 8),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(swap).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; .reg .b32 first, second, a0, a1, a2, a3, b0, b1, b2, b3;\n"
        "setp.ne.u32 p, $9, 0;\n"
        "shl.b32 first, $9, 4;\n"
        "add.u32 first, $8, first;\n"
        "xor.b32 second, first, 16;\n"
        "ld.shared.v4.b32 {a0, a1, a2, a3}, [first];\n"
        "ld.shared.v4.b32 {b0, b1, b2, b3}, [second];\n"
        "selp.b32 $0, b0, a0, p; selp.b32 $1, b1, a1, p; selp.b32 $2, b2, a2, p; selp.b32 $3, b3, a3, p;\n"
        "selp.b32 $4, a0, b0, p; selp.b32 $5, a1, b1, p; selp.b32 $6, a2, b2, p; selp.b32 $7, a3, b3, p; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
        True,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(8))


@dsl_user_op
def prefetch_l2(gmem_addr, *, loc=None, ip=None) -> None:
    """Prefetch the L2 line of ``gmem_addr``."""
    inline_asm(None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "prefetch.global.L2 [$0];", "l", True)


# ------------------------------------------------------------------------------------------------
# Thread-block clusters: another CTA's shared memory (``mapa``), signalled by mbarriers.
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def ld_shared_v4_f32(smem_addr, *, loc=None, ip=None):
    """16-byte shared load: four f32."""
    res = inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,r",
        True,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def st_shared_v4_f32(smem_addr, x0, x1, x2, x3, *, loc=None, ip=None) -> None:
    """16-byte shared store of four f32."""
    inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)]
        + [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)],
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
        "r,f,f,f,f",
        True,
    )


@dsl_user_op
def ld_shared_v2_f32(smem_addr, *, loc=None, ip=None):
    """8-byte shared load: two f32."""
    res = inline_asm(
        llvm.StructType.get_literal([T.f32()] * 2),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v2.f32 {$0, $1}, [$2];",
        "=f,=f,r",
        True,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def st_async_cluster(smem_addr, mbar_addr, cta_rank, values, *, loc=None, ip=None) -> None:
    """``st.async`` of two or four 32-bit ``values`` (all f32, or all 32-bit words: ``.f32`` or ``.b32``) to
    the shared address ``smem_addr`` of the cluster's CTA ``cta_rank`` (this CTA's addresses, mapped there),
    its completion counted in bytes on that CTA's mbarrier at ``mbar_addr`` (``mbarrier::complete_tx``)."""
    n = len(values)
    floats = all(isinstance(v, (float, Float32)) for v in values)
    kind, constraint = ("f32", "f") if floats else ("b32", "r")
    words = ", ".join(f"${i + 3}" for i in range(n))
    inline_asm(
        None,
        [
            Int32(smem_addr).ir_value(loc=loc, ip=ip),
            Int32(mbar_addr).ir_value(loc=loc, ip=ip),
            Int32(cta_rank).ir_value(loc=loc, ip=ip),
        ]
        + [(Float32(v) if floats else Uint32(v)).ir_value(loc=loc, ip=ip) for v in values],
        "{ .reg .b32 remote_data, remote_mbar;\n"
        "mapa.shared::cluster.u32 remote_data, $0, $2;\n"
        "mapa.shared::cluster.u32 remote_mbar, $1, $2;\n"
        f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v{n}.{kind}"
        f" [remote_data], {{{words}}}, [remote_mbar];\n"
        "}",
        "r,r,r," + ",".join([constraint] * n),
        True,
    )


@dsl_user_op
def mbarrier_arrive_cluster(mbar_addr, cta_rank, *, loc=None, ip=None) -> None:
    """Arrive (release, cluster scope) on the mbarrier at ``mbar_addr`` of the cluster's CTA ``cta_rank``."""
    inline_asm(
        None,
        [Int32(mbar_addr).ir_value(loc=loc, ip=ip), Int32(cta_rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 remote_mbar;\n"
        "mapa.shared::cluster.u32 remote_mbar, $0, $1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote_mbar];\n"
        "}",
        "r,r",
        True,
    )


@dsl_user_op
def mbarrier_wait_cluster(mbar_addr, phase, *, loc=None, ip=None) -> None:
    """Wait (acquire, cluster scope) for the completion of phase ``phase`` of this CTA's mbarrier at
    ``mbar_addr``: what other CTAs of the cluster released with their arrivals is visible after it."""
    inline_asm(
        None,
        [Int32(mbar_addr).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred done;\n"
        "wait_cluster:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$0], $1;\n"
        "@!done bra wait_cluster;\n"
        "}",
        "r,r",
        True,
    )


@dsl_user_op
def ld_shared_f16x4_as_f32(smem_addr, *, loc=None, ip=None):
    """8-byte shared load of four f16 (two words, lowest first), widened to four f32."""
    res = inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 a, b; .reg .f16 h0, h1, h2, h3;\n"
        "ld.shared.v2.b32 {a, b}, [$4];\n"
        "mov.b32 {h0, h1}, a; mov.b32 {h2, h3}, b;\n"
        "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
        "=f,=f,=f,=f,r",
        True,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))
