// Shared pieces of the CPU FFI kernels (cpu_attention.cc, cpu_moe.cc, cpu_loss.cc, cpu_adamw.cc):
// GCC vector types, aligned scratch, a vectorized exp, an in-register transpose, the
// register-blocked products they are written in, and a parallel-for on XLA's intra-op thread pool. Plain GCC vector extensions:
// AVX-512 under -march=native where the host has it, narrower vectors elsewhere.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <utility>
#include <thread>
#include <vector>
#include <cstdlib>

#include "xla/ffi/api/ffi.h"

namespace c2jax_simd {

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// Allocator for scratch: 64-byte aligned (a vector load never straddles two cache lines) and
// default-initialized (resize leaves floats unwritten: the kernels write before they read).
template <typename T>
struct ScratchAlloc {
  using value_type = T;
  ScratchAlloc() = default;
  template <typename U>
  ScratchAlloc(const ScratchAlloc<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  void construct(U* p) { ::new (static_cast<void*>(p)) U; }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(std::forward<A>(a)...); }
  template <typename U>
  bool operator==(const ScratchAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const ScratchAlloc<U>&) const { return false; }
};
using Floats = std::vector<float, ScratchAlloc<float>>;

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 Splat(float x) { return v16{} + x; }
inline float Sum(v16 v) {
  float s = 0;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
inline size_t Up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// exp(x) for x in [-87, 88] (clamped there), |rel err| < 2e-7: 2^n * 2^f, f in [-0.5, 0.5].
inline v16 Exp(v16 x) {
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  x = x > Splat(88.0f) ? Splat(88.0f) : x;
  const v16 y = x * 1.44269504088896341f;
  const v16 half = y < Splat(0.0f) ? Splat(-0.5f) : Splat(0.5f);
  const i16 n = __builtin_convertvector(y + half, i16);
  const v16 f = (y - __builtin_convertvector(n, v16)) * 0.6931471805599453f;
  v16 p = Splat(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const i16 bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One round of the in-register 16x16 transpose: swaps the off-diagonal h x h blocks of each
// 2h x 2h block of rows r[0..16) (rounds h = 8, 4, 2, 1 transpose them).
template <int h>
inline void SwapBlocks(v16* r) {
  i16 lo, hi;  // constants after unrolling: one two-source permute each
  for (int j = 0; j < 16; ++j) {
    lo[j] = j & h ? 16 + j - h : j;
    hi[j] = j & h ? 16 + j : j + h;
  }
  for (int i = 0; i < 16; ++i)
    if (!(i & h)) {
      const v16 a = r[i], b = r[i + h];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + h] = __builtin_shuffle(a, b, hi);
    }
}

// dst[j ldd + i] = src[i lds + j] for i < rows, j < cols: 16x16 tiles through registers, each
// source line read once (a 16-row strip at a time), scalar at the edges.
inline void Transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < cols16; j0 += 16) {
      v16 r[16];
      for (int i = 0; i < 16; ++i) r[i] = Load(src + (i0 + i) * lds + j0);
      SwapBlocks<8>(r);
      SwapBlocks<4>(r);
      SwapBlocks<2>(r);
      SwapBlocks<1>(r);
      for (int j = 0; j < 16; ++j) Store(dst + (j0 + j) * ldd + i0, r[j]);
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// Packed panels of X [K, N]: [Np/64][K][64] (Np a multiple of 64, columns N..Np zero), so a
// product streams each 64-column panel contiguously (rows of a [512, 512] matrix lie 2 KB apart
// and fall into a few L1 sets). X[k][n] = src[k ld + n], or src[n ld + k] when transposed.
// panel_rows > K: panels [Np/64][panel_rows][64] of which this fills the first K rows (two packs
// at row offsets 0 and K stack two matrices along K, for one product over both).
inline void PackPanels(const float* src, int64_t ld, int64_t K, int64_t N, int64_t Np, float* dst,
                       bool transposed = false, int64_t panel_rows = 0) {
  if (panel_rows < K) panel_rows = K;
  for (int64_t c = 0; c < Np; c += 64) {
    float* panel = dst + c * panel_rows;
    const int64_t w = std::clamp<int64_t>(N - c, 0, 64);
    if (w < 64) std::memset(panel, 0, sizeof(float) * K * 64);
    if (transposed) {
      Transpose(src + c * ld, ld, w, K, panel, 64);
    } else {
      for (int64_t kk = 0; kk < K; ++kk) std::memcpy(panel + kk * 64, src + kk * ld + c, sizeof(float) * w);
    }
  }
}

// Rows [r, r + RB) of C[:, c:c + 64] = (or +=) A @ panel (K rows of 64). kAColumns: the tile's
// rows are columns [r, r + RB) of A [K, ...] instead of rows of A [..., K] (A^T @ panel, A read in
// place: RB neighbouring floats of each of its rows broadcast in turn).
template <int RB, bool kAColumns = false>
inline void RowsPanelTile(const float* A, int64_t lda, int64_t r, int64_t K, const float* panel, float* C,
                          int64_t ldc, int64_t c, bool accumulate = false) {
  v16 acc[RB][4];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = accumulate ? Load(C + (r + i) * ldc + c + 16 * j) : v16{};
  const float* a = kAColumns ? A + r : A + r * lda;
  for (int64_t kk = 0; kk < K; ++kk) {
    const float* b = panel + kk * 64;
    const v16 b0 = Load(b), b1 = Load(b + 16), b2 = Load(b + 32), b3 = Load(b + 48);
    for (int i = 0; i < RB; ++i) {
      const float x = kAColumns ? a[kk * lda + i] : a[i * lda + kk];
      acc[i][0] += x * b0;
      acc[i][1] += x * b1;
      acc[i][2] += x * b2;
      acc[i][3] += x * b3;
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < 4; ++j) Store(C + (r + i) * ldc + c + 16 * j, acc[i][j]);
}

// C[m, 0:N] = (or +=) A[m, 0:K] @ X[0:K, 0:N] for m < M, X packed by PackPanels with Kp >= K rows
// (N % 64 == 0); rows 6 at a time (24 accumulators) while 6 are left, then 4, 2, 1. kAColumns:
// A[m, k] is A[k lda + m] (the product is A^T @ X for a row-major A [K, M]).
template <bool kAColumns = false>
inline void RowsTimesPacked(const float* A, int64_t lda, int64_t M, int64_t K, const float* Xp, int64_t Kp,
                            int64_t N, float* C, int64_t ldc, bool accumulate = false) {
  for (int64_t c = 0; c < N; c += 64) {
    const float* panel = Xp + c * Kp;
    int64_t r = 0;
    for (; r + 6 <= M; r += 6) RowsPanelTile<6, kAColumns>(A, lda, r, K, panel, C, ldc, c, accumulate);
    if (r + 4 <= M) RowsPanelTile<4, kAColumns>(A, lda, r, K, panel, C, ldc, c, accumulate), r += 4;
    for (; r + 2 <= M; r += 2) RowsPanelTile<2, kAColumns>(A, lda, r, K, panel, C, ldc, c, accumulate);
    if (r < M) RowsPanelTile<1, kAColumns>(A, lda, r, K, panel, C, ldc, c, accumulate);
  }
}

// C[j, 0:W] += sum_{i < M} A[i, j] B[i, 0:W] for j < n (W % 64 == 0): A [M, n] (row stride lda)
// and B [M, W] (row stride ldb) are row-major; B goes through bp (W M floats) as panels
// [W/64][M][64] so it streams contiguously, A is read in place.
inline void ColsTimesRowsPacked(const float* A, int64_t lda, int64_t M, int64_t n, const float* B, int64_t ldb,
                                int64_t W, float* C, int64_t ldc, float* bp) {
  PackPanels(B, ldb, M, W, W, bp);
  RowsTimesPacked<true>(A, lda, n, M, bp, M, W, C, ldc, true);
}

// Runs work(u) for u < n on this thread and XLA's intra-op pool; returns when all are done.
// Tasks that start after the work ran out return at once (they hold the state by shared_ptr).
inline void ParallelFor(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& work) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  const std::function<void(int64_t)>* w = &work;
  auto run = [st, w, n]() {
    for (int64_t u; (u = st->next.fetch_add(1)) < n;) {
      (*w)(u);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace c2jax_simd
