"""Math the translator needs beyond ``triton.language``'s core, written in core ops.

One implementation serves the compiled kernels and Triton's interpreter alike (the interpreter has no
libdevice), so the CPU tests exercise the very code the GPU runs. Each function keeps float32 accuracy
within a few ulps where the naive formula would cancel. The exceptions, where the GPU runs code of its own and
the GPU tests check it: the functions eager's CUDA kernels take from CUDA's math library (atan, lgamma and the
like, at the end of this file), which the GPU calls too and the interpreter computes in float64; rounding to
an integer (the GPU's own instruction); digamma (float32 on the GPU, float64 in the interpreter).
"""

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
    r = tl.where(_sign_bit(x) & y_is_odd, flip(mag), mag)  # (-0.0) ** -1 is -inf, (-0.0) ** 3 is -0.0
    r = tl.where((x < 0) & (~y_is_int), float("nan"), r)
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


# The inverse trigonometric and hyperbolic functions, hypot, erfc, erfinv and lgamma, as Triton's interpreter
# computes them (the GPU calls CUDA's math library for them: see the end of this file): in float64, rounded once
# to the held dtype. Their formulas cancel or reduce arguments, which float64 absorbs for float32 and half inputs.
PI = tl.constexpr(3.141592653589793)
SQRT3 = tl.constexpr(1.7320508075688772)
TAN_PI_12 = tl.constexpr(0.2679491924311227)
# Terms of atan's series at |t| <= tan(pi/12): the last one left out is below 2^-60 of t.
ATAN_TERMS = tl.constexpr(14)
# Past this magnitude x² would overflow float64; asinh(x) and acosh(x) are log(2x) there to float64 precision.
HUGE = tl.constexpr(1e150)
LN2_64 = tl.constexpr(0.6931471805599453)


@triton.jit
def _odd(x, magnitude):
    """The odd function of x whose value at |x| is `magnitude`, ±0 and NaN as they came."""
    return tl.where(x < 0, flip(magnitude), tl.where(x > 0, magnitude, x)).to(x.dtype)


@triton.jit
def _atan_magnitude64(a):
    """atan(a) for float64 a >= 0 (or NaN): a > 1 through pi/2 - atan(1/a), then arguments past tan(pi/12)
    shifted by pi/6 (tan's addition formula), then the alternating series."""
    inverted = a > 1.0
    r = tl.where(inverted, 1.0 / a, a)
    shifted = r > TAN_PI_12
    t = tl.where(shifted, (r * SQRT3 - 1.0) / (r + SQRT3), r)
    z = t * t
    p = tl.zeros_like(z)
    for i in tl.static_range(ATAN_TERMS):  # Horner, from the last term's (-1)^k / (2k + 1) down
        p = p * z + (1.0 - 2.0 * ((ATAN_TERMS - 1 - i) % 2)) / (2 * (ATAN_TERMS - 1 - i) + 1)
    y = t * p
    # Tensors first in each sum: a constexpr on the left would wrap the tensor (the interpreter's math rejects it).
    y = tl.where(shifted, y + PI / 6, y)
    return tl.where(inverted, flip(y) + PI / 2, y)


@triton.jit
def _atan_in_float64(x):
    return _odd(x, _atan_magnitude64(tl.abs(x).to(tl.float64)))


@triton.jit
def _asin_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    return _odd(x, _atan_magnitude64(a / tl.sqrt((1.0 - a) * (1.0 + a))))  # NaN past 1


@triton.jit
def _acos_in_float64(x):
    # 2·atan(sqrt((1 - x) / (1 + x))): no cancellation at either end (pi at -1, 0 at 1).
    x64 = x.to(tl.float64)
    return (2.0 * _atan_magnitude64(tl.sqrt((1.0 - x64) / (1.0 + x64)))).to(x.dtype)


@triton.jit
def _sign_bit(x):
    """Whether float x has its sign bit set (-0.0 and negative NaNs too)."""
    if x.dtype == tl.float64:
        negative = x.to(tl.int64, bitcast=True) < 0
    else:
        negative = x.to(tl.float32).to(tl.int32, bitcast=True) < 0
    return negative


