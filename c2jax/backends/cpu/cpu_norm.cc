// RMSNorm over the last dim for CPU training, optionally followed by the rotate-half RoPE
// rotation (Qwen3's per-head q/k norm then RoPE), forward and backward, as XLA FFI calls (see
// c2jax/backends/cpu/norm.py). One pass over each row each way; XLA CPU instead materializes the
// broadcast 1/rms and runs the rotation halves and their concatenation as separate loops.
//
// Layouts: x / y / dy / dx [N, H, P] float32 (H = 1 for a plain norm), weight and dweight [P],
// r (1/rms, saved for the backward) [N, H], cos / sin [N, P/2] (the rotation's tables, already
// scaled by the attention factor). P % 16 == 0, and P % 32 == 0 with the rotation.
// The weight's gradient is summed per fixed block of kRowsPerUnit rows, then over the blocks in
// order: the same bits whatever the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "cpu_simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace c2jax_simd;  // NOLINT

constexpr int64_t kRowsPerUnit = 64;

ffi::Error Fail(const char* msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

struct Dims {
  int64_t N, H, P;
};

// x [N, H, P], weight [P], r [N, H] and, with the rotation, cos / sin [N, P/2].
const char* Check(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w, size_t r_count, bool rope,
                  size_t table_count, Dims* d) {
  auto xd = x.dimensions();
  if (xd.size() != 3) return "rms norm wants x [N, H, P]";
  *d = {xd[0], xd[1], xd[2]};
  if (d->P % (rope ? 32 : 16)) return "rms norm wants P a multiple of 16 (32 with the rotation)";
  if (w.element_count() != static_cast<size_t>(d->P)) return "rms norm wants weight [P]";
  if (r_count != static_cast<size_t>(d->N * d->H)) return "rms norm wants r [N, H]";
  if (rope && table_count != static_cast<size_t>(d->N * d->P / 2)) return "rms norm rope wants cos, sin [N, P/2]";
  return nullptr;
}

template <bool kRope>
ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight,
                   const float* cos, const float* sin, size_t table_count, float eps,
                   ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> r) {
  Dims d;
  if (const char* why = Check(x, weight, r->element_count(), kRope, table_count, &d)) return Fail(why);
  const int64_t H = d.H, P = d.P, half = P / 2;
  const float *xp = x.typed_data(), *wp = weight.typed_data();
  float *yp = y->typed_data(), *rp = r->typed_data();
  ParallelFor(pool, (d.N + kRowsPerUnit - 1) / kRowsPerUnit, [&](int64_t u) {
    for (int64_t n = u * kRowsPerUnit; n < std::min(d.N, (u + 1) * kRowsPerUnit); ++n)
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + (n * H + h) * P;
        float* yr = yp + (n * H + h) * P;
        v16 acc = {};
        for (int64_t j = 0; j < P; j += 16) {
          const v16 v = Load(xr + j);
          acc += v * v;
        }
        const float rr = 1.0f / std::sqrt(Sum(acc) / static_cast<float>(P) + eps);
        rp[n * H + h] = rr;
        if (!kRope) {
          for (int64_t j = 0; j < P; j += 16) Store(yr + j, Load(wp + j) * (Load(xr + j) * rr));
          continue;
        }
        const float *cr = cos + n * half, *sr = sin + n * half;
        for (int64_t j = 0; j < half; j += 16) {
          const v16 a = Load(wp + j) * (Load(xr + j) * rr), b = Load(wp + half + j) * (Load(xr + half + j) * rr);
          const v16 c = Load(cr + j), s = Load(sr + j);
          Store(yr + j, a * c - b * s);
          Store(yr + half + j, b * c + a * s);
        }
      }
  });
  return ffi::Error::Success();
}

// dxn = dy (rotated back with the rotation); dx = r (w dxn - xhat mean(w dxn xhat)), xhat = r x;
// dweight = sum over rows of dxn xhat.
template <bool kRope>
ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight,
                    ffi::Buffer<ffi::F32> r, const float* cos, const float* sin, size_t table_count,
                    ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dweight) {
  Dims d;
  if (const char* why = Check(x, weight, r.element_count(), kRope, table_count, &d)) return Fail(why);
  if (dy.element_count() != static_cast<size_t>(d.N * d.H * d.P)) return Fail("rms norm backward wants dy like x");
  const int64_t H = d.H, P = d.P, half = P / 2, units = (d.N + kRowsPerUnit - 1) / kRowsPerUnit;
  const float *xp = x.typed_data(), *wp = weight.typed_data(), *rp = r.typed_data(), *gp = dy.typed_data();
  float *dxp = dx->typed_data(), *dwp = dweight->typed_data();
  Floats parts(units * P);
  ParallelFor(pool, units, [&](int64_t u) {
    Floats dxn(kRope ? P : 0);
    float* part = parts.data() + u * P;
    std::fill(part, part + P, 0.0f);
    for (int64_t n = u * kRowsPerUnit; n < std::min(d.N, (u + 1) * kRowsPerUnit); ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t o = (n * H + h) * P;
        const float *xr = xp + o, rr = rp[n * H + h];
        const float* g = gp + o;
        if (kRope) {
          const float *cr = cos + n * half, *sr = sin + n * half;
          for (int64_t j = 0; j < half; j += 16) {
            const v16 d1 = Load(gp + o + j), d2 = Load(gp + o + half + j), c = Load(cr + j), s = Load(sr + j);
            Store(dxn.data() + j, d1 * c + d2 * s);
            Store(dxn.data() + half + j, d2 * c - d1 * s);
          }
          g = dxn.data();
        }
        v16 acc = {};
        for (int64_t j = 0; j < P; j += 16) acc += Load(g + j) * Load(wp + j) * Load(xr + j);
        const float mean = Sum(acc) * rr / static_cast<float>(P);
        float* dr = dxp + o;
        for (int64_t j = 0; j < P; j += 16) {
          const v16 gj = Load(g + j), xh = Load(xr + j) * rr;
          Store(dr + j, rr * (gj * Load(wp + j) - xh * mean));
          Store(part + j, Load(part + j) + gj * xh);
        }
      }
  });
  for (int64_t j = 0; j < P; j += 16) {
    v16 s = {};
    for (int64_t u = 0; u < units; ++u) s += Load(parts.data() + u * P + j);
    Store(dwp + j, s);
  }
  return ffi::Error::Success();
}

ffi::Error NormFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps,
                   ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> r) {
  return Forward<false>(pool, x, w, nullptr, nullptr, 0, eps, y, r);
}

ffi::Error NormBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> r,
                   ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw) {
  return Backward<false>(pool, x, w, r, nullptr, nullptr, 0, dy, dx, dw);
}

ffi::Error RopeFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> cos,
                   ffi::Buffer<ffi::F32> sin, float eps, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> r) {
  if (cos.element_count() != sin.element_count()) return Fail("rms norm rope wants cos and sin alike");
  return Forward<true>(pool, x, w, cos.typed_data(), sin.typed_data(), cos.element_count(), eps, y, r);
}

ffi::Error RopeBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> r,
                   ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> dy,
                   ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw) {
  if (cos.element_count() != sin.element_count()) return Fail("rms norm rope wants cos and sin alike");
  return Backward<true>(pool, x, w, r, cos.typed_data(), sin.typed_data(), cos.element_count(), dy, dx, dw);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxRmsNormFwd, NormFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxRmsNormBwd, NormBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxRmsNormRopeFwd, RopeFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxRmsNormRopeBwd, RopeBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
