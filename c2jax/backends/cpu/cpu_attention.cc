// Causal self-attention of packed rows for CPU training, forward and backward, as XLA FFI calls
// (see c2jax/backends/cpu/attention.py for why). Flash-style: the forward keeps only the
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
  int64_t B, L, H, G, R, P, O, Lp, Pp, Op;   // Lp, Pp, Op: L, P, O rounded up to 64
};

// Keys [j, j + 16) that query (pi, si) sees: pos <= pi, same segment, index < nk.
inline auto Visible(const int32_t* pos, const int32_t* seg, int64_t j, int32_t pi, int32_t si, int64_t nk) {
  constexpr i16 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  i16 pj, sj;
  std::memcpy(&pj, pos + j, sizeof(pj));
  std::memcpy(&sj, seg + j, sizeof(sj));
  return (pj <= pi) & (sj == si) & (kIota + static_cast<int32_t>(j) < static_cast<int32_t>(nk));
}

// The forward's softmax numerators in place for the rows of one query block over keys [0, nkp):
// s [M, ldS] scaled scores, rows (position, head-in-group) pairs from position i0, become
// exp(s - max) where visible (else 0); lse_rows[m] gets the log-sum-exp and inv_sum[m] 1 / row
// sum (the caller scales the product P V instead of P). Groups of 16 keys whose positions all
// exceed the query's (group_min_pos, per group) are zeroed without an exp: the causal upper
// triangle and the padding.
void Probabilities(float* s, int64_t ldS, int64_t i0, int64_t npos, int64_t R, int64_t nk, int64_t nkp,
                   const int32_t* pos, const int32_t* seg, const int32_t* group_min_pos, float* lse_rows,
                   float* inv_sum) {
  for (int64_t t = 0; t < npos; ++t) {
    const int32_t pi = pos[i0 + t], si = seg[i0 + t];
    for (int64_t r = 0; r < R; ++r) {
      float* row = s + (t * R + r) * ldS;
      v16 mx = Splat(-INFINITY);
      for (int64_t j = 0; j < nkp; j += 16) {
        if (group_min_pos[j / 16] > pi) continue;
        const v16 m = Visible(pos, seg, j, pi, si, nk) ? Load(row + j) : Splat(-INFINITY);
        mx = mx > m ? mx : m;
      }
      float l = -INFINITY;
      for (int i = 0; i < 16; ++i) l = std::max(l, mx[i]);
      if (l == -INFINITY) {  // no visible key (cannot happen: a query always sees itself)
        std::memset(row, 0, sizeof(float) * nkp);
        lse_rows[t * R + r] = 0.0f;
        inv_sum[t * R + r] = 0.0f;
        continue;
      }
      v16 sum = {};
      for (int64_t j = 0; j < nkp; j += 16) {
        v16 p = {};
        if (group_min_pos[j / 16] <= pi) p = Visible(pos, seg, j, pi, si, nk) ? Exp(Load(row + j) - l) : v16{};
        Store(row + j, p);
        sum += p;
      }
      const float tot = Sum(sum);
      inv_sum[t * R + r] = 1.0f / tot;
      lse_rows[t * R + r] = l + std::log(tot);
    }
  }
}

