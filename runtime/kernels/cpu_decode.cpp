// A decode step (one token, or a short chunk such as a chain verification) through every decoder layer in
// one call (CPU; fp32, or bf16 layers with an fp32 residual stream, as set_dtype(bf16, mixed=True) runs them).
//
// Same math as runtime.model's layers for T == 1 with a contiguous KV cache: RMSNorm, fused q/k/v,
// rope (the flip-halves form of apply_rope, product for product), the cache write at `pos`, grouped-query
// attention over slots 0..pos, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down_proj, residual.
// The matrix-vector products stay ATen's (MKL GEMV, both cores); everything between them is a short
// loop here, so a layer costs 4 GEMVs plus a few microseconds instead of ~45 Python-dispatched ops.
// Elementwise steps round to the compute type T where the Python ops do (each bf16 op rounds its result).
// Reductions (norm, dot products, softmax sums) use 16 lane-wise partial sums: the order differs from
// ATen's, so results match the Python path to float rounding, not bit for bit ("same math").
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }  // float -> T (round to nearest even for bf16)

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

float sum_of_squares(const float* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

template <typename T>
float dot(const float* a, const T* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * f32(b[i + l]);
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) total += a[i] * f32(b[i]);
  return total;
}

// RMSNorm of the fp32 residual: fp32 x * rsqrt(mean(x^2) + eps) * w (F.rms_norm), or for bf16 layers the
// normalised value cast to bf16, then times the bf16 weight (RMSNorm.forward's mixed branch).
template <typename T>
void rms_norm(const float* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = rnd<T>(f32(rnd<T>(x[i] * inv)) * f32(w[i]));
}

// apply_rope for one head: x * cos + flip_halves(x) * (-sin, +sin), each product and the sum rounded to T.
template <typename T, typename Out>
void rope(const T* x, const T* cos, const T* sin, Out* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const T a = rnd<T>(f32(x[i]) * f32(cos[i]));
    const T b = i < half ? rnd<T>(f32(x[i + half]) * -f32(sin[i])) : rnd<T>(f32(x[i - half]) * f32(sin[i - half]));
    out[i] = static_cast<Out>(rnd<T>(f32(a) + f32(b)));
  }
}

// softmax(q . k_j * scale) . v_j over the first `len` cache slots of one kv head, in float.
template <typename T>
void attend_one(const float* q, const T* k, const T* v, T* out, int64_t len, int64_t d, float scale,
                std::vector<float>& scores, std::vector<float>& acc) {
  scores.resize(len);
  acc.assign(d, 0.0f);
  float max_score = -INFINITY;
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = dot(q, k + j * d, d) * scale;
    max_score = std::max(max_score, scores[j]);
  }
  float denom = 0;
  for (int64_t j = 0; j < len; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    denom += scores[j];
  }
  for (int64_t j = 0; j < len; ++j) {
    const float p = scores[j] / denom;
    const T* vj = v + j * d;
    for (int64_t i = 0; i < d; ++i) acc[i] += p * f32(vj[i]);
  }
  for (int64_t i = 0; i < d; ++i) out[i] = rnd<T>(acc[i]);
}

// y [B, N] = x [B, K] @ W[N, K]^T (+ bias): GEMV per row for B == 1 (the faster kernel here), GEMM otherwise.
void linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (x.size(0) == 1) {
    auto row = x.view({-1});
    auto out = y.view({-1});
    if (has_bias)
      at::addmv_out(out, bias, w, row);
    else
      at::mv_out(out, w, row);
  } else if (has_bias) {
    at::addmm_out(y, bias, x, w.t());
  } else {
    at::mm_out(y, x, w.t());
  }
}

