// The Adam/AdamW step, written once over a vector type `Vec` (one per SIMD path) and
// included once per path inside that path's `#pragma GCC target` region, so every
// instantiation below is compiled for that path's ISA. Moments are always fp32;
// P (parameter), G (gradient) and O (low-precision copy-out) are float, c10::Half or
// c10::BFloat16 (O may be NoOut). One pass: each element is read and written once.

// Applies the update to the first floor(n / V::width) * V::width elements; returns that count.
template <class V, class P, class G, class O>
inline int64_t update_lanes(const Hyper& h, P* p, const G* g, float* m, float* v, O* out,
                            int64_t n) {
  using reg = typename V::reg;
  const reg inv_scale = V::set1(h.inv_scale), omb1 = V::set1(h.one_minus_beta1),
            b2 = V::set1(h.beta2), omb2 = V::set1(h.one_minus_beta2), l2 = V::set1(h.l2),
            decay = V::set1(h.decay), neg_step = V::set1(h.neg_step_size),
            inv_bc2 = V::set1(h.inv_bc2_sqrt), eps = V::set1(h.eps);
  const bool has_l2 = h.l2 != 0.0f;
  int64_t i = 0;
  for (; i + V::width <= n; i += V::width) {
    reg gi = V::mul(V::load(g + i), inv_scale);
    reg pi = V::load(p + i);
    if (has_l2) gi = V::fmadd(l2, pi, gi);
    reg mi = V::load(m + i);
    mi = V::fmadd(omb1, V::sub(gi, mi), mi);
    reg vi = V::fmadd(omb2, V::mul(gi, gi), V::mul(b2, V::load(v + i)));
    reg den = V::fmadd(V::sqrt(vi), inv_bc2, eps);
    pi = V::fmadd(neg_step, V::div(mi, den), V::mul(pi, decay));
    V::store(m + i, mi);
    V::store(v + i, vi);
    V::store(p + i, pi);
    if constexpr (!std::is_same<O, NoOut>::value) V::store(out + i, pi);
  }
  return i;
}

template <class P, class G, class O>
void update_span(const Hyper& h, P* p, const G* g, float* m, float* v, O* out, int64_t n) {
  int64_t done = update_lanes<Vec>(h, p, g, m, v, out, n);
  if (done < n)  // the tail (< one vector) goes element by element
    update_lanes<::cpu_adam::scalar_isa::Vec>(h, p + done, g + done, m + done, v + done,
                                              out ? out + done : out, n - done);
}

template <class G>
bool any_nonfinite_span(const G* g, int64_t n) {
  // x * 0 + acc stays nan from the first inf/nan on: one test at the end
  typename Vec::reg acc = Vec::set1(0.0f);
  const typename Vec::reg zero = Vec::set1(0.0f);
  int64_t i = 0;
  for (; i + Vec::width <= n; i += Vec::width) acc = Vec::fmadd(Vec::load(g + i), zero, acc);
  bool bad = Vec::nonfinite(acc);
  for (; i < n; ++i) bad |= !std::isfinite(static_cast<float>(g[i]));
  return bad;
}

// --- run-time dtype dispatch, instantiated inside this path's target region ---

template <class F>
void with_float_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "cpu_adam: dtype must be float32, float16 or bfloat16, got ", t);
  }
}

// Raw pointers already offset to this span; out == nullptr means no copy-out.
inline void update(const Hyper& h, void* p, at::ScalarType pt, const void* g, at::ScalarType gt,
                   float* m, float* v, void* out, at::ScalarType ot, int64_t n) {
  with_float_type(pt, [&](auto* ptag) {
    using P = std::remove_pointer_t<decltype(ptag)>;
    with_float_type(gt, [&](auto* gtag) {
      using G = std::remove_pointer_t<decltype(gtag)>;
      if (out == nullptr) {
        update_span<P, G, NoOut>(h, static_cast<P*>(p), static_cast<const G*>(g), m, v,
                                 static_cast<NoOut*>(nullptr), n);
        return;
      }
      with_float_type(ot, [&](auto* otag) {
        using O = std::remove_pointer_t<decltype(otag)>;
        update_span<P, G, O>(h, static_cast<P*>(p), static_cast<const G*>(g), m, v,
                             static_cast<O*>(out), n);
      });
    });
  });
}

inline bool any_nonfinite(const void* g, at::ScalarType gt, int64_t n) {
  bool bad = false;
  with_float_type(gt, [&](auto* gtag) {
    using G = std::remove_pointer_t<decltype(gtag)>;
    bad = any_nonfinite_span<G>(static_cast<const G*>(g), n);
  });
  return bad;
}