// The backward's elementwise pass on the transposed scores st and dP^T dpt [nk, ld] of one query
// block (key rows j, query columns m): st <- P^T = exp(s - lse[m]) where key j is visible to
// column m's query, else 0; dpt <- dS^T = P^T * (dP^T - dsum[m]). qpos / qseg / lse / dsum per
// column (mc of them, a multiple of 16); 16-column chunks whose queries all precede key j
// (chunk_max_pos below pos[j]) are zeroed without an exp.
void TransposedScoreGrads(float* st, float* dpt, int64_t ld, int64_t nk, int64_t mc, const int32_t* pos,
                          const int32_t* seg, const int32_t* qpos, const int32_t* qseg,
                          const int32_t* chunk_max_pos, const float* lse, const float* dsum) {
  for (int64_t j = 0; j < nk; ++j) {
    const int32_t pj = pos[j], sj = seg[j];
    float *sr = st + j * ld, *dr = dpt + j * ld;
    for (int64_t c = 0; c < mc; c += 16) {
      if (chunk_max_pos[c / 16] < pj) {
        Store(sr + c, v16{});
        Store(dr + c, v16{});
        continue;
      }
      i16 qp, qs;
      std::memcpy(&qp, qpos + c, sizeof(qp));
      std::memcpy(&qs, qseg + c, sizeof(qs));
      const v16 p = (pj <= qp) & (sj == qs) ? Exp(Load(sr + c) - Load(lse + c)) : v16{};
      Store(sr + c, p);
      Store(dr + c, p * (Load(dr + c) - Load(dsum + c)));
    }
  }
}

// Per (batch, kv head) scratch. Keys as packed panels (cpu_simd.h PackPanels): kt = K^T [P, Lp]
// (forward scores), vr = V [L, Op] (outputs), kr = K [L, Pp] (backward dq); positions and segment
// ids padded to Lp never match a query. The backward packs each query block instead: qt = Q^T,
// dot = dO^T (transposed scores and dP), qp = Q, dop = dO (dK, dV).
struct Scratch {
  Floats kt, vr, kr, qb, dob, qt, dot, qp, dop, s, dp, out, dk, dv, lse, inv_sum, dsum;
  std::vector<int32_t> pos, seg, group_min_pos, qpos, qseg, chunk_max_pos;
};

void LoadKeys(const Dims& d, int64_t b, int64_t g, const float* k, const float* v, const int32_t* pos,
              const int32_t* seg, Scratch& w, bool backward) {
  const float *krows = k + (b * d.L * d.G + g) * d.P, *vrows = v + (b * d.L * d.G + g) * d.O;
  if (backward) {
    w.kr.resize(d.L * d.Pp);
    PackPanels(krows, d.G * d.P, d.L, d.P, d.Pp, w.kr.data());
  } else {
    w.kt.resize(d.P * d.Lp);
    PackPanels(krows, d.G * d.P, d.P, d.L, d.Lp, w.kt.data(), true);
    w.vr.resize(d.L * d.Op);
    PackPanels(vrows, d.G * d.O, d.L, d.O, d.Op, w.vr.data());
  }
  w.pos.assign(d.Lp, INT32_MAX);   // never <= a query's position
  w.seg.assign(d.Lp, INT32_MIN);
  std::memcpy(w.pos.data(), pos + b * d.L, sizeof(int32_t) * d.L);
  std::memcpy(w.seg.data(), seg + b * d.L, sizeof(int32_t) * d.L);
  if (backward) return;
  w.group_min_pos.resize(d.Lp / 16);  // the forward's skip of wholly masked key groups
  for (int64_t j = 0; j < d.Lp; j += 16)
    w.group_min_pos[j / 16] = *std::min_element(w.pos.begin() + j, w.pos.begin() + j + 16);
}

// Rows of block [i0, i0 + npos) of head group g (W wide, a multiple of 16), times `scale`, into
// dst [M, ld] (zero past W).
void LoadRows(const Dims& d, int64_t b, int64_t g, int64_t i0, int64_t npos, const float* x, int64_t W,
              float scale, float* dst, int64_t ld) {
  for (int64_t t = 0; t < npos; ++t)
    for (int64_t r = 0; r < d.R; ++r) {
      const float* src = x + ((b * d.L + i0 + t) * d.H + g * d.R + r) * W;
      float* o = dst + (t * d.R + r) * ld;
      for (int64_t c = 0; c < W; c += 16) Store(o + c, Load(src + c) * scale);
      std::memset(o + W, 0, sizeof(float) * (ld - W));
    }
}

