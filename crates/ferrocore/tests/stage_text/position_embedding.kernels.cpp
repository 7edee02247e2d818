// ferrocore: unit boundary

extern "C" int cpp_poi_fused_arange_embedding_add_0(const float* __restrict__ in_ptr0, const float* __restrict__ in_ptr1, float* __restrict__ out_ptr0) {
  int ferro_err = 0;
  for (int64_t x0 = 0; x0 < 2LL; ++x0) {
    // group 0: loop [48]
      #pragma omp simd
      for (int64_t x1 = 0; x1 < 48LL; ++x1) {
        float tmp0 = in_ptr0[(48LL*x0 + x1)];
        float tmp1 = in_ptr1[x1];
        float tmp2 = static_cast<float>(tmp0 + tmp1);
        float loc_0 = tmp2;
        out_ptr0[(48LL*x0 + x1)] = loc_0;
      }
  }
  return ferro_err;
}