@triton.jit
def _atan2_in_float64(y, x):
    # C's atan2, special cases included: both zero gives 0 or pi by x's sign bit, both infinite pi/4 or 3pi/4.
    y, x = tl.broadcast(y, x)
    ay = tl.abs(y).to(tl.float64)
    ax = tl.abs(x).to(tl.float64)
    both_infinite = (ay == float("inf")) & (ax == float("inf"))
    r = _atan_magnitude64(tl.where(both_infinite, 1.0, ay / ax))
    r = tl.where((ay == 0.0) & (ax == 0.0), 0.0, r)
    r = tl.where(_sign_bit(x), flip(r) + PI, r)
    return tl.where(_sign_bit(y), flip(r), r).to(y.dtype)


@triton.jit
def _sinh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    e = expm1(a)
    h = tl.exp(0.5 * a)
    # e + e / (e + 1) = e^a - e^-a without cancellation; past 20, e^a / 2 alone, as h² / 2 (no overflow of e^a
    # where the result still fits).
    return _odd(x, tl.where(a > 20.0, (0.5 * h) * h, 0.5 * (e + e / (e + 1.0))))


@triton.jit
def _cosh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    e = tl.exp(a)
    h = tl.exp(0.5 * a)
    return tl.where(a > 20.0, (0.5 * h) * h, 0.5 * (e + 1.0 / e)).to(x.dtype)


@triton.jit
def _asinh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    # log(a + sqrt(a² + 1)) written as log1p(a + a² / (1 + sqrt(a² + 1))): exact near 0.
    r = log1p(a + a * a / (1.0 + tl.sqrt(a * a + 1.0)))
    return _odd(x, tl.where(a > HUGE, tl.log(a) + LN2_64, r))


@triton.jit
def _acosh_in_float64(x):
    x64 = x.to(tl.float64)
    t = x64 - 1.0
    r = log1p(t + tl.sqrt(t * (x64 + 1.0)))
    r = tl.where(x64 > HUGE, tl.log(x64) + LN2_64, r)
    return tl.where(x64 < 1.0, float("nan"), r).to(x.dtype)


@triton.jit
def _atanh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    r = tl.where(a == 1.0, float("inf"), 0.5 * log1p(2.0 * a / (1.0 - a)))  # NaN past 1
    return _odd(x, r)


@triton.jit
def _hypot_in_float64(a, b):
    # C's hypot: infinite where either is (even beside NaN); scaled by the larger magnitude, so float64 inputs
    # do not overflow in the squares.
    a, b = tl.broadcast(a, b)
    aa = tl.abs(a).to(tl.float64)
    ab = tl.abs(b).to(tl.float64)
    big = tl.where(aa > ab, aa, ab)
    small = tl.where(aa > ab, ab, aa)
    q = tl.where(big == 0.0, 0.0, small / big)
    r = big * tl.sqrt(1.0 + q * q)
    r = tl.where((a != a) | (b != b), float("nan"), r)
    return tl.where((aa == float("inf")) | (ab == float("inf")), float("inf"), r).to(a.dtype)


@triton.jit
def logaddexp(a, b):
    # ATen's: the larger plus log1p(exp(-|a - b|)), and a itself where both are the same infinity.
    m = tl.where(a > b, a, b)
    r = m + log1p(tl.exp(-tl.abs(a - b)))
    return tl.where((tl.abs(a) == float("inf")) & (a == b), a, r)


@triton.jit
def logaddexp2(a, b):
    m = tl.where(a > b, a, b)
    r = m + log1p(tl.exp2(-tl.abs(a - b))) * 1.4426950408889634
    return tl.where((tl.abs(a) == float("inf")) & (a == b), a, r)


@triton.jit
def xlogy(x, y):
    # 0 where x is 0 (even where log(y) is infinite), NaN wherever y is.
    r = tl.where(x == 0, 0.0, x * tl.log(y))
    return tl.where(y != y, float("nan"), r)


@triton.jit
def fmax(a, b):
    # The larger, NaN only where both are.
    return tl.where(a != a, b, tl.where((b != b) | (a > b), a, b))


@triton.jit
def fmin(a, b):
    return tl.where(a != a, b, tl.where((b != b) | (a < b), a, b))


@triton.jit
def copysign(a, b):
    return tl.where(_sign_bit(b), flip(tl.abs(a)), tl.abs(a))