// The inverse: src [M, ld] (its first W columns) times `scale` (and row_scale[m] when given) into
// the rows of x.
void StoreRows(const Dims& d, int64_t b, int64_t g, int64_t i0, int64_t npos, const float* src, int64_t ld,
               int64_t W, float scale, float* x, const float* row_scale = nullptr) {
  for (int64_t t = 0; t < npos; ++t)
    for (int64_t r = 0; r < d.R; ++r) {
      const int64_t m = t * d.R + r;
      float* o = x + ((b * d.L + i0 + t) * d.H + g * d.R + r) * W;
      const float* s = src + m * ld;
      const float f = row_scale ? scale * row_scale[m] : scale;
      for (int64_t c = 0; c < W; c += 16) Store(o + c, Load(s + c) * f);
    }
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
  d->Pp = static_cast<int64_t>(Up(d->P, 64));
  d->Op = static_cast<int64_t>(Up(d->O, 64));
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
  const int64_t Mp = kQueryBlock * d.R;
  ParallelFor(pool, d.B * d.G, [&](int64_t u) {
    const int64_t b = u / d.G, g = u % d.G;
    thread_local Scratch w;  // reused across units and calls: no page faults on fresh buffers
    LoadKeys(d, b, g, kp, vp, pp, sp, w, false);
    w.qb.resize(Mp * d.P);
    w.s.resize(Mp * d.Lp);
    w.out.resize(Mp * d.Op);
    w.lse.resize(Mp);
    w.inv_sum.resize(Mp);
    for (int64_t i0 = 0; i0 < d.L; i0 += kQueryBlock) {
      const int64_t npos = std::min<int64_t>(kQueryBlock, d.L - i0), M = npos * d.R;
      const int64_t nk = i0 + npos, nkp = Up(nk, kKeyPad);
      LoadRows(d, b, g, i0, npos, qp, d.P, scale, w.qb.data(), d.P);
      RowsTimesPacked(w.qb.data(), d.P, M, d.P, w.kt.data(), d.P, nkp, w.s.data(), d.Lp);
      Probabilities(w.s.data(), d.Lp, i0, npos, d.R, nk, nkp, w.pos.data(), w.seg.data(), w.group_min_pos.data(),
                    w.lse.data(), w.inv_sum.data());
      RowsTimesPacked(w.s.data(), d.Lp, M, nk, w.vr.data(), d.L, d.Op, w.out.data(), d.Op);
      StoreRows(d, b, g, i0, npos, w.out.data(), d.Op, d.O, 1.0f, op, w.inv_sum.data());
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
  // Per query block of M rows: S^T = K Q^T and dP^T = V dO^T [nk, M] straight from the key rows,
  // so dV += P^T dO and dK += dS^T Q take P^T / dS^T as row operands; only dq = scale dS K needs
  // dS, transposed once.
  const int64_t Mp = kQueryBlock * d.R, Mt = Up(Mp, 64);
  ParallelFor(pool, d.B * d.G, [&](int64_t u) {
    const int64_t b = u / d.G, g = u % d.G;
    thread_local Scratch w;  // reused across units and calls: no page faults on fresh buffers
    LoadKeys(d, b, g, kp, vp, pp, sp, w, true);
    const float *krows = kp + (b * d.L * d.G + g) * d.P, *vrows = vp + (b * d.L * d.G + g) * d.O;
    w.qb.resize(Mp * d.Pp);
    w.dob.resize(Mp * d.Op);
    w.qt.resize(d.P * Mt);
    w.dot.resize(d.O * Mt);
    w.qp.resize(Mp * d.Pp);
    w.dop.resize(Mp * d.Op);
    w.s.resize(d.Lp * Mt);  // S^T [L, Mt], later dS [Mp, Lp]
    w.dp.resize(d.L * Mt);
    w.out.resize(Mp * d.Pp);
    w.lse.resize(Mt);
    w.dsum.resize(Mt);
    w.qpos.resize(Mt);
    w.qseg.resize(Mt);
    w.chunk_max_pos.resize(Mt / 16);
    w.dk.assign(d.L * d.Pp, 0.0f);
    w.dv.assign(d.L * d.Op, 0.0f);
    for (int64_t i0 = 0; i0 < d.L; i0 += kQueryBlock) {
      const int64_t npos = std::min<int64_t>(kQueryBlock, d.L - i0), M = npos * d.R, nk = i0 + npos;
      const int64_t mc = Up(M, 16), mp = Up(M, 64);
      LoadRows(d, b, g, i0, npos, qp, d.P, scale, w.qb.data(), d.Pp);
      LoadRows(d, b, g, i0, npos, dop, d.O, 1.0f, w.dob.data(), d.Op);
      for (int64_t t = 0; t < npos; ++t)
        for (int64_t r = 0; r < d.R; ++r) {
          const int64_t row = (b * d.L + i0 + t) * d.H + g * d.R + r, m = t * d.R + r;
          w.lse[m] = lp[row];
          w.qpos[m] = pp[b * d.L + i0 + t];
          w.qseg[m] = sp[b * d.L + i0 + t];
          const float *o = op + row * d.O, *dor = &w.dob[m * d.Op];
          v16 s = {};
          for (int64_t c = 0; c < d.O; c += 16) s += Load(o + c) * Load(dor + c);
          w.dsum[m] = Sum(s);  // rowsum(dP * P) = rowsum(dO * O)
        }
      for (int64_t m = M; m < mc; ++m) w.qpos[m] = INT32_MIN, w.qseg[m] = 0, w.lse[m] = w.dsum[m] = 0.0f;
      for (int64_t c = 0; c < mc; c += 16)
        w.chunk_max_pos[c / 16] = *std::max_element(w.qpos.begin() + c, w.qpos.begin() + c + 16);
      PackPanels(w.qb.data(), d.Pp, d.P, M, mp, w.qt.data(), true);
      PackPanels(w.dob.data(), d.Op, d.O, M, mp, w.dot.data(), true);
      RowsTimesPacked(krows, d.G * d.P, nk, d.P, w.qt.data(), d.P, mp, w.s.data(), Mt);
      RowsTimesPacked(vrows, d.G * d.O, nk, d.O, w.dot.data(), d.O, mp, w.dp.data(), Mt);
      TransposedScoreGrads(w.s.data(), w.dp.data(), Mt, nk, mc, w.pos.data(), w.seg.data(), w.qpos.data(),
                           w.qseg.data(), w.chunk_max_pos.data(), w.lse.data(), w.dsum.data());
      // dV += P^T dO; dK += dS^T (scale q); dq = scale dS K
      PackPanels(w.dob.data(), d.Op, M, d.O, d.Op, w.dop.data());
      RowsTimesPacked(w.s.data(), Mt, nk, M, w.dop.data(), M, d.Op, w.dv.data(), d.Op, true);
      PackPanels(w.qb.data(), d.Pp, M, d.P, d.Pp, w.qp.data());
      RowsTimesPacked(w.dp.data(), Mt, nk, M, w.qp.data(), M, d.Pp, w.dk.data(), d.Pp, true);
      Transpose(w.dp.data(), Mt, nk, M, w.s.data(), d.Lp);
      RowsTimesPacked(w.s.data(), d.Lp, M, nk, w.kr.data(), d.L, d.Pp, w.out.data(), d.Pp);
      StoreRows(d, b, g, i0, npos, w.out.data(), d.Pp, d.P, scale, dqp);
    }
    for (int64_t j = 0; j < d.L; ++j) {
      std::memcpy(dkp + ((b * d.L + j) * d.G + g) * d.P, &w.dk[j * d.Pp], sizeof(float) * d.P);
      std::memcpy(dvp + ((b * d.L + j) * d.G + g) * d.O, &w.dv[j * d.Op], sizeof(float) * d.O);
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