template <typename T>
void decode_layers_impl(at::Tensor& x, int64_t tokens, const std::vector<at::Tensor>& layers, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, int64_t pos,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps) {
  const int64_t rows = x.size(0), Tn = tokens, B = rows / Tn, hidden = x.size(1);
  const int64_t L = static_cast<int64_t>(layers.size() / 7);
  const int64_t D = head_dim, Hq = num_heads, Hkv = num_kv_heads, group = Hq / Hkv;
  const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
  const int64_t S = k_cache.size(3), Bc = k_cache.size(1);
  const int64_t inter = layers[5].size(0) / 2;
  const float feps = static_cast<float>(eps), scale = 1.0f / std::sqrt(static_cast<float>(D));
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  auto opts = k_cache.options();
  at::Tensor normed = at::empty({rows, hidden}, opts), qkv = at::empty({rows, qkv_size}, opts);
  at::Tensor attn = at::empty({rows, q_size}, opts), proj = at::empty({rows, hidden}, opts);
  at::Tensor gate_up = at::empty({rows, 2 * inter}, opts), act = at::empty({rows, inter}, opts);
  // several tokens per row: their roped queries [B, Hq, T, D] and the causal mask over the cache prefix
  at::Tensor q_all, mask;
  if (Tn > 1) {
    q_all = at::empty({B, Hq, Tn, D}, opts);
    mask = at::ones({Tn, pos + Tn}, opts.dtype(at::kBool)).tril(pos);  // query t sees slots 0..pos+t
  }
  float* xp = x.data_ptr<float>();
  const T* pp = proj.data_ptr<T>();
  const int64_t layer_stride = Bc * Hkv * S * D, row_stride = Hkv * S * D, len = pos + 1;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = &layers[7 * l];
    for (int64_t r = 0; r < rows; ++r)
      rms_norm(xp + r * hidden, w[0].data_ptr<T>(), normed.data_ptr<T>() + r * hidden, hidden, feps);
    linear(normed, w[1], w[2], qkv);
    T* kc = k_cache.data_ptr<T>() + l * layer_stride;
    T* vc = v_cache.data_ptr<T>() + l * layer_stride;
    for (int64_t r = 0; r < rows; ++r) {  // rope k and write k/v at slot pos + t
      const int64_t b = r / Tn, t = r % Tn;
      const T* row = qkv.data_ptr<T>() + r * qkv_size;
      for (int64_t h = 0; h < Hkv; ++h) {
        rope(row + q_size + h * D, cos_p + t * D, sin_p + t * (D / 2), kc + b * row_stride + (h * S + pos + t) * D, D);
        std::copy(row + q_size + kv_size + h * D, row + q_size + kv_size + (h + 1) * D,
                  vc + b * row_stride + (h * S + pos + t) * D);
      }
    }
    if (Tn == 1) {
      auto attend_range = [&](int64_t begin, int64_t end) {
        std::vector<float> scores, acc, q(D);
        for (int64_t i = begin; i < end; ++i) {  // i enumerates (row, query head)
          const int64_t b = i / Hq, h = i % Hq;
          rope(qkv.data_ptr<T>() + b * qkv_size + h * D, cos_p, sin_p, q.data(), D);
          const int64_t base = b * row_stride + (h / group) * S * D;
          attend_one(q.data(), kc + base, vc + base, attn.data_ptr<T>() + b * q_size + h * D, len, D, scale, scores,
                     acc);
        }
      };
      if (len * B >= 512)
        at::parallel_for(0, B * Hq, 1, attend_range);  // long contexts: split the heads over the cores
      else
        attend_range(0, B * Hq);
    } else {  // a short chunk (chain verification): ATen's SDPA over the cache prefix, as the Python layers run
      T* qp = q_all.data_ptr<T>();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = r / Tn, t = r % Tn;
        for (int64_t h = 0; h < Hq; ++h)
          rope(qkv.data_ptr<T>() + r * qkv_size + h * D, cos_p + t * D, sin_p + t * (D / 2),
               qp + ((b * Hq + h) * Tn + t) * D, D);
      }
      auto keys = k_cache[l].narrow(0, 0, B).narrow(2, 0, pos + Tn);
      auto values = v_cache[l].narrow(0, 0, B).narrow(2, 0, pos + Tn);
      auto out = at::scaled_dot_product_attention(q_all, keys, values, mask, 0.0, false, std::nullopt, true);
      attn.view({B, Tn, Hq, D}).copy_(out.transpose(1, 2));
    }
    linear(attn, w[3], at::Tensor(), proj);
    for (int64_t i = 0; i < rows * hidden; ++i) xp[i] += f32(pp[i]);
    for (int64_t r = 0; r < rows; ++r)
      rms_norm(xp + r * hidden, w[4].data_ptr<T>(), normed.data_ptr<T>() + r * hidden, hidden, feps);
    linear(normed, w[5], at::Tensor(), gate_up);
    for (int64_t b = 0; b < rows; ++b) {
      const T* g = gate_up.data_ptr<T>() + b * 2 * inter;
      T* a = act.data_ptr<T>() + b * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gi = f32(g[i]);
        a[i] = rnd<T>(f32(rnd<T>(gi / (1.0f + std::exp(-gi)))) * f32(g[inter + i]));
      }
    }
    linear(act, w[6], at::Tensor(), proj);
    for (int64_t i = 0; i < rows * hidden; ++i) xp[i] += f32(pp[i]);
  }
}

}  // namespace