# erfc's continued fraction past 2, exp(-x²)/√π / (x + (1/2)/(x + 1/(x + (3/2)/(x + …)))), from its 50th term:
# the terms after it move it by less than 1e-13 there.
ERFC_TERMS = tl.constexpr(50)
INV_SQRT_PI = tl.constexpr(0.5641895835477563)
TWO_OVER_SQRT_PI = tl.constexpr(1.1283791670955126)
# Winitzki's closed form for erfinv (within 2e-3): its constant a and 2 / (pi a).
WINITZKI_A = tl.constexpr(0.147)
WINITZKI_C = tl.constexpr(4.330746750799873)


@triton.jit
def _erfc_in_float64(x):
    """erfc in float64: 1 - erf(x) below 2 (erfc is above 4.7e-3 there: the difference keeps 1e-14), the
    continued fraction past it, 2 - erfc(-x) for negative x."""
    x64 = x.to(tl.float64)
    a = tl.abs(x64)
    t = tl.zeros_like(a)
    for i in tl.static_range(ERFC_TERMS):
        t = ((ERFC_TERMS - i) * 0.5) / (a + t)
    r = tl.where(a < 2.0, 1.0 - tl.erf(a), tl.exp(-a * a) * INV_SQRT_PI / (a + t))
    return tl.where(x64 < 0.0, 2.0 - r, r).to(x.dtype)


@triton.jit
def _erfinv_in_float64(x):
    """erfinv in float64: Winitzki's closed form, then five Newton steps on erf(z) - |x|, written (1 - |x|) -
    erfc(z) from |x| = 1/2 on (1 - |x| is exact there, and erf(z) near 1 would cancel); ±inf at ±1, NaN past."""
    x64 = x.to(tl.float64)
    a = tl.abs(x64)
    log_rest = tl.log((1.0 - a) * (1.0 + a))
    c = WINITZKI_C + 0.5 * log_rest
    z = tl.sqrt(tl.sqrt(c * c - log_rest / WINITZKI_A) - c)
    near_one = a >= 0.5
    for _ in tl.static_range(5):
        excess = tl.where(near_one, (1.0 - a) - _erfc_in_float64(z), tl.erf(z) - a)
        z = z - excess / (TWO_OVER_SQRT_PI * tl.exp(-z * z))
    return _odd(x, tl.where(a == 1.0, float("inf"), z))


# Lanczos's approximation of the gamma function, g = 7 with nine terms: relative error near 1e-15.
LANCZOS_G = tl.constexpr(7.0)
HALF_LOG_2PI = tl.constexpr(0.9189385332046728)


@triton.jit
def _lanczos_lgamma(y):
    """lgamma(y) for float64 y >= 0.5, written so that no term overflows before the result does."""
    z = y - 1.0
    a = (0.99999999999980993 + 676.5203681218851 / (z + 1.0) - 1259.1392167224028 / (z + 2.0)
         + 771.32342877765313 / (z + 3.0) - 176.61502916214059 / (z + 4.0) + 12.507343278686905 / (z + 5.0)
         - 0.13857109526572012 / (z + 6.0) + 9.9843695780195716e-6 / (z + 7.0) + 1.5056327351493116e-7 / (z + 8.0))
    t = z + LANCZOS_G + 0.5
    # (z + 0.5)·log(t) - t, as (z + 0.5)·(log(t) - 1) - g: no difference of two huge terms.
    return (z + 0.5) * (tl.log(t) - 1.0) + tl.log(a) + (HALF_LOG_2PI - LANCZOS_G)


@triton.jit
def _lgamma_in_float64(x):
    # Below 1/2 by reflection, log(pi / |sin(pi x)|) - lgamma(1 - x), with sin's argument reduced to within 1/2 of
    # an integer first (exact). Poles (0 and the negative integers) and both infinities give inf; 1 and 2 give 0.
    x64 = x.to(tl.float64)
    reflect = x64 < 0.5
    lanczos = _lanczos_lgamma(tl.where(reflect, 1.0 - x64, x64))
    r = x64 - tl.floor(x64 + 0.5)
    result = tl.where(reflect, flip(tl.log(tl.abs(tl.sin(r * PI)) / PI)) - lanczos, lanczos)
    result = tl.where((x64 <= 0.0) & (x64 == tl.floor(x64)), float("inf"), result)
    result = tl.where((x64 == 1.0) | (x64 == 2.0), 0.0, result)
    return tl.where(x64 == float("inf"), float("inf"), result).to(x.dtype)


