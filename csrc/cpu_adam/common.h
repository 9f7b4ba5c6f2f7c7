// Shared by every SIMD path of the CPU Adam kernel (cpu_adam.cpp).
#pragma once
#include <cstdint>

namespace cpu_adam {

// Scalars of one step, folded on the host (double) and rounded to fp32 once:
//   g  = grad * inv_scale                     (+ weight_decay * p when !adamw: Adam's L2)
//   m  = m + (1 - beta1) * (g - m)            (torch's lerp form of beta1*m + (1-beta1)*g)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p * decay                            (decay = 1 - lr * weight_decay when adamw, else 1)
//   p  = p - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and inv_bc2_sqrt = 1 / sqrt(1 - beta2^t).
struct Hyper {
  float inv_scale, one_minus_beta1, beta2, one_minus_beta2, l2, decay, neg_step_size,
      inv_bc2_sqrt, eps;
};

// The "no low-precision copy-out" tag type.
struct NoOut {};

// Identifiers of the SIMD paths (also the order of preference, best last).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

}  // namespace cpu_adam
