// Causal self-attention of packed rows for CPU training, forward and backward, as XLA FFI calls
// (see c2jax/models/cpu_attention.py for why). Flash-style: the forward keeps only the
// log-sum-exp of each query row; the backward recomputes the probabilities block by block.
// Built with cpu_kernels.cc into one library; plain GCC vector extensions.
//
// Layouts (row-major): q [B, L, H, P], k [B, L, G, P], v [B, L, G, O], positions / segment ids
// [B, L] int32, out [B, L, H, O], lse [B, L, H]; query head h uses kv head h / (H / G).
// Key j is visible to query i when j <= i's block end, pos[j] <= pos[i] and seg[j] == seg[i]
// (exact for rows whose positions increase inside each segment, as c2jax packs them).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace c2jax_simd;  // NOLINT

constexpr int kQueryBlock = 32;  // positions per query block
constexpr int kKeyPad = 64;      // score rows are padded to this many keys

struct Dims {
  int64_t B, L, H, G, R, P, O, Lp;
};

// Per-row visibility of the keys [0, nk) of one query block; scores -> probabilities in place.
// s: [M, Lp] scaled scores; rows are (position, head-in-group) pairs starting at position i0.
// With lse given (backward) p = exp(s - lse); else softmax, lse written.
void Probabilities(float* s, int64_t ldS, int64_t i0, int64_t npos, int64_t R, int64_t nk, int64_t nkp,
                   const int32_t* pos, const int32_t* seg, float* lse_rows, bool have_lse) {
  i16 iota;
  for (int i = 0; i < 16; ++i) iota[i] = i;
  for (int64_t t = 0; t < npos; ++t) {
    const int32_t pi = pos[i0 + t], si = seg[i0 + t];
    for (int64_t r = 0; r < R; ++r) {
      float* row = s + (t * R + r) * ldS;
      if (!have_lse) {
        v16 mx = Splat(-INFINITY);
        for (int64_t j = 0; j < nkp; j += 16) {
          i16 pj, sj;
          std::memcpy(&pj, pos + j, sizeof(pj));
          std::memcpy(&sj, seg + j, sizeof(sj));
          const v16 x = Load(row + j);
          const v16 m = (pj <= pi) & (sj == si) & (iota + static_cast<int32_t>(j) < static_cast<int32_t>(nk)) ? x : Splat(-INFINITY);
          mx = mx > m ? mx : m;
        }
        float m = -INFINITY;
        for (int i = 0; i < 16; ++i) m = std::max(m, mx[i]);
        if (m == -INFINITY) {  // no visible key (cannot happen: a query always sees itself)
          std::memset(row, 0, sizeof(float) * nkp);
          lse_rows[t * R + r] = 0.0f;
          continue;
        }
        v16 sum = {};
        for (int64_t j = 0; j < nkp; j += 16) {
          i16 pj, sj;
          std::memcpy(&pj, pos + j, sizeof(pj));
          std::memcpy(&sj, seg + j, sizeof(sj));
          const v16 e = Exp(Load(row + j) - m);
          const v16 p = (pj <= pi) & (sj == si) & (iota + static_cast<int32_t>(j) < static_cast<int32_t>(nk)) ? e : v16{};
          Store(row + j, p);
          sum += p;
        }
        const float tot = Sum(sum), inv = 1.0f / tot;
        for (int64_t j = 0; j < nkp; j += 16) Store(row + j, Load(row + j) * inv);
        lse_rows[t * R + r] = m + std::log(tot);
      } else {
        const float l = lse_rows[t * R + r];
        for (int64_t j = 0; j < nkp; j += 16) {
          i16 pj, sj;
          std::memcpy(&pj, pos + j, sizeof(pj));
          std::memcpy(&sj, seg + j, sizeof(sj));
          const v16 e = Exp(Load(row + j) - l);
          Store(row + j, (pj <= pi) & (sj == si) & (iota + static_cast<int32_t>(j) < static_cast<int32_t>(nk)) ? e : v16{});
        }
      }
    }
  }
}

