// ferrocore C++ kernel prelude: type conversions and NaN-aware helpers shared by all kernels.
// No <cmath> (0.2 s of parsing per compile, more than the kernels of a small graph): real math
// is `ferro::`, over the compiler's builtins, which are what <cmath>'s overloads call.
#include <cstdint>
#include <limits>
#include <type_traits>

// Vector variants from glibc's libmvec, so `omp simd` loops over math functions vectorize.
extern "C" {
float expf(float) __attribute__((simd("notinbranch")));
double exp(double) __attribute__((simd("notinbranch")));
float exp2f(float) __attribute__((simd("notinbranch")));
double exp2(double) __attribute__((simd("notinbranch")));
float expm1f(float) __attribute__((simd("notinbranch")));
double expm1(double) __attribute__((simd("notinbranch")));
float logf(float) __attribute__((simd("notinbranch")));
double log(double) __attribute__((simd("notinbranch")));
float log2f(float) __attribute__((simd("notinbranch")));
double log2(double) __attribute__((simd("notinbranch")));
float log10f(float) __attribute__((simd("notinbranch")));
double log10(double) __attribute__((simd("notinbranch")));
float log1pf(float) __attribute__((simd("notinbranch")));
double log1p(double) __attribute__((simd("notinbranch")));
float sinf(float) __attribute__((simd("notinbranch")));
double sin(double) __attribute__((simd("notinbranch")));
float cosf(float) __attribute__((simd("notinbranch")));
double cos(double) __attribute__((simd("notinbranch")));
float tanf(float) __attribute__((simd("notinbranch")));
double tan(double) __attribute__((simd("notinbranch")));
float asinf(float) __attribute__((simd("notinbranch")));
double asin(double) __attribute__((simd("notinbranch")));
float acosf(float) __attribute__((simd("notinbranch")));
double acos(double) __attribute__((simd("notinbranch")));
float atanf(float) __attribute__((simd("notinbranch")));
double atan(double) __attribute__((simd("notinbranch")));
float sinhf(float) __attribute__((simd("notinbranch")));
double sinh(double) __attribute__((simd("notinbranch")));
float coshf(float) __attribute__((simd("notinbranch")));
double cosh(double) __attribute__((simd("notinbranch")));
float tanhf(float) __attribute__((simd("notinbranch")));
double tanh(double) __attribute__((simd("notinbranch")));
float asinhf(float) __attribute__((simd("notinbranch")));
double asinh(double) __attribute__((simd("notinbranch")));
float acoshf(float) __attribute__((simd("notinbranch")));
double acosh(double) __attribute__((simd("notinbranch")));
float atanhf(float) __attribute__((simd("notinbranch")));
double atanh(double) __attribute__((simd("notinbranch")));
float erff(float) __attribute__((simd("notinbranch")));
double erf(double) __attribute__((simd("notinbranch")));
float erfcf(float) __attribute__((simd("notinbranch")));
double erfc(double) __attribute__((simd("notinbranch")));
float powf(float, float) __attribute__((simd("notinbranch")));
double pow(double, double) __attribute__((simd("notinbranch")));
float atan2f(float, float) __attribute__((simd("notinbranch")));
double atan2(double, double) __attribute__((simd("notinbranch")));
// sin and cos again, under names g++ does not take for its builtins: it merges the builtins'
// sin(x) and cos(x) of one argument into one sincos call, which has no vector variant, and the
// loop runs scalar (sin(x) * cos(x) over 8M floats: 54 ms against Inductor's 7).
float ferro_sinf(float) __asm__("sinf") __attribute__((simd("notinbranch"), const, nothrow, leaf));
double ferro_sin(double) __asm__("sin") __attribute__((simd("notinbranch"), const, nothrow, leaf));
float ferro_cosf(float) __asm__("cosf") __attribute__((simd("notinbranch"), const, nothrow, leaf));
double ferro_cos(double) __asm__("cos") __attribute__((simd("notinbranch"), const, nothrow, leaf));
}