@triton.jit
def _digamma_positive(y):
    """digamma(y) for float64 y > 0: shifted past 10 by digamma(y) = digamma(y + 1) - 1/y, then the asymptotic
    series log(y) - 1/(2y) - sum of B_2k / (2k y^2k) through k = 7 (the next term is below 1e-16 at 10)."""
    shift = tl.zeros_like(y)
    for _ in tl.static_range(10):
        small = y < 10.0
        shift = tl.where(small, shift - 1.0 / y, shift)
        y = tl.where(small, y + 1.0, y)
    z = 1.0 / (y * y)
    series = z * (1.0 / 12 - z * (1.0 / 120 - z * (1.0 / 252 - z * (1.0 / 240 - z * (1.0 / 132 - z * (
        691.0 / 32760 - z / 12.0))))))
    return shift + tl.log(y) - 0.5 / y - series


@triton.jit
def _digamma_in_float64(x):
    # Negative x by reflection, digamma(1 - x) - pi / tan(pi x) (the argument reduced as in lgamma); NaN at the
    # negative integers and -inf, -inf at +0.0 and inf at -0.0, as eager.
    x64 = x.to(tl.float64)
    negative = x64 < 0.0
    y = tl.where(negative, 1.0 - x64, x64)
    psi = _digamma_positive(tl.where(y > 0.0, y, 1.0))
    r = x64 - tl.floor(x64 + 0.5)
    psi = tl.where(negative, psi - tl.cos(r * PI) / tl.sin(r * PI) * PI, psi)
    psi = tl.where(x64 == 0.0, tl.where(_sign_bit(x64), float("inf"), float("-inf")), psi)
    psi = tl.where(negative & (x64 == tl.floor(x64)), float("nan"), psi)
    return tl.where(x64 != x64, x64, psi).to(x.dtype)


# Eager's pi² for trigamma in float32 (its kernel squares pi rounded to float32, and rounds the square).
PI_SQUARED_FLOAT32 = tl.constexpr(9.86960506439209)


@triton.jit
def trigamma(x):
    """polygamma(1, x), as eager's CUDA kernel computes it in the held dtype: below 1/2 by reflection,
    pi² / sin²(pi x) - trigamma(1 - x); six steps of trigamma(x) = trigamma(x + 1) + 1/x²; then the asymptotic
    series (1 + 1/(2x) + (1/6 - (1/30 - 1/(42 x²)) / x²) / x²) / x."""
    one = tl.full(x.shape, 1.0, x.dtype)
    # Each constant inside its expression: one assigned in a branch would become a float32 value.
    if x.dtype == tl.float64:
        pi_squared = one * (PI * PI)
    else:
        pi_squared = one * PI_SQUARED_FLOAT32
    reflect = x < 0.5
    sin_pi_x = tl.sin(x * PI)
    result = tl.where(reflect, 0.0 - div_rn(pi_squared, sin_pi_x * sin_pi_x), 0.0)
    y = tl.where(reflect, 1.0 - x, x)
    for _ in tl.static_range(6):
        result = result + div_rn(one, y * y)
        y = y + 1.0
    ixx = div_rn(one, y * y)
    result = result + div_rn(one + div_rn(one, 2.0 * y) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42))), y)
    return tl.where(reflect, flip(result), result)


@triton.jit
def sinc(x):
    """sin(pi x) / (pi x) as eager: pi x rounded to the held dtype first (that rounding decides the value near the
    nonzero integers), 1 at 0."""
    p = x * PI
    return tl.where(x == 0.0, 1.0, div_rn(tl.sin(p), p))


# The functions eager's CUDA kernels compute with CUDA's math library (``::atan`` and the like, in float32 for
# half inputs): on the GPU the same library's functions (libdevice), so values agree with eager's bit for bit, at
# float32's cost. Their forms in float64 ran 2.6× (atan) and 10× (lgamma) slower than Inductor's kernels, which
# call libdevice too (bench/results/elementwise-2026-12-01-0558). The interpreter, which has no libdevice,
# computes the float64 forms above, within an ulp of the exact value.
@triton.jit
def atan(x):
    if INTERPRETED:
        return _atan_in_float64(x)
    else:
        return libdevice.atan(x)


