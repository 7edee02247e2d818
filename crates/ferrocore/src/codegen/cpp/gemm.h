// float32 matrix products for the matrix-product kernels (codegen/cpp/gemm.rs), included only
// in sources that have one. A register-blocked micro-kernel over one packed panel of B: rows of
// A broadcast against two vectors of B's columns, accumulated with FMAs in k order (as MKL's
// small-matrix kernels do). Vectors are GCC's: 16 lanes under AVX-512, 8 otherwise.
namespace ferro {
#if defined(__AVX512F__)
#define FERRO_GEMM_LANES 16
#else
#define FERRO_GEMM_LANES 8
#endif
typedef float gemm_vf __attribute__((vector_size(FERRO_GEMM_LANES * 4)));
constexpr int64_t gemm_lanes = FERRO_GEMM_LANES;
// columns of a micro tile: two vectors
constexpr int64_t gemm_nr = 2 * FERRO_GEMM_LANES;
// rows of a micro tile: 12 accumulators, 2 of B and a broadcast fit 16 vector registers
constexpr int64_t gemm_mr = 6;
// k per packed panel: 256 x 32 floats (32 KiB) stay in L1/L2 across the panel's row tiles
constexpr int64_t gemm_kc = 256;

static inline gemm_vf gemm_load(const float* p) {
  gemm_vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
static inline void gemm_store(float* p, gemm_vf v) { __builtin_memcpy(p, &v, sizeof v); }

// c[MR x gemm_nr] = (first ? 0 : c) + a[MR rows, kc] * b[kc rows of gemm_nr, row stride ldb].
// The sources compile with -ffp-contract=off (eager's pointwise rounding); here products fuse
// into FMAs.
template <int MR>
__attribute__((optimize("fp-contract=fast"))) static inline void gemm_micro(
    bool first, int64_t kc, const float* __restrict__ a, int64_t a_row, int64_t a_k, const float* __restrict__ b, int64_t ldb,
    float* __restrict__ c, int64_t ldc) {
  gemm_vf lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = first ? gemm_vf{} : gemm_load(c + r * ldc);
    hi[r] = first ? gemm_vf{} : gemm_load(c + r * ldc + gemm_lanes);
  }
  for (int64_t p = 0; p < kc; ++p) {
    const gemm_vf b0 = gemm_load(b + p * ldb), b1 = gemm_load(b + p * ldb + gemm_lanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float s = a[r * a_row + p * a_k];
      lo[r] += s * b0;
      hi[r] += s * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    gemm_store(c + r * ldc, lo[r]);
    gemm_store(c + r * ldc + gemm_lanes, hi[r]);
  }
}

// The rows [0, m) of one panel, gemm_mr at a time, the last ones fewer.
static inline void gemm_rows(bool first, int64_t m, int64_t kc, const float* a, int64_t a_row, int64_t a_k, const float* b,
                             int64_t ldb, float* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + gemm_mr <= m; i += gemm_mr) gemm_micro<gemm_mr>(first, kc, a + i * a_row, a_row, a_k, b, ldb, c + i * ldc, ldc);
  const float* ai = a + i * a_row;
  float* ci = c + i * ldc;
  switch (m - i) {
    case 5: gemm_micro<5>(first, kc, ai, a_row, a_k, b, ldb, ci, ldc); break;
    case 4: gemm_micro<4>(first, kc, ai, a_row, a_k, b, ldb, ci, ldc); break;
    case 3: gemm_micro<3>(first, kc, ai, a_row, a_k, b, ldb, ci, ldc); break;
    case 2: gemm_micro<2>(first, kc, ai, a_row, a_k, b, ldb, ci, ldc); break;
    case 1: gemm_micro<1>(first, kc, ai, a_row, a_k, b, ldb, ci, ldc); break;
    default: break;
  }
}

#if FERRO_GEMM_LANES == 16
typedef int32_t gemm_vi __attribute__((vector_size(64)));
static const gemm_vi gemm_zip_lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const gemm_vi gemm_zip_hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#else
typedef int32_t gemm_vi __attribute__((vector_size(32)));
static const gemm_vi gemm_zip_lo = {0, 8, 1, 9, 2, 10, 3, 11};
static const gemm_vi gemm_zip_hi = {4, 12, 5, 13, 6, 14, 7, 15};
#endif

// Transposes the gemm_lanes x gemm_lanes block whose rows are r: log2(lanes) rounds of
// interleaving row i with row i + lanes/2 (a perfect shuffle; two-source permutes).
static inline void gemm_transpose(gemm_vf* r) {
  constexpr int half = FERRO_GEMM_LANES / 2;
#pragma GCC unroll 4
  for (int round = 0; round < (FERRO_GEMM_LANES == 16 ? 4 : 3); ++round) {
    gemm_vf t[FERRO_GEMM_LANES];
#pragma GCC unroll 8
    for (int i = 0; i < half; ++i) {
      t[2 * i] = __builtin_shuffle(r[i], r[i + half], gemm_zip_lo);
      t[2 * i + 1] = __builtin_shuffle(r[i], r[i + half], gemm_zip_hi);
    }
#pragma GCC unroll 16
    for (int i = 0; i < FERRO_GEMM_LANES; ++i) r[i] = t[i];
  }
}

// pack[p * gemm_nr + j] = b[p * b_k + j * b_col] for p < kc and j < nc, zero for nc <= j. A
// whole panel whose columns are contiguous along k (a linear layer's weight, read transposed)
// moves in register-transposed blocks; the rest element by element.
static inline void gemm_pack(int64_t kc, int64_t nc, const float* b, int64_t b_k, int64_t b_col, float* pack) {
  int64_t p = 0;
  if (b_k == 1 && nc == gemm_nr) {
    for (; p + gemm_lanes <= kc; p += gemm_lanes) {
      for (int64_t jb = 0; jb < gemm_nr; jb += gemm_lanes) {
        gemm_vf r[FERRO_GEMM_LANES];
        for (int q = 0; q < FERRO_GEMM_LANES; ++q) r[q] = gemm_load(b + (jb + q) * b_col + p);
        gemm_transpose(r);
        for (int q = 0; q < FERRO_GEMM_LANES; ++q) gemm_store(pack + (p + q) * gemm_nr + jb, r[q]);
      }
    }
  }
  for (; p < kc; ++p) {
    const float* src = b + p * b_k;
    float* dst = pack + p * gemm_nr;
    for (int64_t j = 0; j < nc; ++j) dst[j] = src[j * b_col];
    for (int64_t j = nc; j < gemm_nr; ++j) dst[j] = 0.0f;
  }
}

// c[i * ldc + j] = sum over p of a[i * a_row + p * a_k] * b[p * b_k + j * b_col], for i < m and
// j < n; the columns of c from n up to n rounded up to gemm_nr are scratch (ldc at least that).
// B's panels are read in place when their rows are contiguous and whole, else packed.
static void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t b_k,
                     int64_t b_col, float* c, int64_t ldc) {
  alignas(64) float pack[gemm_kc * gemm_nr];
  for (int64_t k0 = 0; k0 < k; k0 += gemm_kc) {
    const int64_t kc = k - k0 < gemm_kc ? k - k0 : gemm_kc;
    for (int64_t j0 = 0; j0 < n; j0 += gemm_nr) {
      const int64_t nc = n - j0 < gemm_nr ? n - j0 : gemm_nr;
      const float* panel = b + k0 * b_k + j0 * b_col;
      int64_t ldb = b_k;
      if (b_col != 1 || nc < gemm_nr) {
        gemm_pack(kc, nc, panel, b_k, b_col, pack);
        panel = pack;
        ldb = gemm_nr;
      }
      gemm_rows(k0 == 0, m, kc, a + k0 * a_k, a_row, a_k, panel, ldb, c + j0, ldc);
    }
  }
}
}  // namespace ferro
