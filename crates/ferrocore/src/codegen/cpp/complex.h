// complex32 (chalf) storage: two IEEE halves; kernels move it as std::complex<float>.
// Emitted after <complex> and the prelude, only into units that move complex values.
struct ferro_chalf { uint16_t re, im; };
static inline std::complex<float> ferro_chalf2c(ferro_chalf h) { return {ferro_h2f(h.re), ferro_h2f(h.im)}; }
static inline ferro_chalf ferro_c2chalf(std::complex<float> v) { return {ferro_f2h(v.real()), ferro_f2h(v.imag())}; }
static inline std::complex<float> ferro_round_chalf(std::complex<float> v) { return ferro_chalf2c(ferro_c2chalf(v)); }
