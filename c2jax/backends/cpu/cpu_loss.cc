// The per-token NLL over materialized logits for CPU training, forward and backward, as XLA FFI
// calls (see c2jax/train/head_loss.py): one vectorized pass per row for max / sum-exp / the
// target's logit, and one pass writing the logits' gradient.
//
// Layouts: logits [T, V] float32, targets [T] int32, nll / lse / cotangents [T]. A target outside
// [0, V) gets nll = NaN (as jnp.take_along_axis fills it) and no one-hot term in the gradient.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"
#include "cpu_simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace c2jax_simd;  // NOLINT

constexpr int64_t kRowsPerUnit = 32;

ffi::Error Fail(const char* msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

// max and sum of exp(x - max) over a row of V floats (V % 16 == 0).
inline float RowLse(const float* x, int64_t V) {
  v16 mx = Splat(-INFINITY);
  for (int64_t j = 0; j < V; j += 16) {
    const v16 v = Load(x + j);
    mx = mx > v ? mx : v;
  }
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = std::max(m, mx[i]);
  if (!std::isfinite(m)) return m;
  v16 sum = {};
  for (int64_t j = 0; j < V; j += 16) sum += Exp(Load(x + j) - m);
  return m + std::log(Sum(sum));
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                   ffi::ResultBuffer<ffi::F32> nll, ffi::ResultBuffer<ffi::F32> lse) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || targets.element_count() != static_cast<size_t>(ld[0]) || ld[1] % 16)
    return Fail("token nll wants logits [T, V] (V a multiple of 16) and targets [T]");
  const int64_t T = ld[0], V = ld[1];
  const float* x = logits.typed_data();
  const int32_t* tg = targets.typed_data();
  float *np_ = nll->typed_data(), *lp = lse->typed_data();
  ParallelFor(pool, (T + kRowsPerUnit - 1) / kRowsPerUnit, [&](int64_t u) {
    for (int64_t t = u * kRowsPerUnit; t < std::min(T, (u + 1) * kRowsPerUnit); ++t) {
      const float l = RowLse(x + t * V, V);
      lp[t] = l;
      np_[t] = tg[t] >= 0 && tg[t] < V ? l - x[t * V + tg[t]] : std::numeric_limits<float>::quiet_NaN();
    }
  });
  return ffi::Error::Success();
}

// d[t, v] = scale * ((g_nll[t] + g_lse[t]) * exp(logits[t, v] - lse[t]) - g_nll[t] [v == target[t]])
ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> g_nll, ffi::Buffer<ffi::F32> g_lse,
                    float scale, ffi::ResultBuffer<ffi::F32> d) {
  auto ld = logits.dimensions();
  const size_t T = ld.size() == 2 ? ld[0] : 0;
  if (ld.size() != 2 || ld[1] % 16 || lse.element_count() != T || targets.element_count() != T ||
      g_nll.element_count() != T || g_lse.element_count() != T)
    return Fail("token nll backward wants logits [T, V] (V a multiple of 16) and lse, targets, cotangents [T]");
  const int64_t V = ld[1];
  const float *x = logits.typed_data(), *lp = lse.typed_data(), *gn = g_nll.typed_data(), *gl = g_lse.typed_data();
  const int32_t* tg = targets.typed_data();
  float* dp = d->typed_data();
  ParallelFor(pool, (static_cast<int64_t>(T) + kRowsPerUnit - 1) / kRowsPerUnit, [&](int64_t u) {
    for (int64_t t = u * kRowsPerUnit; t < std::min<int64_t>(T, (u + 1) * kRowsPerUnit); ++t) {
      const float c = (gn[t] + gl[t]) * scale, l = lp[t];
      const float* xr = x + t * V;
      float* dr = dp + t * V;
      for (int64_t j = 0; j < V; j += 16) Store(dr + j, c * Exp(Load(xr + j) - l));
      if (tg[t] >= 0 && tg[t] < V) dr[tg[t]] -= gn[t] * scale;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxTokenNllFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxTokenNllBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