// x: [B*T, hidden] fp32 residual stream of T new tokens per row, row-major (updated in place and returned).
// layers: 7 tensors per layer, all of the compute type: input norm w, qkv w [q+2kv, hidden], qkv bias
//   (empty if none), o w, post norm w, gate_up w [2m, hidden], down w [hidden, m].
// k_cache, v_cache: [L, B_cache, Hkv, S, D] contiguous, of the compute type; token t's k/v go to slot pos + t.
// cos: [T, D] (both halves), sin: [T, D/2], of the compute type, already times the rope attention scale.
at::Tensor decode_layers(at::Tensor x, int64_t tokens, const std::vector<at::Tensor>& layers, at::Tensor k_cache,
                         at::Tensor v_cache, at::Tensor cos, at::Tensor sin, int64_t pos, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [B*T, hidden] fp32");
  TORCH_CHECK(tokens >= 1 && x.size(0) % tokens == 0, "x rows must be a multiple of the tokens per row");
  TORCH_CHECK(!layers.empty() && layers.size() % 7 == 0, "7 tensors per layer");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(pos + tokens <= k_cache.size(3) && x.size(0) / tokens <= k_cache.size(1),
              "positions or batch outside the KV cache");
  TORCH_CHECK(cos.size(0) == tokens && sin.size(0) == tokens, "one cos/sin row per token");
  TORCH_CHECK(k_cache.size(0) >= static_cast<int64_t>(layers.size() / 7), "the KV cache has too few layers");
  if (k_cache.scalar_type() == at::kFloat)
    decode_layers_impl<float>(x, tokens, layers, k_cache, v_cache, cos, sin, pos, num_heads, num_kv_heads, head_dim,
                              eps);
  else if (k_cache.scalar_type() == at::kBFloat16)
    decode_layers_impl<at::BFloat16>(x, tokens, layers, k_cache, v_cache, cos, sin, pos, num_heads, num_kv_heads, head_dim,
                                     eps);
  else
    TORCH_CHECK(false, "compute type must be fp32 or bf16");
  return x;
}

// RMSNorm of fp32 rows x [N, hidden] with an fp32 weight (F.rms_norm's math in one pass per row, rows split
// over the cores): the Python layers' norm for long chunks (prefill), where F.rms_norm runs ~10 ATen ops.
at::Tensor rms_norm_rows(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [N, hidden] fp32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "weight must be [hidden] fp32");
  const int64_t n = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm(xp + r * hidden, wp, op + r * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "a decode step through every decoder layer (CPU, fp32 / bf16)");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of fp32 rows (CPU)");
}