// Per (batch, kv head) scratch: keys padded to Lp (positions / segments past L never match).
struct Scratch {
  std::vector<float> kt, vt, qb, dob, s, dp, out, dk, dv, lse, dsum;
  std::vector<int32_t> pos, seg;
};

void LoadKeys(const Dims& d, int64_t b, int64_t g, const float* k, const float* v, const int32_t* pos,
              const int32_t* seg, Scratch& w, bool need_vt) {
  w.kt.assign(d.P * d.Lp, 0.0f);
  for (int64_t j = 0; j < d.L; ++j) {
    const float* kr = k + ((b * d.L + j) * d.G + g) * d.P;
    for (int64_t p = 0; p < d.P; ++p) w.kt[p * d.Lp + j] = kr[p];
  }
  if (need_vt) {
    w.vt.assign(d.O * d.Lp, 0.0f);
    for (int64_t j = 0; j < d.L; ++j) {
      const float* vr = v + ((b * d.L + j) * d.G + g) * d.O;
      for (int64_t o = 0; o < d.O; ++o) w.vt[o * d.Lp + j] = vr[o];
    }
  }
  // keys as packed panels [Lp/64][P][64] (rows of kt are Lp floats apart: L1 set conflicts)
  std::vector<float> packed(w.kt.size());
  PackPanels(w.kt.data(), d.Lp, d.P, d.Lp, packed.data());
  w.kt.swap(packed);
  if (need_vt) {
    packed.resize(w.vt.size());
    PackPanels(w.vt.data(), d.Lp, d.O, d.Lp, packed.data());
    w.vt.swap(packed);
  }
  w.pos.assign(d.Lp, INT32_MIN);
  w.seg.assign(d.Lp, INT32_MIN);
  std::memcpy(w.pos.data(), pos + b * d.L, sizeof(int32_t) * d.L);
  std::memcpy(w.seg.data(), seg + b * d.L, sizeof(int32_t) * d.L);
  for (int64_t j = d.L; j < d.Lp; ++j) w.pos[j] = INT32_MAX;  // never <= a query's position
}

// Query rows of block [i0, i0 + npos) of head group g, times `scale`, into dst [Mp, P].
void LoadRows(const Dims& d, int64_t b, int64_t g, int64_t i0, int64_t npos, const float* x, int64_t W,
              float scale, float* dst, int64_t Mp) {
  std::memset(dst, 0, sizeof(float) * Mp * W);
  for (int64_t t = 0; t < npos; ++t)
    for (int64_t r = 0; r < d.R; ++r) {
      const float* src = x + ((b * d.L + i0 + t) * d.H + g * d.R + r) * W;
      float* o = dst + (t * d.R + r) * W;
      for (int64_t c = 0; c < W; ++c) o[c] = src[c] * scale;
    }
}

void StoreRows(const Dims& d, int64_t b, int64_t g, int64_t i0, int64_t npos, const float* src, int64_t W,
               float scale, float* x) {
  for (int64_t t = 0; t < npos; ++t)
    for (int64_t r = 0; r < d.R; ++r) {
      float* o = x + ((b * d.L + i0 + t) * d.H + g * d.R + r) * W;
      const float* s = src + (t * d.R + r) * W;
      for (int64_t c = 0; c < W; ++c) o[c] = s[c] * scale;
    }
}

// C[j, 0:W] += A[:, j]^T B[:, 0:W]: the packed form where W is a multiple of 64.
void ColsTimesRows(const float* A, int64_t lda, int64_t M, int64_t n, const float* B, int64_t ldb, int64_t W,
                   float* C, int64_t ldc, std::vector<float>& scratch) {
  if (W % 64 == 0) ColsTimesRowsPacked(A, lda, M, n, B, ldb, W, C, ldc, scratch);
  else ColsTimesRowsW(A, lda, M, n, B, ldb, W, C, ldc);
}

