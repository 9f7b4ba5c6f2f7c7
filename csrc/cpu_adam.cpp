// CPU Adam / AdamW for colossal_lite (python side: colossal_lite/nn/optimizer/).
//
// One fused pass per parameter span: unscale the gradient by the loss scale, Adam's L2 or
// AdamW's decoupled weight decay, both moments, bias correction, the fp32 (or fp16/bf16)
// parameter write, and the optional fp16/bf16 copy-out of the updated parameter. Before it,
// an optional read-only scan of the gradient for inf/nan: when one is found nothing is
// written and the caller is told (an update cannot be undone once half of it is written).
//
// SIMD: the kernel body (cpu_adam/adam_body.h) is compiled three times in this translation
// unit, inside `#pragma GCC target` regions for AVX-512, AVX2+FMA(+F16C) and the baseline
// ISA; the path is chosen at run time with __builtin_cpu_supports, or forced by name.
// Threads: at::parallel_for (torch's OpenMP pool, so torch.set_num_threads applies).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_ADAM_X86 1
#else
#define CPU_ADAM_X86 0
#endif

#include "cpu_adam/common.h"

namespace cpu_adam {

namespace scalar_isa {
#include "cpu_adam/simd_scalar.h"
#include "cpu_adam/adam_body.h"
}  // namespace scalar_isa

#if CPU_ADAM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2_isa {
#include "cpu_adam/simd_avx2.h"
#include "cpu_adam/adam_body.h"
}  // namespace avx2_isa
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512_isa {
#include "cpu_adam/simd_avx512.h"
#include "cpu_adam/adam_body.h"
}  // namespace avx512_isa
#pragma GCC pop_options
#endif

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per thread task (tiny tensors stay serial)

bool cpu_has(Isa isa) {
#if CPU_ADAM_X86
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("avx");  // F16C ships with every AVX2 CPU
    case Isa::avx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2");
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

Isa best_isa() {
  for (Isa isa : {Isa::avx512, Isa::avx2})
    if (cpu_has(isa)) return isa;
  return Isa::scalar;
}

Isa resolve(const std::string& simd) {
  if (simd == "auto") return best_isa();
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (simd == isa_name(isa)) {
      TORCH_CHECK(cpu_has(isa), "cpu_adam: simd='", simd, "' is not supported by this CPU");
      return isa;
    }
  }
  TORCH_CHECK(false, "cpu_adam: simd must be 'auto', 'avx512', 'avx2' or 'scalar', got '", simd,
              "'");
}

void run_update(Isa isa, const Hyper& h, void* p, at::ScalarType pt, const void* g,
                at::ScalarType gt, float* m, float* v, void* out, at::ScalarType ot, int64_t n) {
  switch (isa) {
#if CPU_ADAM_X86
    case Isa::avx512: avx512_isa::update(h, p, pt, g, gt, m, v, out, ot, n); return;
    case Isa::avx2: avx2_isa::update(h, p, pt, g, gt, m, v, out, ot, n); return;
#endif
    default: scalar_isa::update(h, p, pt, g, gt, m, v, out, ot, n);
  }
}

bool run_nonfinite(Isa isa, const void* g, at::ScalarType gt, int64_t n) {
  switch (isa) {
#if CPU_ADAM_X86
    case Isa::avx512: return avx512_isa::any_nonfinite(g, gt, n);
    case Isa::avx2: return avx2_isa::any_nonfinite(g, gt, n);
#endif
    default: return scalar_isa::any_nonfinite(g, gt, n);
  }
}

void check_operand(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", what, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", what, " has ", t.numel(),
              " elements, the parameter has ", numel);
}

char* at_elem(const at::Tensor& t, int64_t i) {
  return static_cast<char*>(t.data_ptr()) + i * static_cast<int64_t>(t.element_size());
}

bool scan_nonfinite(Isa isa, const at::Tensor& grad) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, grad.numel(), kGrain, [&](int64_t b, int64_t e) {
    if (!bad.load(std::memory_order_relaxed) &&
        run_nonfinite(isa, at_elem(grad, b), grad.scalar_type(), e - b))
      bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

Hyper make_hyper(int64_t step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool adamw, double loss_scale) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (bias correction), got ", step);
  TORCH_CHECK(loss_scale > 0 && std::isfinite(loss_scale),
              "cpu_adam: loss_scale must be finite and > 0, got ", loss_scale);
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  Hyper h;
  h.inv_scale = static_cast<float>(1.0 / loss_scale);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);
  h.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  h.neg_step_size = static_cast<float>(-lr / bc1);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  return h;
}

}  // namespace

// Returns found_inf. When check_finite and the gradient holds inf/nan, nothing is written.
bool adam_update(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                 at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& out_lowp, int64_t step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, double loss_scale, bool check_finite, const std::string& simd) {
  const int64_t n = param.numel();
  check_operand(param, "param", n);
  check_operand(grad, "grad", n);
  check_operand(exp_avg, "exp_avg", n);
  check_operand(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "cpu_adam: exp_avg and exp_avg_sq must be float32, got ", exp_avg.scalar_type(),
              " and ", exp_avg_sq.scalar_type());
  const bool has_out = out_lowp.has_value() && out_lowp->defined();
  if (has_out) check_operand(*out_lowp, "out_lowp", n);
  const Isa isa = resolve(simd);
  const Hyper h = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, loss_scale);
  if (check_finite && scan_nonfinite(isa, grad)) return true;
  const at::ScalarType ot = has_out ? out_lowp->scalar_type() : at::kFloat;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    run_update(isa, h, at_elem(param, b), param.scalar_type(), at_elem(grad, b),
               grad.scalar_type(), exp_avg.data_ptr<float>() + b, exp_avg_sq.data_ptr<float>() + b,
               has_out ? at_elem(*out_lowp, b) : nullptr, ot, e - b);
  });
  return false;
}

bool any_nonfinite(const at::Tensor& grad, const std::string& simd) {
  check_operand(grad, "grad", grad.numel());
  return scan_nonfinite(resolve(simd), grad);
}

std::vector<std::string> supported_simd() {
  std::vector<std::string> names;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (cpu_has(isa)) names.emplace_back(isa_name(isa));
  return names;
}

std::string best_simd() { return isa_name(best_isa()); }

}  // namespace cpu_adam

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused CPU Adam/AdamW (fp32/fp16/bf16, AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("adam_update", &cpu_adam::adam_update, "one fused Adam/AdamW step; returns found_inf",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("out_lowp"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("loss_scale"),
        py::arg("check_finite"), py::arg("simd"));
  m.def("any_nonfinite", &cpu_adam::any_nonfinite, "true when grad holds inf or nan",
        py::arg("grad"), py::arg("simd"));
  m.def("supported_simd", &cpu_adam::supported_simd, "SIMD paths this CPU can run");
  m.def("best_simd", &cpu_adam::best_simd, "the path simd='auto' takes");
}
