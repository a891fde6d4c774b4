// The MoE layer of a CPU decode step as one XLA FFI call: every expert some row chose is read
// once, whatever the number of rows that chose it (XLA CPU's few-row products re-read or stream
// slowly; see c2jax/backends/cpu/kernels.py). Built at first use by cpu_kernels.py with the host's
// compiler; plain GCC vector extensions, so it builds wherever g++ does.
//
// Weights are packed in panels of 16 output columns: a [K, N] matrix is stored [N/16][K][16],
// so a panel is one contiguous stream and each 16-float load is one cache line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 16;        // output columns per panel
constexpr int kRows = 8;          // rows a weight stream is shared by
constexpr int kPrefetch = 1024;   // floats ahead within a panel (4 KB)

typedef float v16 __attribute__((vector_size(64)));

// y[r, :] = x[r, :] @ W for r < R (R <= kRows); W packed [N/16][K][16], N a multiple of 32.
template <int R>
void PackedRows(const float* x, int K, const float* w, int N, float* y) {
  for (int p = 0; p < N / kPanel; p += 2) {
    const float* w0 = w + static_cast<size_t>(p) * K * kPanel;
    const float* w1 = w0 + static_cast<size_t>(K) * kPanel;
    v16 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = v16{};
    for (int k = 0; k < K; ++k) {
      v16 v0, v1;
      std::memcpy(&v0, w0 + k * kPanel, sizeof(v16));
      std::memcpy(&v1, w1 + k * kPanel, sizeof(v16));
      __builtin_prefetch(w0 + k * kPanel + kPrefetch);
      __builtin_prefetch(w1 + k * kPanel + kPrefetch);
      for (int r = 0; r < R; ++r) {
        const float b = x[r * K + k];
        a0[r] += b * v0;
        a1[r] += b * v1;
      }
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(y + static_cast<size_t>(r) * N + p * kPanel, &a0[r], sizeof(v16));
      std::memcpy(y + static_cast<size_t>(r) * N + (p + 1) * kPanel, &a1[r], sizeof(v16));
    }
  }
}

void Rows(int R, const float* x, int K, const float* w, int N, float* y) {
  switch (R) {
    case 1: return PackedRows<1>(x, K, w, N, y);
    case 2: return PackedRows<2>(x, K, w, N, y);
    case 3: return PackedRows<3>(x, K, w, N, y);
    case 4: return PackedRows<4>(x, K, w, N, y);
    case 5: return PackedRows<5>(x, K, w, N, y);
    case 6: return PackedRows<6>(x, K, w, N, y);
    case 7: return PackedRows<7>(x, K, w, N, y);
    default: return PackedRows<8>(x, K, w, N, y);
  }
}

ffi::Error Fail(const std::string& what) { return ffi::Error::InvalidArgument("c2jax_moe_ffn: " + what); }

