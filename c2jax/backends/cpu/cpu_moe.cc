// The routed-expert SwiGLU layer for CPU training and prefill, forward and backward, as XLA FFI
// calls (see c2jax/backends/cpu/moe.py for why). Capacity semantics of moe.capacity_dispatch: an
// expert takes its first `cap` assignments in token order; the rest (and ids outside [0, E))
// contribute nothing.
//
// Layouts (row-major): x [T, D], ids / weights [T, K], w_gate / w_up [N, E, D, F], w_down [N, E, F, D]:
// stacks of N layers' weights, of which `layer` (int32 []) is used, read in place (a stacked
// model's per-layer slices would otherwise be copied out for every call; N = 1 for one layer).
// Assignment a = t * K + k. The kept assignments, grouped by expert in token order, are the
// "sorted rows" (at most A); forward residuals are kept in that order, written by the products
// in place: gu [A, 2F] (gate | up pre-activations) and y [A, D] (the expert's output row);
// rows past the kept count are left unwritten and never read.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace c2jax_simd;  // NOLINT

// Assignment rows per chunk of an expert's rows. The backward's weight gradients add each chunk's
// product into the expert's [D, F] sums, so a longer chunk reads and writes them fewer times
// (256: ~4% off the backward against 128, measured on one core; 512 was slower). The forward's
// 192 is a multiple of the 6-row product tile, so full chunks leave no narrower tail tiles.
constexpr int64_t kChunk = 192;
constexpr int64_t kBwdChunk = 256;

struct Shape {
  int64_t T, K, D, F, E, A;
};

ffi::Error Fail(const char* msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

ffi::Error CheckShape(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::F32>& weights,
                      ffi::Buffer<ffi::F32>& wg, ffi::Buffer<ffi::F32>& wu, ffi::Buffer<ffi::F32>& wd,
                      ffi::Buffer<ffi::S32>& layer, Shape* s, int64_t* offset) {
  auto xd = x.dimensions(), id = ids.dimensions(), wdim = weights.dimensions();
  auto gd = wg.dimensions(), ud = wu.dimensions(), dd = wd.dimensions();
  if (xd.size() != 2 || id.size() != 2 || wdim.size() != 2 || gd.size() != 4 || ud.size() != 4 || dd.size() != 4)
    return Fail("expert ffn wants x [T, D], ids and weights [T, K], w_gate / w_up [N, E, D, F], w_down [N, E, F, D]");
  s->T = xd[0], s->D = xd[1], s->K = id[1], s->E = gd[1], s->F = gd[3], s->A = s->T * s->K;
  const int64_t N = gd[0];
  if (id[0] != s->T || wdim[0] != s->T || wdim[1] != s->K || gd[2] != s->D || ud[0] != N || ud[1] != s->E ||
      ud[2] != s->D || ud[3] != s->F || dd[0] != N || dd[1] != s->E || dd[2] != s->F || dd[3] != s->D)
    return Fail("expert ffn: shapes of x, ids, weights and the expert weights disagree");
  if (s->D % 64 || s->F % 64) return Fail("expert ffn: width and expert width must be multiples of 64");
  if (layer.element_count() != 1) return Fail("expert ffn: layer must be an int32 scalar");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= N) return Fail("expert ffn: layer index outside the stacked weights");
  *offset = l * s->E * s->D * s->F;
  return ffi::Error::Success();
}

// Kept assignments of each expert in token order: rows[start[e] .. start[e + 1]); sorted[a] is
// assignment a's row there (-1 where dropped).
void Route(const Shape& s, const int32_t* ids, int64_t cap, std::vector<int64_t>* start, std::vector<int64_t>* rows,
           std::vector<int64_t>* sorted) {
  std::vector<int64_t> count(s.E, 0);
  start->assign(s.E + 1, 0);
  for (int64_t a = 0; a < s.A; ++a)
    if (ids[a] >= 0 && ids[a] < s.E && count[ids[a]] < cap) ++count[ids[a]];
  for (int64_t e = 0; e < s.E; ++e) (*start)[e + 1] = (*start)[e] + count[e];
  rows->resize((*start)[s.E]);
  std::vector<int64_t> fill(start->begin(), start->end() - 1);
  for (int64_t a = 0; a < s.A; ++a) {
    const int32_t e = ids[a];
    if (e >= 0 && e < s.E && fill[e] < (*start)[e + 1]) (*rows)[fill[e]++] = a;
  }
  sorted->assign(s.A, -1);
  for (size_t r = 0; r < rows->size(); ++r) (*sorted)[(*rows)[r]] = static_cast<int64_t>(r);
}

