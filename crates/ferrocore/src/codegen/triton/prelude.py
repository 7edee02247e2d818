import os
import threading

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    ferro_jit = triton.jit
else:

    class DeferredJit:
        """`triton.jit`, deferred to the first use. The decorator reads and tokenizes the
        function's source, which is nearly all of a wrapper module's import, while a warm start
        launches cached binaries and never needs it. The first use turns every deferred function
        of the module into its JITFunction, in the module's globals too, where Triton's compiler
        looks its callees up."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = fn.__name__
            self._jit = None

        _lock = threading.Lock()  # kernels are compiled on several threads

        def jit_function(self):
            with DeferredJit._lock:
                if self._jit is None:
                    scope = self.fn.__globals__
                    for name, value in list(scope.items()):
                        if isinstance(value, DeferredJit):
                            if value._jit is None:
                                value._jit = triton.jit(value.fn)
                            scope[name] = value._jit
            return self._jit

        def __getattr__(self, name):
            if name in ("fn", "_jit"):  # not set yet (a copy): no JITFunction to ask
                raise AttributeError(name)
            return getattr(self.jit_function(), name)

        def __getitem__(self, grid):
            return self.jit_function()[grid]

    ferro_jit = DeferredJit

# Combine functions of reductions and helpers with torch's semantics (NaN-propagating max/min,
# Python floor division and modulo, no trap on a zero integer divisor: 0, as in the C++ kernels).


@ferro_jit
def ferro_max(a, b):
    return tl.where((a > b) | (a != a), a, b)


@ferro_jit
def ferro_min(a, b):
    return tl.where((a < b) | (a != a), a, b)


@ferro_jit
def ferro_sum(a, b):
    return a + b


@ferro_jit
def ferro_prod(a, b):
    return a * b


@ferro_jit
def ferro_any(a, b):
    return a | b


@ferro_jit
def ferro_atomic_combine(base, ptr, val, mask, BITS: tl.constexpr, OP: tl.constexpr):
    # What no atomic instruction does (a product; a 16-bit maximum or minimum): each lane
    # compares-and-swaps its combined value until it lands (lanes on one address serialize).
    # Masked lanes swap the buffer's first element with itself, a no-op; so do finished lanes.
    # OP: 0 product, 1 maximum, 2 minimum (NaN-propagating, as ferro_max/ferro_min).
    ptr = tl.where(mask, ptr, base)
    bits = ptr.to(tl.pointer_type(BITS), bitcast=True)
    old = tl.load(ptr)
    val = val.to(old.dtype)
    done = mask == 0
    while tl.sum((done == 0).to(tl.int32)) > 0:
        if OP == 0:
            combined = old * val
        elif OP == 1:
            combined = ferro_max(old, val)
        else:
            combined = ferro_min(old, val)
        new = tl.where(done, old, combined)
        prev = tl.atomic_cas(bits, old.to(BITS, bitcast=True), new.to(BITS, bitcast=True))
        landed = prev == old.to(BITS, bitcast=True)
        done = done | landed
        old = tl.where(landed, old, prev.to(old.dtype, bitcast=True))


@ferro_jit
def ferro_welford(mean_a, m2_a, w_a, mean_b, m2_b, w_b):
    # merges two (mean, M2, count) partials of a variance (Chan et al.); empty ones are neutral
    w = w_a + w_b
    frac = tl.where(w == 0, 0.0, w_b / tl.where(w == 0, 1.0, w))
    delta = mean_b - mean_a
    return mean_a + delta * frac, m2_a + m2_b + delta * delta * w_a * frac, w


@ferro_jit
def ferro_argmax(va, ia, vb, ib):
    # the first maximum wins; NaN beats every number
    a_nan = va != va
    b_nan = vb != vb
    better = (va > vb) | (a_nan & (b_nan == 0))
    same = (va == vb) | (a_nan & b_nan)
    take_a = better | (same & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@ferro_jit
def ferro_argmin(va, ia, vb, ib):
    a_nan = va != va
    b_nan = vb != vb
    better = (va < vb) | (a_nan & (b_nan == 0))
    same = (va == vb) | (a_nan & b_nan)
    take_a = better | (same & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@ferro_jit
def ferro_minus_one(b):
    # the divisor whose quotient can overflow (minimum // -1); unsigned types have none
    if b.dtype.is_int_signed():
        return b == -1
    else:
        return b != b


# Integer division: a zero divisor gives 0 (no trap). A -1 divisor negates with wrap-around and
# leaves remainder 0, so the minimum divided by -1 gives eager's minimum (sdiv would overflow:
# undefined in LLVM; Triton does not promote 8- and 16-bit operands as C does).
@ferro_jit
def ferro_floordiv_i(a, b):
    minus_one = ferro_minus_one(b)
    safe = tl.where((b == 0) | minus_one, 1, b)
    q = a // safe
    r = a % safe
    q = tl.where((r != 0) & ((r < 0) != (safe < 0)), q - 1, q)
    return tl.where(b == 0, 0, tl.where(minus_one, -a, q))


@ferro_jit
def ferro_mod_i(a, b):
    special = (b == 0) | ferro_minus_one(b)
    safe = tl.where(special, 1, b)
    r = a % safe
    r = tl.where((r != 0) & ((r < 0) != (safe < 0)), r + safe, r)
    return tl.where(special, 0, r)


@ferro_jit
def ferro_truncdiv_i(a, b):
    minus_one = ferro_minus_one(b)
    safe = tl.where((b == 0) | minus_one, 1, b)
    return tl.where(b == 0, 0, tl.where(minus_one, -a, a // safe))


@ferro_jit
def ferro_fmod_i(a, b):
    special = (b == 0) | ferro_minus_one(b)
    safe = tl.where(special, 1, b)
    return tl.where(special, 0, a % safe)


@ferro_jit
def ferro_remainder_f(a, b):
    r = ferro_fmod_f(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@ferro_jit
def ferro_floordiv_f(a, b):
    # exact where floor(a / b) is not: the quotient of a - fmod(a, b), corrected by one when the
    # remainder's sign differs from the divisor's, rounded to the integer it should be
    rem = ferro_fmod_f(a, b)
    q = (a - rem) / b
    q = tl.where((rem != 0) & ((b < 0) != (rem < 0)), q - 1, q)
    fq = tl.math.floor(q)
    q = tl.where(q - fq > 0.5, fq + 1, fq)
    zero = tl.where(a / b < 0, -0.0, 0.0)
    q = tl.where(q == 0, zero, q)
    return tl.where(b == 0, a / b, q)


@ferro_jit
def ferro_ipow(base, exp):
    # integer power by squaring; negative exponents as torch: 1 for base 1, +-1 for base -1, else 0
    base, exp = tl.broadcast(base, exp)
    zero = tl.zeros_like(base)
    result = zero + 1
    b = base
    e = exp
    for _ in range(64):
        result = tl.where((e & 1) != 0, result * b, result)
        e = e >> 1
        b = b * b
    # (unsigned operands have no negative side: the interpreter rejects comparing them with -1)
    if exp.dtype.is_int_signed():
        if base.dtype.is_int_signed():
            odd = (exp & 1) != 0
            negative = tl.where(base == 1, zero + 1, tl.where(base == -1, tl.where(odd, zero - 1, zero + 1), zero))
        else:
            negative = tl.where(base == 1, zero + 1, zero)
        result = tl.where(exp < 0, negative, result)
    return result


@ferro_jit
def ferro_philox(seed, offset):
    # Philox 4x32-10 keyed by the int64 seed, counter (offset low, offset high, 0, 0): the same
    # stream as the C++ backend's ferro_philox (Triton's philox is the same generator)
    offset = offset.to(tl.uint64, bitcast=True)
    lo = (offset & 0xFFFFFFFF).to(tl.uint32)
    hi = (offset >> 32).to(tl.uint32)
    zero = tl.zeros_like(lo)
    return tl.philox(seed, lo, hi, zero, zero)


@ferro_jit
def ferro_rand(seed, offset):
    r0, r1, r2, r3 = ferro_philox(seed, offset)
    return (r0 >> 8).to(tl.float32) * (1.0 / 16777216.0)  # 24 random bits: [0, 1)


@ferro_jit
def ferro_randn(seed, offset):
    r0, r1, r2, r3 = ferro_philox(seed, offset)
    # Box-Muller on two 32-bit draws; u1 in (0, 1] keeps the log finite
    u1 = (r0.to(tl.float64) + 1.0) * (1.0 / 4294967296.0)
    u2 = r1.to(tl.float64) * (1.0 / 4294967296.0)
    return (tl.math.sqrt(-2.0 * tl.math.log(u1)) * tl.math.cos(6.283185307179586 * u2)).to(tl.float32)


@ferro_jit
def ferro_floordiv_pos(a, d: tl.constexpr):
    # index math: floor(a / d) for a constant d > 1 and an `a` that may be negative
    q = a // d
    return tl.where((a % d != 0) & (a < 0), q - 1, q)


@ferro_jit
def ferro_mod_pos(a, d: tl.constexpr):
    r = a % d
    return tl.where(r < 0, r + d, r)


# float32 blocks multiplied in float32 (as eager does unless TF32 is allowed), in the interpreter
# as on the GPU
@ferro_jit
def ferro_dot_f32(a, b):
    return tl.dot(a, b, input_precision="ieee")


@ferro_jit
def ferro_dot_acc_f32(a, b, acc):
    return tl.dot(a, b, acc, input_precision="ieee")


# Transcendental functions: libdevice on the GPU. Triton's interpreter (TRITON_INTERPRET=1, how
# CI runs these kernels on CPU tensors) has no libdevice: there they are numpy functions over the
# interpreter's tensors.
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    import math as _math

    import numpy as _np
    from triton.runtime.interpreter import TensorHandle as _Handle

    def _numpy(f):
        def apply(*xs):
            data = _np.asarray(f(*[x.handle.data for x in xs]))
            dt = xs[0].dtype
            data = data.astype(xs[0].handle.data.dtype)
            return tl.core.tensor(_Handle(data, dt), tl.block_type(dt, list(data.shape)) if data.shape else dt)

        return apply

    ferro_exp = _numpy(_np.exp)

    @ferro_jit
    def ferro_div(a, b):
        return a / b

    @ferro_jit
    def ferro_sqrt(x):
        return tl.math.sqrt(x)

    @ferro_jit
    def ferro_rsqrt(x):
        return tl.math.rsqrt(x)

    ferro_expm1 = _numpy(_np.expm1)
    ferro_log1p = _numpy(_np.log1p)
    ferro_log10 = _numpy(_np.log10)
    ferro_tan = _numpy(_np.tan)
    ferro_asin = _numpy(_np.arcsin)
    ferro_acos = _numpy(_np.arccos)
    ferro_atan = _numpy(_np.arctan)
    ferro_sinh = _numpy(_np.sinh)
    ferro_cosh = _numpy(_np.cosh)
    ferro_tanh = _numpy(_np.tanh)
    ferro_asinh = _numpy(_np.arcsinh)
    ferro_acosh = _numpy(_np.arccosh)
    ferro_atanh = _numpy(_np.arctanh)
    def _lgamma(v):
        try:
            return _math.lgamma(v)
        except (ValueError, OverflowError):  # poles at 0, -1, ...
            return _math.inf

    def _erfcx(v):
        if v < 25.0:
            try:
                return _math.exp(v * v) * _math.erfc(v)
            except OverflowError:
                return _math.inf
        r = 1.0 / (v * v)  # asymptotic series, as the C++ backend's ferro_erfcx
        return 0.5641895835477563 / v * (1.0 - 0.5 * r + 0.75 * r * r - 1.875 * r * r * r)

    ferro_erfc = _numpy(_np.vectorize(_math.erfc, otypes=[_np.float64]))
    ferro_erfcx = _numpy(_np.vectorize(_erfcx, otypes=[_np.float64]))
    ferro_lgamma = _numpy(_np.vectorize(_lgamma, otypes=[_np.float64]))
    ferro_nearbyint = _numpy(_np.rint)
    ferro_trunc = _numpy(_np.trunc)
    ferro_atan2 = _numpy(_np.arctan2)
    ferro_pow = _numpy(_np.power)
    ferro_fmod_f = _numpy(_np.fmod)

    # the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even
    @ferro_jit
    def ferro_round_bf16(x):
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))

    @ferro_jit
    def ferro_store_bf16(x):
        return ferro_round_bf16(x).to(tl.bfloat16)

    # the interpreter multiplies bfloat16 blocks as raw integers: float32 holds them exactly
    @ferro_jit
    def ferro_dot(a, b):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @ferro_jit
    def ferro_dot_acc(a, b, acc):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @ferro_jit
    def ferro_exp2_ftz(x):
        return tl.math.exp2(x)
else:

    # a matrix-product template's step: 16-bit operands into float32 sums (tensor cores)
    @ferro_jit
    def ferro_dot(a, b):
        return tl.dot(a, b)

    # the product added to `acc` by the tensor cores (kernels compile without FMA contraction:
    # `acc + tl.dot(a, b)` would be a further addition per element)
    @ferro_jit
    def ferro_dot_acc(a, b, acc):
        return tl.dot(a, b, acc)

    # 2^x in one instruction, results below 2^-126 flushed to 0: an attention kernel's
    # probabilities (at most 1 in a row summing to at least 1, so a flushed one changes nothing).
    # Kernels compile keeping denormals, where `tl.math.exp2` costs several instructions more
    # per score (an ALiBi forward 8% slower on the H200).
    @ferro_jit
    def ferro_exp2_ftz(x):
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    from triton.language.extra import libdevice

    # Linking libdevice costs a kernel's compile ~50 ms (its bitcode is parsed and optimized each
    # time), so the functions most kernels use (normalizations' rsqrt, softmax's exp) are written
    # here without it, as accurate as ATen's CUDA kernels.

    # exp within 2 ulp over the whole range, denormal results included (tl.exp's ex2.approx is
    # off by 2e-4 relative near the overflow bound and flushes denormals): exp(x) = 2^n exp(r),
    # n = round(x / ln 2), r = x - n ln 2 with ln 2 in two parts (Cody and Waite), exp(r) by its
    # Taylor polynomial to r^7 (|r| <= 0.35: truncated below 0.1 ulp), and 2^n applied in two
    # halves so that a denormal result is rounded once
    @ferro_jit
    def ferro_exp(x):
        if x.dtype == tl.float32:
            xc = tl.minimum(tl.maximum(x, -104.0), 89.0)  # beyond: 0 and inf, from the scaling
            n = (xc * 1.4426950408889634 + 12582912.0) - 12582912.0  # round to nearest
            r = tl.fma(n, -0.693145751953125, xc)  # exact: ln 2's high part has 16 bits
            r = tl.fma(n, -1.4286068202862268e-06, r)
            p = tl.fma(r, 1.0 / 5040.0, 1.0 / 720.0)
            p = tl.fma(p, r, 1.0 / 120.0)
            p = tl.fma(p, r, 1.0 / 24.0)
            p = tl.fma(p, r, 1.0 / 6.0)
            p = tl.fma(p, r, 0.5)
            p = tl.fma(p, r, 1.0)
            p = tl.fma(p, r, 1.0)
            k = n.to(tl.int32)
            half = k >> 1
            s1 = ((half + 127) << 23).to(tl.float32, bitcast=True)
            s2 = ((k - half + 127) << 23).to(tl.float32, bitcast=True)
            return tl.where(x != x, x, p * s1 * s2)
        else:
            return libdevice.exp(x)

    # IEEE square root, as ATen's sqrtf (tl.math.sqrt is libdevice's sqrt.approx.ftz)
    @ferro_jit
    def ferro_sqrt(x):
        if x.dtype == tl.float32:
            return tl.math.sqrt_rn(x)
        else:
            return tl.math.sqrt(x)

    # rsqrt.approx.f32, as ATen's rsqrtf (tl.math.rsqrt is libdevice's, with denormals flushed)
    @ferro_jit
    def ferro_rsqrt(x):
        if x.dtype == tl.float32:
            return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.math.rsqrt(x)

    # IEEE division like CUDA's `/` in ATen's kernels (Triton's `/` is div.full: 2 ulp)
    @ferro_jit
    def ferro_div(a, b):
        if a.dtype == tl.float32:
            return tl.math.div_rn(a, b)
        else:  # float64 division is IEEE already
            return a / b

    @ferro_jit
    def ferro_expm1(x):
        return libdevice.expm1(x)

    @ferro_jit
    def ferro_log1p(x):
        return libdevice.log1p(x)

    @ferro_jit
    def ferro_log10(x):
        return libdevice.log10(x)

    @ferro_jit
    def ferro_tan(x):
        return libdevice.tan(x)

    @ferro_jit
    def ferro_asin(x):
        return libdevice.asin(x)

    @ferro_jit
    def ferro_acos(x):
        return libdevice.acos(x)

    @ferro_jit
    def ferro_atan(x):
        return libdevice.atan(x)

    @ferro_jit
    def ferro_sinh(x):
        return libdevice.sinh(x)

    @ferro_jit
    def ferro_cosh(x):
        return libdevice.cosh(x)

    @ferro_jit
    def ferro_tanh(x):
        return libdevice.tanh(x)

    @ferro_jit
    def ferro_asinh(x):
        return libdevice.asinh(x)

    @ferro_jit
    def ferro_acosh(x):
        return libdevice.acosh(x)

    @ferro_jit
    def ferro_atanh(x):
        return libdevice.atanh(x)

    @ferro_jit
    def ferro_erfc(x):
        return libdevice.erfc(x)

    @ferro_jit
    def ferro_erfcx(x):
        return libdevice.erfcx(x)

    @ferro_jit
    def ferro_lgamma(x):
        return libdevice.lgamma(x)

    @ferro_jit
    def ferro_nearbyint(x):
        return libdevice.nearbyint(x)

    @ferro_jit
    def ferro_trunc(x):
        return libdevice.trunc(x)

    @ferro_jit
    def ferro_atan2(a, b):
        return libdevice.atan2(a, b)

    @ferro_jit
    def ferro_pow(a, b):
        return libdevice.pow(a, b)

    # exact, as C's fmod (Triton's float `%` divides: wrong by far for large quotients)
    @ferro_jit
    def ferro_fmod_f(a, b):
        return libdevice.fmod(a, b)

    @ferro_jit
    def ferro_round_bf16(x):
        return x.to(tl.bfloat16).to(tl.float32)

    @ferro_jit
    def ferro_store_bf16(x):
        return x.to(tl.bfloat16)
