// ferrocore: unit boundary

extern "C" int cpp_red_fused_mean_sub_sq_var_add_rsqrt_0(const float* __restrict__ in_ptr0, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  float tmp2 = static_cast<float>(3.2e1);
  float tmp3 = static_cast<float>(3.125e-2);
  float tmp9 = static_cast<float>(3.2e1);
  float tmp10 = static_cast<float>(3.125e-2);
  float tmp14 = static_cast<float>(1e-5);
  for (int64_t x0 = 0; x0 < 4LL; ++x0) {
    // group 0: reduction [32]
      float acc1 = static_cast<float>(0);
      #pragma omp simd reduction(+:acc1)
      for (int64_t x1 = 0; x1 < 32LL; ++x1) {
        float tmp0 = in_ptr0[(32LL*x0 + x1)];
        acc1 = acc1 + tmp0;
      }
      float tmp4 = static_cast<float>(acc1 * tmp3);
      float loc_0 = tmp4;
    // group 1: reduction [32]
      float acc8 = static_cast<float>(0);
      #pragma omp simd reduction(+:acc8)
      for (int64_t x1 = 0; x1 < 32LL; ++x1) {
        float tmp5 = in_ptr0[(32LL*x0 + x1)];
        float tmp6 = static_cast<float>(tmp5 - loc_0);
        float tmp7 = static_cast<float>(tmp6 * tmp6);
        acc8 = acc8 + tmp7;
      }
      float tmp11 = static_cast<float>(acc8 * tmp10);
      float loc_1 = tmp11;
    // group 2: loop [32]
      float tmp15 = static_cast<float>(loc_1 + tmp14);
      float tmp16 = static_cast<float>(1) / ferro::sqrt(tmp15);
      #pragma omp simd
      for (int64_t x1 = 0; x1 < 32LL; ++x1) {
        float tmp12 = in_ptr0[(32LL*x0 + x1)];
        float tmp13 = static_cast<float>(tmp12 - loc_0);
        float tmp17 = static_cast<float>(tmp13 * tmp16);
        float loc_2 = tmp17;
        out_ptr0[(32LL*x0 + x1)] = loc_2;
      }
  }
  return ferro_err;
}
