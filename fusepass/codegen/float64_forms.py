"""The inverse trigonometric and hyperbolic functions, hypot, erfc, erfinv and lgamma, as Triton's interpreter
computes them (the GPU calls CUDA's math library for them: see mathlib.py): in float64, rounded once
to the held dtype. Their formulas cancel or reduce arguments, which float64 absorbs for float32 and half inputs.
"""
import triton
import triton.language as tl

from fusepass.codegen.elementary import expm1, flip, log1p, sign_bit

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
def atan_in_float64(x):
    return _odd(x, _atan_magnitude64(tl.abs(x).to(tl.float64)))


@triton.jit
def asin_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    return _odd(x, _atan_magnitude64(a / tl.sqrt((1.0 - a) * (1.0 + a))))  # NaN past 1


@triton.jit
def acos_in_float64(x):
    # 2·atan(sqrt((1 - x) / (1 + x))): no cancellation at either end (pi at -1, 0 at 1).
    x64 = x.to(tl.float64)
    return (2.0 * _atan_magnitude64(tl.sqrt((1.0 - x64) / (1.0 + x64)))).to(x.dtype)


@triton.jit
def atan2_in_float64(y, x):
    # C's atan2, special cases included: both zero gives 0 or pi by x's sign bit, both infinite pi/4 or 3pi/4.
    y, x = tl.broadcast(y, x)
    ay = tl.abs(y).to(tl.float64)
    ax = tl.abs(x).to(tl.float64)
    both_infinite = (ay == float("inf")) & (ax == float("inf"))
    r = _atan_magnitude64(tl.where(both_infinite, 1.0, ay / ax))
    r = tl.where((ay == 0.0) & (ax == 0.0), 0.0, r)
    r = tl.where(sign_bit(x), flip(r) + PI, r)
    return tl.where(sign_bit(y), flip(r), r).to(y.dtype)


@triton.jit
def sinh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    e = expm1(a)
    h = tl.exp(0.5 * a)
    # e + e / (e + 1) = e^a - e^-a without cancellation; past 20, e^a / 2 alone, as h² / 2 (no overflow of e^a
    # where the result still fits).
    return _odd(x, tl.where(a > 20.0, (0.5 * h) * h, 0.5 * (e + e / (e + 1.0))))


@triton.jit
def cosh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    e = tl.exp(a)
    h = tl.exp(0.5 * a)
    return tl.where(a > 20.0, (0.5 * h) * h, 0.5 * (e + 1.0 / e)).to(x.dtype)


@triton.jit
def asinh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    # log(a + sqrt(a² + 1)) written as log1p(a + a² / (1 + sqrt(a² + 1))): exact near 0.
    r = log1p(a + a * a / (1.0 + tl.sqrt(a * a + 1.0)))
    return _odd(x, tl.where(a > HUGE, tl.log(a) + LN2_64, r))


@triton.jit
def acosh_in_float64(x):
    x64 = x.to(tl.float64)
    t = x64 - 1.0
    r = log1p(t + tl.sqrt(t * (x64 + 1.0)))
    r = tl.where(x64 > HUGE, tl.log(x64) + LN2_64, r)
    return tl.where(x64 < 1.0, float("nan"), r).to(x.dtype)


@triton.jit
def atanh_in_float64(x):
    a = tl.abs(x).to(tl.float64)
    r = tl.where(a == 1.0, float("inf"), 0.5 * log1p(2.0 * a / (1.0 - a)))  # NaN past 1
    return _odd(x, r)


@triton.jit
def hypot_in_float64(a, b):
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


# erfc's continued fraction past 2, exp(-x²)/√π / (x + (1/2)/(x + 1/(x + (3/2)/(x + …)))), from its 50th term:
# the terms after it move it by less than 1e-13 there.
ERFC_TERMS = tl.constexpr(50)
INV_SQRT_PI = tl.constexpr(0.5641895835477563)
TWO_OVER_SQRT_PI = tl.constexpr(1.1283791670955126)
# Winitzki's closed form for erfinv (within 2e-3): its constant a and 2 / (pi a).
WINITZKI_A = tl.constexpr(0.147)
WINITZKI_C = tl.constexpr(4.330746750799873)


@triton.jit
def erfc_in_float64(x):
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
def erfinv_in_float64(x):
    """erfinv in float64: Winitzki's closed form, then five Newton steps on erf(z) - |x|, written (1 - |x|) -
    erfc(z) from |x| = 1/2 on (1 - |x| is exact there, and erf(z) near 1 would cancel); ±inf at ±1, NaN past."""
    x64 = x.to(tl.float64)
    a = tl.abs(x64)
    log_rest = tl.log((1.0 - a) * (1.0 + a))
    c = WINITZKI_C + 0.5 * log_rest
    z = tl.sqrt(tl.sqrt(c * c - log_rest / WINITZKI_A) - c)
    near_one = a >= 0.5
    for _ in tl.static_range(5):
        excess = tl.where(near_one, (1.0 - a) - erfc_in_float64(z), tl.erf(z) - a)
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
def lgamma_in_float64(x):
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
def digamma_in_float64(x):
    # Negative x by reflection, digamma(1 - x) - pi / tan(pi x) (the argument reduced as in lgamma); NaN at the
    # negative integers and -inf, -inf at +0.0 and inf at -0.0, as eager.
    x64 = x.to(tl.float64)
    negative = x64 < 0.0
    y = tl.where(negative, 1.0 - x64, x64)
    psi = _digamma_positive(tl.where(y > 0.0, y, 1.0))
    r = x64 - tl.floor(x64 + 0.5)
    psi = tl.where(negative, psi - tl.cos(r * PI) / tl.sin(r * PI) * PI, psi)
    psi = tl.where(x64 == 0.0, tl.where(sign_bit(x64), float("inf"), float("-inf")), psi)
    psi = tl.where(negative & (x64 == tl.floor(x64)), float("nan"), psi)
    return tl.where(x64 != x64, x64, psi).to(x.dtype)
