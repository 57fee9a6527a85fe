"""Math the translator needs beyond ``triton.language``'s core, written in core ops.

One implementation serves the compiled kernels and Triton's interpreter alike (the interpreter has no
libdevice), so the CPU tests exercise the very code the GPU runs. Each function keeps float32 accuracy
within a few ulps where the naive formula would cancel.
"""
import os

import triton
import triton.language as tl

# Triton's interpreter truncates float32 → bfloat16 (its round-to-nearest-even is off too); the GPU rounds.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def to_bfloat16(x):
    """Round to bfloat16, to nearest even, as eager and the GPU do."""
    x = x.to(tl.float32)
    if INTERPRETING:
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
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


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
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def round_half_even(x):
    f = tl.floor(x)
    d = x - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


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
    x = x + tl.zeros_like(y)  # one shape for both (either may be a 0-d value)
    y = y + tl.zeros_like(x)
    mag = tl.exp2(y * tl.log2(tl.abs(x)))
    y_is_int = tl.floor(y) == y
    y_is_odd = y_is_int & ((y - 2.0 * tl.floor(y * 0.5)) != 0.0)
    r = tl.where((x < 0) & y_is_odd, -mag, mag)
    r = tl.where((x < 0) & (~y_is_int), float("nan"), r)
    return tl.where((y == 0.0) | (x == 1.0), 1.0, r)


@triton.jit
def int_pow(x, y):
    # Integer power by repeated squaring (exponents of int tensors are small); negative exponents give 0
    # except for bases 1 and -1, as in eager.
    x = x + tl.zeros_like(y)
    y = y + tl.zeros_like(x)
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
def erf_gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def tanh_gelu(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


@triton.jit
def erf_gelu_backward(grad, x):
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return grad * (cdf + x * pdf)


@triton.jit
def tanh_gelu_backward(grad, x):
    x_sq = x * x
    inner = 0.7978845608028654 * (x + 0.044715 * x_sq * x)
    t = tanh(inner)
    left = 0.5 * x
    right = 1.0 + t
    left_derivative = 0.5 * right
    right_derivative = left * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x_sq)
    return grad * (left_derivative + right_derivative)


@triton.jit
def silu_backward(grad, x):
    s = tl.sigmoid(x)
    return grad * s * (1.0 + x * (1.0 - s))


@triton.jit
def softplus(x, beta, threshold):
    bx = x * beta
    return tl.where(bx > threshold, x, log1p(tl.exp(bx)) / beta)


@triton.jit
def softplus_backward(grad, x, beta, threshold):
    bx = x * beta
    z = tl.exp(bx)
    return tl.where(bx > threshold, grad, grad * z / (z + 1.0))


@triton.jit
def elu(x, alpha, scale, input_scale):
    return tl.where(x > 0, x * scale, expm1(x * input_scale) * (alpha * scale))


@triton.jit
def mish(x):
    return x * tanh(softplus(x, 1.0, 20.0))