@triton.jit
def asin(x):
    if INTERPRETED:
        return _asin_in_float64(x)
    else:
        return libdevice.asin(x)


@triton.jit
def acos(x):
    if INTERPRETED:
        return _acos_in_float64(x)
    else:
        return libdevice.acos(x)


@triton.jit
def atan2(y, x):
    if INTERPRETED:
        return _atan2_in_float64(y, x)
    else:
        return libdevice.atan2(y, x)


@triton.jit
def sinh(x):
    if INTERPRETED:
        return _sinh_in_float64(x)
    else:
        return libdevice.sinh(x)


@triton.jit
def cosh(x):
    if INTERPRETED:
        return _cosh_in_float64(x)
    else:
        return libdevice.cosh(x)


@triton.jit
def asinh(x):
    if INTERPRETED:
        return _asinh_in_float64(x)
    else:
        return libdevice.asinh(x)


@triton.jit
def acosh(x):
    if INTERPRETED:
        return _acosh_in_float64(x)
    else:
        return libdevice.acosh(x)


@triton.jit
def atanh(x):
    if INTERPRETED:
        return _atanh_in_float64(x)
    else:
        return libdevice.atanh(x)


@triton.jit
def hypot(a, b):
    if INTERPRETED:
        return _hypot_in_float64(a, b)
    else:
        return libdevice.hypot(a, b)


@triton.jit
def lgamma(x):
    if INTERPRETED:
        return _lgamma_in_float64(x)
    else:
        return libdevice.lgamma(x)




@triton.jit
def _digamma_float32(x):
    """digamma for float32 x (float32 and half inputs): NaN at the negative integers, -inf at +0.0 and inf at -0.0;
    negative x by reflection, -pi·cot(pi r) + digamma(1 - x) with r the fraction of x, in float64 (sinpi and cospi:
    no argument reduction); shifted past 4 by digamma(x) = digamma(x + 1) - 1/x, then the asymptotic series
    log(x) - 1/(2x) - sum of B_2k / (2k x^2k) through k = 7 (the next term is below 1e-10 at 4).

    Eager's CUDA kernel shifts past 10: up to ten divisions where this takes four, and ten roundings summed. On
    2e6 float32 values in (0, 30] and 2e5 in [-20, 0) (offline, against float64), eager's float32 digamma is up to
    146 ulp off (0.81 ulp on average; near the root at 1.46, where the terms cancel), this up to 80 (0.60). Past
    10, both are the same series of the same values."""
    negative = x < 0.0
    result = tl.zeros_like(x)
    # Where the block holds a negative x at all: a select computes both of its sides on every element.
    # At least one dimension to reduce (x may be a 0-d value).
    if tl.max(negative.to(tl.int32) + tl.zeros([1], tl.int32)) > 0:
        r = x.to(tl.float64) - trunc(x.to(tl.float64))
        result = tl.where(negative, (-PI * libdevice.cospi(r) / libdevice.sinpi(r)).to(tl.float32), 0.0)
    y = tl.where(negative, 1.0 - x, x)
    one = tl.full(y.shape, 1.0, tl.float32)
    for _ in tl.static_range(4):
        small = y < 4.0
        result = tl.where(small, result - div_rn(one, y), result)
        y = tl.where(small, y + 1.0, y)
    z = div_rn(one, y * y)
    p = ((((((1.0 / 12) * z - 691.0 / 32760) * z + 1.0 / 132) * z - 1.0 / 240) * z + 1.0 / 252) * z
         - 1.0 / 120) * z + 1.0 / 12
    psi = libdevice.log(y) - div_rn(one * 0.5, y) - z * p + result
    psi = tl.where(x == 0.0, tl.where(_sign_bit(x), float("inf"), float("-inf")), psi)
    return tl.where(negative & (x == tl.floor(x)), float("nan"), psi)


@triton.jit
def digamma(x):
    if INTERPRETED:
        return _digamma_in_float64(x)
    elif x.dtype == tl.float64:
        return _digamma_in_float64(x)
    else:
        return _digamma_float32(x)


@triton.jit
def erfc(x):
    if INTERPRETED:
        return _erfc_in_float64(x)
    else:
        return libdevice.erfc(x)


@triton.jit
def erfinv(x):
    if INTERPRETED:
        return _erfinv_in_float64(x)
    else:
        return libdevice.erfinv(x)
