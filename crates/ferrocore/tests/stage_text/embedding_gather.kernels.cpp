// ferrocore: unit boundary

extern "C" int cpp_poi_fused_emb_scaled_0(const int64_t* __restrict__ in_ptr0, const float* __restrict__ in_ptr1, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  float tmp5 = static_cast<float>(2e0);
  for (int64_t x0 = 0; x0 < 6LL; ++x0) {
    // group 0: loop [8]
      bool bad2 = false;
      int64_t tmp0 = in_ptr0[x0];
      int64_t tmp1 = tmp0;
      bad2 = bad2 || (tmp1 < 0) || (tmp1 >= 10LL);
      int64_t tmp3 = (tmp1 < 0 ? 0LL : (tmp1 >= 10LL ? 9LL : tmp1));
      #pragma omp simd reduction(||:bad2)
      for (int64_t x1 = 0; x1 < 8LL; ++x1) {
        float tmp4 = in_ptr1[x1 + 8LL*tmp3];
        float tmp6 = static_cast<float>(tmp4 * tmp5);
        float loc_0 = tmp6;
        out_ptr0[(8LL*x0 + x1)] = loc_0;
      }
      if (bad2) {
        #pragma omp atomic write
        ferro_err = 1;
      }
  }
  return ferro_err;
}
