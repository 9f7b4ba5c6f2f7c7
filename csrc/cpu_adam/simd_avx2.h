// AVX2 + FMA (+ F16C) vector of 8 floats; same interface as simd_avx512.h.
struct Vec {
  using reg = __m256;
  static constexpr int width = 8;
  static constexpr const char* name = "avx2";
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static reg load(const c10::BFloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static void store(c10::Half* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(c10::BFloat16* p, reg x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // every lane is in [0, 0xFFFF], so unsigned saturation packs it exactly
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static bool nonfinite(reg x) {
    reg z = _mm256_mul_ps(x, _mm256_setzero_ps());
    return _mm256_movemask_ps(_mm256_cmp_ps(z, z, _CMP_UNORD_Q)) != 0;
  }
};