// out[t] = sum_k weight[t, k] * SwiGLU_{ids[t, k]}(x[t]), summed in f32; ids outside [0, E)
// (another device's experts) add nothing.
//   x [T, D], ids int32 [T, K], weight [T, K]
//   w_gate_up [..., E, 2F/16, D, 16]: gate columns [0, F), up columns [F, 2F), packed
//   w_down    [..., E, D/16, F, 16]
// Leading dims of size 1 (a device's shard of a [n, E, ...] array) are allowed.
ffi::Error MoeFfn(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weight,
                  ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), id = ids.dimensions(), gd = w_gate_up.dimensions(), dd = w_down.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || weight.element_count() != ids.element_count())
    return Fail("want x [T, D], ids and weight [T, K]");
  if (w_gate_up.element_type() != ffi::F32 || w_down.element_type() != ffi::F32)
    return Fail("expert weights must be float32");
  if (gd.size() < 4 || dd.size() < 4) return Fail("expert weights must be packed [..., E, N/16, K, 16]");
  const int64_t T = xd[0], D = xd[1], K = id[1];
  const int64_t g = gd.size(), d = dd.size();
  const int64_t E = gd[g - 4], F = gd[g - 3] * kPanel / 2;
  for (int64_t i = 0; i + 4 < g; ++i)
    if (gd[i] != 1) return Fail("leading dims of w_gate_up must be 1");
  for (int64_t i = 0; i + 4 < d; ++i)
    if (dd[i] != 1) return Fail("leading dims of w_down must be 1");
  if (gd[g - 2] != D || gd[g - 1] != kPanel || dd[d - 4] != E || dd[d - 3] * kPanel != D ||
      dd[d - 2] != F || dd[d - 1] != kPanel)
    return Fail("w_gate_up [E, 2F/16, D, 16] and w_down [E, D/16, F, 16] do not match x [T, D]");
  if (D % (2 * kPanel) || (2 * F) % (2 * kPanel))
    return Fail("width and 2 x expert width must be multiples of 32");

  const float* xp = x.typed_data();
  const int32_t* ip = ids.typed_data();
  const float* cw = weight.typed_data();
  const float* wgu = static_cast<const float*>(w_gate_up.untyped_data());
  const float* wd = static_cast<const float*>(w_down.untyped_data());
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * D);

  // assignments grouped by expert (counting sort: keeps token order within an expert)
  std::vector<int64_t> start(E + 1, 0), order(T * K);
  for (int64_t a = 0; a < T * K; ++a)
    if (ip[a] >= 0 && ip[a] < E) ++start[ip[a] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < T * K; ++a)
    if (ip[a] >= 0 && ip[a] < E) order[fill[ip[a]]++] = a;

  std::vector<float> xs(kRows * D), h(kRows * 2 * F), act(kRows * F), y(kRows * D);
  for (int64_t e = 0; e < E; ++e) {
    const float* wgu_e = wgu + static_cast<size_t>(e) * 2 * F * D;
    const float* wd_e = wd + static_cast<size_t>(e) * F * D;
    for (int64_t s = start[e]; s < start[e + 1]; s += kRows) {
      const int R = static_cast<int>(std::min<int64_t>(kRows, start[e + 1] - s));
      for (int r = 0; r < R; ++r) std::memcpy(&xs[r * D], xp + (order[s + r] / K) * D, sizeof(float) * D);
      Rows(R, xs.data(), D, wgu_e, 2 * F, h.data());
      for (int r = 0; r < R; ++r)
        for (int64_t f = 0; f < F; ++f) {
          const float gv = h[r * 2 * F + f];
          act[r * F + f] = gv / (1.0f + std::exp(-gv)) * h[r * 2 * F + F + f];
        }
      Rows(R, act.data(), F, wd_e, D, y.data());
      for (int r = 0; r < R; ++r) {
        const int64_t a = order[s + r];
        float* orow = o + (a / K) * D;
        const float c = cw[a];
        for (int64_t j = 0; j < D; ++j) orow[j] += c * y[r * D + j];
      }
    }
  }
  return ffi::Error::Success();
}

// y [M, N] = x [M, K] @ W, W packed [N/16, K, 16] (leading dims of size 1 allowed); rows in
// blocks of 8, each block streaming W once.
ffi::Error PackedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t r = wd.size();
  if (xd.size() != 2 || r < 3) return Fail("packed_matmul wants x [M, K] and w [..., N/16, K, 16]");
  for (int64_t i = 0; i + 3 < r; ++i)
    if (wd[i] != 1) return Fail("packed_matmul: leading dims of w must be 1");
  const int64_t M = xd[0], K = xd[1], N = wd[r - 3] * kPanel;
  if (wd[r - 2] != K || wd[r - 1] != kPanel || N % (2 * kPanel))
    return Fail("packed_matmul: w [N/16, K, 16] (N a multiple of 32) does not match x [M, K]");
  for (int64_t m = 0; m < M; m += kRows)
    Rows(static_cast<int>(std::min<int64_t>(kRows, M - m)), x.typed_data() + m * K, K, w.typed_data(), N,
         y->typed_data() + m * N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxMoeFfn, MoeFfn,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
