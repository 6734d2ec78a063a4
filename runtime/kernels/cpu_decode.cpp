// One-token decode through every decoder layer in one call (CPU, fp32).
//
// Same math as runtime.model's layers for T == 1 with a contiguous KV cache: RMSNorm, fused q/k/v,
// rope (the flip-halves form of apply_rope, product for product), the cache write at `pos`, grouped-query
// attention over slots 0..pos, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down_proj, residual.
// The matrix-vector products stay ATen's (MKL GEMV, both cores); everything between them is a short
// loop here, so a layer costs 4 GEMVs plus a few microseconds instead of ~45 Python-dispatched ops.
// Reductions (norm, dot products, softmax sums) use 16 lane-wise partial sums: the order differs from
// ATen's, so results match the Python path to float rounding, not bit for bit ("same math").
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;

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

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// out = x * rsqrt(mean(x^2) + eps) * w, as F.rms_norm.
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// apply_rope for one head: x * cos + flip_halves(x) * (-sin, +sin).
void rope(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i + half] * -sin[i];
    out[i] = a + b;
  }
  for (int64_t i = half; i < d; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i - half] * sin[i - half];
    out[i] = a + b;
  }
}

// softmax(q . k_j * scale) . v_j over the first `len` cache slots of one kv head.
void attend_one(const float* q, const float* k, const float* v, float* out, int64_t len, int64_t d,
                float scale, std::vector<float>& scores) {
  scores.resize(len);
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
  for (int64_t i = 0; i < d; ++i) out[i] = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float p = scores[j] / denom;
    const float* vj = v + j * d;
    for (int64_t i = 0; i < d; ++i) out[i] += p * vj[i];
  }
}

// y [B, N] = x [B, K] @ W[N, K]^T (+ bias): GEMV per row for B == 1 (the faster kernel here), GEMM otherwise.
void linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y) {
  if (x.size(0) == 1) {
    auto row = x.view({-1});
    auto out = y.view({-1});
    if (bias.defined() && bias.numel() > 0)
      at::addmv_out(out, bias, w, row);
    else
      at::mv_out(out, w, row);
  } else if (bias.defined() && bias.numel() > 0) {
    at::addmm_out(y, bias, x, w.t());
  } else {
    at::mm_out(y, x, w.t());
  }
}

}  // namespace

// x: [B, hidden] fp32 residual stream of the new tokens (updated in place and returned).
// layers: 7 tensors per layer: input norm w, qkv w [q+2kv, hidden], qkv bias (empty if none), o w,
//   post norm w, gate_up w [2m, hidden], down w [hidden, m].
// k_cache, v_cache: [L, B_cache, Hkv, S, D] contiguous; the new k/v go to slot `pos` of rows 0..B-1.
// cos: [D] (both halves), sin: [D/2], both already multiplied by the rope attention scale.
at::Tensor decode_layers(at::Tensor x, const std::vector<at::Tensor>& layers, at::Tensor k_cache,
                         at::Tensor v_cache, at::Tensor cos, at::Tensor sin, int64_t pos, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [B, hidden] fp32");
  TORCH_CHECK(layers.size() % 7 == 0, "7 tensors per layer");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t B = x.size(0), hidden = x.size(1), L = static_cast<int64_t>(layers.size() / 7);
  const int64_t D = head_dim, Hq = num_heads, Hkv = num_kv_heads, group = Hq / Hkv;
  const int64_t q_size = Hq * D, kv_size = Hkv * D, S = k_cache.size(3), Bc = k_cache.size(1);
  TORCH_CHECK(pos < S && B <= Bc && k_cache.size(0) >= L, "position or batch outside the KV cache");
  const int64_t inter = layers[5].size(0) / 2;
  const float feps = static_cast<float>(eps), scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  auto opts = x.options();
  at::Tensor normed = at::empty({B, hidden}, opts), qkv = at::empty({B, q_size + 2 * kv_size}, opts);
  at::Tensor attn = at::empty({B, q_size}, opts), proj = at::empty({B, hidden}, opts);
  at::Tensor gate_up = at::empty({B, 2 * inter}, opts), act = at::empty({B, inter}, opts);
  float* xp = x.data_ptr<float>();
  const int64_t layer_stride = Bc * Hkv * S * D, row_stride = Hkv * S * D;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = &layers[7 * l];
    for (int64_t b = 0; b < B; ++b)
      rms_norm(xp + b * hidden, w[0].data_ptr<float>(), normed.data_ptr<float>() + b * hidden, hidden, feps);
    linear(normed, w[1], w[2], qkv);
    float* kc = k_cache.data_ptr<float>() + l * layer_stride;
    float* vc = v_cache.data_ptr<float>() + l * layer_stride;
    for (int64_t b = 0; b < B; ++b) {  // rope k and write k/v at `pos`
      const float* row = qkv.data_ptr<float>() + b * (q_size + 2 * kv_size);
      for (int64_t h = 0; h < Hkv; ++h) {
        float* k_slot = kc + b * row_stride + (h * S + pos) * D;
        rope(row + q_size + h * D, cos_p, sin_p, k_slot, D);
        std::copy(row + q_size + kv_size + h * D, row + q_size + kv_size + (h + 1) * D,
                  vc + b * row_stride + (h * S + pos) * D);
      }
    }
    const int64_t len = pos + 1;
    auto attend_range = [&](int64_t begin, int64_t end) {
      std::vector<float> scores, q_buf(D);
      for (int64_t i = begin; i < end; ++i) {  // i enumerates (row, query head)
        const int64_t b = i / Hq, h = i % Hq, kvh = h / group;
        const float* row = qkv.data_ptr<float>() + b * (q_size + 2 * kv_size);
        rope(row + h * D, cos_p, sin_p, q_buf.data(), D);
        const int64_t base = b * row_stride + kvh * S * D;
        attend_one(q_buf.data(), kc + base, vc + base, attn.data_ptr<float>() + b * q_size + h * D, len, D,
                   scale, scores);
      }
    };
    if (len * B >= 512)
      at::parallel_for(0, B * Hq, 1, attend_range);  // long contexts: split the heads over the cores
    else
      attend_range(0, B * Hq);
    linear(attn, w[3], at::Tensor(), proj);
    const float* pp = proj.data_ptr<float>();
    for (int64_t i = 0; i < B * hidden; ++i) xp[i] += pp[i];
    for (int64_t b = 0; b < B; ++b)
      rms_norm(xp + b * hidden, w[4].data_ptr<float>(), normed.data_ptr<float>() + b * hidden, hidden, feps);
    linear(normed, w[5], at::Tensor(), gate_up);
    for (int64_t b = 0; b < B; ++b) {
      const float* g = gate_up.data_ptr<float>() + b * 2 * inter;
      float* a = act.data_ptr<float>() + b * inter;
      for (int64_t i = 0; i < inter; ++i) a[i] = (g[i] / (1.0f + std::exp(-g[i]))) * g[inter + i];
    }
    linear(act, w[6], at::Tensor(), proj);
    for (int64_t i = 0; i < B * hidden; ++i) xp[i] += pp[i];
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "one-token decode through every decoder layer (CPU, fp32)");
}