// Experts largest first: the units of the parallel loops.
std::vector<int64_t> ByLoad(const std::vector<int64_t>& start) {
  std::vector<int64_t> order(start.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return start[a + 1] - start[a] > start[b + 1] - start[b]; });
  return order;
}

inline v16 Sigmoid(v16 g) { return 1.0f / (1.0f + Exp(-g)); }

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                   ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> wu,
                   ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::S32> layer, int64_t cap, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> gu_res, ffi::ResultBuffer<ffi::F32> y_res) {
  Shape s;
  int64_t off;
  if (auto e = CheckShape(x, ids, weights, wg, wu, wd, layer, &s, &off); e.failure()) return e;
  const int64_t D = s.D, F = s.F, K = s.K;
  const float *xp = x.typed_data(), *cw = weights.typed_data();
  const float *wgp = wg.typed_data() + off, *wup = wu.typed_data() + off, *wdp = wd.typed_data() + off;
  float *gup = gu_res->typed_data(), *yp = y_res->typed_data(), *op = out->typed_data();
  std::vector<int64_t> start, rows, sorted;
  Route(s, ids.typed_data(), cap, &start, &rows, &sorted);
  const std::vector<int64_t> order = ByLoad(start);
  ParallelFor(pool, s.E, [&](int64_t u) {
    const int64_t e = order[u];
    if (start[e + 1] == start[e]) return;
    // [w_gate | w_up] and w_down as packed panels; uninitialized: the packs write all of it
    Floats packed(3 * D * F);
    float *wgu = packed.data(), *wdn = wgu + 2 * D * F;
    PackPanels(wgp + e * D * F, F, D, F, F, wgu);
    PackPanels(wup + e * D * F, F, D, F, F, wgu + D * F);
    PackPanels(wdp + e * F * D, D, F, D, D, wdn);
    Floats xs(kChunk * D), h(kChunk * F);
    for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, start[e + 1] - r0);
      float *gu = gup + r0 * 2 * F, *y = yp + r0 * D;
      for (int64_t i = 0; i < n; ++i) std::memcpy(&xs[i * D], xp + (rows[r0 + i] / K) * D, sizeof(float) * D);
      RowsTimesPacked(xs.data(), D, n, D, wgu, D, 2 * F, gu, 2 * F);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < F; j += 16) {
          const v16 gv = Load(&gu[i * 2 * F + j]);
          Store(&h[i * F + j], gv * Sigmoid(gv) * Load(&gu[i * 2 * F + F + j]));
        }
      RowsTimesPacked(h.data(), F, n, F, wdn, F, D, y, D);
    }
  });
  ParallelFor(pool, s.T, [&](int64_t t) {  // out[t] = sum_k weights[t, k] y[row of t K + k]
    float* o = op + t * D;
    for (int64_t j = 0; j < D; j += 16) Store(o + j, v16{});
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = sorted[t * K + k];
      if (r < 0) continue;
      const float c = cw[t * K + k];
      for (int64_t j = 0; j < D; j += 16) Store(o + j, Load(o + j) + c * Load(yp + r * D + j));
    }
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                    ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> wu,
                    ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> gu_res,
                    ffi::Buffer<ffi::F32> y_res,
                    ffi::Buffer<ffi::F32> dout, int64_t cap,
                    ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dweights,
                    ffi::ResultBuffer<ffi::F32> dwg, ffi::ResultBuffer<ffi::F32> dwu, ffi::ResultBuffer<ffi::F32> dwd) {
  Shape s;
  int64_t off;
  if (auto e = CheckShape(x, ids, weights, wg, wu, wd, layer, &s, &off); e.failure()) return e;
  const int64_t D = s.D, F = s.F, K = s.K;
  if (gu_res.element_count() != static_cast<size_t>(s.A * 2 * F) ||
      y_res.element_count() != static_cast<size_t>(s.A * D) || dout.element_count() != static_cast<size_t>(s.T * D))
    return Fail("expert ffn backward: residuals gu [A, 2F], y [A, D] and dout [T, D] expected");
  const float *xp = x.typed_data(), *cw = weights.typed_data(), *dop = dout.typed_data();
  const float *wgp = wg.typed_data() + off, *wup = wu.typed_data() + off, *wdp = wd.typed_data() + off;
  const float *gup = gu_res.typed_data(), *yp = y_res.typed_data();
  float *dxp = dx->typed_data(), *dcw = dweights->typed_data();
  float *dwgp = dwg->typed_data(), *dwup = dwu->typed_data(), *dwdp = dwd->typed_data();
  std::vector<int64_t> start, rows, sorted;
  Route(s, ids.typed_data(), cap, &start, &rows, &sorted);
  std::unique_ptr<float[]> dxs_all(new float[std::max<size_t>(rows.size(), 1) * D]);  // dx per sorted row
  const std::vector<int64_t> order = ByLoad(start);
  ParallelFor(pool, s.E, [&](int64_t u) {
    const int64_t e = order[u];
    float *dwge = dwgp + e * D * F, *dwue = dwup + e * D * F, *dwde = dwdp + e * F * D;
    std::memset(dwge, 0, sizeof(float) * D * F);
    std::memset(dwue, 0, sizeof(float) * D * F);
    std::memset(dwde, 0, sizeof(float) * F * D);
    if (start[e + 1] == start[e]) return;
    // w_down^T [D, F] and [w_gate^T; w_up^T] [2F, D] as packed panels
    Floats wT(3 * D * F);  // uninitialized: the packs write all of it
    float *wdT = wT.data(), *wguT = wdT + D * F;
    PackPanels(wdp + e * F * D, D, D, F, F, wdT, true);
    PackPanels(wgp + e * D * F, F, F, D, D, wguT, true, 2 * F);           // panel rows [0, F)
    PackPanels(wup + e * D * F, F, F, D, D, wguT + F * 64, true, 2 * F);  // panel rows [F, 2F)
    Floats xs(kBwdChunk * D), dy(kBwdChunk * D), dh(kBwdChunk * F), dgu(kBwdChunk * 2 * F), h(kBwdChunk * F);
    Floats bp(std::max(F, D) * kBwdChunk);  // dG, dU or dY as panels
    for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kBwdChunk) {
      const int64_t n = std::min<int64_t>(kBwdChunk, start[e + 1] - r0);
      const float* gu = gup + r0 * 2 * F;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t a = rows[r0 + i], t = a / K;
        std::memcpy(&xs[i * D], xp + t * D, sizeof(float) * D);
        const float c = cw[a];
        for (int64_t j = 0; j < D; j += 16) Store(&dy[i * D + j], c * Load(dop + t * D + j));
      }
      RowsTimesPacked(dy.data(), D, n, D, wdT, D, F, dh.data(), F);  // dH = dY w_down^T
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < F; j += 16) {
          const v16 g = Load(gu + i * 2 * F + j), uu = Load(gu + i * 2 * F + F + j);
          const v16 sg = Sigmoid(g), silu = g * sg, d = Load(&dh[i * F + j]);
          Store(&h[i * F + j], silu * uu);
          Store(&dgu[i * 2 * F + j], d * uu * (sg * (1.0f + g * (1.0f - sg))));
          Store(&dgu[i * 2 * F + F + j], d * silu);
        }
      // dX = [dG | dU] [w_gate^T; w_up^T]
      RowsTimesPacked(dgu.data(), 2 * F, n, 2 * F, wguT, 2 * F, D, dxs_all.get() + r0 * D, D);
      ColsTimesRowsPacked(xs.data(), D, n, D, dgu.data(), 2 * F, F, dwge, F, bp.data());      // dW_gate += X^T dG
      ColsTimesRowsPacked(xs.data(), D, n, D, dgu.data() + F, 2 * F, F, dwue, F, bp.data());  // dW_up += X^T dU
      ColsTimesRowsPacked(h.data(), F, n, F, dy.data(), D, D, dwde, D, bp.data());            // dW_down += H^T dY
    }
  });
  ParallelFor(pool, s.T, [&](int64_t t) {
    float* o = dxp + t * D;
    for (int64_t j = 0; j < D; j += 16) Store(o + j, v16{});
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = sorted[t * K + k];
      if (r < 0) {
        dcw[t * K + k] = 0.0f;
        continue;
      }
      v16 acc = {};  // d weights[t, k] = <y, dout[t]>
      for (int64_t j = 0; j < D; j += 16) {
        Store(o + j, Load(o + j) + Load(dxs_all.get() + r * D + j));
        acc += Load(yp + r * D + j) * Load(dop + t * D + j);
      }
      dcw[t * K + k] = Sum(acc);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxExpertFfnFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxExpertFfnBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
