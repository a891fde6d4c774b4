// One AdamW step of a parameter leaf in place, as an XLA FFI call (see c2jax/train/cpu_adamw.py):
// optax's chain clip_by_global_norm -> scale_by_adam -> add_decayed_weights ->
// scale_by_learning_rate -> apply_updates in a single pass over p, g, m, v.
//
// coef (float32 [7], computed in JAX): apply (0: leave p, m, v as they are), clip (1: g is scaled
// by max_norm / g_norm), g_norm, max_norm, 1 - b1^t, 1 - b2^t, step (-learning rate).
// p, m and v are aliased to the outputs, so "leave" means return at once. g may be one layer of
// stacked p, m, v: it updates their elements [offset, offset + size of g) (the layer's gradient is
// then read where the backward wrote it, never concatenated with the other layers').
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "cpu_simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace c2jax_simd;  // NOLINT

constexpr int64_t kUnit = 1 << 15;  // elements per parallel work unit (a multiple of 16)

struct Coef {
  float b1, omb1, b2, omb2, eps, wd, g_norm, max_norm, bc1, bc2, step;
  bool clip;
};

// The same operations in the same order as optax (see the module note), on 16 lanes or one.
template <typename T>
inline void Step(const Coef& c, T& p, T g, T& m, T& v, T (*sqrt_fn)(T)) {
  if (c.clip) g = (g / c.g_norm) * c.max_norm;
  m = c.omb1 * g + c.b1 * m;
  v = c.omb2 * (g * g) + c.b2 * v;
  T u = (m / c.bc1) / (sqrt_fn(v / c.bc2) + c.eps);
  u = u + c.wd * p;
  p = p + c.step * u;
}

inline v16 SqrtV(v16 x) {
  for (int i = 0; i < 16; ++i) x[i] = std::sqrt(x[i]);
  return x;
}
inline float SqrtS(float x) { return std::sqrt(x); }

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> m,
                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> coef, double b1, double b2, double eps, double wd,
                 int64_t offset,
                 ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> m_out,
                 ffi::ResultBuffer<ffi::F32> v_out) {
  const size_t size = p.element_count(), n = g.element_count();
  if (m.element_count() != size || v.element_count() != size || coef.element_count() != 7)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "adamw wants p, m, v of one size and coef [7] (apply, clip, g_norm, max_norm, bc1, bc2, step)");
  if (offset < 0 || static_cast<size_t>(offset) + n > size)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "adamw: g at offset runs past the end of p");
  if (p_out->typed_data() != p.typed_data() || m_out->typed_data() != m.typed_data() ||
      v_out->typed_data() != v.typed_data())  // "leave as they are" relies on it
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "adamw: p, m and v must be aliased to the outputs");
  const float* k = coef.typed_data();
  if (k[0] == 0.0f) return ffi::Error::Success();
  // constants rounded from double as XLA rounds optax's Python floats
  const Coef c{static_cast<float>(b1), static_cast<float>(1.0 - b1), static_cast<float>(b2),
               static_cast<float>(1.0 - b2), static_cast<float>(eps), static_cast<float>(wd), k[2], k[3], k[4], k[5],
               k[6], k[1] != 0.0f};
  float *pp = p_out->typed_data() + offset, *mp = m_out->typed_data() + offset, *vp = v_out->typed_data() + offset;
  const float* gp = g.typed_data();
  const int64_t units = static_cast<int64_t>((n + kUnit - 1) / kUnit);
  ParallelFor(pool, units, [&](int64_t u) {
    const size_t lo = u * kUnit, hi = std::min(n, lo + kUnit);
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
      v16 pv = Load(pp + i), mv = Load(mp + i), vv = Load(vp + i);
      Step<v16>(c, pv, Load(gp + i), mv, vv, SqrtV);
      Store(pp + i, pv), Store(mp + i, mv), Store(vp + i, vv);
    }
    for (; i < hi; ++i) Step<float>(c, pp[i], gp[i], mp[i], vp[i], SqrtS);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<double>("b1")
                                  .Attr<double>("b2")
                                  .Attr<double>("eps")
                                  .Attr<double>("wd")
                                  .Attr<int64_t>("offset")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