ffi::Error Fail(const char* msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

ffi::Error CheckDims(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                     ffi::Buffer<ffi::S32>& pos, ffi::Buffer<ffi::S32>& seg, Dims* d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return Fail("causal attention wants q [B, L, H, P], k [B, L, G, P], v [B, L, G, O]");
  d->B = qd[0], d->L = qd[1], d->H = qd[2], d->P = qd[3], d->G = kd[2], d->O = vd[3];
  if (kd[0] != d->B || kd[1] != d->L || kd[3] != d->P || vd[0] != d->B || vd[1] != d->L || vd[2] != d->G ||
      d->G == 0 || d->H % d->G || d->P % 16 || d->O % 16)
    return Fail("causal attention: q, k, v shapes disagree (G must divide H, P and O be multiples of 16)");
  auto pd = pos.dimensions(), sd = seg.dimensions();
  if (pd.size() != 2 || sd.size() != 2 || pd[0] != d->B || pd[1] != d->L || sd[0] != d->B || sd[1] != d->L)
    return Fail("causal attention: positions and segment ids must be [B, L]");
  d->R = d->H / d->G;
  d->Lp = static_cast<int64_t>(Up(d->L, kKeyPad));
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> seg, float scale,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Dims d;
  if (auto e = CheckDims(q, k, v, pos, seg, &d); e.failure()) return e;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t *pp = pos.typed_data(), *sp = seg.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  const int64_t Mp = Up(kQueryBlock * d.R, 4);
  ParallelFor(pool, d.B * d.G, [&](int64_t u) {
    const int64_t b = u / d.G, g = u % d.G;
    Scratch w;
    LoadKeys(d, b, g, kp, vp, pp, sp, w, false);
    w.qb.resize(Mp * d.P);
    w.s.resize(Mp * d.Lp);
    w.out.resize(Mp * d.O);
    w.lse.resize(Mp);
    for (int64_t i0 = 0; i0 < d.L; i0 += kQueryBlock) {
      const int64_t npos = std::min<int64_t>(kQueryBlock, d.L - i0), M = Up(npos * d.R, 4);
      const int64_t nk = i0 + npos, nkp = Up(nk, kKeyPad);
      LoadRows(d, b, g, i0, npos, qp, d.P, scale, w.qb.data(), M);
      RowsTimesPacked(w.qb.data(), d.P, M, d.P, w.kt.data(), nkp, w.s.data(), d.Lp);
      Probabilities(w.s.data(), d.Lp, i0, npos, d.R, nk, nkp, w.pos.data(), w.seg.data(), w.lse.data(), false);
      RowsTimesRowsW(w.s.data(), d.Lp, M, nk, vp + (b * d.L * d.G + g) * d.O, d.G * d.O, d.O, w.out.data(), d.O);
      StoreRows(d, b, g, i0, npos, w.out.data(), d.O, 1.0f, op);
      for (int64_t t = 0; t < npos; ++t)
        for (int64_t r = 0; r < d.R; ++r) lp[(b * d.L + i0 + t) * d.H + g * d.R + r] = w.lse[t * d.R + r];
    }
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, float scale,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  Dims d;
  if (auto e = CheckDims(q, k, v, pos, seg, &d); e.failure()) return e;
  if (out.element_count() != static_cast<size_t>(d.B * d.L * d.H * d.O) ||
      dout.element_count() != out.element_count() || lse.element_count() != static_cast<size_t>(d.B * d.L * d.H))
    return Fail("causal attention backward: out / dout [B, L, H, O] and lse [B, L, H] expected");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *op = out.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  const int32_t *pp = pos.typed_data(), *sp = seg.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int64_t Mp = Up(kQueryBlock * d.R, 4);
  ParallelFor(pool, d.B * d.G, [&](int64_t u) {
    const int64_t b = u / d.G, g = u % d.G;
    Scratch w;
    LoadKeys(d, b, g, kp, vp, pp, sp, w, true);
    w.qb.resize(Mp * d.P);
    w.dob.resize(Mp * d.O);
    w.s.resize(Mp * d.Lp);
    w.dp.resize(Mp * d.Lp);
    w.out.resize(Mp * d.P);
    w.lse.assign(Mp, 0.0f);
    w.dsum.assign(Mp, 0.0f);
    w.dk.assign(d.Lp * d.P, 0.0f);
    w.dv.assign(d.Lp * d.O, 0.0f);
    const float* krows = kp + (b * d.L * d.G + g) * d.P;
    std::vector<float> scratch;
    for (int64_t i0 = 0; i0 < d.L; i0 += kQueryBlock) {
      const int64_t npos = std::min<int64_t>(kQueryBlock, d.L - i0), M = Up(npos * d.R, 4);
      const int64_t nk = i0 + npos, nkp = Up(nk, kKeyPad);
      LoadRows(d, b, g, i0, npos, qp, d.P, scale, w.qb.data(), M);
      LoadRows(d, b, g, i0, npos, dop, d.O, 1.0f, w.dob.data(), M);
      for (int64_t t = 0; t < npos; ++t)
        for (int64_t r = 0; r < d.R; ++r) {
          const int64_t row = (b * d.L + i0 + t) * d.H + g * d.R + r;
          w.lse[t * d.R + r] = lp[row];
          const float *o = op + row * d.O, *dor = dop + row * d.O;
          float s = 0;
          for (int64_t c = 0; c < d.O; ++c) s += o[c] * dor[c];
          w.dsum[t * d.R + r] = s;  // rowsum(dP * P) = rowsum(dO * O)
        }
      RowsTimesPacked(w.qb.data(), d.P, M, d.P, w.kt.data(), nkp, w.s.data(), d.Lp);
      Probabilities(w.s.data(), d.Lp, i0, npos, d.R, nk, nkp, w.pos.data(), w.seg.data(), w.lse.data(), true);
      for (int64_t m = npos * d.R; m < M; ++m) std::memset(&w.s[m * d.Lp], 0, sizeof(float) * nkp);
      RowsTimesPacked(w.dob.data(), d.O, M, d.O, w.vt.data(), nkp, w.dp.data(), d.Lp);
      for (int64_t m = 0; m < M; ++m) {  // dS = P * (dP - rowsum(dO * O)), in w.dp
        float* dpr = &w.dp[m * d.Lp];
        const float* pr = &w.s[m * d.Lp];
        const v16 ds = Splat(w.dsum[m]);
        for (int64_t j = 0; j < nkp; j += 16) Store(dpr + j, Load(pr + j) * (Load(dpr + j) - ds));
      }
      // dV += P^T dO; dK += dS^T (scale q); dq = scale dS K
      ColsTimesRows(w.s.data(), d.Lp, M, Up(nk, 4), w.dob.data(), d.O, d.O, w.dv.data(), d.O, scratch);
      ColsTimesRows(w.dp.data(), d.Lp, M, Up(nk, 4), w.qb.data(), d.P, d.P, w.dk.data(), d.P, scratch);
      RowsTimesRowsW(w.dp.data(), d.Lp, M, nk, krows, d.G * d.P, d.P, w.out.data(), d.P);
      StoreRows(d, b, g, i0, npos, w.out.data(), d.P, scale, dqp);
    }
    for (int64_t j = 0; j < d.L; ++j) {
      std::memcpy(dkp + ((b * d.L + j) * d.G + g) * d.P, &w.dk[j * d.P], sizeof(float) * d.P);
      std::memcpy(dvp + ((b * d.L + j) * d.G + g) * d.O, &w.dv[j * d.O], sizeof(float) * d.O);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxCausalAttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(C2jaxCausalAttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
