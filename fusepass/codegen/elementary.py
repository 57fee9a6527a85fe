"""Elementary float and integer functions the kernels and the other math modules share: roundings, divisions with
ATen's semantics, the powers, and the tanh, expm1 and log1p forms (jit functions)."""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fusepass.runtime.device import INTERPRETED


@triton.jit
def to_bfloat16(x):
    """Round to bfloat16, to nearest even, as eager and the GPU do."""
    x = x.to(tl.float32)
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def log1p(x):
    # Goldberg: log(u) * x / (u - 1) cancels the rounding of u = 1 + x.
    u = 1.0 + x
    d = u - 1.0
    r = tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x == float("inf"), x, r)  # (there the quotient is inf / inf)


@triton.jit
def expm1(x):
    # Kahan: (u - 1) * x / log(u) cancels the rounding of u = exp(x).
    u = tl.exp(x)
    d = u - 1.0
    lu = tl.log(u)
    small = (d == 0.0) | (lu == 0.0)
    r = tl.where(small, x, d * (x / tl.where(small, 1.0, lu)))
    r = tl.where(d == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def tanh(x):
    # Below |x| = 0.4 the odd Taylor series through x^13 (the next term is below 2^-28 relative); beyond,
    # 1 - 2 / (exp(2|x|) + 1), whose cancellation there costs a few ulp at most. Two special-function-unit
    # ops (exp2 and a reciprocal) where an expm1-based form takes five: tanh runs on every score of a
    # softcapped attention, beside the softmax's own exp2 on the same unit.
    a = tl.abs(x)
    if x.dtype == tl.float64:
        # The series' 2^-28 would show in float64: expm1 (Kahan's, accurate in any precision) instead, the
        # cost of its three special-function ops no concern there. Past |x| = 20, tanh is 1 in float64.
        e = expm1(2.0 * tl.where(a > 20.0, 20.0, a))
        t = e / (e + 2.0)
        return tl.where(x < 0, -t, tl.where(x > 0, t, x))  # ±0 and NaN as they came
    z = x * x
    series = x + x * z * (-0.3333333333333333 + z * (0.13333333333333333 + z * (-0.05396825396825397 + z * (
        0.021869488536155203 + z * (-0.008863235529902197 + z * 0.003592128036572481)))))
    t = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.4, series, tl.where(x < 0, -t, t))


@triton.jit
def tanh_within_bfloat16(x):
    """tanh within 2^-10.9 of it on the GPU (PTX's tanh.approx.f32, one special-function op where `tanh` takes
    two and some twenty others), for values eager rounds to bfloat16 (2^-9); `tanh` itself in the interpreter."""
    if INTERPRETED:
        return tanh(x)
    else:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x.to(tl.float32)], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def round_half_even(x):
    # On the GPU its rounding instruction (as eager's nearbyint): there `x - floor(x)` below would be contracted
    # with the product that made x into one fused multiply-add, which sees the product unrounded.
    if INTERPRETED:
        f = tl.floor(x)
        d = x - f
        f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        up = (d > 0.5) | ((d == 0.5) & f_is_odd)
        return tl.where(up, f + 1.0, f)
    else:
        return libdevice.rint(x)


@triton.jit
def div_rn(a, b):
    """a / b rounded to nearest, as C's `/`: Triton's float32 `/` is `div.full.f32`, within 2 ulp."""
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def flip(x):
    """-x with the sign of a zero flipped too: Triton's `-x` is `0 - x`, which is +0.0 for x = +0.0."""
    return x * -1.0


@triton.jit
def sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)


@triton.jit
def fmod(a, b):
    # C fmod, computed in float64 so that trunc(a / b) * b is exact for float32 operands.
    a64 = a.to(tl.float64)
    b64 = b.to(tl.float64)
    return (a64 - trunc(a64 / b64) * b64).to(a.dtype)


@triton.jit
def remainder(a, b):
    # Python's %: the result takes the sign of the divisor.
    r = fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def float_floor_div(a, b):
    # ATen's div_floor: the quotient of a - fmod(a, b), corrected toward floor, then rounded to the
    # nearest integer (it is one up to rounding).
    mod = fmod(a, b)
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    floordiv = tl.floor(div)
    floordiv = tl.where(div - floordiv > 0.5, floordiv + 1.0, floordiv)
    zero = tl.where((a / b) < 0, -0.0, 0.0)
    result = tl.where(div != 0, floordiv, zero)
    return tl.where(b == 0, a / b, result)


@triton.jit
def int_floor_div(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def int_remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def pow(x, y):
    # x ** y for float x, y: exact signs for negative bases with integral exponents, C's special cases.
    x, y = tl.broadcast(x, y)  # one shape for both (either may be a 0-d value); -0.0 + 0 would lose its sign
    mag = tl.exp2(y * tl.log2(tl.abs(x)))
    y_is_int = tl.floor(y) == y
    y_is_odd = y_is_int & ((y - 2.0 * tl.floor(y * 0.5)) != 0.0)
    r = tl.where(sign_bit(x) & y_is_odd, flip(mag), mag)  # (-0.0) ** -1 is -inf, (-0.0) ** 3 is -0.0
    r = tl.where((x < 0) & (x != float("-inf")) & (~y_is_int), float("nan"), r)  # (-inf) ** 2.5 is inf
    return tl.where((y == 0.0) | (x == 1.0), 1.0, r)


@triton.jit
def int_pow(x, y):
    # Integer power by repeated squaring (exponents of int tensors are small); negative exponents give 0
    # except for bases 1 and -1, as in eager.
    x, y = tl.broadcast(x, y)  # one shape for both (either may be a 0-d value)
    result = tl.full(x.shape, 1, x.dtype)
    base = x
    e = tl.where(y < 0, 0, y)
    for _ in tl.static_range(63):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    neg = y < 0
    result = tl.where(neg & (x == 1), 1, tl.where(neg & (x == -1), tl.where((y & 1) != 0, -1, 1),
                                                     tl.where(neg, 0, result)))
    return result


@triton.jit
def sign_bit(x):
    """Whether float x has its sign bit set (-0.0 and negative NaNs too)."""
    if x.dtype == tl.float64:
        negative = x.to(tl.int64, bitcast=True) < 0
    else:
        negative = x.to(tl.float32).to(tl.int32, bitcast=True) < 0
    return negative
