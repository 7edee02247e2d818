// ferrocore: unit boundary

extern "C" int cpp_poi_fused_cat_relu_0(const float* __restrict__ in_ptr0, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 2LL; ++x0) {
    // group 0: loop [3]
      #pragma omp simd
      for (int64_t x1 = 0; x1 < 3LL; ++x1) {
        float tmp0 = in_ptr0[(3LL*x0 + x1)];
        float tmp1 = (tmp0 < 0 ? static_cast<float>(0) : tmp0);
        float loc_0 = tmp1;
        out_ptr0[(8LL*x0 + x1)] = loc_0;
      }
  }
  return ferro_err;
}
// ferrocore: unit boundary

extern "C" int cpp_poi_fused_cat_relu_1(const float* __restrict__ in_ptr0, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 2LL; ++x0) {
    // group 0: loop [5]
      #pragma omp simd
      for (int64_t x1 = 0; x1 < 5LL; ++x1) {
        float tmp0 = in_ptr0[(5LL*x0 + x1)];
        float tmp1 = (tmp0 < 0 ? static_cast<float>(0) : tmp0);
        float loc_0 = tmp1;
        out_ptr0[(8LL*x0 + x1 + 3LL)] = loc_0;
      }
  }
  return ferro_err;
}
