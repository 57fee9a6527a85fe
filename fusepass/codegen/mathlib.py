"""Math the translator needs beyond ``triton.language``'s core, written in core ops.

One implementation serves the compiled kernels and Triton's interpreter alike (the interpreter has no
libdevice), so the CPU tests exercise the very code the GPU runs. Each function keeps float32 accuracy
within a few ulps where the naive formula would cancel. The exceptions, where the GPU runs code of its own and
the GPU tests check it: the functions eager's CUDA kernels take from CUDA's math library (atan, lgamma and the
like, at the end of this file), which the GPU calls too and the interpreter computes in float64
(float64_forms.py); rounding to an integer (the GPU's own instruction); digamma (float32 on the GPU, float64 in the
interpreter). The elementary functions the others build on are elementary.py's.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The kernels call the elementary functions through this module too (``fm.trunc``).
from fusepass.codegen.elementary import (div_rn, expm1, flip, float_floor_div, fmod, int_floor_div,  # noqa: F401
                                         int_pow, int_remainder, log1p, pow, remainder, round_half_even, sign, sign_bit,
                                         tanh, tanh_within_bfloat16, to_bfloat16, trunc)
from fusepass.codegen.float64_forms import (PI, acos_in_float64, acosh_in_float64, asin_in_float64, asinh_in_float64,
                                            atan2_in_float64, atan_in_float64, atanh_in_float64, cosh_in_float64,
                                            digamma_in_float64, erfc_in_float64, erfinv_in_float64, hypot_in_float64,
                                            lgamma_in_float64, sinh_in_float64)
from fusepass.runtime.device import INTERPRETED


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
    return tl.where(sign_bit(b), flip(tl.abs(a)), tl.abs(a))


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
# float32's cost. Their forms in float64 ran several times slower than Inductor's kernels, which call libdevice
# too. The interpreter, which has no libdevice, computes the float64 forms above, within an ulp of the exact
# value.
@triton.jit
def atan(x):
    if INTERPRETED:
        return atan_in_float64(x)
    else:
        return libdevice.atan(x)


@triton.jit
def asin(x):
    if INTERPRETED:
        return asin_in_float64(x)
    else:
        return libdevice.asin(x)


@triton.jit
def acos(x):
    if INTERPRETED:
        return acos_in_float64(x)
    else:
        return libdevice.acos(x)


@triton.jit
def atan2(y, x):
    if INTERPRETED:
        return atan2_in_float64(y, x)
    else:
        return libdevice.atan2(y, x)


@triton.jit
def sinh(x):
    if INTERPRETED:
        return sinh_in_float64(x)
    else:
        return libdevice.sinh(x)


@triton.jit
def cosh(x):
    if INTERPRETED:
        return cosh_in_float64(x)
    else:
        return libdevice.cosh(x)


@triton.jit
def asinh(x):
    if INTERPRETED:
        return asinh_in_float64(x)
    else:
        return libdevice.asinh(x)


@triton.jit
def acosh(x):
    if INTERPRETED:
        return acosh_in_float64(x)
    else:
        return libdevice.acosh(x)


@triton.jit
def atanh(x):
    if INTERPRETED:
        return atanh_in_float64(x)
    else:
        return libdevice.atanh(x)


@triton.jit
def hypot(a, b):
    if INTERPRETED:
        return hypot_in_float64(a, b)
    else:
        return libdevice.hypot(a, b)


@triton.jit
def lgamma(x):
    if INTERPRETED:
        return lgamma_in_float64(x)
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
    psi = tl.where(x == 0.0, tl.where(sign_bit(x), float("inf"), float("-inf")), psi)
    return tl.where(negative & (x == tl.floor(x)), float("nan"), psi)


@triton.jit
def digamma(x):
    if INTERPRETED:
        return digamma_in_float64(x)
    elif x.dtype == tl.float64:
        return digamma_in_float64(x)
    else:
        return _digamma_float32(x)


@triton.jit
def erfc(x):
    if INTERPRETED:
        return erfc_in_float64(x)
    else:
        return libdevice.erfc(x)


@triton.jit
def erfinv(x):
    if INTERPRETED:
        return erfinv_in_float64(x)
    else:
        return libdevice.erfinv(x)
