// AVX-512 vector of 16 floats: loads and stores for fp32, fp16 (vcvtph2ps / vcvtps2ph,
// round to nearest even) and bf16 (integer shift, round to nearest even as c10::BFloat16).
// Included only inside a `#pragma GCC target("avx512f,...")` region (see cpu_adam.cpp).
struct Vec {
  using reg = __m512;
  static constexpr int width = 16;
  static constexpr const char* name = "avx512";
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static reg load(const c10::BFloat16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static void store(c10::Half* p, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(c10::BFloat16* p, reg x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  // true when any lane is inf or nan (x * 0 is nan exactly for those lanes)
  static bool nonfinite(reg x) {
    reg z = _mm512_mul_ps(x, _mm512_setzero_ps());
    return _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q) != 0;
  }
};
