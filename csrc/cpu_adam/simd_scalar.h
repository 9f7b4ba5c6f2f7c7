// One float per "vector": the portable path (any CPU; the compiler may still use the
// baseline ISA, e.g. SSE2 on x86-64). Conversions are c10's, i.e. torch's own rounding.
struct Vec {
  using reg = float;
  static constexpr int width = 1;
  static constexpr const char* name = "scalar";
  static reg set1(float x) { return x; }
  static reg load(const float* p) { return *p; }
  static reg load(const c10::Half* p) { return static_cast<float>(*p); }
  static reg load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static void store(float* p, reg x) { *p = x; }
  static void store(c10::Half* p, reg x) { *p = c10::Half(x); }
  static void store(c10::BFloat16* p, reg x) { *p = c10::BFloat16(x); }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg sqrt(reg a) { return std::sqrt(a); }
  // a * b + c rounded once, as the FMA of the vector paths (a float product is exact in
  // double), without needing an FMA unit: ill-conditioned sums (g + wd * p cancelling) then
  // agree with the vector paths and torch instead of differing by a rounding of a * b.
  static reg fmadd(reg a, reg b, reg c) {
    return static_cast<float>(static_cast<double>(a) * b + static_cast<double>(c));
  }
  static bool nonfinite(reg x) { return !std::isfinite(x); }
};
