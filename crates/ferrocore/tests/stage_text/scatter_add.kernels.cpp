// ferrocore: unit boundary

extern "C" int cpp_poi_fused_scatter_0(const float* __restrict__ in_ptr0, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 40LL; ++x0) {
    // group 0: loop []
      float tmp0 = in_ptr0[x0];
      float loc_0 = tmp0;
      out_ptr0[x0] = loc_0;
  }
  return ferro_err;
}
// ferrocore: unit boundary

extern "C" int cpp_poi_fused_scatter_1(const int64_t* __restrict__ in_ptr0, const float* __restrict__ in_ptr1, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 6LL; ++x0) {
    // group 0: loop [4]
      bool bad2 = false;
      for (int64_t x1 = 0; x1 < 4LL; ++x1) {
        int64_t tmp0 = in_ptr0[(4LL*x0 + x1)];
        int64_t tmp1 = tmp0;
        bad2 = bad2 || (tmp1 < 0) || (tmp1 >= 10LL);
        int64_t tmp3 = (tmp1 < 0 ? 0LL : (tmp1 >= 10LL ? 9LL : tmp1));
        float tmp4 = in_ptr1[(4LL*x0 + x1)];
        float loc_0 = tmp4;
        #pragma omp atomic
        out_ptr0[x1 + 4LL * tmp3] += loc_0;
      }
      if (bad2) {
        #pragma omp atomic write
        ferro_err = 1;
      }
  }
  return ferro_err;
}
// ferrocore: unit boundary

extern "C" int cpp_poi_fused_relu_2(float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 40LL; ++x0) {
    // group 0: loop []
      float tmp0 = out_ptr0[x0];
      float tmp1 = (tmp0 < 0 ? static_cast<float>(0) : tmp0);
      float loc_0 = tmp1;
      out_ptr0[x0] = loc_0;
  }
  return ferro_err;
}
