// ferrocore: unit boundary

extern "C" int cpp_red_fused_sm_0(const float* __restrict__ in_ptr0, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 4LL; ++x0) {
    float row0[16];
    // group 0: reduction [16]
      float acc1 = -std::numeric_limits<float>::infinity();
      #pragma omp simd reduction(ferro_fmax:acc1)
      for (int64_t x1 = 0; x1 < 16LL; ++x1) {
        float tmp0 = in_ptr0[(16LL*x0 + x1)];
        acc1 = ferro_max(acc1, tmp0);
      }
      float loc_0 = acc1;
    // group 1: reduction [16]
      float acc5 = static_cast<float>(0);
      #pragma omp simd reduction(+:acc5)
      for (int64_t x1 = 0; x1 < 16LL; ++x1) {
        float tmp2 = in_ptr0[(16LL*x0 + x1)];
        float tmp3 = static_cast<float>(tmp2 - loc_0);
        float tmp4 = ferro_expf(tmp3);
        float loc_1 = tmp4;
        row0[x1] = loc_1;
        acc5 = acc5 + loc_1;
      }
      float loc_2 = acc5;
    // group 2: loop [16]
      float tmp7 = static_cast<float>(1) / loc_2;
      #pragma omp simd
      for (int64_t x1 = 0; x1 < 16LL; ++x1) {
        float tmp6 = row0[x1];
        float tmp8 = static_cast<float>(tmp6 * tmp7);
        float loc_3 = tmp8;
        out_ptr0[(16LL*x0 + x1)] = loc_3;
      }
  }
  return ferro_err;
}