namespace ferro {
#define FERRO_UNARY(fn) \
  static inline float fn(float x) { return __builtin_##fn##f(x); } \
  static inline double fn(double x) { return __builtin_##fn(x); }
#define FERRO_BINARY(fn) \
  static inline float fn(float x, float y) { return __builtin_##fn##f(x, y); } \
  static inline double fn(double x, double y) { return __builtin_##fn(x, y); }
FERRO_UNARY(exp) FERRO_UNARY(exp2) FERRO_UNARY(expm1) FERRO_UNARY(log) FERRO_UNARY(log2) FERRO_UNARY(log10)
FERRO_UNARY(log1p) FERRO_UNARY(sqrt) FERRO_UNARY(tan) FERRO_UNARY(asin)
FERRO_UNARY(acos) FERRO_UNARY(atan) FERRO_UNARY(sinh) FERRO_UNARY(cosh) FERRO_UNARY(tanh) FERRO_UNARY(asinh)
FERRO_UNARY(acosh) FERRO_UNARY(atanh) FERRO_UNARY(erf) FERRO_UNARY(erfc) FERRO_UNARY(lgamma) FERRO_UNARY(floor)
FERRO_UNARY(ceil) FERRO_UNARY(nearbyint) FERRO_UNARY(trunc)
FERRO_BINARY(fmod) FERRO_BINARY(pow) FERRO_BINARY(atan2) FERRO_BINARY(copysign)
#undef FERRO_UNARY
#undef FERRO_BINARY
static inline float sin(float x) { return ferro_sinf(x); }
static inline double sin(double x) { return ferro_sin(x); }
static inline float cos(float x) { return ferro_cosf(x); }
static inline double cos(double x) { return ferro_cos(x); }
static inline float abs(float x) { return __builtin_fabsf(x); }
static inline double abs(double x) { return __builtin_fabs(x); }
static inline float fma(float x, float y, float z) { return __builtin_fmaf(x, y, z); }
static inline double fma(double x, double y, double z) { return __builtin_fma(x, y, z); }
static inline bool isnan(float x) { return __builtin_isnan(x); }
static inline bool isnan(double x) { return __builtin_isnan(x); }
static inline bool isinf(float x) { return __builtin_isinf(x); }
static inline bool isinf(double x) { return __builtin_isinf(x); }
// std::max and std::min (integers; floats take the NaN-propagating ferro_max / ferro_min)
template <typename T> static inline T max(T a, T b) { return (a < b) ? b : a; }
template <typename T> static inline T min(T a, T b) { return (b < a) ? b : a; }
}  // namespace ferro

#ifdef __FLT16_MAX__
static inline float ferro_h2f(uint16_t h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t ferro_f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; __builtin_memcpy(&h, &v, 2); return h; }
#else
// compilers without _Float16 on x86 (clang < 15): the same conversions in integer arithmetic,
// rounding to nearest even; NaN becomes the quiet NaN 0x7e00 with its sign
static inline float ferro_h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {
    float v = (float)man * 5.9604644775390625e-8f;  // a subnormal: man * 2^-24, exact
    __builtin_memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
static inline uint16_t ferro_f2h(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  uint32_t sign = u & 0x80000000u, h;
  u ^= sign;
  if (u >= (143u << 23)) {  // 2^16 and beyond: inf (NaN stays NaN)
    h = u > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // a half subnormal or zero: let a float add round it
    float a;
    __builtin_memcpy(&a, &u, 4);
    a += 0.5f;
    __builtin_memcpy(&h, &a, 4);
    h -= 126u << 23;
  } else {
    u += (uint32_t)(-112 * (1 << 23)) + 0xfffu + ((u >> 13) & 1u);  // rebias, round to nearest even
    h = u >> 13;
  }
  return (uint16_t)(h | (sign >> 16));
}
#endif
static inline float ferro_bf2f(uint16_t b) { uint32_t u = ((uint32_t)b) << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint16_t ferro_f2bf(float f) {
  uint32_t u; __builtin_memcpy(&u, &f, 4);
  if (ferro::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}
static inline float ferro_round_half(float f) { return ferro_h2f(ferro_f2h(f)); }
// erfcx(x) = exp(x^2) erfc(x) in double; past x = 25 erfc underflows, so the asymptotic series
// 1/(x sqrt(pi)) (1 - 1/(2x^2) + 3/(4x^4) - 15/(8x^6)) takes over (truncation error < 1e-10)
static inline double ferro_erfcx(double x) {
  if (!(x >= 25.0)) return ferro::exp(x * x) * ferro::erfc(x);
  double r = 1.0 / (x * x);
  return 0.5641895835477563 / x * (1.0 - 0.5 * r + 0.75 * r * r - 1.875 * r * r * r);
}
static inline float ferro_round_bf16(float f) { return ferro_bf2f(ferro_f2bf(f)); }
template <typename T> static inline T ferro_max(T a, T b) { return (b > a || b != b) ? b : a; }
template <typename T> static inline T ferro_min(T a, T b) { return (b < a || b != b) ? b : a; }
template <typename T> static inline T ferro_remainder(T a, T b) {
  T r = ferro::fmod(a, b);
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}
template <typename T> static inline T ferro_ipow(T base, T exp) {
  if (exp < 0) return (base == 1) ? 1 : ((base == -1) ? ((exp & 1) ? -1 : 1) : 0);
  T result = 1;
  while (exp) { if (exp & 1) result *= base; exp >>= 1; base *= base; }
  return result;
}
static inline int64_t ferro_floordiv(int64_t a, int64_t b) { int64_t q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
static inline int64_t ferro_mod(int64_t a, int64_t b) { int64_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
// Float -> int32/int64 as CPU eager gives it on x86 (its casts compile to cvttss2si/cvttsd2si,
// whose answer out of range is the most negative value): NaN, +-inf and values whose truncation
// leaves the range give the minimum. Written without C++'s undefined conversion (which g++ folds
// to 0 or the maximum for a constant). Narrower targets: `cast_expr` keeps the low bits of these.
template <typename I, typename F> static inline I ferro_f2i(F x) {
  static_assert(sizeof(I) == 4 || sizeof(I) == 8, "int32 or int64");
  // -2^31 or -2^63, exact in float and double; `lo - 1` is exact only for double and int32, where
  // (lo - 1, lo) truncates to lo. No trunc: g++ 12 does not vectorize a loop that calls it.
  const F lo = F(std::numeric_limits<I>::min());
  bool in_range = ((x >= lo) | (x > lo - F(1))) & (x < -lo);  // false for NaN
  I v = static_cast<I>(in_range ? x : F(0));
  return in_range ? v : std::numeric_limits<I>::min();
}
template <typename T> static inline T ferro_sign(T x) { return (T)((T(0) < x) - (x < T(0))); }
// Zeros the compiler cannot fold (weak: another unit could define them): added to an integer
// converted to float, they turn g++'s `trunc(x)` for `(float)(int)x` back into +0.0 where x
// was a negative fraction (see `cast_expr`). Never written.
__attribute__((weak)) float ferro_zero_f = 0.0f;
__attribute__((weak)) double ferro_zero_d = 0.0;
// Neumaier's compensated addition: s + c holds the sum of every v added, rounding errors kept in c
static inline void ferro_sum2(double& s, double& c, double v) {
  double t = s + v;
  c += ferro::abs(s) >= ferro::abs(v) ? (s - t) + v : (v - t) + s;
  s = t;
}
#pragma omp declare reduction(ferro_fmax : float : omp_out = ferro_max(omp_out, omp_in)) initializer(omp_priv = -__builtin_inff())
#pragma omp declare reduction(ferro_fmin : float : omp_out = ferro_min(omp_out, omp_in)) initializer(omp_priv = __builtin_inff())
#pragma omp declare reduction(ferro_dmax : double : omp_out = ferro_max(omp_out, omp_in)) initializer(omp_priv = -__builtin_inf())
#pragma omp declare reduction(ferro_dmin : double : omp_out = ferro_min(omp_out, omp_in)) initializer(omp_priv = __builtin_inf())
// Integer division and modulo: ATen raises on a zero divisor; a kernel must not trap, so it
// yields 0 there (documented in ARCHITECTURE.md). The minimum divided by -1 overflows (x86's
// idiv traps: SIGFPE); eager's quotient wraps to the minimum and its remainder is 0, so a -1
// divisor negates with wrap-around and leaves remainder 0. (8- and 16-bit operands promote to
// int and never overflow; the guard costs nothing there.)
template <typename T> static inline bool ferro_is_minus_one(T b) { return std::is_signed<T>::value && b == T(-1); }
template <typename T> static inline T ferro_neg_wrap(T a) {
  using U = typename std::make_unsigned<T>::type;
  return static_cast<T>(static_cast<U>(U(0) - static_cast<U>(a)));
}
template <typename T> static inline T ferro_floordiv_i(T a, T b) {
  if (b == 0) return 0;
  if (ferro_is_minus_one(b)) return ferro_neg_wrap(a);
  T q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename T> static inline T ferro_truncdiv_i(T a, T b) { return b == 0 ? 0 : (ferro_is_minus_one(b) ? ferro_neg_wrap(a) : a / b); }
template <typename T> static inline T ferro_mod_i(T a, T b) {
  if (b == 0 || ferro_is_minus_one(b)) return 0;
  T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <typename T> static inline T ferro_fmod_i(T a, T b) { return (b == 0 || ferro_is_minus_one(b)) ? 0 : a % b; }
template <typename T> static inline T ferro_lshift(T a, T b) {
  if (b < 0 || b >= (T)(sizeof(T) * 8)) return 0;
  return (T)((typename std::make_unsigned<T>::type)a << b);
}
template <typename T> static inline T ferro_rshift(T a, T b) {
  if (b < 0 || b >= (T)(sizeof(T) * 8)) return a < 0 ? (T)-1 : (T)0;
  return a >> b;
}
// exp for float with no special-case branch: libmvec's expf leaves the vector path for -inf
// (masked softmax), this one stays vectorized. <= 1 ulp (Cephes polynomial); exact 0, inf and
// NaN at the edges, denormal results included.
static inline float ferro_bits_f(int32_t i) { return __builtin_bit_cast(float, i); }
static inline float ferro_expf(float x) {
  // out-of-range lanes (and NaN) compute exp(0) and are replaced at the end: computing them
  // would produce denormal intermediates, which cost ~100 cycles each on x86
  float xc = ((x > -103.972084f) & (x < 88.7228394f)) ? x : 0.0f;  // `&`: no branch to if-convert
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = ferro::fma(n, -0.693359375f, xc);
  r = ferro::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500E-4f;
  p = ferro::fma(p, r, 1.3981999507E-3f);
  p = ferro::fma(p, r, 8.3334519073E-3f);
  p = ferro::fma(p, r, 4.1665795894E-2f);
  p = ferro::fma(p, r, 1.6666665459E-1f);
  p = ferro::fma(p, r, 5.0000001201E-1f);
  p = ferro::fma(p, r * r, r + 1.0f);
  int32_t ni = (int32_t)n;
  int32_t n1 = ni >> 1;  // 2^n as two factors keeps denormal results
  int32_t n2 = ni - n1;
  float s = p * ferro_bits_f((n1 + 127) << 23) * ferro_bits_f((n2 + 127) << 23);
  s = x > 88.7228394f ? __builtin_inff() : s;
  s = x < -103.972084f ? 0.0f : s;
  return x != x ? x : s;
}
// Python floor division for floats, exact where floor(a / b) is not: the quotient is formed
// from a - fmod(a, b), corrected by one when the remainder's sign differs from the divisor's,
// then rounded to the nearest integer it should be; zero keeps the sign of a / b.
template <typename T> static inline T ferro_floordiv_f(T a, T b) {
  if (b == 0) return a / b;
  T rem = ferro::fmod(a, b);
  T q = (a - rem) / b;
  if (rem != 0 && ((b < 0) != (rem < 0))) q -= T(1);
  if (q == 0) return ferro::copysign(T(0), a / b);
  T fq = ferro::floor(q);
  return (q - fq > T(0.5)) ? fq + T(1) : fq;
}
// Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a counter-based
// generator, so element i of a stream is a pure function of (seed, i) and any loop order or
// thread split gives the same numbers.
static inline void ferro_philox(uint64_t seed, uint64_t offset, uint32_t out[4]) {
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  uint32_t c0 = (uint32_t)offset, c1 = (uint32_t)(offset >> 32), c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0;
    uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
static inline float ferro_rand(uint64_t seed, uint64_t offset) {
  uint32_t r[4];
  ferro_philox(seed, offset, r);
  return (float)(r[0] >> 8) * (1.0f / 16777216.0f);  // 24 random bits: [0, 1)
}
static inline float ferro_randn(uint64_t seed, uint64_t offset) {
  uint32_t r[4];
  ferro_philox(seed, offset, r);
  // Box-Muller on two 32-bit draws; u1 in (0, 1] keeps the log finite
  double u1 = ((double)r[0] + 1.0) * (1.0 / 4294967296.0);
  double u2 = (double)r[1] * (1.0 / 4294967296.0);
  return (float)(ferro::sqrt(-2.0 * ferro::log(u1)) * ferro::cos(6.283185307179586 * u2));
}
