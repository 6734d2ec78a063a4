// qspec's CPU step: linear kernels for every weight format, and a whole decode / verification step through every
// decoder layer in one call (runtime/kernels/cpu_step.py builds it once per machine and documents the layouts).
//
// Linear kernels. y[m, n] = sum_k W[n, k] x[m, k] for M <= 64 rows of activations (tokens), multithreaded over
// output rows. Dense fp32 / bf16 weights are read in place, row-major [N, K] (the module's own tensor: no copy).
// Quantized weights live in tiles of 16 output rows stored column pair by column pair: pair j of a tile holds,
// for each of its 16 rows, the codes of input columns 2j and 2j + 1, so one load feeds both columns of 16 rows.
//   I8  int8 [tiles, K/2, 16, 2] = code - 128;                 zeros = z - 128
//   I4  uint8 [tiles, K/2, 16] = code(2j) | code(2j + 1) << 4 (2- and 3-bit codes too); zeros = z
//   FP8 uint8 [tiles, K/2, 16, 2] e4m3 bytes;                  scales = the fp32 scale * 256 (see the decoders)
//   scales, zeros: fp32 [tiles, groups, 16] (zeros int8 where they are integers: ZeroTable); a group is `group`
//   consecutive input columns (even, or all K) after act-order inputs are gathered by `perm`; K is padded with zero
//   codes to a multiple of 32.
// Per group the kernel accumulates a = sum_k code * x, then adds s * (a - z * sum_k x): the dequantized weight
// (code - z) * s times x, in fp32, in a fixed order: each output's sum runs over k in order whatever M, the
// batch or the thread split, so a row's result never depends on which other rows share the call.
//
// Shape invariance (the contract speculative decoding needs: greedy speculation equals plain greedy decoding token
// for token). A position's results are the same bits whether the step computes it alone (a 1-token decode step),
// as row j of a (k+1)-token chain, as a node of a tree, or beside other sequences of a batch, in every family and
// weight format: linear kernels never choose their kernel or sum order by row count (AMX's default policy included;
// only its opt-in "approximate" policy does, below); norms, rope and SiLU are per row; attention sums each query's softmax over its visible keys only, packed
// in key order (softmax_packed8/16), so neither the chunk length nor masked keys between a tree node's ancestors
// move a term; where the quantized attention cuts a long context into pieces, it cuts each query's own visible
// keys by their number, so a piece holds the same keys in every shape. tests/test_shape_invariance.py checks it bit
// for bit (tests/test_cpu_step_kv_quant.py over quantized caches, pieces included).
//
// Kernel families, chosen at run time (set_isa caps them for tests): AVX2 + FMA + F16C (the baseline this file is
// compiled for); AVX-512; AVX512-BF16 (vdpbf16ps for bf16 x bf16, and int4 codes as bf16 128 + code, exactly);
// AMX (Sapphire Rapids and later): tile matmuls for bf16-activation layers, dense weights loaded as the A operand
// straight from [N, K], quantized tiles expanded to bf16 (exactly) as the B operand; by default for dense bf16 layers
// at every row count (the row policy below: AMX sums in another order, so mixing it with the vector kernels by row
// count is not row-invariant).
// fp32 activations widen weights to fp32 and use FMA in every family.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace qspec {

enum Kind : int64_t { F32 = 0, BF16 = 1, I8 = 2, I4 = 3, FP8 = 4 };
enum Isa : int { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AVX512BF16 = 2, ISA_AMX = 3 };
constexpr int64_t NR = 16;  // output rows per quantized tile
constexpr int64_t MAX_M = 64;
constexpr int64_t KB = 32;  // input columns per AMX k-block (one bf16 tile row)
// Dense calls of this many rows or more prefetch each weight stream STREAM_AHEAD bytes ahead into L2: their dot
// products take long enough that the hardware prefetchers alone leave memory idle meanwhile (9 rows of the 1.5B's
// layers on the Zen 4: 108 -> 79 ms, near the vdpbf16ps peak); one row reads faster without (47 vs 60 ms).
constexpr int64_t STREAM_AHEAD_ROWS = 4, STREAM_AHEAD = 4096;

bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

bool amx_permitted() {  // Linux hands out the AMX tile state on request (arch_prctl XCOMP_PERM, XTILEDATA = 18)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

int cpu_isa() {
  static int level = [] {
    __builtin_cpu_init();
    int l = ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      l = ISA_AVX512;
    if (l == ISA_AVX512 && cpuid_bit(7, 1, 0, 5)) l = ISA_AVX512BF16;       // CPUID.(7,1):EAX[5] AVX512_BF16
    if (l == ISA_AVX512BF16 && cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) && amx_permitted())
      l = ISA_AMX;  // CPUID.(7,0):EDX[22] AMX-BF16, [24] AMX-TILE
    return l;
  }();
  return level;
}

int g_isa_cap = ISA_AMX;  // set_isa lowers it (tests run every kernel family on one machine)
int g_quant_quads = 1;  // set_quant_quads: int4 codes unpacked four pair columns a load (0: one pair column a load)
inline int isa() { return std::min(cpu_isa(), g_isa_cap); }

struct Weight {
  int64_t kind = F32, N = 0, K = 0, group = 0, ngroups = 1;
  bool bf16_act = false;
  bool int8_act = false;  // activations quantized per token to int8: integer dot products (i8act)
  bool codes_zeros = false;  // every zero point rounds to 0..15: int4 codes minus them fit signed bytes (amx8)
  at::Tensor data, scales, zeros, perm, bias;  // zeros: fp32, or int8 where every zero point is an integer

  int64_t tiles() const { return (N + NR - 1) / NR; }
  bool quantized() const { return kind == I8 || kind == I4 || kind == FP8; }
  int64_t pair_bytes() const { return kind == I4 ? NR : 2 * NR; }  // bytes of one column pair of a tile
  int64_t tile_bytes() const { return ((K + KB - 1) / KB * KB / 2) * pair_bytes(); }
  const uint8_t* tile(int64_t t) const { return reinterpret_cast<const uint8_t*>(data.data_ptr()) + t * tile_bytes(); }
};

// A weight's zero-point table as the kernels read it. Integer zero points (RTN, GPTQ, AWQ codes; FP8's 0) are kept
// as int8: a decode step streams the table beside the codes, and an int4 g64 tile group's fp32 zeros were 64 of its
// 640 bytes (int8: 16). Widened to fp32 on load, so a result is the same bits either way.
struct ZeroTable {
  const float* f = nullptr;
  const int8_t* i = nullptr;
  explicit ZeroTable(const Weight& w) {
    if (w.zeros.scalar_type() == at::kChar)
      i = w.zeros.data_ptr<int8_t>();
    else
      f = w.zeros.data_ptr<float>();
  }
  float operator[](int64_t at) const { return i ? static_cast<float>(i[at]) : f[at]; }
  __m256 load8(int64_t at) const {
    if (i) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(i + at))));
    return _mm256_loadu_ps(f + at);
  }
};

// AMX (tile matmuls) sums each output in another order than the vector kernels (per 32-column k-block, then across
// blocks), so a layer whose kernel depended on the row count would give a row other bits in a 1-row decode step
// than in a (k+1)-row verification: speculative greedy decoding would then drift from plain greedy decoding at
// near-ties. The row policy (set_amx, QSPEC_CPU_AMX) therefore never mixes the two by default:
//   exact        (default) AMX for every bf16-activation layer it fits at ANY row count, quantized ones too (their
//                codes expanded to bf16 tiles just ahead of the tile loads): row-invariant (one kernel per layer for
//                all M; tested on an AMX Xeon). A 1-row step costs what the vector kernels' does (within ~3 % on
//                the 1.5B, int4 / int8 / FP8; the 135M's int8 / FP8 ~8 % slower, in cache) and an 8-row
//                verification ~1.2-1.3x of it instead of 2.3-3x (notes/issue-39.md, thirty-second session)
//   dense        AMX for dense bf16 layers only, the vector kernels for quantized ones: row-invariant
//   off          no AMX: every family's vector kernels, row-invariant (the policy on CPUs without AMX)
//   approximate  AMX from AMX_MIN_ROWS rows, vdpbf16ps below (the fastest mix: vdpbf16ps reads memory faster
//                than the tile path when one row is all the work); a row's result is the same bits for any call
//                of 1..AMX_MIN_ROWS-1 rows and for any call of more, but between the two it can differ in the
//                last bits of fp32: APPROXIMATE for speculative decoding (greedy outputs can differ from plain)
// AMX takes a layer whose activations are bf16 and whose shapes fit whole tiles: dense weights with K a multiple
// of 32 and N of 16 (the A operand is loaded from the weight in place), quantized ones with groups of whole
// k-blocks (or one group per row).
constexpr int64_t AMX_MIN_ROWS = 3;
enum AmxMode : int { AMX_OFF = 0, AMX_EXACT = 1, AMX_APPROXIMATE = 2, AMX_DENSE = 3 };
int g_amx_mode = AMX_EXACT;
inline bool amx_rows(int level, int64_t M) {
  if (level < ISA_AMX || g_amx_mode == AMX_OFF) return false;
  return g_amx_mode != AMX_APPROXIMATE || M >= AMX_MIN_ROWS;
}
inline bool amx_dense(const Weight& w, int level, int64_t M) {
  return amx_rows(level, M) && w.kind == BF16 && w.K % KB == 0 && w.N % NR == 0;
}
inline bool amx_quant(const Weight& w, int level, int64_t M) {
  return g_amx_mode != AMX_DENSE && amx_rows(level, M) && w.quantized() && w.bf16_act &&
         (w.ngroups == 1 || w.group % KB == 0);
}

inline uint16_t bf16_bits(float v) {  // round to nearest even, as torch's float -> bfloat16 cast
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_value(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// The layer's input, prepared once per call: gathered (act-order), rounded to bf16 where the layer computes in
// bf16, zero-padded to 32 columns and (for AMX) 16 rows, with per-group sums for the zero points and, for AMX
// dense layers, the activations transposed into B tiles.
struct Acts {
  int64_t M = 0, Mp = 0, K = 0, Kp = 0;
  std::vector<float> x;        // [M, Kp]
  std::vector<uint16_t> xb;    // [Mp, Kp] bf16 (bf16 layers)
  std::vector<float> gsum;     // [M, ngroups] (quantized layers)
  std::vector<uint32_t> xt;    // [Mp / 16, Kp / 32, 16, 16]: x^T in AMX B layout (k pair, row m) (AMX dense)
};

// ---- conversions of whole activation blocks: vectorized, split over the cores --------------------------------------

// body(begin, end) over rows [0, rows) of `per_row` values each: on the calling thread for small blocks (a decode
// step's rows), split over the cores from 64 K values (a verification's or a prefill chunk's: these loops ran on
// one core while the other waited: a 40-row step of the 1.5B 272 -> 253 ms). A row's values never depend on the split.
template <typename F>
void over_rows(int64_t rows, int64_t per_row, const F& body) {
  if (rows * per_row < (int64_t{1} << 16) || at::in_parallel_region()) return body(0, rows);
  at::parallel_for(0, rows, 1, body);
}

// 8 fp32 -> 8 bf16 bit patterns, rounded to nearest even (the same bits as bf16_bits, or with TORCH_NAN as torch's
// cast, which makes every NaN 0x7fc0).
template <bool TORCH_NAN>
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = TORCH_NAN ? _mm256_set1_epi32(0x7fc0)
                                  : _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(r, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}
inline __m256 bf16_values8(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// One row of x rounded to bf16: bits to xb, their values to xv (fp32); n values.
inline void round_row_bf16(const float* x, int64_t n, uint16_t* xb, float* xv) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m128i bits = bf16_bits8<false>(_mm256_loadu_ps(x + k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xb + k), bits);
    _mm256_storeu_ps(xv + k, bf16_values8(bits));
  }
  for (; k < n; ++k) {
    xb[k] = bf16_bits(x[k]);
    xv[k] = bf16_value(xb[k]);
  }
}

// One row's group sums (the quantized kernels' zero-point term): each group's values 8 lanes at a time in k order
// (one chain of lane-wise adds), the lanes summed in a fixed tree, then the group's last len % 8 values in k order.
// Every call of any row count sums a row alike (a chain of single adds in k order was latency-bound: ~0.1 ms of a
// default-model decode step and ~0.2 ms of an 8-row verification's, on one core while the other waited). Row is
// fp32 or bf16 bits (widened exactly).
template <typename Row>
inline void group_sums(const Weight& w, const Row* row, float* out) {
  auto lanes8 = [&](int64_t k) {
    if constexpr (std::is_same_v<Row, uint16_t>)
      return bf16_values8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
    else
      return _mm256_loadu_ps(row + k);
  };
  auto value = [&](int64_t k) {
    if constexpr (std::is_same_v<Row, uint16_t>)
      return bf16_value(row[k]);
    else
      return row[k];
  };
  for (int64_t g = 0; g < w.ngroups; ++g) {
    const int64_t begin = g * w.group, end = std::min(w.K, (g + 1) * w.group);
    __m256 acc = _mm256_setzero_ps();
    int64_t k = begin;
    for (; k + 8 <= end; k += 8) acc = _mm256_add_ps(acc, lanes8(k));
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float sum = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
    for (; k < end; ++k) sum += value(k);
    out[g] = sum;
  }
}

// One activation row as the kernels read it: its K values (in the act-order permutation's order where the layer has
// one), then zeros up to Kp.
template <typename V>
inline void padded_row(const V* src, int64_t K, int64_t Kp, const int64_t* perm, V* dst) {
  if (perm)
    for (int64_t k = 0; k < K; ++k) dst[k] = src[perm[k]];
  else
    std::memcpy(dst, src, K * sizeof(V));
  std::fill(dst + K, dst + Kp, V{0});
}

// The activation block's shape for M rows of w's input: Mp rows for the tiles, Kp columns (vector loops over whole
// chunks: padded columns are zero in x and in the codes).
inline void act_shape(const Weight& w, int64_t M, Acts& a) {
  a.M = M;
  a.Mp = (M + 15) / 16 * 16;
  a.K = w.K;
  a.Kp = (w.K + KB - 1) / KB * KB;
}

void prepare(const Weight& w, const float* x, int64_t M, int64_t ldx, Acts& a, int level) {
  act_shape(w, M, a);
  const int64_t K = w.K, Kp = a.Kp;
  a.x.resize(M * Kp);
  if (w.bf16_act) a.xb.resize(a.Mp * Kp);
  const int64_t* perm = w.perm.defined() ? w.perm.data_ptr<int64_t>() : nullptr;
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* dst = a.x.data() + m * Kp;
      padded_row(x + m * ldx, K, Kp, perm, dst);
      if (w.bf16_act) {
        uint16_t* xb = a.xb.data() + m * Kp;
        round_row_bf16(dst, K, xb, dst);
        std::fill(xb + K, xb + Kp, uint16_t{0});
      }
    }
  });
  if (w.bf16_act) std::fill(a.xb.begin() + M * Kp, a.xb.end(), uint16_t{0});  // rows M..Mp: zero
  if (w.quantized()) {
    a.gsum.resize(M * w.ngroups);
    over_rows(M, K, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) group_sums(w, a.x.data() + m * Kp, a.gsum.data() + m * w.ngroups);
    });
  }
  if (amx_dense(w, level, M)) {  // xt[chunk c, block b, pair row r, m % 16] = pair b * 16 + r of row c * 16 + m % 16
    const int64_t kblocks = Kp / KB, pairs = Kp / 2;
    a.xt.resize(a.Mp * pairs);
    const int32_t* src = reinterpret_cast<const int32_t*>(a.xb.data());
    const __m256i lo = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(pairs));
    const __m256i hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8 * pairs));
    over_rows(a.Mp / 16 * kblocks, 16 * KB, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {  // (chunk, block) pairs: a gather of 8 rows' pair per half of each tile row
        const int32_t* base = src + (i / kblocks) * 16 * pairs + (i % kblocks) * 16;
        uint32_t* out = a.xt.data() + i * 256;
        for (int64_t r = 0; r < 16; ++r) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * 16), _mm256_i32gather_epi32(base + r, lo, 4));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * 16 + 8), _mm256_i32gather_epi32(base + r, hi, 4));
        }
      }
    });
  }
}

// prepare's work for a layer on AMX quantized tiles whose rows arrive as bf16 bits (the step's activations): the
// tiles' rows are those bits (prepare's rounding leaves a bf16 value as it is) and group_sums adds the same fp32
// values, so the same bits, without the fp32 copies (a widened row, then prepare's padded copy, then its rounding:
// serial passes over a verification's rows while the other core waited).
void prepare_bf16(const Weight& w, const uint16_t* x, int64_t M, Acts& a) {
  act_shape(w, M, a);
  const int64_t K = w.K, Kp = a.Kp;
  a.xb.resize(a.Mp * Kp);
  const int64_t* perm = w.perm.defined() ? w.perm.data_ptr<int64_t>() : nullptr;
  for (int64_t m = 0; m < M; ++m) padded_row(x + m * K, K, Kp, perm, a.xb.data() + m * Kp);
  std::fill(a.xb.begin() + M * Kp, a.xb.end(), uint16_t{0});
  a.gsum.resize(M * w.ngroups);
  for (int64_t m = 0; m < M; ++m) group_sums(w, a.xb.data() + m * Kp, a.gsum.data() + m * w.ngroups);
}

// ---- AVX2 + FMA + F16C (the baseline this file is compiled for) -----------------------------------------

namespace avx2 {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> 8 fp32
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Dense row-major weights: RB rows x MB activation rows of 8-lane partial sums, reduced at the end.
template <int RB, int MB, bool BF>
void dense_block(const Weight& w, const Acts& a, int64_t n0, int64_t rs, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.K, Kp = a.Kp;
  const float* ax = a.x.data();
  const float* wf = BF ? nullptr : w.data.data_ptr<float>();
  const uint16_t* wb = BF ? reinterpret_cast<const uint16_t*>(w.data.data_ptr<at::BFloat16>()) : nullptr;
  __m256 acc[RB][MB];
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const bool tail = k + 8 > K;
    __m256 wv[RB];
    _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) {
      if (tail) {  // the last columns: widen through a zero-padded copy
        alignas(32) float buf[8] = {0};
        for (int64_t j = k; j < K; ++j) buf[j - k] = BF ? bf16_value(wb[(n0 + r * rs) * K + j]) : wf[(n0 + r * rs) * K + j];
        wv[r] = _mm256_load_ps(buf);
      } else {
        wv[r] = BF ? bf16x8(wb + (n0 + r * rs) * K + k) : _mm256_loadu_ps(wf + (n0 + r * rs) * K + k);
      }
    }
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(ax + (m0 + i) * Kp + k);  // zero past K
      _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) y[(m0 + i) * ldy + n0 + r * rs] = hsum(acc[r][i]);
}

// Columns 2j and 2j + 1 of 8 rows (half a tile) widened to fp32.
template <int64_t KIND>
inline void pair8(const uint8_t* tile, int64_t j, int half, __m256& lo, __m256& hi) {
  if (KIND == I4) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + j * NR + 8 * half)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else {
    // 16 bytes: row r's (col 2j, col 2j+1) at bytes 2r, 2r+1 -> 8 dwords, low word = col 2j, high word = 2j+1
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * 2 * NR + 16 * half));
    if (KIND == I8) {  // bytes to [col 2j of rows 0-7, col 2j+1 of rows 0-7], each half sign-extended (no shifts:
      // this core runs vector shifts at half the rate of shuffles, and three a pair bounded a decode step)
      const __m128i split = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
      lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(split));
      hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(split, split)));
    } else {  // FP8 e4m3 -> fp16 bits (exponent bias 15 vs 7: the value / 256) -> fp32
      __m256i v = _mm256_cvtepu8_epi16(b);
      __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7),
                                  _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8));
      __m256i lo_d = _mm256_and_si256(h, _mm256_set1_epi32(0xffff)), hi_d = _mm256_srli_epi32(h, 16);
      // pack the dwords' low words: per 128-bit lane [lo0..3, hi0..3], then gather the lo / hi quarters
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo_d, hi_d), 0xd8);
      lo = _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
      hi = _mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1));
    }
  }
}

// UB units of half a tile (8 rows) from unit0 (unit u: tile u / 2, rows 8 (u % 2) ..) x MB activation rows:
// independent accumulator chains for the UB x MB outputs, each column pair read once for all of them; each
// output's sum still runs over k in the same order, so the blocking never changes a result.
template <int64_t KIND, int TB, int MB>
void quant_block(const Weight& w, const Acts& a, int64_t unit0, int64_t m0, float* y, int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups;
  const float* ax = a.x.data();
  const float* gs = a.gsum.data();
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  int64_t tile[TB];
  int half[TB];
  const uint8_t* codes[TB];
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
    tile[t] = (unit0 + t) / 2;
    half[t] = static_cast<int>((unit0 + t) % 2);
    codes[t] = w.tile(tile[t]);
  }
  __m256 tot[TB][MB];
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) tot[t][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // even and odd columns in separate accumulators: two independent FMA chains per output instead of one chain
    // of dependent pairs (AVX2's FMA latency, not its throughput, bounded a decode step)
    __m256 even[TB][MB], odd[TB][MB];
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) even[t][i] = odd[t][i] = _mm256_setzero_ps();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    for (int64_t j = kb / 2; j < (ke + 1) / 2; ++j) {
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        __m256 lo, hi;
        pair8<KIND>(codes[t], j, half[t], lo, hi);
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
          even[t][i] = _mm256_fmadd_ps(lo, _mm256_set1_ps(ax[(m0 + i) * Kp + 2 * j]), even[t][i]);
          odd[t][i] = _mm256_fmadd_ps(hi, _mm256_set1_ps(ax[(m0 + i) * Kp + 2 * j + 1]), odd[t][i]);
        }
      }
    }
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
      const int64_t at = (tile[t] * G + g) * NR + 8 * half[t];
      const __m256 s = _mm256_loadu_ps(sc + at), z = zc.load8(at);
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const __m256 corr = _mm256_mul_ps(z, _mm256_set1_ps(gs[(m0 + i) * G + g]));
        const __m256 acc = _mm256_add_ps(even[t][i], odd[t][i]);
        tot[t][i] = _mm256_fmadd_ps(s, _mm256_sub_ps(acc, corr), tot[t][i]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
    const int64_t n0 = tile[t] * NR + 8 * half[t], rows = std::min<int64_t>(8, w.N - n0);
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
      alignas(32) float out[8];
      _mm256_store_ps(out, tot[t][i]);
      if (rows > 0) std::memcpy(y + (m0 + i) * ldy + n0, out, rows * sizeof(float));
    }
  }
}

}  // namespace avx2

// ---- AVX-512 (F, BW, VL, DQ) ---------------------------------------------------------------------------------

// The TB tiles an AVX-512 quantized block reads, tile0, tile0 + ts, ... (run_quant's streams): each one's index (its
// scales, zeros and outputs) and its codes.
template <int TB>
struct Tiles {
  int64_t index[TB];
  const uint8_t* codes[TB];
  Tiles(const Weight& w, int64_t tile_bytes, int64_t tile0, int64_t ts) {
    const uint8_t* data = reinterpret_cast<const uint8_t*>(w.data.data_ptr());
    for (int t = 0; t < TB; ++t) {
      index[t] = tile0 + t * ts;
      codes[t] = data + index[t] * tile_bytes;
    }
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
inline __m512 load16(const ZeroTable& z, int64_t at) {
  if (z.i) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z.i + at))));
  return _mm512_loadu_ps(z.f + at);
}
namespace avx512 {

template <int RB, int MB, bool BF>
void dense_block(const Weight& w, const Acts& a, int64_t n0, int64_t rs, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.K, Kp = a.Kp;
  const float* ax = a.x.data();
  const float* wf = BF ? nullptr : w.data.data_ptr<float>();
  const uint16_t* wb = BF ? reinterpret_cast<const uint16_t*>(w.data.data_ptr<at::BFloat16>()) : nullptr;
  __m512 acc[RB][MB];
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t row_bytes = K * (BF ? 2 : 4);
  const char* next = (BF ? reinterpret_cast<const char*>(wb) : reinterpret_cast<const char*>(wf)) + (n0 + RB) * row_bytes;
  const bool far = m0 == 0 && rs > 1 && a.M >= STREAM_AHEAD_ROWS;
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    if (m0 == 0 && rs == 1)  // the next rows' same columns: their lines are in flight while these compute
      _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
        _mm_prefetch(next + r * row_bytes + k * (BF ? 2 : 4), _MM_HINT_T0);
    if (far)  // each stream 4 KB ahead, into L2
      _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
        _mm_prefetch(next + (r * rs - RB) * row_bytes + k * (BF ? 2 : 4) + STREAM_AHEAD, _MM_HINT_T1);
    __m512 wv[RB];
    _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) {
      if (BF) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, wb + (n0 + r * rs) * K + k));
        wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
      } else {
        wv[r] = _mm512_maskz_loadu_ps(mask, wf + (n0 + r * rs) * K + k);
      }
    }
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(ax + (m0 + i) * Kp + k);  // zero past K
      _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) y[(m0 + i) * ldy + n0 + r * rs] = _mm512_reduce_add_ps(acc[r][i]);
}

// The lanes of tile `tile`'s 16 outputs that lie inside N.
inline __mmask16 tile_mask(int64_t N, int64_t tile) {
  const int64_t cols = std::min<int64_t>(NR, N - tile * NR);
  return cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
}

inline void store_tile(const __m512 tot, int64_t N, int64_t tile, float* row) {
  _mm512_mask_storeu_ps(row + tile * NR, tile_mask(N, tile), tot);
}

// bf16_bits8<true> on 16 lanes in one register: each dword's low half the bf16 bit pattern of its lane (round to
// nearest even, every NaN torch's 0x7fc0), the high half zero.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// 16 lanes rounded to bf16 and widened back (bf16_values8(bf16_bits8<true>(.)) lane by lane: torch's cast there and
// back).
inline __m512 bf16_values16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

// A tile row's 16 sums as bf16 bit patterns, rounded as bf16_bits8<true> rounds (torch's cast): a layer writing its
// bf16 outputs here gives what converting its fp32 outputs would. (One 16-lane rounding, where two 8-lane ones and
// their packing cost ~2.5x the instructions: every row of every tile of an 8-row step's layers comes here.)
inline void store_tile_bf16(const __m512 tot, int64_t N, int64_t tile, uint16_t* row) {
  _mm256_mask_storeu_epi16(row + tile * NR, tile_mask(N, tile), _mm512_cvtepi32_epi16(bf16_bits16(tot)));
}

// A tile's 16 bias values (zero past N).
inline __m512 bias16(const float* bias, int64_t N, int64_t tile) {
  return _mm512_maskz_loadu_ps(tile_mask(N, tile), bias + tile * NR);
}

// Columns 2j and 2j + 1 of a tile's 16 rows widened to fp32.
template <int64_t KIND>
inline void pair16(const uint8_t* tile, int64_t j, __m512& lo, __m512& hi) {
  if (KIND == I4) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * NR)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 2 * NR));
    if (KIND == I8) {
      __m512i d = _mm512_cvtepi8_epi16(b);
      lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16));
      hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16));
    } else {
      __m512i v = _mm512_cvtepu8_epi16(b);
      __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7f)), 7),
                                  _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
      lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));                          // low words: col 2j
      hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));  // high words: col 2j + 1
    }
  }
}

template <int64_t KIND, int TB, int MB>
void quant_block(const Weight& w, const Acts& a, int64_t tile0, int64_t ts, int64_t m0, float* y, int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups;
  const float* ax = a.x.data();
  const float* gs = a.gsum.data();
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  const int64_t tile_bytes = (Kp / 2) * w.pair_bytes();
  const Tiles<TB> tiles(w, tile_bytes, tile0, ts);
  __m512 tot[TB][MB];
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) tot[t][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[TB][MB];
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[t][i] = _mm512_setzero_ps();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    for (int64_t j = kb / 2; j < (ke + 1) / 2; ++j) {
      __m512 x0[MB], x1[MB];
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        x0[i] = _mm512_set1_ps(ax[(m0 + i) * Kp + 2 * j]);
        x1[i] = _mm512_set1_ps(ax[(m0 + i) * Kp + 2 * j + 1]);
      }
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        __m512 lo, hi;
        pair16<KIND>(tiles.codes[t], j, lo, hi);
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
          acc[t][i] = _mm512_fmadd_ps(lo, x0[i], acc[t][i]);
          acc[t][i] = _mm512_fmadd_ps(hi, x1[i], acc[t][i]);
        }
      }
    }
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
      const int64_t at = (tiles.index[t] * G + g) * NR;
      const __m512 s = _mm512_loadu_ps(sc + at), z = load16(zc, at);
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const __m512 corr = _mm512_mul_ps(z, _mm512_set1_ps(gs[(m0 + i) * G + g]));
        tot[t][i] = _mm512_fmadd_ps(s, _mm512_sub_ps(acc[t][i], corr), tot[t][i]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
      store_tile(tot[t][i], w.N, tiles.index[t], y + (m0 + i) * ldy);
}

}  // namespace avx512
#pragma GCC pop_options

// ---- AVX512-BF16 -------------------------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace avx512bf16 {

// Dense bf16 weights x bf16 activations: 32 weights (16 column pairs) per vdpbf16ps.
enum Prefetch : int { PREFETCH_NONE = 0, PREFETCH_NEXT_ROWS = 1, PREFETCH_STREAMS = 2 };

// One k step of a block: RB weight rows' 32 columns at k (masked: the last, partial chunk) against MB activation
// rows, with the block's prefetches.
template <int RB, int MB, int PF, bool MASKED>
inline void dense_step(__m512 (&acc)[RB][MB], const uint16_t* const (&wr)[RB], const uint16_t* xr, int64_t Kp,
                       const char* next, int64_t row_bytes, int64_t k, __mmask32 mask) {
  if (PF == PREFETCH_NEXT_ROWS)  // the next rows' same columns: their lines are in flight while these compute
    _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) _mm_prefetch(next + r * row_bytes + k * 2, _MM_HINT_T0);
  if (PF == PREFETCH_STREAMS)  // each stream 4 KB ahead, into L2
    _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + k) + STREAM_AHEAD, _MM_HINT_T1);
  __m512i wv[RB];
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    wv[r] = MASKED ? _mm512_maskz_loadu_epi16(mask, wr[r] + k) : _mm512_loadu_si512(wr[r] + k);
  _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
    const __m512i xv = _mm512_loadu_si512(xr + i * Kp + k);  // zero past K
    _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
      acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)wv[r], (__m512bh)xv);
  }
}

// The prefetch choice is a template argument and the partial chunk a step of its own, so the k loop holds no
// branch and no mask arithmetic: with both in every step GCC spilled an activation vector and the flags to the
// stack, and a 9-row block ran at ~70 % of the vdpbf16ps peak in cache (Zen 4; 80 % now, the same bits).
template <int RB, int MB, int PF>
void dense_sums(const Weight& w, const Acts& a, int64_t n0, int64_t rs, int64_t m0, float* y, int64_t ldy) {
  const int64_t K = w.K, Kp = a.Kp, row_bytes = K * 2, full = K / 32 * 32;
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.data.data_ptr<at::BFloat16>());
  const uint16_t* xr = a.xb.data() + m0 * Kp;
  const char* next = reinterpret_cast<const char*>(wb + (n0 + RB) * K);
  const uint16_t* wr[RB];
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r) wr[r] = wb + (n0 + r * rs) * K;
  __m512 acc[RB][MB];
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += 32) dense_step<RB, MB, PF, false>(acc, wr, xr, Kp, next, row_bytes, k, 0);
  if (full < K)
    dense_step<RB, MB, PF, true>(acc, wr, xr, Kp, next, row_bytes, full, (1u << (K - full)) - 1);
  _Pragma("GCC unroll 16") for (int r = 0; r < RB; ++r)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) y[(m0 + i) * ldy + n0 + r * rs] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int RB, int MB>
void dense_block(const Weight& w, const Acts& a, int64_t n0, int64_t rs, int64_t m0, float* y, int64_t ldy) {
  if (m0 == 0 && rs == 1) return dense_sums<RB, MB, PREFETCH_NEXT_ROWS>(w, a, n0, rs, m0, y, ldy);
  if (m0 == 0 && rs > 1 && a.M >= STREAM_AHEAD_ROWS) return dense_sums<RB, MB, PREFETCH_STREAMS>(w, a, n0, rs, m0, y, ldy);
  dense_sums<RB, MB, PREFETCH_NONE>(w, a, n0, rs, m0, y, ldy);
}

// A pair column's codes as 32 bf16 words in vdpbf16ps / AMX B-row order (word 2r = row r's column 2j, word 2r+1
// its column 2j+1), exactly: int4 as 128 + code (0x4300 | code is the bf16 of 128 + code; the caller subtracts
// 128 * sum x with the zero point), int8 through fp32, e4m3 as fp16 bits (the value / 256) through fp32.
template <int64_t KIND>
inline __m512i pair_bf16(const uint8_t* tile, int64_t j) {
  if (KIND == I4) {  // byte = c0 | c1 << 4: (v | v << 12) & 0x000f000f puts c0, c1 in the two words
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * NR)));
    const __m512i words =
        _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000f000f), 0xA8);  // (A|B)&C
    return _mm512_or_si512(words, _mm512_set1_epi32(0x43004300));
  }
  __m512 lo, hi;  // words 0..15 and 16..31 as fp32
  if (KIND == I8) {  // each half of the pair column's 32 bytes sign-extended straight to dwords
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * 2 * NR))));
    hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * 2 * NR + NR))));
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 2 * NR));
    const __m512i v = _mm512_cvtepu8_epi16(b);
    const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7f)), 7),
                                      _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [lo (words 0..15), hi (words 16..31)]
}

// Four pair columns of int4 codes (64 bytes: pair j + l in 128-bit lane l, row r in byte r) as the four code word
// vectors pair_bf16<I4> gives for j .. j + 3, from one load: a dword transpose puts rows 4l .. 4l + 3 of the four
// pairs in lane l, and two rounds of in-lane byte unpacking (low nibbles with high, then with the byte 0x43) widen
// each byte to its two words. The same words, so the same sums, with 10 instructions for 64 bytes instead of 16.
inline void quad_bf16_i4(const uint8_t* codes, __m512i (&words)[4]) {
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i v = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(codes));
  const __m512i nibble = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(0x43);
  const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  const __m512i rows03 = _mm512_unpacklo_epi8(lo, hi), rows47 = _mm512_unpackhi_epi8(lo, hi);
  words[0] = _mm512_unpacklo_epi8(rows03, high);
  words[1] = _mm512_unpackhi_epi8(rows03, high);
  words[2] = _mm512_unpacklo_epi8(rows47, high);
  words[3] = _mm512_unpackhi_epi8(rows47, high);
}

// Quantized tiles x bf16 activations with vdpbf16ps (the code words above); offset 128 for int4.
template <int64_t KIND, int TB, int MB>
void quant_block(const Weight& w, const Acts& a, int64_t tile0, int64_t ts, int64_t m0, float* y, int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(a.xb.data());
  const float* gs = a.gsum.data();
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  const int64_t tile_bytes = (Kp / 2) * w.pair_bytes();
  const Tiles<TB> tiles(w, tile_bytes, tile0, ts);
  const __m512 offset = _mm512_set1_ps(KIND == I4 ? 128.0f : 0.0f);
  __m512 tot[TB][MB];
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) tot[t][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[TB][MB];
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[t][i] = _mm512_setzero_ps();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K), je = (ke + 1) / 2;
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {  // this tile's scales and zeros two groups ahead
      const int64_t ahead = (tiles.index[t] * G + g + 2) * NR;
      _mm_prefetch(reinterpret_cast<const char*>(sc + ahead), _MM_HINT_T0);
      _mm_prefetch(zc.i ? reinterpret_cast<const char*>(zc.i + ahead) : reinterpret_cast<const char*>(zc.f + ahead),
                   _MM_HINT_T0);
    }
    int64_t j = kb / 2;
    if (KIND == I4 && g_quant_quads)
      for (; j + 4 <= je; j += 4) {
        _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)  // as below
          _mm_prefetch(reinterpret_cast<const char*>(tiles.codes[t] + j * NR) + STREAM_AHEAD, _MM_HINT_T1);
        _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
          __m512i words[4];
          quad_bf16_i4(tiles.codes[t] + j * NR, words);
          _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)
            _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[t][i] = _mm512_dpbf16_ps(
                acc[t][i], (__m512bh)words[q],
                (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[(m0 + i) * (Kp / 2) + j + q])));
        }
      }
    for (; j < je; ++j) {
      __m512i xp[MB];
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
        xp[i] = _mm512_set1_epi32(static_cast<int>(pairs[(m0 + i) * (Kp / 2) + j]));
      if ((j & (KIND == I4 ? 3 : 1)) == 0)  // each line of each stream, 4 KB ahead into L2 (as the dense blocks)
        _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) _mm_prefetch(
            reinterpret_cast<const char*>(tiles.codes[t] + j * w.pair_bytes()) + STREAM_AHEAD, _MM_HINT_T1);
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        const __m512i wv = pair_bf16<KIND>(tiles.codes[t], j);
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
          acc[t][i] = _mm512_dpbf16_ps(acc[t][i], (__m512bh)wv, (__m512bh)xp[i]);
      }
    }
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
      const int64_t at = (tiles.index[t] * G + g) * NR;
      const __m512 s = _mm512_loadu_ps(sc + at), z = _mm512_add_ps(load16(zc, at), offset);
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const __m512 corr = _mm512_mul_ps(z, _mm512_set1_ps(gs[(m0 + i) * G + g]));
        tot[t][i] = _mm512_fmadd_ps(s, _mm512_sub_ps(acc[t][i], corr), tot[t][i]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
      avx512::store_tile(tot[t][i], w.N, tiles.index[t], y + (m0 + i) * ldy);
}

}  // namespace avx512bf16
#pragma GCC pop_options

// ---- AMX (tile matmuls) ----------------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace amx {

// r[i] lane j -> r[j] lane i (a 16 x 16 fp32 transpose: unpacks within quarters, then quarters moved).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // t[2i] quarter L: r[2i], r[2i+1] lanes 4L, 4L + 1 interleaved; t[2i+1]: 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j] quarter L: lane 4L + j of rows 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int j = 0; j < 4; ++j) {  // lane 4L + j: quarter L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Every tile 64 bytes wide; dense and quant use all 8. The first `act_tiles` tiles hold activation rows (quant's
// accumulators 0..3 and its activations 4) and get `act_rows` rows: a decode step's 1-row call then
// loads one activation row, not 16, and the tile matmul runs 1 row (each row's sums are the same bits: a row's
// products never meet another row's). Loaded at the start of each thread's chunk (another library may have
// configured the tiles since) and released at its end.
struct Tiles {
  explicit Tiles(int act_tiles = 0, int act_rows = 16) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = t < act_tiles ? act_rows : 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { _tile_release(); }
};

// Dense bf16: C [16 weight rows n, 16 activation rows m] += W [16 n, 32 k] (loaded from [N, K] in place) . x^T [16 k
// pairs, 16 m] (prepared). Two weight blocks by two chunks of 16 activation rows per pass (accumulators 0..3,
// operands 4..7): each tile load feeds two matmuls, where one chunk a pass re-read every weight block from L2 for
// each chunk (a 40-row verification of the 1.5B: gate_up 2.3x its 16-row cost). An odd last chunk (or block) takes
// a pass of its own. Up to 16 rows (one chunk: decode steps, verifications, the head) a pass's sums wait in their
// accumulators' buffer and go out after the next pass's first two weight blocks are on their way (accumulators 0, 1
// and 2, 3 in turn): written straight after their own pass, the outputs (a transpose and a rounding per row) held
// back the next pass's weight stream, and the head's 8-row call cost ~0.3 ms more than its 1-row one. Each output's
// sum is the same sequence of matmuls over k blocks in every blocking.
void dense(const Weight& w, const Acts& a, int64_t nb0, int64_t nb1, float* y, int64_t ldy, bool bf16_values = false) {
  Tiles tiles;
  const int64_t K = w.K, kblocks = a.Kp / KB, mchunks = a.Mp / 16;
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.data.data_ptr<at::BFloat16>());
  const uint32_t* xt = a.xt.data();
  alignas(64) float c[2][2][16][16];  // [accumulator pair][block]: a pass's sums
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  auto scatter = [&](int64_t nb, int64_t mc, const float (*sums)[16]) {  // sums [16 n, 16 m] -> y rows of chunk mc
    const int64_t rows = std::min<int64_t>(16, a.M - mc * 16);
    __m512 col[16];  // col[m]: row m's 16 outputs (a transpose: a row read down the columns of c took 16 loads)
    if (rows > 1) {
      for (int i = 0; i < 16; ++i) col[i] = _mm512_load_ps(sums[i]);
      transpose16(col);
    }
    for (int64_t m = 0; m < rows; ++m) {  // bf16_values: rounded to bf16 (torch's cast: linear_bf16_values)
      const __m512 v = rows > 1 ? col[m] : _mm512_i32gather_ps(column, &sums[0][m], 4);
      _mm512_storeu_ps(y + (mc * 16 + m) * ldy + nb * NR, bf16_values ? avx512::bf16_values16(v) : v);
    }
  };
  auto prefetch_pair = [&](const uint16_t* w0, int64_t kb) {  // a pair of weight blocks, one line per row
    for (int64_t r = 0; r < 2 * NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + kb * KB), _MM_HINT_T0);
  };
  if (mchunks == 1) {
    int64_t held = -1;  // the pass whose sums wait in c[1 - pair]
    bool held_two = false;
    auto flush = [&](int pair) {
      scatter(held, 0, c[pair][0]);
      if (held_two) scatter(held + 1, 0, c[pair][1]);
      held = -1;
    };
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      const bool two = nb + 1 < nb1;
      const int pair = static_cast<int>((nb - nb0) / 2 % 2);
      const uint16_t* w0 = wb + nb * NR * K;
      if (pair == 0) {
        _tile_zero(0);
        _tile_zero(1);
      } else {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        if (nb + 2 < nb1) prefetch_pair(w0 + 2 * NR * K, kb);
        _tile_loadd(6, xt + kb * 256, 64);
        _tile_loadd(4, w0 + kb * KB, K * 2);
        if (two) _tile_loadd(5, w0 + NR * K + kb * KB, K * 2);
        if (pair == 0) {
          _tile_dpbf16ps(0, 4, 6);
          if (two) _tile_dpbf16ps(1, 5, 6);
        } else {
          _tile_dpbf16ps(2, 4, 6);
          if (two) _tile_dpbf16ps(3, 5, 6);
        }
        if (kb == 1 && held >= 0) flush(1 - pair);
      }
      if (held >= 0) flush(1 - pair);  // (a pass of one k block)
      if (pair == 0) {
        _tile_stored(0, c[0][0], 64);
        if (two) _tile_stored(1, c[0][1], 64);
      } else {
        _tile_stored(2, c[1][0], 64);
        if (two) _tile_stored(3, c[1][1], 64);
      }
      held = nb;
      held_two = two;
    }
    if (held >= 0) flush(static_cast<int>((held - nb0) / 2 % 2));
    return;
  }
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    const uint16_t* w0 = wb + nb * NR * K;
    const uint16_t* w1 = w0 + NR * K;
    int64_t mc = 0;
    for (; two && mc + 2 <= mchunks; mc += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        if (mc == 0 && nb + 2 < nb1) prefetch_pair(w0 + 2 * NR * K, kb);  // the next pass's, while these compute
        _tile_loadd(4, w0 + kb * KB, K * 2);
        _tile_loadd(5, w1 + kb * KB, K * 2);
        _tile_loadd(6, xt + (mc * kblocks + kb) * 256, 64);
        _tile_loadd(7, xt + ((mc + 1) * kblocks + kb) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c[0][0], 64);
      scatter(nb, mc, c[0][0]);
      _tile_stored(1, c[0][0], 64);
      scatter(nb + 1, mc, c[0][0]);
      _tile_stored(2, c[0][0], 64);
      scatter(nb, mc + 1, c[0][0]);
      _tile_stored(3, c[0][0], 64);
      scatter(nb + 1, mc + 1, c[0][0]);
    }
    for (; mc < mchunks; ++mc) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        if (mc == 0 && nb + 2 < nb1) prefetch_pair(w0 + 2 * NR * K, kb);  // the next pass's, while these compute
        _tile_loadd(4, xt + (mc * kblocks + kb) * 256, 64);
        _tile_loadd(2, w0 + kb * KB, K * 2);
        _tile_dpbf16ps(0, 2, 4);
        if (two) {
          _tile_loadd(3, w1 + kb * KB, K * 2);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
      _tile_stored(0, c[0][0], 64);
      scatter(nb, mc, c[0][0]);
      if (two) {
        _tile_stored(1, c[0][0], 64);
        scatter(nb + 1, mc, c[0][0]);
      }
    }
  }
}

// Quantized: C [16 m, 16 n] += x [16 m, 32 k] (tile 4, from the bf16 activations) . codes [16 k pairs, 16 n]
// (tiles 5..7 in turn: 16 pair columns expanded to bf16 words), per group, then s * (C - (offset + z) * sum x) per
// group; up to PASS tiles per pass (accumulators 0..3), each pass's tiles from PASS segments of the core's range read
// side by side, so each is a stream running through contiguous tiles (as run_quant's spans) rather than a pair of
// adjacent tiles whose stream ends after one tile. Expansion runs AHEAD blocks in front of the tile loads (a ring of
// buffers): a tile load of freshly stored data waits for the stores to reach the cache, so the stores for block
// k + AHEAD overlap the matmuls of block k. A tile's sums are the same in any pass or order.
template <int64_t KIND, int PASS, int MAXR>
void quant_rows(const Weight& w, const Acts& a, int64_t t0, int64_t t1, float* y, int64_t ldy, uint16_t* yb,
                const float* bias) {
  constexpr int AHEAD = 3;
  const int chunk_rows = static_cast<int>(std::min<int64_t>(16, a.M));  // a call of <16 rows: one chunk of M rows
  Tiles tiles(5, chunk_rows);
  const int64_t Kp = a.Kp, G = w.ngroups, mchunks = a.Mp / 16, blocks = Kp / KB;
  const int64_t group_blocks = G == 1 ? blocks : w.group / KB;
  const int64_t tile_bytes = (Kp / 2) * w.pair_bytes(), block_bytes = 16 * w.pair_bytes();
  const uint8_t* data = reinterpret_cast<const uint8_t*>(w.data.data_ptr());
  const uint16_t* xb = a.xb.data();
  const float* gs = a.gsum.data();
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  const __m512 offset = _mm512_set1_ps(KIND == I4 ? 128.0f : 0.0f);
  alignas(64) __m512i ring[AHEAD + 1][PASS][16];
  alignas(64) float c[PASS][16][16];
  __m512 tot[PASS][MAXR];  // the row totals: in registers up to 16 of them (quant's choices), else spilled
  const int64_t seg = (t1 - t0) / PASS, rest = t0 + PASS * seg;  // rest .. t1: fewer than PASS tiles, one pass
  for (int64_t pass = 0; pass < seg + (rest < t1 ? 1 : 0); ++pass) {
    int64_t idx[PASS];  // this pass's tiles
    int nt = 0;
    if (pass < seg)
      for (int u = 0; u < PASS; ++u) idx[nt++] = t0 + pass + u * seg;
    else
      for (int64_t t = rest; t < t1; ++t) idx[nt++] = t;
    auto expand = [&](int64_t kb) {
      for (int u = 0; u < nt; ++u) {
        const uint8_t* tile = data + idx[u] * tile_bytes;
        const char* ahead = reinterpret_cast<const char*>(tile + (kb + 8) * block_bytes);
        for (int64_t line = 0; line < block_bytes / 64; ++line)  // 8 blocks ahead: in flight meanwhile
          _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        __m512i* b = ring[kb % (AHEAD + 1)][u];
        if (KIND == I4) {  // four pair columns per 64-byte load (the same words)
          for (int r = 0; r < 16; r += 4) {
            __m512i words[4];
            avx512bf16::quad_bf16_i4(tile + (kb * 16 + r) * NR, words);
            for (int q = 0; q < 4; ++q) b[r + q] = words[q];
          }
        } else {
          for (int r = 0; r < 16; ++r) b[r] = avx512bf16::pair_bf16<KIND>(tile, kb * 16 + r);
        }
      }
    };
    auto product = [&](int u, const __m512i* b) {  // accumulator u += activations . b (tile numbers are immediates)
      switch (u) {
        case 0: _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5); break;
        case 1: _tile_loadd(6, b, 64); _tile_dpbf16ps(1, 4, 6); break;
        case 2: _tile_loadd(7, b, 64); _tile_dpbf16ps(2, 4, 7); break;
        default: _tile_loadd(5, b, 64); _tile_dpbf16ps(3, 4, 5); break;
      }
    };
    auto store = [&](int u) {
      switch (u) {
        case 0: _tile_stored(0, c[0], 64); break;
        case 1: _tile_stored(1, c[1], 64); break;
        case 2: _tile_stored(2, c[2], 64); break;
        default: _tile_stored(3, c[3], 64); break;
      }
    };
    for (int64_t mc = 0; mc < mchunks; ++mc) {
      const int64_t rows = std::min<int64_t>(16, a.M - mc * 16);
      _Pragma("GCC unroll 4") for (int u = 0; u < PASS; ++u)
        _Pragma("GCC unroll 16") for (int m = 0; m < MAXR; ++m) tot[u][m] = _mm512_setzero_ps();
      for (int64_t kb = 0; kb < std::min<int64_t>(AHEAD, blocks); ++kb) expand(kb);
      for (int64_t kb = 0; kb < blocks; ++kb) {
        if (kb + AHEAD < blocks) expand(kb + AHEAD);
        if (kb % group_blocks == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        _tile_loadd(4, xb + (mc * 16) * Kp + kb * KB, Kp * 2);
        for (int u = 0; u < nt; ++u) product(u, ring[kb % (AHEAD + 1)][u]);
        if ((kb + 1) % group_blocks != 0 && kb + 1 != blocks) continue;
        const int64_t g = kb / group_blocks;  // the group ends here: apply its scale and zero point
        _Pragma("GCC unroll 4") for (int u = 0; u < PASS; ++u) {
          if (u >= nt) break;
          store(u);
          const int64_t at = (idx[u] * G + g) * NR;
          const __m512 s = _mm512_loadu_ps(sc + at), z = _mm512_add_ps(load16(zc, at), offset);
          _Pragma("GCC unroll 16") for (int m = 0; m < MAXR; ++m) {
            if (m >= rows) break;
            const __m512 corr = _mm512_mul_ps(z, _mm512_set1_ps(gs[(mc * 16 + m) * G + g]));
            tot[u][m] = _mm512_fmadd_ps(s, _mm512_sub_ps(_mm512_load_ps(c[u][m]), corr), tot[u][m]);
          }
        }
      }
      _Pragma("GCC unroll 4") for (int u = 0; u < PASS; ++u) {
        if (u >= nt) break;
        _Pragma("GCC unroll 16") for (int m = 0; m < MAXR; ++m) {
          if (m >= rows) break;
          const __m512 out = bias ? _mm512_add_ps(tot[u][m], avx512::bias16(bias, w.N, idx[u])) : tot[u][m];
          if (yb)
            avx512::store_tile_bf16(out, w.N, idx[u], yb + (mc * 16 + m) * ldy);
          else
            avx512::store_tile(out, w.N, idx[u], y + (mc * 16 + m) * ldy);
        }
      }
    }
  }
}

// The pass shape by rows: the row totals stay in registers for one row (4 tiles a pass) and for 2..8 rows (2 tiles a
// pass, 16 totals); a chunk of 16 rows keeps 4 tiles and spills them. Loading and storing each total per group was
// most of an 8-row call's extra cost (the loop is bound by its stores: the codes' expansion, the tile stores and the
// totals): 135M int4 c(8) -8 %, the 1.5B's c(1) -8 % and c(8) -6 % (notes/issue-39.md, thirty-fourth session). A
// tile's sums are the same in any pass, so every M gets the same bits.
template <int64_t KIND>
void quant(const Weight& w, const Acts& a, int64_t t0, int64_t t1, float* y, int64_t ldy, uint16_t* yb,
           const float* bias) {
  if (a.M == 1) return quant_rows<KIND, 4, 1>(w, a, t0, t1, y, ldy, yb, bias);
  if (a.M <= 8) return quant_rows<KIND, 2, 8>(w, a, t0, t1, y, ldy, yb, bias);
  quant_rows<KIND, 4, 16>(w, a, t0, t1, y, ldy, yb, bias);
}

}  // namespace amx
#pragma GCC pop_options

// ---- int8 activations (W8A8, W4A8): integer dot products ------------------------------------------------------
// A layer with int8_act quantizes each activation row (token) to int8 as it enters, as
// quantize.grid.quantize_activations_per_token does: s = max(amax |x|, 1e-8) / 127, q = clamp(round(x / s), -127,
// 127), rounding half to even. Per group g of output n the kernels sum d = sum_k q[k] * (code[n, k] - z[n, g]) in
// int32, exactly (the zero points are integers), then in fp32, group after group, each operation rounded once:
//   acc = float(d_0) * s_w[n, 0];  acc = acc + float(d_g) * s_w[n, g] (g = 1, 2, ...);  y = acc * s  (+ bias)
// which is QuantLinear.w8a8_reference's order: the kernels equal it bit for bit. Integer sums are exact in any
// order, so a row's result never depends on the other rows of the call.
// Kernels: AVX512-VNNI vpdpbusd (4 u8 x s8 products per dword: the pair layout is transposed in registers so one
// dword holds 4 columns of one row: int8 codes read unsigned, code = stored ^ 0x80); without VNNI (AVX-512, AVX2)
// vpmaddwd on a row's (code 2j, code 2j+1) int16 words x (q 2j, q 2j+1), int8 codes read signed (code - 128).
bool cpu_vnni() {  // CPUID.(7,0):ECX[11] AVX512_VNNI
  static const bool ok = cpuid_bit(7, 0, 2, 11);
  return ok;
}
bool g_vnni = true;  // set_vnni(false): tests run the vpmaddwd kernels on a VNNI CPU

namespace i8act {

enum Family : int { MADD2 = 0, MADD512 = 1, VNNI = 2, MADDUBS2 = 3 };

struct QActs {
  int64_t M = 0, Kp = 0;
  std::vector<int8_t> q;        // [M, Kp] in the layer's column order (perm), zero past K
  std::vector<float> scale;     // [M]
  std::vector<int32_t> qsum;    // [M, groups]
  std::vector<uint32_t> pairs;  // [M, Kp / 2]: (q 2j, q 2j+1) as int16 words (vpmaddwd)
  std::vector<uint32_t> split;  // [M, Kp / 8, 2]: an 8-column block's even, odd columns as 4 bytes (VNNI int4)
  std::vector<__m256i> spread;  // [M, Kp / 4]: vpmaddubsw's activation vector of each 4-column step (AVX2 int4)
};

// Rows below this many take the vpmaddubsw kernel tile by tile (maddubs_tile) with their activations spread once
// per call; from it on a tile's nibbles are expanded once for all rows (run_expanded).
constexpr int64_t EXPAND_ROWS = 4;

// VNNI reads 4 (int8) or 8 (int4) columns per load: groups must not end inside one
inline bool quads_fit(const Weight& w) { return w.ngroups == 1 || w.group % (w.kind == I4 ? 8 : 4) == 0; }

// vpmaddubsw steps over two column pairs: a group must not end between them (the last group may: zero activations)
inline bool pair_steps_fit(const Weight& w) { return w.kind == I4 && (w.ngroups == 1 || w.group % 4 == 0); }

int family(const Weight& w) {
  const int level = isa();
  if (level >= ISA_AVX512 && g_vnni && cpu_vnni() && quads_fit(w)) return VNNI;
  if (level >= ISA_AVX512) return MADD512;
  return pair_steps_fit(w) ? MADDUBS2 : MADD2;
}

inline int8_t quant_value(float v, float s) {  // torch.clamp(torch.round(v / s), -127, 127)
  const float r = std::nearbyint(v / s);       // the default rounding mode: half to even
  return static_cast<int8_t>(std::min(std::max(r, -127.0f), 127.0f));
}

// 8 values quantized to int8 at q: the same IEEE division and rounding as quant_value, 8 lanes at a time (a
// scalar nearbyint per value cost as much as the layer's whole dot product at decode)
inline void quant8(const float* v, __m256 s, int8_t* q) {
  const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  const __m256i i = _mm256_cvtps_epi32(c);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
}

inline float abs_max(const float* x, int64_t n) {  // exact in any order
  __m256 m = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// Row m: the int8 codes in the layer's column order, their per-group sums, and the kernel's activation words.
void quantize_row(const Weight& w, const float* src, int64_t m, QActs& a, int fam, std::vector<float>& gathered) {
  if (w.perm.defined()) {  // act-order: gather first (amax is the same over either order)
    const int64_t* perm = w.perm.data_ptr<int64_t>();
    gathered.resize(w.K);
    for (int64_t k = 0; k < w.K; ++k) gathered[k] = src[perm[k]];
    src = gathered.data();
  }
  const float s = std::max(abs_max(src, w.K), 1e-8f) / 127.0f;
  a.scale[m] = s;
  int8_t* q = a.q.data() + m * a.Kp;
  int64_t k = 0;
  for (; k + 8 <= w.K; k += 8) quant8(src + k, _mm256_set1_ps(s), q + k);
  for (; k < w.K; ++k) q[k] = quant_value(src[k], s);
  for (int64_t g = 0; g < w.ngroups; ++g) {
    int32_t sum = 0;
    for (int64_t c = g * w.group; c < std::min(w.K, (g + 1) * w.group); ++c) sum += q[c];
    a.qsum[m * w.ngroups + g] = sum;
  }
  for (int64_t c = 0; c < a.Kp; c += 16) {  // Kp is a multiple of 32
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c));
    if (fam == MADD2 || fam == MADD512) {  // dword j = (q 2j, q 2j+1) as int16 words: the row sign-extended
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.pairs.data() + m * (a.Kp / 2) + c / 2), _mm256_cvtepi8_epi16(b));
    } else if (fam == VNNI && w.kind == I4) {  // per 8 columns: dword (q 0, 2, 4, 6), dword (q 1, 3, 5, 7)
      const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.split.data() + (m * (a.Kp / 8) + c / 8) * 2), _mm_shuffle_epi8(b, order));
    }
  }
  if (fam == MADDUBS2 && a.M < EXPAND_ROWS) {  // step s (columns 4s..4s+3): (q 4s, q 4s+1) x 8 | (q 4s+2, q 4s+3) x 8
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    for (int64_t s4 = 0; s4 < a.Kp / 4; ++s4) {
      int32_t four;
      std::memcpy(&four, q + 4 * s4, 4);
      a.spread[m * (a.Kp / 4) + s4] = _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread);
    }
  }
}

// rows: the rows the activation arrays hold (>= M: AMX tiles load 16 rows at a time; the rows past M are not read
// back)
void prepare(const Weight& w, const float* x, int64_t M, int64_t ldx, QActs& a, int fam, int64_t rows) {
  a.M = M;
  a.Kp = (w.K + KB - 1) / KB * KB;
  a.q.assign(rows * a.Kp, 0);
  a.scale.resize(M);
  a.qsum.resize(M * w.ngroups);
  if (fam == MADD2 || fam == MADD512) a.pairs.resize(M * a.Kp / 2);  // vpmaddubsw and VNNI read q itself
  if (fam == VNNI && w.kind == I4) a.split.resize(rows * a.Kp / 4);
  if (fam == MADDUBS2 && M < EXPAND_ROWS) a.spread.resize(M * a.Kp / 4);
  auto quantize_rows = [&](int64_t m0, int64_t m1) {
    std::vector<float> gathered;
    for (int64_t m = m0; m < m1; ++m) quantize_row(w, x + m * ldx, m, a, fam, gathered);
  };
  if (M > MAX_M)  // prompt chunks: split over the cores (a step's few rows: one core, no fork)
    at::parallel_for(0, M, 16, quantize_rows);
  else
    quantize_rows(0, M);
}

// Half a tile (8 rows) x MB activation rows, vpmaddwd: the AVX2 kernel.
template <int64_t KIND, int TB, int MB>
void madd_block2(const Weight& w, const QActs& a, int64_t tile0, int half, int64_t m0, float* y, int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups, tile_bytes = (Kp / 2) * w.pair_bytes();
  const uint8_t* base0 = reinterpret_cast<const uint8_t*>(w.data.data_ptr()) + tile0 * tile_bytes;
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  __m256 tot[TB][MB];
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[TB][MB];
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[t][i] = _mm256_setzero_si256();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    for (int64_t j = kb / 2; j < (ke + 1) / 2; ++j) {
      __m256i xp[MB];
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
        xp[i] = _mm256_set1_epi32(static_cast<int>(a.pairs[(m0 + i) * (Kp / 2) + j]));
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        const uint8_t* tile = base0 + t * tile_bytes;
        __m256i v;
        if (KIND == I4) {  // row r's byte c0 | c1 << 4 -> words (c0, c1) of dword r
          const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + j * NR + 8 * half)));
          v = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)), _mm256_set1_epi32(0x000f000f));
        } else {  // row r's (code 2j, code 2j+1) - 128 sign-extended to the words of dword r
          v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * 2 * NR + 16 * half)));
        }
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
          acc[t][i] = _mm256_add_epi32(acc[t][i], _mm256_madd_epi16(v, xp[i]));
      }
    }
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
      const int64_t at = ((tile0 + t) * G + g) * NR + 8 * half;
      const __m256 s = _mm256_loadu_ps(sc + at);
      const __m256i z = _mm256_cvtps_epi32(zc.load8(at));  // integer zero points (- 128 for int8)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const __m256i qs = _mm256_set1_epi32(a.qsum[(m0 + i) * G + g]);
        const __m256i d = _mm256_sub_epi32(acc[t][i], _mm256_mullo_epi32(z, qs));
        const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(d), s);
        tot[t][i] = g == 0 ? part : _mm256_add_ps(tot[t][i], part);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
    const int64_t n0 = (tile0 + t) * NR + 8 * half, rows = std::min<int64_t>(8, w.N - n0);
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_mul_ps(tot[t][i], _mm256_set1_ps(a.scale[m0 + i])));
      if (rows > 0) std::memcpy(y + (m0 + i) * ldy + n0, out, rows * sizeof(float));
    }
  }
}

// The AVX2 int4 kernels' per-group epilogue: a tile's two 8-row halves of int32 group sums, minus zero point x the
// row's code sum, times the scale, added to the running fp32 totals in group order (the reference's order).
// sc: the weight's scales (read once a tile by the caller: data_ptr is an out-of-line call).
template <int MB>
inline void group_epilogue(const Weight& w, const QActs& a, const float* sc, const ZeroTable& zc, int64_t tile,
                           int64_t g, int64_t m0, const __m256i (&acc)[2][MB], __m256 (&tot)[2][MB]) {
  const int64_t G = w.ngroups;
  _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h) {
    const int64_t at = (tile * G + g) * NR + 8 * h;
    const __m256 s = _mm256_loadu_ps(sc + at);
    const __m256i z = _mm256_cvtps_epi32(zc.load8(at));
    _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i) {
      const __m256i qs = _mm256_set1_epi32(a.qsum[(m0 + i) * G + g]);
      const __m256i d = _mm256_sub_epi32(acc[h][i], _mm256_mullo_epi32(z, qs));
      const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), s);
      tot[h][i] = g == 0 ? p : _mm256_add_ps(tot[h][i], p);
    }
  }
}

// A tile's 16 outputs for MB activation rows: the totals times each row's activation scale.
template <int MB>
inline void store_tile_rows(const Weight& w, const QActs& a, int64_t tile, int64_t m0, const __m256 (&tot)[2][MB],
                            float* y, int64_t ldy) {
  _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h) {
    const int64_t n0 = tile * NR + 8 * h, rows = std::min<int64_t>(8, w.N - n0);
    _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i) {
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_mul_ps(tot[h][i], _mm256_set1_ps(a.scale[m0 + i])));
      if (rows > 0) std::memcpy(y + (m0 + i) * ldy + n0, out, rows * sizeof(float));
    }
  }
}

// One tile (16 rows) of 4-bit codes x MB activation rows with vpmaddubsw, the AVX2 int4 kernel: 32 code bytes are
// column pairs j and j + 1 of the tile's 16 rows; their nibbles, interleaved per row (code 2j, code 2j + 1), meet
// (x 2j, x 2j + 1) in the low 128-bit lane and the next pair in the high one. A code times an int8 fits int16 with
// room (a pair: 2 x 15 x 127 = 3810; 8 steps: 30480) before the sums widen to int32 per group: the exact integer
// sums madd_block2 forms, so the same bits, at a third of its instructions per weight.
template <int MB>
void maddubs_tile(const Weight& w, const QActs& a, int64_t tile, int64_t m0, float* y, int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups;
  const uint8_t* codes = w.tile(tile);
  const ZeroTable zc(w);
  const float* sc = w.scales.data_ptr<float>();  // once a tile, not per group (an out-of-line call)
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 tot[2][MB];
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[2][MB];  // rows 0-7, 8-15: int32 sums of the group
    _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
      _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) acc[h][i] = _mm256_setzero_si256();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    const int64_t jb = kb / 2, je = jb + (((ke + 1) / 2 - jb + 1) & ~int64_t{1});  // whole steps; past K: zeros
    for (int64_t j = jb; j < je;) {
      const int64_t end = std::min(je, j + 16);  // 8 steps of int16 sums
      __m256i part[2][MB];
      _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) part[h][i] = _mm256_setzero_si256();
      const uint8_t* cp = codes + j * NR;
      const __m256i* xp = a.spread.data() + m0 * (Kp / 4) + j / 2;  // (x 2j, 2j + 1) x 8 | (x 2j + 2, 2j + 3) x 8
      const auto step = [&](int64_t s) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + s * 2 * NR));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256i rows[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
        _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) {
          const __m256i x = xp[i * (Kp / 4) + s];
          _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
            part[h][i] = _mm256_add_epi16(part[h][i], _mm256_maddubs_epi16(rows[h], x));
        }
      };
      if (end - j == 16) {  // a whole block of 8 steps (every one but a group's or K's tail): unrolled
        _Pragma("GCC unroll 8") for (int64_t s = 0; s < 8; ++s) step(s);
      } else {
        for (int64_t s = 0; s < (end - j) / 2; ++s) step(s);
      }
      j = end;
      _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 4") for (int i = 0; i < MB; ++i) {  // the two lanes hold the same rows: add them
          const __m256i both = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(part[h][i])),
                                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(part[h][i], 1)));
          acc[h][i] = _mm256_add_epi32(acc[h][i], both);
        }
    }
    group_epilogue<MB>(w, a, sc, zc, tile, g, m0, acc, tot);
  }
  store_tile_rows<MB>(w, a, tile, m0, tot, y, ldy);
}

// Many activation rows (prompt chunks, verifications): a tile's nibbles are expanded once per call into `ex`, per
// step of 4 columns rows 0-7 then rows 8-15, each row's 4 codes one byte each in a dword. An activation row's 4
// int8 values are then one broadcast dword (no shuffle), and the expansion is not repeated per block of rows.
void expand_tile(const Weight& w, int64_t tile, int64_t steps, uint8_t* ex) {
  const uint8_t* codes = w.tile(tile);
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t s = 0; s < steps; ++s) {  // bytes 0-15: column pair 2s of rows 0-15, bytes 16-31: pair 2s + 1
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 2 * s * NR));
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i words[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};  // rows 0-7, 8-15
    for (int h = 0; h < 2; ++h) {  // lane 0: (code 4s, 4s + 1) per row, lane 1: (4s + 2, 4s + 3): interleave
      const __m128i a = _mm256_castsi256_si128(words[h]), b = _mm256_extracti128_si256(words[h], 1);
      const __m256i rows = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ex + (2 * s + h) * 32), rows);
    }
  }
}

// maddubs_tile on an expanded tile: the same integer sums (int16 pairs, widened every 8 steps), so the same bits.
template <int MB>
void maddubs_expanded(const Weight& w, const QActs& a, const uint8_t* ex, int64_t tile, int64_t m0, float* y,
                      int64_t ldy) {
  const int64_t Kp = a.Kp, G = w.ngroups;
  const ZeroTable zc(w);
  const float* sc = w.scales.data_ptr<float>();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[2][MB];
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[2][MB];
    _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
      _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i) acc[h][i] = _mm256_setzero_si256();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    const int64_t se = kb / 4 + (ke - kb + 3) / 4;  // whole steps; past K: zero activations
    for (int64_t s = kb / 4; s < se;) {
      const int64_t end = std::min(se, s + 8);
      __m256i part[2][MB];
      _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i) part[h][i] = _mm256_setzero_si256();
      for (; s < end; ++s) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ex + s * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ex + s * 64 + 32));
        _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i) {
          int32_t four;
          std::memcpy(&four, a.q.data() + (m0 + i) * Kp + 4 * s, 4);
          const __m256i x = _mm256_set1_epi32(four);
          part[0][i] = _mm256_add_epi16(part[0][i], _mm256_maddubs_epi16(w0, x));
          part[1][i] = _mm256_add_epi16(part[1][i], _mm256_maddubs_epi16(w1, x));
        }
      }
      _Pragma("GCC unroll 4") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 8") for (int i = 0; i < MB; ++i)  // a row's two int16 sums -> its int32
          acc[h][i] = _mm256_add_epi32(acc[h][i], _mm256_madd_epi16(part[h][i], ones));
    }
    group_epilogue<MB>(w, a, sc, zc, tile, g, m0, acc, tot);
  }
  store_tile_rows<MB>(w, a, tile, m0, tot, y, ldy);
}

// Tiles [t_begin, t_end) for all of a.M >= EXPAND_ROWS rows: each tile expanded once, then every block of rows.
void run_expanded(const Weight& w, const QActs& a, int64_t t_begin, int64_t t_end, float* y, int64_t ldy) {
  thread_local std::vector<uint8_t> ex;
  ex.resize(NR * a.Kp);
  for (int64_t t = t_begin; t < t_end; ++t) {
    expand_tile(w, t, a.Kp / 4, ex.data());
    int64_t m0 = 0;  // 3 rows: 6 int16 chains, 2 weight and 3 activation vectors stay in the 16 registers
    for (; m0 + 3 <= a.M; m0 += 3) maddubs_expanded<3>(w, a, ex.data(), t, m0, y, ldy);
    for (; m0 + 2 <= a.M; m0 += 2) maddubs_expanded<2>(w, a, ex.data(), t, m0, y, ldy);
    for (; m0 < a.M; ++m0) maddubs_expanded<1>(w, a, ex.data(), t, m0, y, ldy);
  }
}

}  // namespace i8act

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace i8act512 {

using i8act::QActs;

// Pair columns j, j + 1 of a tile's int8 codes (64 bytes: row r's two codes at word r, then word 16 + r) as
// dword r = row r's 4 codes, unsigned (stored ^ 0x80 = code): vpdpbusd's u8 operand.
inline __m512i quad_i8(const uint8_t* tile, int64_t j) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(tile + j * 2 * NR));
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Pair columns j..j+3 of a tile's int4 codes (64 bytes: byte 16p + r = row r's codes 2(j+p) | 2(j+p)+1 << 4) as
// dword r = row r's 4 bytes: a 4 x 4 transpose of dwords across the 128-bit lanes, then of bytes within them.
// Low nibbles: columns 2j, 2j+2, 2j+4, 2j+6; high: 2j+1, 2j+3, 2j+5, 2j+7.
inline void octet_i4(const uint8_t* tile, int64_t j, __m512i& lo, __m512i& hi) {
  const __m512i didx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i bidx = _mm512_broadcast_i32x4(_mm_set_epi8(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0));
  const __m512i v = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(didx, _mm512_loadu_si512(tile + j * NR)), bidx);
  const __m512i nib = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(v, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
}

// Row r's pair (code 2j, code 2j+1) as the int16 words of dword r (vpmaddwd), int8 codes signed (code - 128).
template <int64_t KIND>
inline __m512i pair_words(const uint8_t* tile, int64_t j) {
  if (KIND == I4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * NR)));
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000f000f), 0xA8);  // (A|B)&C
  }
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 2 * NR)));
}

// One group's integer dots of TB tiles x MB rows over pairs [j0, j1), added to acc.
template <bool VNNI, int64_t KIND, int TB, int MB>
inline void group_dots(const Weight& w, const QActs& a, const uint8_t* base0, int64_t tile_bytes, int64_t m0,
                       int64_t j0, int64_t j1, __m512i (&acc)[TB][MB]) {
  const int64_t Kp = a.Kp;
  constexpr int64_t STEP = !VNNI ? 1 : KIND == I4 ? 4 : 2;  // pair columns per load: one 64-byte line (VNNI)
  for (int64_t j = j0; j < j1; j += STEP) {
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)  // 64 pairs ahead: in flight while these compute
      if (VNNI || (j & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(base0 + t * tile_bytes + (j + 64) * w.pair_bytes()), _MM_HINT_T0);
    if (VNNI && KIND == I4) {
      __m512i xe[MB], xo[MB];
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const uint32_t* s = a.split.data() + ((m0 + i) * (Kp / 8) + j / 4) * 2;
        xe[i] = _mm512_set1_epi32(static_cast<int>(s[0]));
        xo[i] = _mm512_set1_epi32(static_cast<int>(s[1]));
      }
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        __m512i lo, hi;
        octet_i4(base0 + t * tile_bytes, j, lo, hi);
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
          acc[t][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[t][i], lo, xe[i]), hi, xo[i]);
      }
    } else {
      __m512i xv[MB];
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        uint32_t bits;
        if (VNNI)
          std::memcpy(&bits, a.q.data() + (m0 + i) * Kp + 2 * j, 4);  // q 2j..2j+3
        else
          bits = a.pairs[(m0 + i) * (Kp / 2) + j];
        xv[i] = _mm512_set1_epi32(static_cast<int>(bits));
      }
      _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
        const __m512i v = VNNI ? quad_i8(base0 + t * tile_bytes, j) : pair_words<KIND>(base0 + t * tile_bytes, j);
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
          acc[t][i] = VNNI ? _mm512_dpbusd_epi32(acc[t][i], v, xv[i])
                           : _mm512_add_epi32(acc[t][i], _mm512_madd_epi16(v, xv[i]));
      }
    }
  }
}

// TB tiles x MB activation rows: per group the integer dots, then the fp32 epilogue in the reference's order.
template <bool VNNI, int64_t KIND, int TB, int MB>
void block(const Weight& w, const QActs& a, int64_t tile0, int64_t m0, float* y, int64_t ldy) {
  const int64_t G = w.ngroups, tile_bytes = (a.Kp / 2) * w.pair_bytes();
  const uint8_t* base0 = reinterpret_cast<const uint8_t*>(w.data.data_ptr()) + tile0 * tile_bytes;
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  // the zero point in the codes' units as read: int8 kernel zeros hold z - 128; VNNI reads int8 codes unsigned
  const __m512i shift = _mm512_set1_epi32(VNNI && KIND == I8 ? 128 : 0);
  __m512 tot[TB][MB];
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[TB][MB];
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) acc[t][i] = _mm512_setzero_si512();
    const int64_t kb = g * w.group, ke = std::min(kb + w.group, w.K);
    group_dots<VNNI, KIND, TB, MB>(w, a, base0, tile_bytes, m0, kb / 2, (ke + 1) / 2, acc);
    _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t) {
      const int64_t at = ((tile0 + t) * G + g) * NR;
      const __m512 s = _mm512_loadu_ps(sc + at);
      const __m512i z = _mm512_add_epi32(_mm512_cvtps_epi32(load16(zc, at)), shift);
      _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i) {
        const __m512i qs = _mm512_set1_epi32(a.qsum[(m0 + i) * G + g]);
        const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][i], _mm512_mullo_epi32(z, qs))), s);
        tot[t][i] = g == 0 ? part : _mm512_add_ps(tot[t][i], part);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int t = 0; t < TB; ++t)
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; ++i)
      avx512::store_tile(_mm512_mul_ps(tot[t][i], _mm512_set1_ps(a.scale[m0 + i])), w.N, tile0 + t, y + (m0 + i) * ldy);
}

}  // namespace i8act512
#pragma GCC pop_options

// ---- AMX-INT8 for int8-activation layers -------------------------------------------------------------------------
// The same integer sums as the VNNI kernel (per group d = sum q * code - z * sum q, exact in int32: for int8 codes
// tdpbsud multiplies signed activation bytes by unsigned code bytes as vpdpbusd does and adds without saturation; for
// int4 tdpbssd multiplies them by code - z, signed, which is d itself), then the same fp32 epilogue in the same
// order: the same bits as VNNI for every row, so calls of AMX_INT8_MIN_ROWS rows or more take the tiles
// and fewer take VNNI without a row's result depending on the call (shape-invariant by construction, unlike bf16).
// C tiles 0..3: [16 activation rows, 16 outputs] int32 for up to 4 chunks of 16 rows; tile 4: A, 16 rows x 64
// activation bytes (q, or for int4 the even / odd split of each 8 columns that octet_i4's code order wants); tile 5:
// B, 16 k-quads x 16 outputs x 4 code bytes, expanded from the tile's codes AHEAD chunks in front of its load.
// From 8 rows: below, the codes' expansion to B tiles through memory costs more than VNNI's extra row products
// (the 1.5B's W4A8 step: 2 and 5 rows slower on tiles, 9 rows 1.07-1.26x faster; notes/issue-39.md, 30th session)
constexpr int64_t AMX_INT8_MIN_ROWS = 8, KC = 64;  // KC: activation columns per tile product

bool cpu_amx_int8() { return cpuid_bit(7, 0, 3, 25); }  // CPUID.(7,0):EDX[25] AMX-INT8

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
namespace amx8 {

using i8act::QActs;

// B rows of one chunk (KC columns). int4: each code minus its output's zero point (zb: z in every byte of output
// n's dword), signed bytes in -15..15 for tdpbssd, so the tiles sum q * (code - z) itself: the integer d that
// acc - z * qsum gives, without the epilogue's multiply and subtraction per row.
template <int64_t KIND>
inline void expand(const uint8_t* tile, int64_t chunk, __m512i* b, __m512i zb) {
  const int64_t j0 = chunk * KC / 2;  // pair column
  if (KIND == I4) {
    for (int64_t o = 0; o < 8; ++o) {
      i8act512::octet_i4(tile, j0 + 4 * o, b[2 * o], b[2 * o + 1]);
      b[2 * o] = _mm512_sub_epi8(b[2 * o], zb);
      b[2 * o + 1] = _mm512_sub_epi8(b[2 * o + 1], zb);
    }
  } else {
    for (int64_t r = 0; r < 16; ++r) b[r] = i8act512::quad_i8(tile, j0 + 2 * r);
  }
}

template <int64_t KIND>
inline void tile_product(int mc) {  // int4: signed codes minus zero points (tdpbssd); int8: unsigned codes (tdpbsud)
  if (KIND == I4) {
    switch (mc) {
      case 0: _tile_dpbssd(0, 4, 5); break;
      case 1: _tile_dpbssd(1, 4, 5); break;
      case 2: _tile_dpbssd(2, 4, 5); break;
      default: _tile_dpbssd(3, 4, 5); break;
    }
    return;
  }
  switch (mc) {
    case 0: _tile_dpbsud(0, 4, 5); break;
    case 1: _tile_dpbsud(1, 4, 5); break;
    case 2: _tile_dpbsud(2, 4, 5); break;
    default: _tile_dpbsud(3, 4, 5); break;
  }
}

inline void tile_out(int mc, int32_t (*c)[16]) {
  switch (mc) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

// A call of more than MAX_M rows (prompt chunks) runs blocks of MAX_M rows; each tile's expanded B rows are then
// kept for all of them (a panel of tiles at a time, PANEL_BYTES of B rows in L2) instead of re-reading and
// re-expanding the codes per block of rows: the 135M's 512-row W8A8 prefill ran its layers as 8 calls of 64 rows.
// Up to MAX_M rows a ring of AHEAD + 1 chunks' B rows serves (a decode or verification step's codes pass once).
constexpr int64_t PANEL_BYTES = 512 * 1024;

template <int64_t KIND>
void run(const Weight& w, const QActs& a, int64_t t_begin, int64_t t_end, float* y, int64_t ldy) {
  amx::TileConfig cfg;  // (amx::Tiles configures 5 tiles; this kernel uses 6)
  for (int t = 0; t < 6; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  constexpr int AHEAD = 2;
  const int64_t Kp = a.Kp, G = w.ngroups, M = a.M, chunks = Kp / KC;
  const int64_t group_chunks = G == 1 ? chunks : w.group / KC, tile_bytes = (Kp / 2) * w.pair_bytes();
  const uint8_t* data = reinterpret_cast<const uint8_t*>(w.data.data_ptr());
  // int4: row m's split words (even, odd columns of each 8) hold its 64 columns of a chunk as 64 bytes, row stride Kp
  const uint8_t* acts = KIND == I4 ? reinterpret_cast<const uint8_t*>(a.split.data())
                                   : reinterpret_cast<const uint8_t*>(a.q.data());
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  const bool blocks = M > MAX_M;
  const int64_t panel = blocks ? std::max<int64_t>(1, PANEL_BYTES / (chunks * 1024)) : 1;  // tiles a panel
  alignas(64) __m512i ring[AHEAD + 1][16];
  thread_local std::vector<uint8_t> kept_bytes;  // blocks: the panel's B rows, [tile, chunk, 16], 64-byte aligned
  __m512i* kept = nullptr;
  if (blocks) {
    kept_bytes.resize(panel * chunks * 1024 + 64);
    kept = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(kept_bytes.data()) + 63) & ~uintptr_t{63});
  }
  alignas(64) int32_t c[16][16];
  alignas(64) float tot[MAX_M][16];  // per row of the block: the fp32 sum over groups so far
  for (int64_t p0 = t_begin; p0 < t_end; p0 += panel) {
    const int64_t p1 = std::min(t_end, p0 + panel);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
      const int64_t rows = std::min(MAX_M, M - m0), mchunks = (rows + 15) / 16;
      const bool expanding = m0 == 0;  // the panel's first block of rows expands its codes
      for (int64_t t = p0; t < p1; ++t) {
        const uint8_t* tile = data + t * tile_bytes;
        auto slot = [&](int64_t k) { return blocks ? kept + ((t - p0) * chunks + k) * 16 : ring[k % (AHEAD + 1)]; };
        auto expand_chunk = [&](int64_t k) {
          const __m512i zb = KIND == I4 ? _mm512_mullo_epi32(_mm512_cvtps_epi32(load16(zc, (t * G + k / group_chunks) * NR)),
                                                             _mm512_set1_epi32(0x01010101))  // z in each byte
                                        : _mm512_setzero_si512();
          expand<KIND>(tile, k, slot(k), zb);
        };
        if (expanding)
          for (int64_t k = 0; k < std::min<int64_t>(AHEAD, chunks); ++k) expand_chunk(k);
        for (int64_t k = 0; k < chunks; ++k) {
          if (expanding && k + AHEAD < chunks) expand_chunk(k + AHEAD);
          if (k % group_chunks == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          }
          _tile_loadd(5, slot(k), 64);
          for (int64_t mc = 0; mc < mchunks; ++mc) {
            _tile_loadd(4, acts + (m0 + mc * 16) * Kp + k * KC, Kp);
            tile_product<KIND>(static_cast<int>(mc));
          }
          if ((k + 1) % group_chunks != 0 && k + 1 != chunks) continue;
          const int64_t g = k / group_chunks;  // the group ends here: the VNNI kernel's epilogue, row by row
          const int64_t at = (t * G + g) * NR;
          const __m512 s = _mm512_loadu_ps(sc + at);
          const __m512i z = KIND == I8 ? _mm512_add_epi32(_mm512_cvtps_epi32(load16(zc, at)), _mm512_set1_epi32(128))
                                       : _mm512_setzero_si512();  // int4: subtracted in the codes already
          for (int64_t mc = 0; mc < mchunks; ++mc) {
            tile_out(static_cast<int>(mc), c);
            for (int64_t m = mc * 16; m < std::min(rows, mc * 16 + 16); ++m) {
              const __m512i acc = _mm512_load_si512(c[m - mc * 16]);
              const __m512i d = KIND == I4 ? acc
                                           : _mm512_sub_epi32(acc, _mm512_mullo_epi32(z, _mm512_set1_epi32(a.qsum[(m0 + m) * G + g])));
              const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(d), s);
              _mm512_store_ps(tot[m], g == 0 ? part : _mm512_add_ps(_mm512_load_ps(tot[m]), part));
            }
          }
        }
        for (int64_t m = 0; m < rows; ++m)
          avx512::store_tile(_mm512_mul_ps(_mm512_load_ps(tot[m]), _mm512_set1_ps(a.scale[m0 + m])), w.N, t,
                             y + (m0 + m) * ldy);
      }
    }
  }
  _tile_release();
}

}  // namespace amx8
#pragma GCC pop_options

namespace i8act {

template <int TB, int MB>
void blocks(const Weight& w, const QActs& a, int fam, int64_t t, int64_t m0, float* y, int64_t ldy) {
  const bool i4 = w.kind == I4;
  if (fam == VNNI)
    return i4 ? i8act512::block<true, I4, TB, MB>(w, a, t, m0, y, ldy) : i8act512::block<true, I8, TB, MB>(w, a, t, m0, y, ldy);
  if (fam == MADD512)
    return i4 ? i8act512::block<false, I4, TB, MB>(w, a, t, m0, y, ldy) : i8act512::block<false, I8, TB, MB>(w, a, t, m0, y, ldy);
  if (fam == MADDUBS2) {  // one tile per call, its nibbles expanded once for all MB rows
    for (int64_t u = t; u < t + TB; ++u) maddubs_tile<MB>(w, a, u, m0, y, ldy);
    return;
  }
  for (int half = 0; half < 2; ++half) {
    if (i4)
      madd_block2<I4, TB, MB>(w, a, t, half, m0, y, ldy);
    else
      madd_block2<I8, TB, MB>(w, a, t, half, m0, y, ldy);
  }
}

// Tiles [t_begin, t_end) for every activation row: spans of tiles that stay in cache while each block of rows runs,
// TB * MB <= 8 accumulator chains (AVX2: 4). No blocking changes a result (integer sums).
// One activation row (a decode step) reads one tile at a time: tiles lie one after another, so a core then streams
// its codes, scales and zeros as three sequential reads; 8 tiles at once made 24 streams a core, which the hardware
// prefetchers follow worse (AVX-512 Zen 4, 28 layers of the 1.5B's shapes: 1-row pass 10 % faster, decode TPOT 8-12 %).
// Eight rows or more run 8 rows a block: each tile's codes are unpacked once for 8 rows, not twice for 2 x 4.
void run(const Weight& w, const QActs& a, int fam, int64_t t_begin, int64_t t_end, float* y, int64_t ldy) {
  if (fam == MADDUBS2 && a.M >= EXPAND_ROWS) return run_expanded(w, a, t_begin, t_end, y, ldy);
  const bool wide = fam != MADD2 && fam != MADDUBS2;
  if (wide && a.M == 1) {
    for (int64_t t = t_begin; t < t_end; ++t) blocks<1, 1>(w, a, fam, t, 0, y, ldy);
    return;
  }
  constexpr int64_t SPAN = 8;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += SPAN) {
    const int64_t t1 = std::min(t0 + SPAN, t_end);
    for (int64_t m0 = 0; m0 < a.M;) {
      const int64_t left = a.M - m0;
      const int mb = left >= 8 && wide ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      int64_t t = t0;
      if (mb == 8) {
        for (; t < t1; ++t) blocks<1, 8>(w, a, fam, t, m0, y, ldy);
      } else if (mb == 4) {
        if (wide)
          for (; t + 2 <= t1; t += 2) blocks<2, 4>(w, a, fam, t, m0, y, ldy);
        for (; t < t1; ++t) blocks<1, 4>(w, a, fam, t, m0, y, ldy);
      } else if (mb == 2) {
        if (wide)
          for (; t + 4 <= t1; t += 4) blocks<4, 2>(w, a, fam, t, m0, y, ldy);
        for (; t + 2 <= t1; t += 2) blocks<2, 2>(w, a, fam, t, m0, y, ldy);
        for (; t < t1; ++t) blocks<1, 2>(w, a, fam, t, m0, y, ldy);
      } else {
        if (wide)
          for (; t + 8 <= t1; t += 8) blocks<8, 1>(w, a, fam, t, m0, y, ldy);
        for (; t + 4 <= t1; t += 4) blocks<4, 1>(w, a, fam, t, m0, y, ldy);
        for (; t < t1; ++t) blocks<1, 1>(w, a, fam, t, m0, y, ldy);
      }
      m0 += mb;
    }
  }
}

// Whether a call of M rows takes the AMX-INT8 tiles (the same bits as VNNI; any AMX row policy but off): whole
// chunks of KC columns that no group boundary cuts, and int4 zero points the B tiles can subtract in bytes.
bool amx_int8_rows(const Weight& w, int fam, int64_t M) {
  const int64_t Kp = (w.K + KB - 1) / KB * KB;
  return fam == VNNI && M >= AMX_INT8_MIN_ROWS && isa() >= ISA_AMX && g_amx_mode != AMX_OFF && cpu_amx_int8() &&
         Kp % KC == 0 && (w.ngroups == 1 || w.group % KC == 0) && (w.kind != I4 || w.codes_zeros);
}

// y [M, N] fp32 = the int8-activation layer on x [M, K] (+ bias), split over the cores by tiles.
void linear_into(const Weight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) {
  thread_local QActs scratch;
  QActs& a = scratch;  // a local reference: the workers' lambda must read this thread's copy, not their own
  const int fam = family(w);
  const bool tiles = amx_int8_rows(w, fam, M);
  prepare(w, x, M, ldx, a, fam, tiles ? (M + 15) / 16 * 16 : M);
  if (tiles) {
    at::parallel_for(0, w.tiles(), 1, [&](int64_t b, int64_t e) {
      if (w.kind == I4)
        amx8::run<I4>(w, a, b, e, y, ldy);
      else
        amx8::run<I8>(w, a, b, e, y, ldy);
    });
  } else {
    at::parallel_for(0, w.tiles(), 1, [&](int64_t b, int64_t e) { run(w, a, fam, b, e, y, ldy); });
  }
  if (w.bias.defined() && w.bias.numel()) {
    const float* bp = w.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < w.N; ++n) y[m * ldy + n] += bp[n];
  }
}

std::string kernel_name(const Weight& w, int64_t M) {  // the kernel a call of M rows runs
  static const char* names[] = {"avx2-maddwd", "avx512-maddwd", "avx512-vnni", "avx2-maddubs"};
  const int fam = family(w);
  return amx_int8_rows(w, fam, M) ? "amx-int8" : names[fam];
}

}  // namespace i8act

// ---- dispatch ---------------------------------------------------------------------------------------------------

// TB tiles tile0, tile0 + ts, ..., tile0 + (TB - 1) ts (ts > 1 only where level >= ISA_AVX512: see run_quant).
template <int TB, int MB>
void quant_blocks(const Weight& w, const Acts& a, int64_t tile0, int64_t ts, int64_t m0, float* y, int64_t ldy,
                  int level) {
  if (w.bf16_act && level >= ISA_AVX512BF16) {
    switch (w.kind) {
      case I8: return avx512bf16::quant_block<I8, TB, MB>(w, a, tile0, ts, m0, y, ldy);
      case FP8: return avx512bf16::quant_block<FP8, TB, MB>(w, a, tile0, ts, m0, y, ldy);
      default: return avx512bf16::quant_block<I4, TB, MB>(w, a, tile0, ts, m0, y, ldy);
    }
  }
  if (level >= ISA_AVX512) {
    switch (w.kind) {
      case I8: return avx512::quant_block<I8, TB, MB>(w, a, tile0, ts, m0, y, ldy);
      case FP8: return avx512::quant_block<FP8, TB, MB>(w, a, tile0, ts, m0, y, ldy);
      default: return avx512::quant_block<I4, TB, MB>(w, a, tile0, ts, m0, y, ldy);
    }
  }
  // AVX2: the TB (adjacent) tiles as 2 TB half-tile units, UB per kernel call (4 outputs: 8 chains of 16 registers)
  constexpr int UB = std::min(2 * TB, MB == 1 ? 4 : MB == 2 ? 2 : 1);
  for (int64_t u = 2 * tile0; u < 2 * (tile0 + TB); u += UB) {
    switch (w.kind) {
      case I8: avx2::quant_block<I8, UB, MB>(w, a, u, m0, y, ldy); break;
      case FP8: avx2::quant_block<FP8, UB, MB>(w, a, u, m0, y, ldy); break;
      default: avx2::quant_block<I4, UB, MB>(w, a, u, m0, y, ldy); break;
    }
  }
}

template <int RB, int MB>
void dense_rows(const Weight& w, const Acts& a, int64_t n0, int64_t rs, int64_t m0, float* y, int64_t ldy, int level) {
  const bool bf = w.kind == BF16;
  if (bf && level >= ISA_AVX512BF16) return avx512bf16::dense_block<RB, MB>(w, a, n0, rs, m0, y, ldy);
  if (level >= ISA_AVX512 && bf) return avx512::dense_block<RB, MB, true>(w, a, n0, rs, m0, y, ldy);
  if (level >= ISA_AVX512) return avx512::dense_block<RB, MB, false>(w, a, n0, rs, m0, y, ldy);
  if constexpr (MB <= 4) {  // AVX2 blocks take at most 4 rows (16 registers)
    if (bf) return avx2::dense_block<RB, MB, true>(w, a, n0, rs, m0, y, ldy);
    return avx2::dense_block<RB, MB, false>(w, a, n0, rs, m0, y, ldy);
  }
}

template <int RB>
void dense_rows_mb(const Weight& w, const Acts& a, int64_t n, int64_t rs, int64_t m0, int64_t mb, float* y,
                   int64_t ldy, int level) {
  switch (mb) {
    case 9: return dense_rows<RB, 9>(w, a, n, rs, m0, y, ldy, level);
    case 8: return dense_rows<RB, 8>(w, a, n, rs, m0, y, ldy, level);
    case 7: return dense_rows<RB, 7>(w, a, n, rs, m0, y, ldy, level);
    case 6: return dense_rows<RB, 6>(w, a, n, rs, m0, y, ldy, level);
    case 5: return dense_rows<RB, 5>(w, a, n, rs, m0, y, ldy, level);
    case 4: return dense_rows<RB, 4>(w, a, n, rs, m0, y, ldy, level);
    case 3: return dense_rows<RB, 3>(w, a, n, rs, m0, y, ldy, level);
    case 2: return dense_rows<RB, 2>(w, a, n, rs, m0, y, ldy, level);
    default: return dense_rows<RB, 1>(w, a, n, rs, m0, y, ldy, level);
  }
}

int g_dense_streams = 4;  // set_dense_streams: weight streams a core reads side by side (0: one)

// Blocking: each dense block reads RB weight rows once for every activation row (in blocks of MB <= 9); each
// quantized block reads TB tiles for MB activation rows, TB * MB <= 8 independent accumulator chains (AVX2:
// 4 outputs, each in two chains: even and odd columns). Weight rows / tiles are the outer loop, so they are read
// from memory once per call. No blocking changes an output's sum order.
// AVX2 has 16 vector registers: RB x MB accumulators + RB weight vectors + one activation vector must fit, or
// accumulators spill and each k step waits on a store and a reload (4 x 4 spilled 5 chains: a 9-row verification
// ran at a fraction of the FMA peak). There multi-row calls split the rows into near-equal blocks of <= 4 (9 = 3 +
// 3 + 3) and take 3 weight rows per block where a block has 3 or 4 rows (12 chains + 3 + 1 registers).
// AVX-512 has 32: near-equal blocks of <= 9 rows, 4 weight rows a block of <= 6 (<= 24 chains + 4 + 1), 3 beyond
// (<= 27 + 3 + 1). A verification's 5-9 rows then read each weight once, in one block: blocks of 4 + 4 + 1 re-read
// them from cache and ran 5 rows at 100 G MAC/s against 165 in one block (in-cache weights, Zen 4).
void run_dense(const Weight& w, const Acts& a, int64_t n_begin, int64_t n_end, float* y, int64_t ldy, int level) {
  const int64_t M = a.M;
  const bool avx2_regs = level < ISA_AVX512;
  const int64_t mbmax = avx2_regs ? 4 : 9;
  const int64_t blocks = (M + mbmax - 1) / mbmax, widest = (M + blocks - 1) / blocks;
  const int64_t rb = avx2_regs ? (widest >= 3 ? 3 : 4) : (widest <= 6 ? 4 : 3);
  auto weight_rows = [&](int64_t n, int64_t rs, int64_t rows) {  // rows n, n + rs, ...: every activation block
    for (int64_t i = 0, m0 = 0; m0 < M; ++i) {
      const int64_t mb = M / blocks + (i < M % blocks ? 1 : 0);
      if (rows == 4) dense_rows_mb<4>(w, a, n, rs, m0, mb, y, ldy, level);
      else if (rows == 3) dense_rows_mb<3>(w, a, n, rs, m0, mb, y, ldy, level);
      else dense_rows_mb<1>(w, a, n, rs, m0, mb, y, ldy, level);
      m0 += mb;
    }
  };
  // Each weight is read once, from memory, at the pace of the core's stream prefetchers, which keep more lines in
  // flight for several distant sequential streams than for one (rb adjacent rows are one stream to them). So the
  // core's rows are cut into S = 4 segments (3 where blocks take 3 rows) read side by side: each block takes the next
  // row of rb segments (software prefetch only from STREAM_AHEAD_ROWS rows). A row's sum order is the same in any
  // block. AMD Zen 4, bf16, 1-row pass over the 0.5B's layers: 23 -> 33-52 GB/s (host phases); 8 streams: slower.
  const int64_t S = g_dense_streams / 4 * rb, seg = S > 0 ? (n_end - n_begin) / S : 0;
  if (seg > 0) {
    for (int64_t j = 0; j < seg; ++j)
      for (int64_t s = 0; s < S; s += rb) weight_rows(n_begin + s * seg + j, seg, rb);
    n_begin += S * seg;
  }
  for (int64_t n = n_begin; n < n_end;) {
    const int64_t rows = n + rb <= n_end ? rb : 1;
    weight_rows(n, 1, rows);
    n += rows;
  }
}

int g_quant_streams = 8;  // set_quant_streams: tile streams a core reads side by side (0: one)

// The `count` (<= SPAN) tiles t0, t0 + ts, ... for every block of activation rows: their codes stay in cache while
// each block runs.
constexpr int64_t SPAN = 8;
void quant_span(const Weight& w, const Acts& a, int64_t t0, int64_t count, int64_t ts, float* y, int64_t ldy,
                int level) {
  const bool wide = level >= ISA_AVX512;  // AVX2 has half the registers: half the chains
  for (int64_t m0 = 0; m0 < a.M;) {
    const int64_t left = a.M - m0;
    const int mb = left >= 8 && wide ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    int64_t u = 0;
    if (mb == 8) {
      for (; u < count; ++u) quant_blocks<1, 8>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
    } else if (mb == 4) {
      if (wide)
        for (; u + 2 <= count; u += 2) quant_blocks<2, 4>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
      for (; u < count; ++u) quant_blocks<1, 4>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
    } else if (mb == 2) {
      if (wide)
        for (; u + 4 <= count; u += 4) quant_blocks<4, 2>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
      for (; u + 2 <= count; u += 2) quant_blocks<2, 2>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
      for (; u < count; ++u) quant_blocks<1, 2>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
    } else {
      if (wide)
        for (; u + 8 <= count; u += 8) quant_blocks<8, 1>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
      for (; u + 4 <= count; u += 4) quant_blocks<4, 1>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
      for (; u < count; ++u) quant_blocks<1, 1>(w, a, t0 + u * ts, ts, m0, y, ldy, level);
    }
    m0 += mb;
  }
}

// A core's tiles as SPAN segments read side by side (AVX-512): a span takes the next tile of each, so each of SPAN
// streams runs through contiguous tiles (codes, scales and zeros alike) instead of ending after one tile, which
// left the prefetchers retraining on SPAN new short streams every span (int4 codes read at 15 GB/s from memory and
// 23 from cache). AVX2's blocks take adjacent tiles (half-tile units): contiguous spans there. A tile's sums are
// the same in any order of tiles.
void run_quant(const Weight& w, const Acts& a, int64_t t_begin, int64_t t_end, float* y, int64_t ldy, int level) {
  const int64_t seg = level >= ISA_AVX512 && g_quant_streams ? (t_end - t_begin) / SPAN : 0;
  for (int64_t i = 0; i < seg; ++i) quant_span(w, a, t_begin + i, SPAN, seg, y, ldy, level);
  for (int64_t t0 = t_begin + SPAN * seg; t0 < t_end; t0 += SPAN)
    quant_span(w, a, t0, std::min(SPAN, t_end - t0), 1, y, ldy, level);
}

// y [M, N] fp32 (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias), M <= MAX_M (int8-activation layers:
// any M), split over the cores.
// Given yb, a layer on AMX quantized tiles writes its outputs there instead, as bf16 bit patterns (row stride ldy;
// the rounding linear_rows would do, inside the split instead of after it on one core), and the call returns true;
// every other layer writes y and returns false. (The AMX kernel adds the bias in its store, the others after.)
bool run_prepared(const Weight& w, const Acts& a, float* y, int64_t ldy, uint16_t* yb, int level);

// amx::dense over all of w's column blocks, split over the cores in pairs of blocks.
void run_amx_dense(const Weight& w, const Acts& a, float* y, int64_t ldy, bool bf16_values) {
  at::parallel_for(0, w.N / NR / 2 + (w.N / NR) % 2, 1, [&](int64_t b, int64_t e) {
    amx::dense(w, a, 2 * b, std::min(2 * e, w.N / NR), y, ldy, bf16_values);
  });
}

bool linear_into(const Weight& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, Acts& a,
                 uint16_t* yb = nullptr) {
  if (w.int8_act) {  // any number of rows (prompt chunks: amx8::run's blocks of rows)
    TORCH_CHECK(M >= 1, "the CPU step's linear takes 1 row or more, got ", M);
    i8act::linear_into(w, x, M, ldx, y, ldy);
    return false;
  }
  TORCH_CHECK(M >= 1 && M <= MAX_M, "the CPU step's linear takes 1..64 rows, got ", M);
  const int level = isa();
  prepare(w, x, M, ldx, a, level);
  return run_prepared(w, a, y, ldy, yb, level);
}

// linear_into's kernels on activations already prepared (a).
bool run_prepared(const Weight& w, const Acts& a, float* y, int64_t ldy, uint16_t* yb, int level) {
  const int64_t M = a.M;
  if (amx_quant(w, level, M)) {
    const float* bias = w.bias.defined() && w.bias.numel() ? w.bias.data_ptr<float>() : nullptr;
    at::parallel_for(0, w.tiles(), 1, [&](int64_t t0, int64_t t1) {
      switch (w.kind) {
        case I8: return amx::quant<I8>(w, a, t0, t1, y, ldy, yb, bias);
        case FP8: return amx::quant<FP8>(w, a, t0, t1, y, ldy, yb, bias);
        default: return amx::quant<I4>(w, a, t0, t1, y, ldy, yb, bias);
      }
    });
    return yb != nullptr;
  }
  if (amx_dense(w, level, M)) {
    run_amx_dense(w, a, y, ldy, false);
  } else if (w.quantized()) {
    at::parallel_for(0, w.tiles(), 1, [&](int64_t b, int64_t e) { run_quant(w, a, b, e, y, ldy, level); });
  } else {
    const int64_t grain = std::max<int64_t>(4, 2048 / std::max<int64_t>(w.K / 64, 1));
    at::parallel_for(0, (w.N + 3) / 4, grain / 4, [&](int64_t b, int64_t e) {
      run_dense(w, a, 4 * b, std::min(4 * e, w.N), y, ldy, level);
    });
  }
  if (w.bias.defined() && w.bias.numel()) {
    const float* bp = w.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < w.N; ++n) y[m * ldy + n] += bp[n];
  }
  return false;
}

// ---- the whole step: every decoder layer, for T new tokens in each of B rows ------------------------------------

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }  // float -> T (round to nearest even for bf16)
template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

constexpr int kLanes = 16;

inline float sum_of_squares(const float* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  float total = 0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace vec512 {

inline __m512 round16(__m512 v) {  // to bf16 and back, round to nearest even (as store8)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m512 bf16_lanes(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store_rounded(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_rounded(at::BFloat16* p, __m512 v) {  // v already bf16-exact: its high halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

// rope (below) for a bf16 head whose half is a multiple of 16: its operations lane by lane, so the same bits (a
// verification's queries were ~10 % of its attention on one core, rounded one value at a time).
template <typename Out>
void rope(const at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* sin, Out* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = bf16_lanes(x + i), x2 = bf16_lanes(x + half + i), s = bf16_lanes(sin + i);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(s), _mm512_set1_epi32(INT32_MIN)));
    store_rounded(out + i, round16(_mm512_add_ps(round16(_mm512_mul_ps(x1, bf16_lanes(cos + i))),
                                                 round16(_mm512_mul_ps(x2, neg)))));
    store_rounded(out + half + i, round16(_mm512_add_ps(round16(_mm512_mul_ps(x2, bf16_lanes(cos + half + i))),
                                                        round16(_mm512_mul_ps(x1, s)))));
  }
}

}  // namespace vec512
#pragma GCC pop_options

// apply_rope for one head: x * cos + flip_halves(x) * (-sin, +sin), each product and the sum rounded to T.
template <typename T, typename Out>
void rope(const T* x, const T* cos, const T* sin, Out* out, int64_t d) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (d % 32 == 0 && isa() >= ISA_AVX512) return vec512::rope(x, cos, sin, out, d);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const T a = rnd<T>(f32(x[i]) * f32(cos[i]));
    const T b = i < half ? rnd<T>(f32(x[i + half]) * -f32(sin[i])) : rnd<T>(f32(x[i - half]) * f32(sin[i - half]));
    out[i] = static_cast<Out>(rnd<T>(f32(a) + f32(b)));
  }
}

// Where a row's cached k/v live: contiguous caches [L, B_cache, Hkv, S, D] (row b is cache row b), or paged pools
// [L, blocks, bs, Hkv, D] through the row's block table (index i at block table[i / bs], offset i % bs).
template <typename T>
struct KVView {
  T* k;
  T* v;
  int64_t layer_stride, Hkv, D, S, bs, W;
  const int32_t* tables;  // nullptr: contiguous
  inline int64_t at(int64_t b, int64_t h, int64_t i) const {
    if (!tables) return ((b * Hkv + h) * S + i) * D;
    const int64_t block = tables[b * W + i / bs];
    return ((block * bs + i % bs) * Hkv + h) * D;
  }
};

struct StepModel {
  int64_t hidden = 0, Hq = 0, Hkv = 0, D = 0;
  double eps = 1e-5;
  std::vector<at::Tensor> norms;  // 2 per layer: input, post-attention (the compute type)
  std::vector<Weight> linears;    // 4 per layer: qkv, o, gate_up, down
  int64_t layers() const { return static_cast<int64_t>(linears.size() / 4); }
};

StepModel make_step_model(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                          std::vector<at::Tensor> norms, std::vector<Weight> linears) {
  TORCH_CHECK(!linears.empty() && linears.size() % 4 == 0 && norms.size() * 2 == linears.size(),
              "4 linears and 2 norms per layer");
  StepModel m;
  m.hidden = hidden;
  m.Hq = num_heads;
  m.Hkv = num_kv_heads;
  m.D = head_dim;
  m.eps = eps;
  m.norms = std::move(norms);
  m.linears = std::move(linears);
  for (auto& n : m.norms) n = n.contiguous();
  return m;
}

// 8 lanes of a cached k or v row as fp32 (AVX2: the baseline every attention loop is compiled for).
inline __m256 lanes8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 lanes8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), lanes8(k + i), acc);
  float total = avx2::hsum(acc);
  for (; i < d; ++i) total += q[i] * f32(k[i]);
  return total;
}

template <typename T>
inline void add_row(float p, const T* v, float* acc, int64_t d) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, lanes8(v + i), _mm256_loadu_ps(acc + i)));
  for (; i < d; ++i) acc[i] += p * f32(v[i]);
}

// e^x for 8 fp32 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial; within 2 ulp of expf).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 fp32 lanes rounded to T, as fp32 (bf16: round to nearest even, as torch casts; activations are finite), kept in
// the register: a store and reload through one stack slot had chained every 8 lanes to the one before (an 8-row
// RMSNorm ~8.3k -> ~6.6k cycles a layer).
template <typename T>
inline __m256 round8(__m256 v);
template <>
inline __m256 round8<float>(__m256 v) { return v; }
template <>
inline __m256 round8<at::BFloat16>(__m256 v) {  // the top 16 bits of u + 0x7fff + (bit 16 of u)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 fp32 lanes rounded to T (round8) and stored.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8<at::BFloat16>(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// RMSNorm of the fp32 residual: fp32 x * rsqrt(mean(x^2) + eps) * w (F.rms_norm), or for bf16 layers the
// normalised value cast to bf16, then times the bf16 weight (RMSNorm.forward's mixed branch).
template <typename T>
void rms_norm(const float* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)  // the scalar loop's roundings, 8 lanes at a time
    store8(out + i, _mm256_mul_ps(round8<T>(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)), lanes8(w + i)));
  for (; i < n; ++i) out[i] = rnd<T>(f32(rnd<T>(x[i] * inv)) * f32(w[i]));
}

// SiLU(gate) * up of n values (a row of gate_up: gate, then up), each step rounded to T as the Python ops round.
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = lanes8(gate + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(out + i, _mm256_mul_ps(round8<T>(s), lanes8(up + i)));
  }
  for (; i < n; ++i) {
    const float gi = f32(gate[i]);
    out[i] = rnd<T>(f32(rnd<T>(gi / (1.0f + std::exp(-gi)))) * f32(up[i]));
  }
}

// Softmax in place of the scores of one query's visible keys, p[0, nv) packed in key order. The max, the
// exponentials and their sum run over exactly these: lane l of the sum takes keys l, l + 8, ..., every exponential
// goes through exp8 (a partial last block is masked, never a scalar tail), and each probability is e * (1 / sum).
// The result therefore depends only on the sequence of visible scores: not on the chunk's length, nor on where
// masked keys sit, so a position's attention is the same bits in a 1-token decode step, as row t of a chain, as a
// tree node (its ancestors interleaved with masked siblings) or beside other rows of a batch. Returns the sum and
// writes the max: a piece's statistics, for merging the pieces of a long context (softmax_visible, merge_pieces).
inline float softmax_packed8(float* p, int64_t nv, float* max_out) {
  __m256 m8 = _mm256_set1_ps(-INFINITY);  // the max is exact in any order: 8 lanes, then the tail
  int64_t j = 0;
  for (; j + 8 <= nv; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float mx = *std::max_element(lanes, lanes + 8);
  for (; j < nv; ++j) mx = std::max(mx, p[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < nv; i += 8) {
    const int64_t left = nv - i;
    if (left >= 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmx));
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    } else {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lane);
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + i, live), vmx)), _mm256_castsi256_ps(live));
      _mm256_maskstore_ps(p + i, live, e);
      sum = _mm256_add_ps(sum, e);
    }
  }
  const float total = avx2::hsum(sum), inv = 1.0f / total;
  for (int64_t i = 0; i < nv; ++i) p[i] *= inv;
  *max_out = mx;
  return total;
}
using Softmax = float (*)(float*, int64_t, float*);  // -> the exponentials' sum; the max through the pointer

// A run of one query's visible keys softmaxed alone: local key indices [lo, hi), its max and exponentials' sum.
struct Piece {
  int64_t lo = 0, hi = 0;
  float max = 0.0f, sum = 0.0f;
};

// One query's scores sc[0, n), masked keys -inf, to probabilities (masked: 0) through `softmax` (this ISA's
// softmax_packed8 / softmax_packed16). prefix >= 0: the visible keys are [0, prefix) (causal rows: no packing); else
// they are packed, in key order, into `packed`. The visible keys are cut, in key order, into pieces of `piece` keys,
// each softmaxed alone and recorded in `pieces` when given (piece >= n: one softmax over them all).
inline void softmax_visible(float* sc, int64_t n, int64_t prefix, std::vector<float>& packed,
                            std::vector<int64_t>& where, Softmax softmax, int64_t piece = INT64_MAX,
                            std::vector<Piece>* pieces = nullptr) {
  if (pieces) pieces->clear();
  float mx;
  if (prefix >= 0) {
    for (int64_t lo = 0; lo < prefix; lo += std::min(piece, prefix)) {
      const int64_t hi = prefix - lo <= piece ? prefix : lo + piece;
      const float sum = softmax(sc + lo, hi - lo, &mx);
      if (pieces) pieces->push_back({lo, hi, mx, sum});
    }
    std::fill(sc + prefix, sc + n, 0.0f);
    return;
  }
  packed.clear();
  where.clear();
  for (int64_t i = 0; i < n; ++i)
    if (sc[i] != -INFINITY) {
      packed.push_back(sc[i]);
      where.push_back(i);
    }
  const int64_t nv = static_cast<int64_t>(packed.size());
  for (int64_t lo = 0; lo < nv; lo += std::min(piece, nv)) {
    const int64_t hi = nv - lo <= piece ? nv : lo + piece;
    const float sum = softmax(packed.data() + lo, hi - lo, &mx);
    if (pieces) pieces->push_back({where[lo], where[hi - 1] + 1, mx, sum});
  }
  std::fill(sc, sc + n, 0.0f);
  for (int64_t j = 0; j < nv; ++j) sc[where[j]] = packed[j];
}

// The number of keys query token t of a row sees: its cached [0, start) and the new tokens its local mask allows
// (causal: j <= t).
inline int64_t visible_keys(int64_t start, int64_t count, int64_t t, const bool* local, int64_t Tn) {
  if (!local) return start + t + 1;
  int64_t n = start;
  for (int64_t j = 0; j < count; ++j) n += local[t * Tn + j];
  return n;
}

// dot_row(q, k_j, D) for 4 key rows at once (D % 8 == 0): each key's chain of FMAs in dot_row's order and the
// same horizontal sum, so the same bits; the 4 chains are independent, so their latencies overlap.
constexpr int64_t KEYS4 = 4;
template <typename T>
inline void dot4(const float* q, const T* const* k, int64_t D, float* out) {
  __m256 acc[KEYS4];
  _Pragma("GCC unroll 4") for (int j = 0; j < KEYS4; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    _Pragma("GCC unroll 4") for (int j = 0; j < KEYS4; ++j) acc[j] = _mm256_fmadd_ps(x, lanes8(k[j] + d), acc[j]);
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < KEYS4; ++j) out[j] = avx2::hsum(acc[j]);
}

constexpr int64_t VALUE_ROWS = 32;  // value rows an attention sums at a time, the sums in registers

// acc[c, c + 8R) += p[j] * v[j][c, c + 8R) for the value rows j < count that are given (nullptr: skipped), in key
// order, the sums in registers: add_row's operations (one FMA per lane per key), so the same bits.
template <int R, typename T>
inline void sum_rows(float* acc, const float* p, const T* const* v, int64_t count, int64_t c) {
  __m256 a[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + c + 8 * r);
  for (int64_t j = 0; j < count; ++j) {
    if (!v[j]) continue;
    const __m256 w = _mm256_set1_ps(p[j]);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(w, lanes8(v[j] + c + 8 * r), a[r]);
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + c + 8 * r, a[r]);
}

// sum_rows over all D channels (D % 8 == 0), 64 at a time (8 registers of sums)
template <typename T>
inline void sum_rows_all(float* acc, const float* p, const T* const* v, int64_t count, int64_t D) {
  for (int64_t c = 0; c < D; c += 64) {
    switch (std::min<int64_t>(64, D - c) / 8) {
      case 8: sum_rows<8>(acc, p, v, count, c); break;
      case 7: sum_rows<7>(acc, p, v, count, c); break;
      case 6: sum_rows<6>(acc, p, v, count, c); break;
      case 5: sum_rows<5>(acc, p, v, count, c); break;
      case 4: sum_rows<4>(acc, p, v, count, c); break;
      case 3: sum_rows<3>(acc, p, v, count, c); break;
      case 2: sum_rows<2>(acc, p, v, count, c); break;
      default: sum_rows<1>(acc, p, v, count, c);
    }
  }
}

// Attention of token t of row b for g query heads of kv head h (their roped queries q [g, D]): keys at indices
// [0, start) and the chunk's indices start + j that the row's local mask allows (causal: j <= t). Each key and
// value row is read once for the g heads. scores: scratch [g, start + count]; acc: scratch [g, D].
template <typename T>
void attend(const KVView<T>& kv, int64_t l, int64_t b, int64_t h, int64_t t, int64_t start, int64_t count,
            const bool* local, int64_t Tn, const float* q, int64_t g, float scale, T* out, int64_t out_stride,
            std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& packed,
            std::vector<int64_t>& where) {
  const int64_t D = kv.D, n = start + count;
  const T* kbase = kv.k + l * kv.layer_stride;
  const T* vbase = kv.v + l * kv.layer_stride;
  auto visible = [&](int64_t i) { return i < start || (local ? local[t * Tn + (i - start)] : i - start <= t); };
  scores.assign(g * n, -INFINITY);  // masked keys: e^-inf = 0
  const bool blocked = D % 8 == 0;  // keys 4 at a time (dot4), value sums in registers (sum_rows): the same bits
  for (int64_t i0 = 0; blocked && i0 < n; i0 += KEYS4) {
    bool seen[KEYS4];
    const T* k[KEYS4];
    for (int64_t j = 0; j < KEYS4; ++j) {  // a key past the end or masked: row 0 stands in, its score not kept
      seen[j] = i0 + j < n && visible(i0 + j);
      k[j] = kbase + kv.at(b, h, seen[j] ? i0 + j : 0);
    }
    for (int64_t head = 0; head < g; ++head) {
      float dots[KEYS4];
      dot4(q + head * D, k, D, dots);
      for (int64_t j = 0; j < KEYS4; ++j)
        if (seen[j]) scores[head * n + i0 + j] = dots[j] * scale;
    }
  }
  for (int64_t i = 0; !blocked && i < n; ++i) {
    if (!visible(i)) continue;
    const T* k = kbase + kv.at(b, h, i);
    for (int64_t head = 0; head < g; ++head) scores[head * n + i] = dot_row(q + head * D, k, D) * scale;
  }
  acc.assign(g * D, 0.0f);
  const int64_t prefix = local ? -1 : start + t + 1;  // causal: the visible keys are a prefix
  for (int64_t head = 0; head < g; ++head)
    softmax_visible(scores.data() + head * n, n, prefix, packed, where, softmax_packed8);
  for (int64_t i0 = 0; i0 < n; i0 += VALUE_ROWS) {
    const int64_t kk = std::min(VALUE_ROWS, n - i0);
    const T* v[VALUE_ROWS];
    for (int64_t j = 0; j < kk; ++j) v[j] = visible(i0 + j) ? vbase + kv.at(b, h, i0 + j) : nullptr;
    for (int64_t head = 0; head < g; ++head) {
      if (blocked) {
        sum_rows_all(acc.data() + head * D, scores.data() + head * n + i0, v, kk, D);
        continue;
      }
      for (int64_t j = 0; j < kk; ++j)
        if (v[j]) add_row(scores[head * n + i0 + j], v[j], acc.data() + head * D, D);
    }
  }
  for (int64_t head = 0; head < g; ++head)
    for (int64_t i = 0; i < D; ++i) out[head * out_stride + i] = rnd<T>(acc[head * D + i]);
}

// ---- attention's work items: queries grouped by kv head, long contexts split into key ranges ---------------------

// Whether a layer's attention (cn[b] new tokens after st[b] cached ones per row, H query heads of D channels) is
// worth splitting over the cores: below ~32k multiply-adds of scores the threads' start costs more than it saves.
inline bool attention_threaded(int64_t B, const int64_t* st, const int64_t* cn, int64_t H, int64_t D) {
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += cn[b] * (st[b] + cn[b]);
  return work * H * D >= 32768;
}

constexpr int ATTN_QB = 8;  // queries (token, head) of one row and kv head that share each key and value row read
constexpr int ATTN_QB_TILES = 16;  // ... in the AMX attention: one tile's columns
struct AttnScratch {
  std::vector<float> scores, packed, acc, q;
  std::vector<int64_t> where, rows;
  std::vector<Piece> pieces[ATTN_QB_TILES];
  alignas(32) float key[KEYS4 * 256], fresh_key[KEYS4 * 256], value[VALUE_ROWS * 256];
  alignas(64) float keys16[16 * 256], keys16f[16 * 256];  // attn512q: a block of 16 key rows (f: int4's fresh copies)
  alignas(64) int16_t q16[ATTN_QB * 256];  // int8 keys: the queries rounded to int16 (round_query) ...
  float q_factor[ATTN_QB];                  // ... and their factors
};

// An int8 cache's keys are scored against the query rounded to 16-bit integers (kv_quant.round_query, the format's
// arithmetic in every family and in the Python layers): q16[d] = round(q[d] / f), half to even, f = max |q| / 32767
// (1 for a zero query). q becomes q16 * f in place (what the fp32 attentions score with) and f is returned (the
// AVX-512 family's integer scores take it). The rounding moves an element by at most f / 2: 2^-16 of the query's
// largest, where the int8 keys' own codes are 2^-8 of theirs.
inline float round_query(float* q, int64_t D, int16_t* q16) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float f = amax > 0.0f ? amax / 32767.0f : 1.0f;
  for (int64_t d = 0; d < D; ++d) {
    q16[d] = static_cast<int16_t>(std::clamp(std::nearbyint(q[d] / f), -32767.0f, 32767.0f));
    q[d] = q16[d] * f;
  }
  return f;
}

// The attention over a quantized cache (both families) and over a full-precision one (AVX-512) splits a long context
// over the cores: a work item reads the keys [from, to) of one row and kv head, `from` a multiple of `piece` at or
// before the row's first new index (every earlier key is cached, so seen by every query: key `from` is each query's
// visible key number `from`). Each query's visible keys are cut into pieces of `piece` keys by their number in its
// own visible sequence, softmaxed and summed alone, and merged after every item has run (merge_pieces). A piece's
// keys are the same in a decode step, a chain or a tree, so the split keeps the shape invariance; a query that sees
// at most `piece` keys is one piece, computed as before.
int64_t g_kv_piece = 1024;  // set_kv_piece (tests)
struct KeyRange {
  int64_t from = 0, to = 0, piece = INT64_MAX;
};

// Whether query token t of a row sees at most one piece of keys: its output is then written in place, unmerged.
inline bool one_piece(int64_t start, int64_t count, int64_t t, const bool* local, int64_t Tn, int64_t piece) {
  return (visible_keys(start, count, t, local, Tn) - 1) / piece == 0;
}

// A query's value sums over piece k of `range` (its k-th piece inside the range): its output when it is one piece,
// else slot from / piece + k of its part (merge_pieces' layout: the D sums, then the piece `pc`'s max and sum).
template <typename T>
inline void store_piece(const float* sums, int64_t D, bool whole, T* out, float* part, const KeyRange& range,
                        size_t k, const Piece* pc) {
  if (whole) {
    for (int64_t d = 0; d < D; ++d) out[d] = rnd<T>(sums[d]);
    return;
  }
  float* dst = part + (range.from / range.piece + static_cast<int64_t>(k)) * (D + 2);
  std::copy(sums, sums + D, dst);
  dst[D] = pc->max;
  dst[D + 1] = pc->sum;
}

// A query's output from its `pieces` partial attentions (attend_quant's part layout, in piece order): piece k's
// sums weighed by its share of the whole softmax, w_k = sum_k e^(max_k - M) / (sum over j of sum_j e^(max_j - M)),
// M the largest max, added in piece order.
template <typename T>
void merge_pieces(const float* part, int64_t pieces, int64_t D, T* out) {
  float top = -INFINITY, total = 0.0f;
  for (int64_t k = 0; k < pieces; ++k) top = std::max(top, part[k * (D + 2) + D]);
  std::vector<float> w(pieces);
  for (int64_t k = 0; k < pieces; ++k) {
    w[k] = part[k * (D + 2) + D + 1] * std::exp(part[k * (D + 2) + D] - top);
    total += w[k];
  }
  for (int64_t k = 0; k < pieces; ++k) w[k] /= total;
  for (int64_t d = 0; d < D; ++d) {
    float sum = 0.0f;
    for (int64_t k = 0; k < pieces; ++k) sum += part[k * (D + 2) + d] * w[k];
    out[d] = rnd<T>(sum);
  }
}

// One layer's attention as work items: up to qb queries (token, head) of one row and kv head, so each key and
// value row read serves all of them (a row's queries per kv head split evenly: 24 in at most 16 are two items of 12,
// so 3 kv heads give 6 items, 3 a core), each over a key range of its row (pieces of g_kv_piece keys before the
// row's first new index, then the rest: 3 kv heads on 2 cores were 2 items against 1 at long contexts); split over
// the cores unless it is tiny. attend(scratch, b, h, nq, tok, mask, range, outs, parts) runs one item on its roped
// queries (scratch.q); the queries that see more than one piece are merged after every item has run.
// A causal chunk of more than ONE_PIECE_TOKENS tokens (a prompt chunk: only int8-activation models' prefill reaches
// the step so) takes its keys in one piece: it has items enough for both cores, and a query of more than one piece
// runs the vector attention alone (a 2048-token W8A8 prefill in chunks of 512 took twice its one-piece time). Its
// positions' bits then differ from a decode step's past g_kv_piece keys (summation order), as a Python-layer
// prefill's do; decode steps, chains and trees are unchanged.
constexpr int64_t ONE_PIECE_TOKENS = 64;

template <typename T, typename Attend>
void attention_items(const std::vector<int64_t>& live, int64_t B, int64_t Hkv, int64_t group, int64_t D, int64_t Tn,
                     const int64_t* st, const int64_t* cn, const bool* lm, int64_t local_stride, const T* qkv,
                     int64_t qkv_size, const T* cos_p, const T* sin_p, T* attn, int64_t q_size, Attend&& attend,
                     int64_t qb = ATTN_QB) {
  const int64_t H = Hkv * group;
  auto row_piece = [&](int64_t b) { return !lm && cn[b] > ONE_PIECE_TOKENS ? INT64_MAX : g_kv_piece; };
  std::vector<int64_t> item_row, item_first, item_count, row_first(B + 1, 0);  // row_first: the row's first index
  std::vector<KeyRange> item_keys;
  int64_t most = 1;  // pieces of the longest row
  for (int64_t b = 0; b < B; ++b) {
    row_first[b + 1] = row_first[b] + cn[b];
    if (cn[b]) most = std::max(most, (st[b] + cn[b] - 1) / row_piece(b) + 1);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv && cn[b] > 0; ++h) {
      const int64_t queries = cn[b] * group, items = (queries + qb - 1) / qb, per = (queries + items - 1) / items;
      const int64_t piece = row_piece(b);
      for (int64_t f = 0; f < queries; f += per) {
        const int64_t cached = st[b] / piece;  // whole pieces before the first new index: one item each
        const int64_t count = std::min(per, queries - f);
        // causal rows: no key past the item's last token (a prompt chunk's early items skip the keys none of their
        // queries sees; a masked key's probability is zero, so its products added nothing: the same bits)
        const int64_t last = lm ? st[b] + cn[b] : st[b] + (f + count - 1) / group + 1;
        for (int64_t k = 0; k <= cached; ++k) {
          item_row.push_back(b * Hkv + h);
          item_first.push_back(f);
          item_count.push_back(count);
          item_keys.push_back({k * piece, k < cached ? (k + 1) * piece : last, piece});
        }
      }
    }
  std::vector<float> partial(most > 1 ? live.size() * H * most * (D + 2) : 0);  // [live, H, most, D + 2]
  auto attend_items = [&](int64_t begin, int64_t end) {
    AttnScratch s;
    s.q.resize(qb * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = item_row[i] / Hkv, h = item_row[i] % Hkv;
      const int nq = static_cast<int>(item_count[i]);
      int64_t tok[ATTN_QB_TILES];
      T* outs[ATTN_QB_TILES];
      float* parts[ATTN_QB_TILES];
      for (int u = 0; u < nq; ++u) {  // query f of this (row, kv head): token f / group, head h * group + f % group
        const int64_t f = item_first[i] + u, t = f / group, head = h * group + f % group, r = row_first[b] + t;
        const int64_t row = live[r];
        tok[u] = t;
        rope(qkv + r * qkv_size + head * D, cos_p + row * D, sin_p + row * (D / 2), s.q.data() + u * D, D);
        outs[u] = attn + r * q_size + head * D;
        parts[u] = partial.empty() ? nullptr : partial.data() + (r * H + head) * most * (D + 2);
      }
      attend(s, b, h, nq, tok, lm ? lm + b * local_stride : nullptr, item_keys[i], outs, parts);
    }
  };
  const int64_t items = static_cast<int64_t>(item_row.size());
  if (attention_threaded(B, st, cn, H, D))
    at::parallel_for(0, items, 1, attend_items);
  else
    attend_items(0, items);
  if (partial.empty()) return;
  for (int64_t b = 0; b < B; ++b)  // the queries of more than one piece: merged, in piece order
    for (int64_t t = 0; t < cn[b]; ++t) {
      const int64_t pieces =
          (visible_keys(st[b], cn[b], t, lm ? lm + b * local_stride : nullptr, Tn) - 1) / row_piece(b) + 1;
      if (pieces == 1) continue;
      const int64_t r = row_first[b] + t;
      for (int64_t head = 0; head < H; ++head)
        merge_pieces(partial.data() + (r * H + head) * most * (D + 2), pieces, D, attn + r * q_size + head * D);
    }
}

// ---- attention with AVX-512: several queries per key row, values accumulated in registers ----------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace attn512 {

inline __m512 lanes16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 lanes16(const at::BFloat16* p) { return vec512::bf16_lanes(p); }

inline __m512 exp16(__m512 x) {  // exp8's Cephes expf on 16 lanes
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// softmax_packed8's contract with 16 lanes (exp16, masked tail) for up to 4 queries' scores side by side (p[q]:
// nv[q] values each; each query's max, exponentials' sum and scaling in one order whether it runs alone or among
// others, so its bits are the same). One query's passes are chains (its max, its sum) that left the core waiting
// between links: ~550 ticks a query of 257 keys, 21k of a core's ticks a layer in an 8-row step (three items of 12
// queries), where the keys' scores took 35k. The max is exact in any order: 16 lanes (a scalar loop was ~5 % of an
// 8k-token decode step).
inline void softmax_packed16_x4(float* const* p, const int64_t* nv, int nq, float* max_out, float* sum_out) {
  __m512 m16[4], sum[4], vmx[4];
  int64_t most = 0;
  for (int q = 0; q < nq; ++q) {
    most = std::max(most, nv[q]);
    m16[q] = _mm512_set1_ps(-INFINITY);
    sum[q] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j + 16 <= most; j += 16)
    for (int q = 0; q < nq; ++q)
      if (j + 16 <= nv[q]) m16[q] = _mm512_max_ps(m16[q], _mm512_loadu_ps(p[q] + j));
  for (int q = 0; q < nq; ++q) {
    float mx = _mm512_reduce_max_ps(m16[q]);
    for (int64_t j = nv[q] / 16 * 16; j < nv[q]; ++j) mx = std::max(mx, p[q][j]);
    max_out[q] = mx;
    vmx[q] = _mm512_set1_ps(mx);
  }
  for (int64_t i = 0; i < most; i += 16)
    for (int q = 0; q < nq; ++q) {
      if (i >= nv[q]) continue;
      const int64_t left = nv[q] - i;
      const __mmask16 live = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p[q] + i), vmx[q])));
      _mm512_mask_storeu_ps(p[q] + i, live, e);
      sum[q] = _mm512_add_ps(sum[q], e);
    }
  for (int q = 0; q < nq; ++q) {
    const float total = _mm512_reduce_add_ps(sum[q]), inv = 1.0f / total;
    for (int64_t i = 0; i < nv[q]; ++i) p[q][i] *= inv;
    sum_out[q] = total;
  }
}

// softmax_packed8's contract for the AVX-512 attention: softmax_packed16_x4 of one query.
inline float softmax_packed16(float* p, int64_t nv, float* max_out) {
  float total;
  softmax_packed16_x4(&p, &nv, 1, max_out, &total);
  return total;
}

// softmax_visible for the queries u < nq of an item that take(u): causal queries whose keys are one piece (0 < prefix
// <= range.piece) four at a time through softmax_packed16_x4, the others one by one.
template <typename Take>
void item_softmax(AttnScratch& s, int nq, int64_t n, const int64_t* tok, int64_t start, const bool* local,
                  const KeyRange& range, const Take& take) {
  int batch[4];
  int64_t nv[4];
  int waiting = 0;
  auto flush = [&] {
    float* p[4];
    float mx[4], sum[4];
    for (int i = 0; i < waiting; ++i) p[i] = s.scores.data() + batch[i] * n;
    softmax_packed16_x4(p, nv, waiting, mx, sum);
    for (int i = 0; i < waiting; ++i) {
      s.pieces[batch[i]].assign(1, Piece{0, nv[i], mx[i], sum[i]});
      std::fill(p[i] + nv[i], p[i] + n, 0.0f);
    }
    waiting = 0;
  };
  for (int u = 0; u < nq; ++u) {
    if (!take(u)) continue;
    const int64_t prefix = local ? -1 : std::min(range.to, start + tok[u] + 1) - range.from;
    if (prefix > 0 && prefix <= range.piece) {
      batch[waiting] = u;
      nv[waiting++] = prefix;
      if (waiting == 4) flush();
    } else {
      softmax_visible(s.scores.data() + u * n, n, prefix, s.packed, s.where, softmax_packed16, range.piece,
                      &s.pieces[u]);
    }
  }
  if (waiting) flush();
}


// The 16 lane sums of 16 vectors in one vector: lane j = the sum of v[j]'s lanes. Each lane's sum is the same tree of
// additions over its own vector's lanes whatever the other vectors hold (pairs within 128-bit quarters, then the
// quarters), so a score never depends on the keys beside it. 45 instructions for 16 sums, where one
// _mm512_reduce_add_ps per sum takes ~8 and leaves the result in a scalar.
// Add: fp32 lanes (AddPs) or int32 lanes carried in the same registers (AddEpi32: exact sums, any order gives them).
struct AddPs {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct AddEpi32 {
  __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};
template <typename Add = AddPs>
inline __m512 sum_lanes16(const __m512 (&v)[16], Add add = {}) {
  __m512 t[8], u[4];
  for (int m = 0; m < 8; ++m)  // quarter q of t[m]: (v[2m] lanes 0+2, v[2m+1] lanes 0+2, v[2m] 1+3, v[2m+1] 1+3)
    t[m] = add(_mm512_unpacklo_ps(v[2 * m], v[2 * m + 1]), _mm512_unpackhi_ps(v[2 * m], v[2 * m + 1]));
  for (int m = 0; m < 4; ++m)  // quarter q of u[m]: the quarter-q sums of v[4m .. 4m + 3]
    u[m] = add(_mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = add(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w1 = add(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return add(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query's scores against a block of 16 key rows (fp32, row j at keys + j * D, D = 16 * C), times scale: each
// key's products summed lane-wise over its C chunks in chunk order (16 independent chains), then across lanes by
// sum_lanes16.
template <int C>
inline __m512 scores16(const float* q, const float* keys, float scale) {
  constexpr int64_t D = 16 * C;
  __m512 v[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) v[j] = _mm512_mul_ps(q0, _mm512_load_ps(keys + j * D));
  _Pragma("GCC unroll 16") for (int c = 1; c < C; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j)
      v[j] = _mm512_fmadd_ps(qc, _mm512_load_ps(keys + j * D + 16 * c), v[j]);
  }
  return _mm512_mul_ps(sum_lanes16(v), _mm512_set1_ps(scale));
}

// scores16 for int8 key codes (C even): the query rounded to int16 (q16 by round_query; factor: its f times the
// softmax scale) and the codes widened to int16 (row j at keys + j * D), multiplied pairwise into int32 lanes
// (vpmaddwd) and summed as integers: exact, so each score is float(q16 . codes) * factor whatever its
// neighbours. Products |q16 * code| <= 2^22, a row of D <= 256 of them stays below 2^30.
template <int C>
inline __m512 scores16_int8(const int16_t* q16, const int16_t* keys, float factor) {
  static_assert(C % 2 == 0, "int16 rows are whole 32-lane vectors");
  constexpr int64_t D = 16 * C;
  __m512 v[16];
  const __m512i q0 = _mm512_loadu_si512(q16);
  _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j)
    v[j] = _mm512_castsi512_ps(_mm512_madd_epi16(q0, _mm512_load_si512(keys + j * D)));
  _Pragma("GCC unroll 8") for (int w = 1; w < C / 2; ++w) {
    const __m512i qw = _mm512_loadu_si512(q16 + 32 * w);
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j)
      v[j] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(v[j]),
                                                  _mm512_madd_epi16(qw, _mm512_load_si512(keys + j * D + 32 * w))));
  }
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(sum_lanes16(v, AddEpi32{}))), _mm512_set1_ps(factor));
}

// Query u's 16 scores of keys i0 .. i0 + kk - 1 (local indices from i0 - base) into its row of scores, each only
// where the query sees the key (others stay -inf). All-visible blocks (cached keys: every query sees them) and a
// causal query's blocks (it sees the keys before causal_end; -1: a tree's mask, visible() per key) take one masked
// store.
template <typename Visible>
inline void store_scores(__m512 r, float* row, int64_t i0, int64_t kk, int64_t base, int64_t start, int64_t causal_end,
                         Visible&& visible) {
  const int64_t end = i0 + kk <= start ? i0 + kk : causal_end >= 0 ? std::min(i0 + kk, causal_end) : -1;
  if (end >= 0) {
    if (end > i0) _mm512_mask_storeu_ps(row + i0 - base, static_cast<__mmask16>((1u << (end - i0)) - 1), r);
    return;
  }
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, r);
  for (int64_t j = 0; j < kk; ++j)
    if (visible(i0 + j)) row[i0 + j - base] = tmp[j];
}

// f(std::integral_constant<int, C>) for head dimension D = 16 * C where C is one of the chunk counts the AVX-512
// attentions are instantiated for (each query's value sums and each key's score chains then stay in registers);
// false, f not called, for any other D (those take the generic attention).
template <typename F>
inline bool with_chunks(int64_t D, F&& f) {
  if (D % 16) return false;
  switch (D / 16) {
    case 1: return f(std::integral_constant<int, 1>{}), true;
    case 2: return f(std::integral_constant<int, 2>{}), true;
    case 4: return f(std::integral_constant<int, 4>{}), true;
    case 6: return f(std::integral_constant<int, 6>{}), true;
    case 8: return f(std::integral_constant<int, 8>{}), true;
    case 16: return f(std::integral_constant<int, 16>{}), true;
    default: return false;
  }
}

// Whether the AVX-512 attentions take head dimension D.
inline bool chunked(int64_t D) {
  return with_chunks(D, [](auto) {});
}

// Each query's probabilities (s.scores row u, by local index i - range.from) times the value rows, summed in key
// order in registers (QP queries at a time, C chunks of 16 channels each); a query's sums for one piece are flushed
// when its next weighted key lies past the piece (or at the end): to its output when it is one piece, else to its
// part. value(i, vc) loads the value row of local index i as C vectors and returns their factor (a quantized row's
// scale; 1, so the same bits, for a full-precision row), applied to the row's weight. A zero weight adds nothing and
// is skipped, so co-queries never change a result, and rows no query weighs are never read.
template <int C, typename T, typename Value>
inline void value_sums(int nq, int64_t n, const int64_t* tok, int64_t start, int64_t count, const bool* local,
                       int64_t Tn, const KeyRange& range, T* const* out, float* const* part, AttnScratch& s,
                       Value&& value) {
  constexpr int64_t D = 16 * C;
  constexpr int QP = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // queries whose value sums stay in registers
  for (int u0 = 0; u0 < nq; u0 += QP) {
    const int nu = std::min(QP, nq - u0);
    __m512 acc[QP][C];
    size_t k[QP] = {};  // each query's piece in progress
    bool whole[QP];
    float p[QP];
    _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u) {
      whole[u] = u < nu && one_piece(start, count, tok[u0 + u], local, Tn, range.piece);
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[u][c] = _mm512_setzero_ps();
    }
    auto flush = [&](int u) {  // query u0 + u's sums of piece k[u], then zeroed for the next
      const int qu = u0 + u;
      alignas(64) float row[D];
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) {
        _mm512_store_ps(row + 16 * c, acc[u][c]);
        acc[u][c] = _mm512_setzero_ps();
      }
      store_piece(row, D, whole[u], out[qu], part[qu], range, k[u], whole[u] ? nullptr : &s.pieces[qu][k[u]]);
    };
    const float* prob[QP];
    _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u) prob[u] = s.scores.data() + (u0 + std::min(u, nu - 1)) * n;
    // Whether rows i .. i + 15 are weighed by every query (no zero weight) inside its current piece: such a block
    // runs without the per-row tests below, the same FMAs in the same order (the tests were ~15 % of an 8k-token
    // decode step). Flushes what row i would flush.
    auto block_weighed = [&](int64_t i) {
      if (i + 16 > n) return false;
      for (int u = 0; u < nu; ++u) {
        const __mmask16 nz = _mm512_cmp_ps_mask(_mm512_loadu_ps(prob[u] + i), _mm512_setzero_ps(), _CMP_NEQ_OQ);
        if (nz != 0xffff) return false;
        for (; i >= s.pieces[u0 + u][k[u]].hi; ++k[u]) flush(u);
        if (i + 16 > s.pieces[u0 + u][k[u]].hi) return false;
      }
      return true;
    };
    for (int64_t i = 0; i < n; ++i) {
      if ((i & 15) == 0 && block_weighed(i)) {
        for (int64_t j = i; j < i + 16; ++j) {
          __m512 vc[C];
          const float factor = value(j, vc);
          _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u) {
            if (u >= nu) break;
            const __m512 weight = _mm512_set1_ps(prob[u][j] * factor);
            _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[u][c] = _mm512_fmadd_ps(weight, vc[c], acc[u][c]);
          }
        }
        i += 15;
        continue;
      }
      bool any = false;
      _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u) {
        p[u] = u < nu ? prob[u][i] : 0.0f;
        any |= p[u] != 0.0f;
      }
      if (!any) continue;
      __m512 vc[C];
      const float factor = value(i, vc);
      _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u) {
        if (p[u] == 0.0f) continue;
        for (; i >= s.pieces[u0 + u][k[u]].hi; ++k[u]) flush(u);
        const __m512 weight = _mm512_set1_ps(p[u] * factor);
        _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[u][c] = _mm512_fmadd_ps(weight, vc[c], acc[u][c]);
      }
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < QP; ++u)
      if (u < nu)
        for (; k[u] < s.pieces[u0 + u].size(); ++k[u]) flush(u);
  }
}

// Attention for up to ATTN_QB queries of one row b and kv head h over the keys of `range` (attention_items): query
// u is q[u] (roped, fp32, D = 16 * C floats) of token tok[u]; it sees key indices [0, start) and start + j where its
// local mask allows (causal: j <= tok[u]). Key rows 16 at a time widened to fp32, each query's 16 scores of them
// (scores16), softmaxed piece by piece (softmax_visible), value sums in registers (value_sums).
template <int C, typename T>
void attend_chunks(const KVView<T>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok, int64_t start,
                   int64_t count, const bool* local, int64_t Tn, const float* q, float scale, const KeyRange& range,
                   T* const* out, float* const* part, AttnScratch& s) {
  constexpr int64_t D = 16 * C;
  const int64_t from = range.from, n = range.to - from;  // scores by i - from
  const T* kbase = kv.k + l * kv.layer_stride;
  const T* vbase = kv.v + l * kv.layer_stride;
  auto visible = [&](int u, int64_t i) {
    return i < start || (local ? local[tok[u] * Tn + (i - start)] : i - start <= tok[u]);
  };
  s.scores.assign(nq * n, -INFINITY);  // the queries' rows; masked keys stay -inf: e^-inf = 0
  for (int64_t i0 = from; i0 < range.to; i0 += 16) {  // 16 key rows widened to fp32, then each query's 16 scores
    const int64_t kk = std::min<int64_t>(16, range.to - i0);
    for (int64_t j = 0; j < 16; ++j) {
      const T* k = j < kk ? kbase + kv.at(b, h, i0 + j) : nullptr;
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c)
        _mm512_store_ps(s.keys16 + j * D + 16 * c, k ? lanes16(k + 16 * c) : _mm512_setzero_ps());
    }
    for (int u = 0; u < nq; ++u)
      store_scores(scores16<C>(q + u * D, s.keys16, scale), s.scores.data() + u * n, i0, kk, from, start,
                   local ? -1 : start + tok[u] + 1, [&](int64_t i) { return visible(u, i); });
  }
  item_softmax(s, nq, n, tok, start, local, range, [](int) { return true; });
  value_sums<C>(nq, n, tok, start, count, local, Tn, range, out, part, s, [&](int64_t i, __m512 (&vc)[C]) {
    const T* v = vbase + kv.at(b, h, from + i);
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) vc[c] = lanes16(v + 16 * c);
    return 1.0f;
  });
}

template <typename T>
void attend(const KVView<T>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok, int64_t start,
            int64_t count, const bool* local, int64_t Tn, const float* q, float scale, const KeyRange& range,
            T* const* out, float* const* part, AttnScratch& s) {
  with_chunks(kv.D, [&](auto c) {
    attend_chunks<decltype(c)::value>(kv, l, b, h, nq, tok, start, count, local, Tn, q, scale, range, out, part, s);
  });
}

// silu_mul on 16 lanes: the same operations lane by lane (exp16 is exp8's), so the same bits; the last n % 16
// values take silu_mul itself (its 8-lane blocks start at multiples of 8 there too).
using vec512::round16;
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) { vec512::store_rounded(p, round16(v)); }
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = lanes16(gate + i);
    __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if constexpr (!std::is_same_v<T, float>) sg = round16(sg);
    store16(out + i, _mm512_mul_ps(sg, lanes16(up + i)));
  }
  if (i < n) qspec::silu_mul(gate + i, up + i, out + i, n - i);
}

}  // namespace attn512
#pragma GCC pop_options

// ---- attention with AMX tiles (bf16 caches) --------------------------------------------------------------------
// Scores: C [16 keys, 16 queries] = K [16 keys, 32 channels] (tile-loaded from the cache in place) . Q^T [16 channel
// pairs, 16 queries] (the item's queries rounded to bf16, as the Python layers' bf16 attention holds them), chunk
// after chunk of 32 channels, times the scale. Values: O [16 queries, 16 channels] += P [16 queries, 32 keys] (each
// probability rounded to bf16, as a bf16 SDPA rounds them) . V [16 key pairs, 16 channels] (two value rows
// interleaved), key block after key block. A query is a column of the score tile and a row of the value tiles: its
// sums never meet another query's, so its bits are the same alone (a decode step) and among a verification's, which
// the vector attention bought with a horizontal sum per query and 16 keys (~30 shuffles) and a broadcast and C FMAs
// per query and value row: an 8-query item cost ~3x a decode step's 3-query item, most of an 8-row step's extra time
// after the linears. A query that sees more than one piece of keys (a context past g_kv_piece) takes the vector
// attention (attn512::attend, alone: co-queries never change its result), so long contexts keep their kernel.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace attn_amx {

inline bool fits(int64_t D) { return D % 32 == 0 && D <= 128; }  // Q^T resident in 4 tiles at most

// The value tiles' channel order: unpacklo/hi_epi16 of two value rows' 32 channels give tile 2z the channels 32z +
// {0-3, 8-11, 16-19, 24-27} and tile 2z + 1 the channels 32z + {4-7, 12-15, 20-23, 28-31}; these put them back.
inline void unpermute(const float* lo, const float* hi, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_load_ps(lo), b = _mm512_load_ps(hi);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(a, first, b));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(a, second, b));
}

// One block of 16 keys' scores: accumulator ACC = keys (tile KEY, chunk after chunk of 32 channels) . Q^T (the
// resident tiles 2 .. 1 + chunks). Even and odd blocks take other tiles, so a block's matmuls queue while the one
// before is stored and spread.
// (GCC's tile intrinsics paste their tile numbers into the assembly: a macro, not a template, makes the two)
#define QSPEC_SCORE_BLOCK(NAME, ACC, KEY)                                     \
  inline void NAME(const uint16_t* keys, int64_t stride_bytes, int64_t chunks) { \
    _tile_zero(ACC);                                                          \
    _tile_loadd(KEY, keys, stride_bytes);                                     \
    _tile_dpbf16ps(ACC, KEY, 2);                                              \
    if (chunks < 2) return;                                                   \
    _tile_loadd(KEY, keys + 32, stride_bytes);                                \
    _tile_dpbf16ps(ACC, KEY, 3);                                              \
    if (chunks < 3) return;                                                   \
    _tile_loadd(KEY, keys + 64, stride_bytes);                                \
    _tile_dpbf16ps(ACC, KEY, 4);                                              \
    if (chunks < 4) return;                                                   \
    _tile_loadd(KEY, keys + 96, stride_bytes);                                \
    _tile_dpbf16ps(ACC, KEY, 5);                                              \
  }
QSPEC_SCORE_BLOCK(score_block_even, 0, 1)
QSPEC_SCORE_BLOCK(score_block_odd, 7, 6)
#undef QSPEC_SCORE_BLOCK

inline void value_product(int t, const void* v) {  // accumulator t += P (tile 4) . V pairs (tiles 5 and 7 in turn)
  switch (t) {
    case 0: _tile_loadd(5, v, 64); _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_loadd(7, v, 64); _tile_dpbf16ps(1, 4, 7); break;
    case 2: _tile_loadd(5, v, 64); _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_loadd(7, v, 64); _tile_dpbf16ps(3, 4, 7); break;
  }
}
inline void value_store(int t, float (*c)[16]) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}

inline void prefetch_rows(const uint16_t* base, const KVView<at::BFloat16>& kv, int64_t b, int64_t h, int64_t i0,
                          int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const char* row = reinterpret_cast<const char*>(base + kv.at(b, h, i));
    for (int64_t line = 0; line < kv.D * 2; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
  }
}

// attn512::attend's contract (attention_items' item: up to ATTN_QB_TILES queries of row b and kv head h over
// `range`) for a bf16 cache.
inline void attend(const KVView<at::BFloat16>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok,
                   int64_t start, int64_t count, const bool* local, int64_t Tn, const float* q, float scale,
                   const KeyRange& range, at::BFloat16* const* out, float* const* part, AttnScratch& s) {
  const int64_t D = kv.D, chunks = D / 32, channel_tiles = D / 16;
  bool whole[ATTN_QB_TILES];
  int wholes = 0;
  for (int u = 0; u < nq; ++u) wholes += whole[u] = one_piece(start, count, tok[u], local, Tn, range.piece);
  auto vector_attention = [&](int u0, int m) {  // queries u0 .. u0 + m - 1 by attn512 (ATTN_QB at a time)
    for (int u = u0; u < u0 + m; u += ATTN_QB)
      attn512::attend(kv, l, b, h, std::min(ATTN_QB, u0 + m - u), tok + u, start, count, local, Tn, q + u * D, scale,
                      range, out + u, part + u, s);
  };
  if (wholes == 0) return vector_attention(0, nq);
  const int64_t from = range.from, n = range.to - from;
  const uint16_t* kbase = reinterpret_cast<const uint16_t*>(kv.k + l * kv.layer_stride);
  const uint16_t* vbase = reinterpret_cast<const uint16_t*>(kv.v + l * kv.layer_stride);
  const int64_t row_stride = kv.tables ? kv.Hkv * D : D;  // between a head's consecutive keys (within a page)
  auto visible = [&](int u, int64_t i) {
    return i < start || (local ? local[tok[u] * Tn + (i - start)] : i - start <= tok[u]);
  };
  amx::Tiles tiles;
  alignas(64) uint32_t qpairs[ATTN_QB_TILES][64];  // each query's channel pairs in bf16 (round to nearest even)
  alignas(64) uint32_t qt[4][16][16];  // Q^T per chunk of 32 channels: [channel pair, query]
  for (int u = 0; u < nq; ++u)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh bits = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + u * D + d + 16), _mm512_loadu_ps(q + u * D + d));
      _mm512_store_si512(qpairs[u] + d / 2, reinterpret_cast<const __m512i&>(bits));
    }
  const __mmask16 queries = static_cast<__mmask16>((1u << nq) - 1);
  const __m512i query_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(64));
  for (int64_t c = 0; c < chunks; ++c)
    for (int r = 0; r < 16; ++r)  // absent queries' columns zero
      _mm512_store_si512(qt[c][r], _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), queries, query_rows,
                                                               qpairs[0] + 16 * c + r, 4));
  _tile_loadd(2, qt[0], 64);
  if (chunks > 1) _tile_loadd(3, qt[1], 64);
  if (chunks > 2) _tile_loadd(4, qt[2], 64);
  if (chunks > 3) _tile_loadd(5, qt[3], 64);
  alignas(64) float ct[16][16];
  alignas(64) uint16_t staged[2][16 * 128];
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  s.scores.assign(nq * n, -INFINITY);
  const int64_t blocks = (n + 15) / 16;
  auto spread = [&](int64_t j) {  // block j's scores (ct: [key, query]) into the queries' rows
    const int64_t i0 = from + 16 * j, kk = std::min<int64_t>(16, range.to - i0);
    __m512 rows[16];
    if (nq > 4) {  // a transpose (64 shuffles) beats more than 4 gathers
      for (int i = 0; i < 16; ++i) rows[i] = _mm512_load_ps(ct[i]);
      amx::transpose16(rows);
    }
    for (int u = 0; u < nq; ++u)
      if (whole[u])
        attn512::store_scores(_mm512_mul_ps(nq > 4 ? rows[u] : _mm512_i32gather_ps(column, &ct[0][u], 4), vscale),
                              s.scores.data() + u * n, i0, kk, from, start, local ? -1 : start + tok[u] + 1,
                              [&](int64_t i) { return visible(u, i); });
  };
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t i0 = from + 16 * j, kk = std::min<int64_t>(16, range.to - i0);
    prefetch_rows(kbase, kv, b, h, std::min(range.to, i0 + 32), std::min(range.to, i0 + 48));
    const uint16_t* keys = staged[j % 2];
    int64_t stride = D;
    if (kk == 16 && (!kv.tables || i0 / kv.bs == (i0 + 15) / kv.bs)) {  // 16 rows at one stride: read in place
      keys = kbase + kv.at(b, h, i0);
      stride = row_stride;
    } else {
      for (int64_t r = 0; r < 16; ++r)
        if (r < kk)
          std::memcpy(staged[j % 2] + r * D, kbase + kv.at(b, h, i0 + r), D * sizeof(uint16_t));
        else
          std::memset(staged[j % 2] + r * D, 0, D * sizeof(uint16_t));
    }
    if (j % 2 == 0)
      score_block_even(keys, stride * 2, chunks);
    else
      score_block_odd(keys, stride * 2, chunks);
    if (j == 0) continue;
    if (j % 2 == 1)
      _tile_stored(0, ct, 64);
    else
      _tile_stored(7, ct, 64);
    spread(j - 1);
  }
  if ((blocks - 1) % 2 == 0)
    _tile_stored(0, ct, 64);
  else
    _tile_stored(7, ct, 64);
  spread(blocks - 1);
  attn512::item_softmax(s, nq, n, tok, start, local, range, [&](int u) { return whole[u]; });
  alignas(64) uint16_t pt[2][16][32];  // P per block of 32 keys: [query, key]; rows of absent or other queries zero
  alignas(64) uint16_t vt[2][4][16][32];  // V pairs per channel tile: [key pair, 2 * channel + key % 2]
  alignas(64) float ot[4][16][16];
  alignas(64) float sums[ATTN_QB_TILES][128];
  std::memset(pt, 0, sizeof(pt));
  const int64_t vblocks = (n + 31) / 32;
  for (int64_t c0 = 0; c0 < channel_tiles; c0 += 4) {  // up to 4 tiles (64 channels) of sums at a time
    const int nt = static_cast<int>(std::min<int64_t>(4, channel_tiles - c0));
    auto build = [&](int64_t j) {  // block j's P rows and value pairs into buffer j % 2
      const int64_t i0 = 32 * j, kk = std::min<int64_t>(32, n - i0);
      prefetch_rows(vbase, kv, b, h, from + std::min(n, i0 + 64), from + std::min(n, i0 + 96));
      const __mmask16 lo = kk >= 16 ? 0xffff : static_cast<__mmask16>((1u << kk) - 1);
      const __mmask16 hi = kk >= 32 ? 0xffff : kk <= 16 ? 0 : static_cast<__mmask16>((1u << (kk - 16)) - 1);
      for (int u = 0; u < nq; ++u) {
        if (!whole[u]) continue;
        const float* p = s.scores.data() + u * n + i0;
        const __m512bh bits = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p));
        _mm512_store_si512(pt[j % 2][u], reinterpret_cast<const __m512i&>(bits));
      }
      for (int r = 0; r < 16; ++r) {  // key pair (i0 + 2r, i0 + 2r + 1): absent keys are zero rows
        const uint16_t* va = 2 * r < kk ? vbase + kv.at(b, h, from + i0 + 2 * r) + 16 * c0 : nullptr;
        const uint16_t* vb = 2 * r + 1 < kk ? vbase + kv.at(b, h, from + i0 + 2 * r + 1) + 16 * c0 : nullptr;
        for (int z = 0; z < nt / 2; ++z) {
          const __m512i x = va ? _mm512_loadu_si512(va + 32 * z) : _mm512_setzero_si512();
          const __m512i y = vb ? _mm512_loadu_si512(vb + 32 * z) : _mm512_setzero_si512();
          _mm512_store_si512(vt[j % 2][2 * z][r], _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(vt[j % 2][2 * z + 1][r], _mm512_unpackhi_epi16(x, y));
        }
      }
    };
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    build(0);
    for (int64_t j = 0; j < vblocks; ++j) {
      if (j + 1 < vblocks) build(j + 1);  // stored while block j's tiles load and multiply
      _tile_loadd(4, pt[j % 2], 64);
      for (int t = 0; t < nt; ++t) value_product(t, vt[j % 2][t]);
    }
    for (int t = 0; t < nt; ++t) value_store(t, ot[t]);
    for (int u = 0; u < nq; ++u)
      if (whole[u])
        for (int z = 0; z < nt / 2; ++z) unpermute(ot[2 * z][u], ot[2 * z + 1][u], sums[u] + 16 * c0 + 32 * z);
  }
  for (int u = 0; u < nq; ++u)
    if (whole[u]) store_piece(sums[u], D, true, out[u], part[u], range, 0, nullptr);
  for (int u = 0; u < nq; ++u)  // the queries of more than one piece: the vector attention, each alone
    if (!whole[u]) vector_attention(u, 1);
}

}  // namespace attn_amx
#pragma GCC pop_options

// ---- quantized KV caches (runtime/kv_quant.py's KVPool): written and read in place ------------------------------
// The step quantizes each new token's k/v exactly as kv_quant.py does (fp32 math in the same order, torch.round's
// round-half-to-even, fp16 scales rounded to nearest even, e4m3 by round to nearest even) and its attention
// dequantizes one cached row at a time into an fp32 scratch row, with the values kv_quant's read gives (code * scale
// (+ min), each operation rounded to fp32 as torch's ops round; the AVX-512 attention applies an int8 / FP8 row's
// scale once to its score and its weight, attn512q::row16): no full-precision copy of the cache exists.
// Attention over those rows follows the full-precision attention's contract (scores of the visible keys in key
// order, softmax_packed8/16, values summed in key order), so it is row- and shape-invariant too.

enum KvFormat : int64_t { KV_INT8 = 1, KV_FP8 = 2, KV_INT4 = 3 };

inline float half_value(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t half_bits(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

// kv_quant._scale: fp16(amax / qmax), 1 where amax is 0 (a zero row stays exactly zero)
inline uint16_t scale_bits(float amax, float qmax) { return half_bits(amax > 0 ? amax / qmax : 1.0f); }

// fp32 -> float8_e4m3fn by round to nearest even (torch's cast), for |v| <= 448 (kv_quant clamps first)
inline uint8_t e4m3_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &u, 4);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // subnormals: steps of 2^-9
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even (a carry bumps the exponent)
  return sign | static_cast<uint8_t>((u >> 20) - (120u << 3));  // exponent bias 127 -> 7
}

// kv_quant.quantize_int8 / quantize_fp8 of one row of D values: codes and the fp16 scale's bits
template <typename T>
void quantize_scaled_row(const T* x, int64_t D, bool fp8, uint8_t* codes, uint16_t* scale) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(f32(x[d])));
  const float qmax = fp8 ? 448.0f : 127.0f;
  *scale = scale_bits(amax, qmax);
  const float s = half_value(*scale);
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::min(std::max(f32(x[d]) / s, -qmax), qmax);
    codes[d] = fp8 ? e4m3_bits(r) : static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(r)));
  }
}

// kv_quant.quantize_asym4 over n values x[i * stride]: codes in [0, 15], fp16 scale (max - min) / 15 and fp16 min
template <typename T>
void quantize_asym4(const T* x, int64_t n, int64_t stride, uint8_t* codes, uint16_t* scale, uint16_t* low) {
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, f32(x[i * stride]));
    hi = std::max(hi, f32(x[i * stride]));
  }
  *scale = scale_bits(hi - lo, 15.0f);
  *low = half_bits(lo);
  const float s = half_value(*scale), m = half_value(*low);
  for (int64_t i = 0; i < n; ++i)
    codes[i] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((f32(x[i * stride]) - m) / s), 0.0f), 15.0f));
}

// kv_quant.pack_int4: channel 2i in the low nibble, 2i + 1 in the high one
inline void pack_nibbles(const uint8_t* codes, int64_t D, uint8_t* out) {
  for (int64_t d = 0; d < D; d += 2) out[d / 2] = static_cast<uint8_t>(codes[d] | (codes[d + 1] << 4));
}

// 8 fp16 values (bits) as fp32
inline __m256 halves8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 16 int4 codes (8 bytes, low nibble first) as two blocks of 8 fp32
inline void nibbles16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
}

// kv_quant.dequantize_scaled of one row: code * scale (int8, or e4m3 decoded exactly through fp16: value / 256)
inline void dequant_scaled_row(const uint8_t* c, bool fp8, float s, float* out, int64_t D) {
  if (!fp8) {
    const __m256 vs = _mm256_set1_ps(s);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + d)));
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
    return;
  }
  const __m256 vs = _mm256_set1_ps(s * 256.0f);  // exact: (value / 256) * (s * 256) rounds as value * s
  for (int64_t d = 0; d < D; d += 8) {
    // e4m3 byte b -> fp16 bits (b & 0x7f) << 7 | (b & 0x80) << 8 in two operations: b sign-extended and shifted
    // by 7 puts the magnitude at bits 7-13 and, for a negative b, ones at bits 14 and 15; the mask keeps bit 15
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + d)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
  }
}

// kv_quant.dequantize_asym4 of one row: code * scale + min (a multiply, then an add: no fused rounding);
// scale / min per channel (keys: fp16 rows) or one per row (values: broadcast, stride 0)
inline void dequant_asym4_row(const uint8_t* c, const uint16_t* s, const uint16_t* m, bool per_channel, float* out,
                              int64_t D) {
  const __m256 vs = _mm256_set1_ps(half_value(*s)), vm = _mm256_set1_ps(half_value(*m));  // per row
  for (int64_t d = 0; d < D; d += 16) {
    __m256 lo, hi;
    nibbles16(c + d / 2, lo, hi);
    const __m256 s0 = per_channel ? halves8(s + d) : vs, s1 = per_channel ? halves8(s + d + 8) : vs;
    const __m256 m0 = per_channel ? halves8(m + d) : vm, m1 = per_channel ? halves8(m + d + 8) : vm;
    _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(lo, s0), m0));
    _mm256_storeu_ps(out + d + 8, _mm256_add_ps(_mm256_mul_ps(hi, s1), m1));
  }
}

template <typename T>
inline void widen_row(const T* x, float* out, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, lanes8(x + d));
}

// A KVPool in one of the quantized formats (layouts in runtime/kv_quant.py), read through block tables (the
// contiguous QuantizedKVCache is a pool with row-by-row tables). int4: open_of says which residual slot holds an
// open block's keys; the blocks this write seals (stage_of >= 0) keep their full-precision keys in `stage` for
// the queries that read them in full precision (a query at index i reads a sealed key j so while
// j >= fresh_from(i), as in token-by-token decoding; kv_quant's module docstring).
template <typename T>
struct QuantKV {
  int64_t format = KV_INT8, Hkv = 0, D = 0, bs = 0, W = 0, lookahead = 0;
  const int32_t* tables = nullptr;
  uint8_t *k = nullptr, *v = nullptr;  // codes: [L, N, Hkv, bs, D] (int4: D / 2 bytes): a head's rows adjacent
  uint16_t *k_scale = nullptr, *v_scale = nullptr, *k_min = nullptr, *v_min = nullptr;  // fp16 bits
  T *k_open = nullptr, *stage = nullptr;  // int4: [L, M, bs, Hkv, D], [L, ns, bs, Hkv, D]
  const int64_t *open_of = nullptr, *stage_of = nullptr, *seal_blocks = nullptr;
  int64_t n_seal = 0;
  int64_t code_layer = 0, token_layer = 0, group_layer = 0, open_layer = 0, stage_layer = 0;  // per-layer strides

  int64_t row_bytes() const { return format == KV_INT4 ? D / 2 : D; }
  int64_t slot(int64_t b, int64_t i) const { return static_cast<int64_t>(tables[b * W + i / bs]) * bs + i % bs; }
  // per-token tensors are stored head-major within a block ([L, N, Hkv, bs, ...], runtime/kv_quant.py): one kv
  // head's rows are adjacent, so the attention streams them
  int64_t token_at(int64_t l, int64_t slot, int64_t h) const {
    return l * token_layer + ((slot / bs) * Hkv + h) * bs + slot % bs;
  }
  int64_t code_at(int64_t l, int64_t slot, int64_t h) const { return l * code_layer + token_at(0, slot, h) * row_bytes(); }
  // int4: the first index whose sealed keys query index i still reads in full precision
  int64_t fresh_from(int64_t i) const {
    const int64_t x = i + 1 - lookahead;
    return x <= 0 ? 0 : x / bs * bs;
  }
  // the full-precision key row (compute type) where int4 keeps one: an open block's residual, or nullptr. A
  // position is (block, o): its pool block (the table's entry) and offset in it, slot = block * bs + o; the
  // attention walks them, so no division per key (five 64-bit divisions a key before: int4's cost at 256 keys).
  const T* open_key(int64_t l, int64_t block, int64_t o, int64_t h) const {
    const int64_t open = open_of[block];
    return open < 0 ? nullptr : k_open + l * open_layer + ((open * bs + o) * Hkv + h) * D;
  }
  const T* staged_key(int64_t l, int64_t block, int64_t o, int64_t h) const {
    const int64_t s = stage_of[block];
    return s < 0 ? nullptr : stage + l * stage_layer + ((s * bs + o) * Hkv + h) * D;
  }
  // the codes of layer l's key (or value) row `row`: the position's (block, head, offset) index, token_at(0, slot,
  // h), as walk_rows gives it; and, int8 / FP8, the row's scale
  const uint8_t* codes(bool key, int64_t l, int64_t row) const { return (key ? k : v) + l * code_layer + row * row_bytes(); }
  float row_scale(bool key, int64_t l, int64_t row) const {
    return half_value((key ? k_scale : v_scale)[l * token_layer + row]);
  }
  // key row of pool block `block` from its codes (int4: the block's per-channel scale and min), as fp32
  void key_codes(int64_t l, int64_t block, int64_t h, int64_t row, float* out) const {
    const uint8_t* c = codes(true, l, row);
    if (format != KV_INT4) return dequant_scaled_row(c, format == KV_FP8, row_scale(true, l, row), out, D);
    const int64_t g = l * group_layer + (block * Hkv + h) * D;
    dequant_asym4_row(c, k_scale + g, k_min + g, true, out, D);
  }
  void value_row(int64_t l, int64_t row, float* out) const {  // row as key_codes'
    const uint8_t* c = codes(false, l, row);
    if (format != KV_INT4) return dequant_scaled_row(c, format == KV_FP8, row_scale(false, l, row), out, D);
    const int64_t t = l * token_layer + row;
    dequant_asym4_row(c, v_scale + t, v_min + t, false, out, D);
  }
  // each position's row index for kv head h of sequence b, positions [from, to) (rows[i - from]), walked block by
  // block: no division per row in the attention's loops (four 64-bit divisions per row and pass before: the int8 KV
  // cost at long context)
  void walk_rows(int64_t b, int64_t h, int64_t from, int64_t to, std::vector<int64_t>& rows) const {
    rows.resize(to - from);
    for (int64_t i = from; i < to;) {
      const int64_t j = i / bs, base = (static_cast<int64_t>(tables[b * W + j]) * Hkv + h) * bs;
      for (int64_t o = i - j * bs; o < bs && i < to; ++o, ++i) rows[i - from] = base + o;
    }
  }
};

// Write one token's k (roped) and v for kv head h at sequence index i of row b. int4: values quantized per token;
// keys go to the open block's residual, or to the stage of a block this write seals (sealed after every write).
template <typename T>
void write_quant(const QuantKV<T>& kv, int64_t l, int64_t b, int64_t i, int64_t h, const T* key, const T* value) {
  const int64_t D = kv.D, slot = kv.slot(b, i), t = kv.token_at(l, slot, h);
  if (kv.format != KV_INT4) {
    quantize_scaled_row(key, D, kv.format == KV_FP8, kv.k + kv.code_at(l, slot, h), kv.k_scale + t);
    quantize_scaled_row(value, D, kv.format == KV_FP8, kv.v + kv.code_at(l, slot, h), kv.v_scale + t);
    return;
  }
  uint8_t codes[512];
  quantize_asym4(value, D, 1, codes, kv.v_scale + t, kv.v_min + t);
  pack_nibbles(codes, D, kv.v + kv.code_at(l, slot, h));
  T* dst = const_cast<T*>(kv.staged_key(l, slot / kv.bs, slot % kv.bs, h));
  if (!dst) dst = const_cast<T*>(kv.open_key(l, slot / kv.bs, slot % kv.bs, h));
  TORCH_CHECK(dst, "int4 KV: a key written to a sealed block with no residual slot (the write plan is stale)");
  std::copy(key, key + D, dst);
}

// int4: quantize the keys of the blocks this write seals (kv_quant.KVPool._seal: per channel over the block's
// tokens) from their stage, after every token of the layer is written.
template <typename T>
void seal_int4(const QuantKV<T>& kv, int64_t l) {
  const int64_t D = kv.D, bs = kv.bs, Hkv = kv.Hkv;
  std::vector<uint8_t> lo(bs), hi(bs);
  for (int64_t s = 0; s < kv.n_seal; ++s) {
    const int64_t block = kv.seal_blocks[s];
    const T* keys = kv.stage + l * kv.stage_layer + s * bs * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; d += 2) {
        const int64_t g = l * kv.group_layer + (block * Hkv + h) * D + d;
        quantize_asym4(keys + h * D + d, bs, Hkv * D, lo.data(), kv.k_scale + g, kv.k_min + g);
        quantize_asym4(keys + h * D + d + 1, bs, Hkv * D, hi.data(), kv.k_scale + g + 1, kv.k_min + g + 1);
        for (int64_t j = 0; j < bs; ++j)
          kv.k[kv.code_at(l, block * bs + j, h) + d / 2] = static_cast<uint8_t>(lo[j] | (hi[j] << 4));
      }
  }
}

// Attention for up to ATTN_QB queries of row b and kv head h over a quantized cache (attn512::attend's contract: query u
// is q[u] of token tok[u], sees indices [0, start) and the new tokens its local mask allows), over the keys of
// `range`. Key rows are dequantized KEYS4 at a time into scratch, each query's scores of them taken as independent
// chains (dot4); value rows VALUE_ROWS at a time, each query's sums kept in registers over them, 64 channels at a
// time. int4 queries read a sealed-now key in full precision from j >= fresh_from (their own rule), the others its
// codes. Every score and every channel's sum is formed as the one-row-at-a-time loop formed it (dot_row, add_row),
// so the blocking changes no bit. A query that is one piece gets its output; else each of its pieces in range goes
// to part[u] + piece number * (D + 2): the sums, then the piece's max and exponentials' sum.
template <typename T>
void attend_quant(const QuantKV<T>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok, int64_t start,
                  int64_t count, const bool* local, int64_t Tn, const float* q, float scale, KeyRange range,
                  T* const* out, float* const* part, AttnScratch& s, Softmax softmax) {
  const int64_t D = kv.D, from = range.from, n = range.to - from;  // scores and rows by local index i - from
  auto visible = [&](int u, int64_t i) {
    return i < start || (local ? local[tok[u] * Tn + (i - start)] : i - start <= tok[u]);
  };
  int64_t fresh[ATTN_QB];
  for (int u = 0; u < nq; ++u) fresh[u] = kv.format == KV_INT4 ? kv.fresh_from(start + tok[u]) : range.to;
  kv.walk_rows(b, h, from, range.to, s.rows);
  s.scores.assign(nq * n, -INFINITY);  // the queries' rows; masked keys stay -inf: e^-inf = 0
  int64_t block = kv.tables[b * kv.W + from / kv.bs], o = from % kv.bs - 1;  // position i's block and offset, walked
  for (int64_t i0 = from; i0 < range.to; i0 += KEYS4) {
    const int64_t kk = std::min(KEYS4, range.to - i0);
    bool seen[KEYS4] = {}, staged[KEYS4] = {};
    for (int64_t j = 0; j < KEYS4; ++j) {
      const int64_t i = i0 + j;
      float* key = s.key + j * D;
      if (j < kk) {
        if (++o == kv.bs) {
          o = 0;
          block = kv.tables[b * kv.W + i / kv.bs];  // one division a block
        }
        for (int u = 0; u < nq; ++u) seen[j] |= visible(u, i);
      }
      if (!seen[j]) {  // past the end or masked for every query: a zero row, its scores not kept
        std::fill(key, key + D, 0.0f);
        continue;
      }
      const T* open = kv.format == KV_INT4 ? kv.open_key(l, block, o, h) : nullptr;  // int4's residual, by block
      const T* stage = kv.format == KV_INT4 && !open ? kv.staged_key(l, block, o, h) : nullptr;
      if (open)
        widen_row(open, key, D);
      else
        kv.key_codes(l, block, h, s.rows[i - from], key);
      if (stage) widen_row(stage, s.fresh_key + j * D, D);
      staged[j] = stage != nullptr;
    }
    for (int u = 0; u < nq; ++u) {
      const float* rows[KEYS4];
      for (int64_t j = 0; j < KEYS4; ++j)
        rows[j] = (staged[j] && i0 + j >= fresh[u] ? s.fresh_key : s.key) + j * D;
      float dots[KEYS4];
      dot4(q + u * D, rows, D, dots);
      for (int64_t j = 0; j < KEYS4; ++j)
        if (seen[j] && visible(u, i0 + j)) s.scores[u * n + i0 + j - from] = dots[j] * scale;
    }
  }
  size_t most = 1;  // pieces a query has in range
  for (int u = 0; u < nq; ++u) {  // causal queries see a prefix of the keys: no packing
    const int64_t prefix = local ? -1 : std::min(range.to, start + tok[u] + 1) - from;
    softmax_visible(s.scores.data() + u * n, n, prefix, s.packed, s.where, softmax, range.piece, &s.pieces[u]);
    most = std::max(most, s.pieces[u].size());
  }
  s.acc.assign(nq * most * D, 0.0f);
  for (int64_t i0 = 0; i0 < n; i0 += VALUE_ROWS) {
    const int64_t kk = std::min(VALUE_ROWS, n - i0);
    for (int64_t j = 0; j < kk; ++j) {
      bool any = false;
      for (int u = 0; u < nq; ++u) any |= s.scores[u * n + i0 + j] != 0.0f;
      if (any) kv.value_row(l, s.rows[i0 + j], s.value + j * D);  // rows no query weighs are never read
    }
    for (int u = 0; u < nq; ++u) {
      const float* p = s.scores.data() + u * n + i0;
      for (size_t k = 0; k < s.pieces[u].size(); ++k) {
        const Piece& pc = s.pieces[u][k];
        if (pc.hi <= i0 || pc.lo >= i0 + kk) continue;
        const float* rows[VALUE_ROWS];
        for (int64_t j = 0; j < kk; ++j)  // a zero weight adds nothing: skipped, so co-queries never change a result
          rows[j] = p[j] != 0.0f && i0 + j >= pc.lo && i0 + j < pc.hi ? s.value + j * D : nullptr;
        sum_rows_all(s.acc.data() + (u * most + k) * D, p, rows, kk, D);
      }
    }
  }
  for (int u = 0; u < nq; ++u) {
    const bool whole = one_piece(start, count, tok[u], local, Tn, range.piece);
    for (size_t k = 0; k < (whole ? 1 : s.pieces[u].size()); ++k)
      store_piece(s.acc.data() + (u * most + k) * D, D, whole, out[u], part[u], range, k,
                  whole ? nullptr : &s.pieces[u][k]);
  }
}

// ---- the quantized attention with AVX-512: 16 lanes, key and value rows dequantized in registers ----------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace attn512q {

// Position `row` (its (block, head, offset) index, token_at without the layer, as walk_rows gives it) of kv head h
// of a quantized pool's keys (key = true; int4 reads the key groups of pool block `block`) or values as C blocks of
// 16 fp32 lanes, to be multiplied by the returned factor. int8 codes, and e4m3 values / 256 against the fp16 scale
// x 256, have at most 18 significant bits with their scale, so kv_quant's values (code * scale) are exact products
// and a row's scale can be applied once, to its score or its weight, instead of to each of its D elements: the same
// math, one multiply in another place. int4 (per-channel key scales, a min) gives its values and 1.
template <int C, typename T>
inline float row16(const QuantKV<T>& kv, int64_t l, int64_t block, int64_t h, bool key, __m512* out, int64_t row) {
  const uint8_t* c = kv.codes(key, l, row);
  if (kv.format == KV_INT8) {
    for (int64_t j = 0; j < C; ++j)
      out[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j))));
    return kv.row_scale(key, l, row);
  }
  if (kv.format == KV_FP8) {  // e4m3 -> fp16 bits (value / 256), the scale * 256 (exact)
    for (int64_t j = 0; j < C; ++j) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j)));
      const __m256i f = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
      out[j] = _mm512_cvtph_ps(f);
    }
    return kv.row_scale(key, l, row) * 256.0f;
  }
  // int4: code * scale + min, keys per channel (the block's), values per token
  const int64_t g = l * kv.group_layer + (block * kv.Hkv + h) * kv.D;
  const int64_t t = l * kv.token_layer + row;
  const __m512 vs = _mm512_set1_ps(half_value(kv.v_scale[t])), vm = _mm512_set1_ps(half_value(kv.v_min[t]));
  const __m128i mask = _mm_set1_epi8(15);
  for (int64_t j = 0; j < C; ++j) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * j));
    const __m128i n = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n));
    const __m512 s = key ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kv.k_scale + g + 16 * j))) : vs;
    const __m512 m = key ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kv.k_min + g + 16 * j))) : vm;
    out[j] = _mm512_add_ps(_mm512_mul_ps(code, s), m);
  }
  return 1.0f;
}

// QuantKV's attention (attend_quant's contract, key range and pieces included) with each key and value row
// dequantized once for up to ATTN_QB queries: keys 16 rows at a time, each query's 16 scores by attn512::scores16
// (int4: a second block holds the sealed-now keys' full-precision copies, whose scores a query takes for the keys
// at or past its fresh_from), value sums kept in registers (attn512::value_sums, each value row dequantized once
// for the item's queries).
template <int C, typename T>
void attend_quant_chunks(const QuantKV<T>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok,
                         int64_t start, int64_t count, const bool* local, int64_t Tn, const float* q, float scale,
                         KeyRange range, T* const* out, float* const* part, AttnScratch& s) {
  constexpr int64_t D = 16 * C;
  const int64_t from = range.from, n = range.to - from;  // scores and rows by i - from
  const bool int4 = kv.format == KV_INT4;
  auto visible = [&](int u, int64_t i) {
    return i < start || (local ? local[tok[u] * Tn + (i - start)] : i - start <= tok[u]);
  };
  const bool ints = kv.format == KV_INT8 && C % 2 == 0;  // integer scores of s.q16 (scores16_int8)
  int64_t fresh[ATTN_QB];
  for (int u = 0; u < nq; ++u) fresh[u] = int4 ? kv.fresh_from(start + tok[u]) : range.to;
  int16_t* keys16i = reinterpret_cast<int16_t*>(s.keys16);  // ints: the 16 rows' codes widened to int16
  auto score = [&](int u) {  // query u's 16 scores of the block's rows (int8 / FP8: times each key's scale below)
    if constexpr (C % 2 == 0)
      if (ints) return attn512::scores16_int8<C>(s.q16 + u * D, keys16i, s.q_factor[u] * scale);
    return attn512::scores16<C>(q + u * D, s.keys16, scale);
  };
  kv.walk_rows(b, h, from, range.to, s.rows);  // no division per row in the loops below
  s.scores.assign(nq * n, -INFINITY);  // the queries' rows; masked keys stay -inf: e^-inf = 0
  int64_t block = kv.tables[b * kv.W + from / kv.bs], o = from % kv.bs - 1;  // position i's block and offset, walked
  for (int64_t i0 = from; i0 < range.to; i0 += 16) {  // 16 key rows, then each query's 16 scores
    const int64_t kk = std::min<int64_t>(16, range.to - i0);
    uint32_t staged = 0;  // int4: rows with a sealed-now key's full-precision copy in keys16f
    alignas(64) float key_scale[16];  // each row's factor (row16): int8 / FP8 scores take their key's scale at the end
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t i = i0 + j;
      bool any = false;
      if (j < kk) {
        if (++o == kv.bs) {
          o = 0;
          block = kv.tables[b * kv.W + i / kv.bs];  // one division a block
        }
        for (int u = 0; u < nq; ++u) any |= visible(u, i);
      }
      float* row = s.keys16 + j * D;
      __m512 kc[C];
      const T* open = any && int4 ? kv.open_key(l, block, o, h) : nullptr;  // int4's residual and key groups, by block
      const T* stage = any && int4 && !open ? kv.staged_key(l, block, o, h) : nullptr;
      key_scale[j] = 1.0f;
      if (ints) {  // the row's codes widened to int16, its scale applied to its scores
        const uint8_t* c = any ? kv.codes(true, l, s.rows[i - from]) : nullptr;
        _Pragma("GCC unroll 8") for (int w = 0; w < C / 2; ++w)
          _mm512_store_si512(keys16i + j * D + 32 * w,
                             c ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * w)))
                               : _mm512_setzero_si512());
        if (c) key_scale[j] = kv.row_scale(true, l, s.rows[i - from]);
        continue;
      }
      if (open)
        _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) kc[c] = attn512::lanes16(open + 16 * c);
      else if (any)  // rows no query sees are never read
        key_scale[j] = row16<C>(kv, l, block, h, true, kc, s.rows[i - from]);
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c)
        _mm512_store_ps(row + 16 * c, any ? kc[c] : _mm512_setzero_ps());
      if (stage) {
        staged |= 1u << j;
        _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c)
          _mm512_store_ps(s.keys16f + j * D + 16 * c, attn512::lanes16(stage + 16 * c));
      }
    }
    for (int u = 0; u < nq; ++u) {
      __m512 r = score(u);
      if (!int4) r = _mm512_mul_ps(r, _mm512_load_ps(key_scale));
      uint32_t own = 0;  // keys this query reads from their fresh copy (int4: j >= its fresh_from)
      for (int64_t j = 0; j < kk && staged; ++j)
        if ((staged >> j & 1) && i0 + j >= fresh[u]) own |= 1u << j;
      if (own)  // each lane is its own key's score: taking some from the fresh block is the mixed block's result
        r = _mm512_mask_blend_ps(static_cast<__mmask16>(own), r, attn512::scores16<C>(q + u * D, s.keys16f, scale));
      attn512::store_scores(r, s.scores.data() + u * n, i0, kk, from, start, local ? -1 : start + tok[u] + 1,
                            [&](int64_t i) { return visible(u, i); });
    }
  }
  attn512::item_softmax(s, nq, n, tok, start, local, range, [](int) { return true; });
  attn512::value_sums<C>(nq, n, tok, start, count, local, Tn, range, out, part, s, [&](int64_t i, __m512 (&vc)[C]) {
    return row16<C>(kv, l, 0, h, false, vc, s.rows[i]);
  });
}

template <typename T>
void attend_quant(const QuantKV<T>& kv, int64_t l, int64_t b, int64_t h, int nq, const int64_t* tok, int64_t start,
                  int64_t count, const bool* local, int64_t Tn, const float* q, float scale, KeyRange range,
                  T* const* out, float* const* part, AttnScratch& s) {
  attn512::with_chunks(kv.D, [&](auto c) {
    attend_quant_chunks<decltype(c)::value>(kv, l, b, h, nq, tok, start, count, local, Tn, q, scale, range, out, part,
                                            s);
  });
}

}  // namespace attn512q
#pragma GCC pop_options

// One layer's k/v writes over a quantized pool: rope each live token's key, quantize it and its value at the
// token's index (int4: then seal the blocks this write completes).
template <typename T>
void write_layer_quant(const QuantKV<T>& kv, int64_t l, const std::vector<int64_t>& live, int64_t Tn,
                       const int64_t* st, const T* qkv, int64_t qkv_size, int64_t q_size, const T* cos_p,
                       const T* sin_p) {
  const int64_t D = kv.D, kv_size = kv.Hkv * D;
  std::vector<T> key(D);
  for (int64_t r = 0; r < static_cast<int64_t>(live.size()); ++r) {
    const int64_t b = live[r] / Tn, t = live[r] % Tn, row = live[r];
    const T* src = qkv + r * qkv_size;
    for (int64_t h = 0; h < kv.Hkv; ++h) {
      rope(src + q_size + h * D, cos_p + row * D, sin_p + row * (D / 2), key.data(), D);
      write_quant(kv, l, b, st[b] + t, h, key.data(), src + q_size + kv_size + h * D);
    }
  }
  if (kv.format == KV_INT4) seal_int4(kv, l);
}

// One layer's attention over a quantized pool (attention_items: each dequantized key and value row serves every
// query of an item, long contexts split into key ranges).
template <typename T>
void attention_layer_quant(const QuantKV<T>& kv, int64_t l, const std::vector<int64_t>& live, int64_t B, int64_t Tn,
                           const int64_t* st, const int64_t* cn, const bool* lm, int64_t local_stride, int64_t group,
                           const T* qkv, int64_t qkv_size, const T* cos_p, const T* sin_p, float scale, T* attn,
                           int64_t q_size) {
  const bool wide = isa() >= ISA_AVX512 && attn512::chunked(kv.D);  // the AVX-512 family's attention (its own bits)
  attention_items(live, B, kv.Hkv, group, kv.D, Tn, st, cn, lm, local_stride, qkv, qkv_size, cos_p, sin_p, attn,
                  q_size,
                  [&](AttnScratch& s, int64_t b, int64_t h, int nq, const int64_t* tok, const bool* mask,
                      const KeyRange& range, T* const* outs, float* const* parts) {
                    if (kv.format == KV_INT8)
                      for (int u = 0; u < nq; ++u)
                        s.q_factor[u] = round_query(s.q.data() + u * kv.D, kv.D, s.q16 + u * kv.D);
                    if (wide)
                      attn512q::attend_quant(kv, l, b, h, nq, tok, st[b], cn[b], mask, Tn, s.q.data(), scale, range,
                                             outs, parts, s);
                    else
                      attend_quant(kv, l, b, h, nq, tok, st[b], cn[b], mask, Tn, s.q.data(), scale, range, outs,
                                   parts, s, softmax_packed8);
                  });
}

// y (rows of the compute type) = x @ W^T through the kernels, rounded to T as the Python layers round.
// y [M, N] (T) = x [M, K] (T) @ W^T: fp32 rows run the kernels in place; bf16 ones widen to fp32 and come back
// rounded as torch casts (vectorized, split over the cores: the same bits as the scalar casts).
template <typename T>
void linear_rows(const Weight& w, const T* x, int64_t M, T* y, Acts& a, std::vector<float>& xf, std::vector<float>& yf) {
  if constexpr (std::is_same_v<T, float>) {
    linear_into(w, x, M, w.K, y, w.N, a);
  } else {
    const int64_t K = w.K, N = w.N;
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
    uint16_t* ys = reinterpret_cast<uint16_t*>(y);
    if (!w.int8_act && amx_quant(w, isa(), M)) {  // the tiles take the bf16 rows as they are
      prepare_bf16(w, xs, M, a);
      run_prepared(w, a, nullptr, N, ys, isa());  // given ys, the AMX quantized kernel writes only there
      return;
    }
    xf.resize(M * K);
    float* xv = xf.data();  // (not xf.data() in the loop: the stores could alias the vector, so it was reloaded)
    over_rows(M, K, [&](int64_t m0, int64_t m1) {
      int64_t i = m0 * K;
      for (; i + 8 <= m1 * K; i += 8)
        _mm256_storeu_ps(xv + i, bf16_values8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xs + i))));
      for (; i < m1 * K; ++i) xv[i] = f32(x[i]);
    });
    yf.resize(M * N);
    if (linear_into(w, xf.data(), M, K, yf.data(), N, a, ys)) return;  // rounded inside the layer's split
    const float* yv = yf.data();
    over_rows(M, N, [&](int64_t m0, int64_t m1) {
      int64_t i = m0 * N;
      for (; i + 8 <= m1 * N; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ys + i), bf16_bits8<true>(_mm256_loadu_ps(yv + i)));
      for (; i < m1 * N; ++i) y[i] = rnd<T>(yv[i]);
    });
  }
}

// A layer over all R rows: calls of up to MAX_M rows, except int8-activation layers, which take every row in one call
// (amx8::run keeps each tile's expanded codes for all of a prompt chunk's blocks of rows).
template <typename T>
void linear_all_rows(const Weight& w, const T* x, int64_t R, T* y, Acts& a, std::vector<float>& xf,
                     std::vector<float>& yf) {
  const int64_t per = w.int8_act ? R : MAX_M;
  for (int64_t r0 = 0; r0 < R; r0 += per) linear_rows(w, x + r0 * w.K, std::min(per, R - r0), y + r0 * w.N, a, xf, yf);
}

// run(T{}) for the compute type T of `type` (fp32 or bf16), else an error saying `what`.
template <typename F>
void with_compute_type(at::ScalarType type, const char* what, F&& run) {
  if (type == at::kFloat)
    run(0.0f);
  else if (type == at::kBFloat16)
    run(at::BFloat16(0.0f));
  else
    TORCH_CHECK(false, what);
}

// SiLU(gate) * up of one row of n values with this CPU's widest loop (every family's gives the same bits).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  if (isa() >= ISA_AVX512)
    attn512::silu_mul(gate, up, out, n);
  else
    silu_mul(gate, up, out, n);
}

// Seconds per phase of the step (enabled by profile(true)): where a step's time goes, for benchmarks.
enum Phase { P_NORM = 0, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_GATE_UP, P_ACT, P_DOWN, P_COUNT };
bool g_profile = false;
double g_phase[P_COUNT] = {0};
struct PhaseClock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(Phase p) {
    if (!g_profile) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase[p] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

// Cache: KVView<T> (the compute type, read in place) or QuantKV<T> (a quantized pool, quantized on write and
// dequantized row by row inside attention).
template <typename T, typename Cache>
void step_impl(const StepModel& m, at::Tensor& x, int64_t Tn, const at::Tensor& starts, const at::Tensor& counts,
               const at::Tensor& local, const Cache& kv, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = starts.size(0), H = m.hidden, D = m.D, Hq = m.Hq, Hkv = m.Hkv, group = Hq / Hkv;
  const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
  const float eps = static_cast<float>(m.eps), scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  const bool* lm = local.defined() ? local.data_ptr<bool>() : nullptr;
  const int64_t local_stride = local.defined() && local.size(0) > 1 ? Tn * Tn : 0;
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  // the valid (row, token) pairs, packed: padding tokens of ragged rows are skipped entirely
  std::vector<int64_t> live;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < cn[b]; ++t) live.push_back(b * Tn + t);
  const int64_t R = static_cast<int64_t>(live.size());
  const int64_t inter = m.linears[2].N / 2;
  std::vector<T> normed(R * H), qkv(R * qkv_size), attn(R * q_size), proj(R * H), gate_up(R * 2 * inter), act(R * inter);
  std::vector<float> xf, yf;
  Acts acts;
  float* xp = x.data_ptr<float>();
  // bf16 caches take the AMX attention wherever the row policy allows AMX (every row count alike)
  const bool amx_attention =
      std::is_same_v<T, at::BFloat16> && isa() >= ISA_AMX && g_amx_mode != AMX_OFF && attn_amx::fits(D);
  PhaseClock clock;
  for (int64_t l = 0; l < m.layers(); ++l) {
    const T* n1 = m.norms[2 * l].data_ptr<T>();
    const T* n2 = m.norms[2 * l + 1].data_ptr<T>();
    const Weight* w = &m.linears[4 * l];
    over_rows(R, H, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rms_norm(xp + live[r] * H, n1, normed.data() + r * H, H, eps);
    });
    clock.lap(P_NORM);
    linear_all_rows(w[0], normed.data(), R, qkv.data(), acts, xf, yf);
    clock.lap(P_QKV);
    if constexpr (std::is_same_v<Cache, QuantKV<T>>) {
      write_layer_quant(kv, l, live, Tn, st, qkv.data(), qkv_size, q_size, cos_p, sin_p);
      clock.lap(P_ROPE_KV);
      attention_layer_quant(kv, l, live, B, Tn, st, cn, lm, local_stride, group, qkv.data(), qkv_size, cos_p, sin_p,
                            scale, attn.data(), q_size);
    } else {
    T* kl = kv.k + l * kv.layer_stride;
    T* vl = kv.v + l * kv.layer_stride;
    for (int64_t r = 0; r < R; ++r) {  // rope k, write k/v at the token's index
      const int64_t b = live[r] / Tn, t = live[r] % Tn, row = live[r];
      const T* src = qkv.data() + r * qkv_size;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = kv.at(b, h, st[b] + t);
        rope(src + q_size + h * D, cos_p + row * D, sin_p + row * (D / 2), kl + at, D);
        std::copy(src + q_size + kv_size + h * D, src + q_size + kv_size + (h + 1) * D, vl + at);
      }
    }
    clock.lap(P_ROPE_KV);
    if (isa() >= ISA_AVX512 && attn512::chunked(D)) {
      attention_items(live, B, Hkv, group, D, Tn, st, cn, lm, local_stride, qkv.data(), qkv_size, cos_p, sin_p,
                      attn.data(), q_size,
                      [&](AttnScratch& s, int64_t b, int64_t h, int nq, const int64_t* tok, const bool* mask,
                          const KeyRange& range, T* const* outs, float* const* parts) {
                        if constexpr (std::is_same_v<T, at::BFloat16>)
                          if (amx_attention) {
                            attn_amx::attend(kv, l, b, h, nq, tok, st[b], cn[b], mask, Tn, s.q.data(), scale, range,
                                             outs, parts, s);
                            return;
                          }
                        attn512::attend(kv, l, b, h, nq, tok, st[b], cn[b], mask, Tn, s.q.data(), scale, range, outs,
                                        parts, s);
                      },
                      amx_attention ? ATTN_QB_TILES : ATTN_QB);
    } else {
    // work items: (token, kv head) with its query heads together, or (token, query head) when there are too few
    // tokens to keep both cores busy (decode steps)
    const int64_t per = R * Hkv >= 4 ? group : 1, items = R * Hq / per;
    auto attend_range = [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc, packed, q(per * D);
      std::vector<int64_t> where;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / (Hq / per), head0 = (i % (Hq / per)) * per, b = live[r] / Tn, t = live[r] % Tn;
        const int64_t row = live[r];
        for (int64_t u = 0; u < per; ++u)
          rope(qkv.data() + r * qkv_size + (head0 + u) * D, cos_p + row * D, sin_p + row * (D / 2), q.data() + u * D, D);
        attend(kv, l, b, head0 / group, t, st[b], cn[b], lm ? lm + b * local_stride : nullptr, Tn, q.data(), per,
               scale, attn.data() + r * q_size + head0 * D, D, scores, acc, packed, where);
      }
    };
    if (attention_threaded(B, st, cn, Hq, D))
      at::parallel_for(0, items, 1, attend_range);
    else
      attend_range(0, items);
    }
    }
    clock.lap(P_ATTN);
    linear_all_rows(w[1], attn.data(), R, proj.data(), acts, xf, yf);
    clock.lap(P_O);
    over_rows(R, H, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < H; ++i) xp[live[r] * H + i] += f32(proj[r * H + i]);
        rms_norm(xp + live[r] * H, n2, normed.data() + r * H, H, eps);
      }
    });
    clock.lap(P_NORM);
    linear_all_rows(w[2], normed.data(), R, gate_up.data(), acts, xf, yf);
    clock.lap(P_GATE_UP);
    over_rows(R, 6 * inter, [&](int64_t r0, int64_t r1) {  // (its exponentials: ~6x a copy's work per value)
      for (int64_t r = r0; r < r1; ++r) {
        const T* gate = gate_up.data() + r * 2 * inter;
        silu_mul_row(gate, gate + inter, act.data() + r * inter, inter);
      }
    });
    clock.lap(P_ACT);
    linear_all_rows(w[3], act.data(), R, proj.data(), acts, xf, yf);
    clock.lap(P_DOWN);
    over_rows(R, H, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < H; ++i) xp[live[r] * H + i] += f32(proj[r * H + i]);
    });
    clock.lap(P_NORM);
  }
}

// x: [B*T, hidden] fp32 residual stream of T new tokens per row (updated in place and returned); row b's valid
// tokens are its first counts[b], at cache indices starts[b]..; local: [1 or B, T, T] bool (a tree's ancestor
// mask among the new tokens) or empty for causal. Caches: contiguous [L, B_cache, Hkv, S, D] (tables empty) or
// paged [L, blocks, bs, Hkv, D] with int32 tables [B, W]. cos: [B*T, D], sin: [B*T, D/2] of the compute type.
at::Tensor step(const StepModel& m, at::Tensor x, int64_t tokens, at::Tensor starts, at::Tensor counts,
                std::optional<at::Tensor> local, at::Tensor k_cache, at::Tensor v_cache, std::optional<at::Tensor> tables,
                at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == m.hidden,
              "x must be [B*T, hidden] fp32");
  const int64_t B = starts.size(0);
  TORCH_CHECK(tokens >= 1 && x.size(0) == B * tokens, "x rows must be B * T");
  TORCH_CHECK(starts.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && counts.size(0) == B,
              "starts and counts: int64 [B]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(cos.size(0) == B * tokens && sin.size(0) == B * tokens, "one cos/sin row per token");
  const bool paged = tables && tables->defined() && tables->numel();
  at::Tensor local_mask = local && local->defined() && local->numel() ? local->contiguous() : at::Tensor();
  if (local_mask.defined())
    TORCH_CHECK(local_mask.scalar_type() == at::kBool && local_mask.size(-1) == tokens, "local mask: bool [., T, T]");
  at::Tensor tab = paged ? tables->to(at::kInt).contiguous() : at::Tensor();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    KVView<T> kv;
    kv.k = k_cache.data_ptr<T>();
    kv.v = v_cache.data_ptr<T>();
    kv.layer_stride = k_cache.stride(0);
    kv.Hkv = m.Hkv;
    kv.D = m.D;
    if (paged) {
      kv.tables = tab.data_ptr<int32_t>();
      kv.W = tab.size(1);
      kv.bs = k_cache.size(2);
      kv.S = 0;
      TORCH_CHECK(k_cache.size(3) == m.Hkv && tab.size(0) == B, "paged pool [L, blocks, bs, Hkv, D], tables [B, W]");
    } else {
      kv.tables = nullptr;
      kv.W = 0;
      kv.bs = 0;
      kv.S = k_cache.size(3);
      TORCH_CHECK(k_cache.size(1) >= B && k_cache.size(2) == m.Hkv, "contiguous cache [L, B, Hkv, S, D]");
      const int64_t* st = starts.data_ptr<int64_t>();
      const int64_t* cn = counts.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(st[b] + cn[b] <= kv.S, "row ", b, " runs past the KV cache");
    }
    TORCH_CHECK(k_cache.size(0) >= m.layers(), "the KV cache has too few layers");
    step_impl<T, KVView<T>>(m, x, tokens, starts, counts, local_mask, kv, cos, sin);
  };
  with_compute_type(k_cache.scalar_type(), "the CPU step's compute type must be fp32 or bf16", run);
  return x;
}

// The step over a quantized KVPool (runtime/kv_quant.py): x, tokens, starts, counts, local, cos, sin as in step();
// tables [B, W] the rows' blocks (the contiguous QuantizedKVCache: its row-by-row tables); format KV_INT8 | KV_FP8 |
// KV_INT4; pool: k, v, k_scale, v_scale and, int4, k_min, v_min, k_open, open_of [N], stage [L, ns, bs, Hkv, D]
// (the sealed blocks' keys so far), stage_of [N], seal_blocks [ns] (runtime.kv_quant.KVPool.begin_step_write).
at::Tensor step_quant(const StepModel& m, at::Tensor x, int64_t tokens, at::Tensor starts, at::Tensor counts,
                      std::optional<at::Tensor> local, at::Tensor tables, at::Tensor cos, at::Tensor sin, int64_t format,
                      int64_t lookahead, std::vector<at::Tensor> pool) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == m.hidden,
              "x must be [B*T, hidden] fp32");
  const int64_t B = starts.size(0);
  TORCH_CHECK(tokens >= 1 && x.size(0) == B * tokens, "x rows must be B * T");
  TORCH_CHECK(starts.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && counts.size(0) == B,
              "starts and counts: int64 [B]");
  TORCH_CHECK(cos.size(0) == B * tokens && sin.size(0) == B * tokens, "one cos/sin row per token");
  TORCH_CHECK(format >= KV_INT8 && format <= KV_INT4, "unknown quantized KV format ", format);
  TORCH_CHECK(pool.size() == (format == KV_INT4 ? 11u : 4u), "pool tensors: k, v, k_scale, v_scale (+ 7 for int4)");
  for (auto& t : pool) TORCH_CHECK(t.is_contiguous(), "the KV pool's tensors must be contiguous");
  TORCH_CHECK(m.D % 16 == 0 && m.D <= 256, "quantized KV in the step: head_dim a multiple of 16, at most 256");
  at::Tensor local_mask = local && local->defined() && local->numel() ? local->contiguous() : at::Tensor();
  if (local_mask.defined())
    TORCH_CHECK(local_mask.scalar_type() == at::kBool && local_mask.size(-1) == tokens, "local mask: bool [., T, T]");
  at::Tensor tab = tables.to(at::kInt).contiguous();
  const at::Tensor& k = pool[0];
  TORCH_CHECK(k.dim() == 5 && k.size(0) >= m.layers() && k.size(2) == m.Hkv, "codes: [L, blocks, Hkv, bs, .]");
  TORCH_CHECK(tab.dim() == 2 && tab.size(0) == B, "tables: [B, W]");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(st[b] + cn[b] <= tab.size(1) * k.size(3), "row ", b, " runs past its blocks");
  auto run = [&](auto zero) {
    using T = decltype(zero);
    QuantKV<T> kv;
    kv.format = format;
    kv.Hkv = m.Hkv;
    kv.D = m.D;
    kv.bs = k.size(3);
    kv.W = tab.size(1);
    kv.lookahead = lookahead;
    kv.tables = tab.data_ptr<int32_t>();
    auto bytes = [](const at::Tensor& t) { return reinterpret_cast<uint8_t*>(t.data_ptr()); };
    auto halves = [](const at::Tensor& t) {
      TORCH_CHECK(t.scalar_type() == at::kHalf, "KV scales must be fp16");
      return reinterpret_cast<uint16_t*>(t.data_ptr());
    };
    kv.k = bytes(pool[0]);
    kv.v = bytes(pool[1]);
    kv.k_scale = halves(pool[2]);
    kv.v_scale = halves(pool[3]);
    kv.code_layer = pool[0].stride(0);
    kv.token_layer = pool[3].stride(0);  // v_scale: [L, N, Hkv, bs] in every format
    if (format == KV_INT4) {
      TORCH_CHECK(pool[6].scalar_type() == cos.scalar_type() && pool[8].scalar_type() == cos.scalar_type(),
                  "int4 residual and stage: the compute type");
      kv.group_layer = pool[2].stride(0);  // k_scale: [L, N, Hkv, D]
      kv.k_min = halves(pool[4]);
      kv.v_min = halves(pool[5]);
      kv.k_open = pool[6].data_ptr<T>();
      kv.open_layer = pool[6].stride(0);
      kv.open_of = pool[7].data_ptr<int64_t>();
      kv.stage = pool[8].data_ptr<T>();
      kv.stage_layer = pool[8].stride(0);
      kv.stage_of = pool[9].data_ptr<int64_t>();
      kv.seal_blocks = pool[10].data_ptr<int64_t>();
      kv.n_seal = pool[10].numel();
    }
    step_impl<T, QuantKV<T>>(m, x, tokens, starts, counts, local_mask, kv, cos, sin);
  };
  with_compute_type(cos.scalar_type(), "the CPU step's compute type must be fp32 or bf16", run);
  return x;
}

// The step's SiLU(gate) * up of rows gate_up [N, 2 n] (fp32 / bf16) -> [N, n], through this CPU's family (tests).
at::Tensor silu_mul_rows(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: [N, 2 n]");
  gate_up = gate_up.contiguous();
  const int64_t N = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({N, n}, gate_up.options());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    for (int64_t r = 0; r < N; ++r) {
      const T* src = gate_up.data_ptr<T>() + r * 2 * n;
      silu_mul_row(src, src + n, out.data_ptr<T>() + r * n, n);
    }
  };
  with_compute_type(gate_up.scalar_type(), "gate_up: fp32 or bf16", run);
  return out;
}

// kv_quant's writers one row at a time, for tests: rows x [N, D] (fp32 / bf16) -> codes [N, D] (int4: unpacked, one
// per byte), scales [N] and mins [N] (int4) as fp16; format KV_INT8 | KV_FP8 | KV_INT4 (asymmetric over the row).
std::vector<at::Tensor> quantize_kv_rows(at::Tensor x, int64_t format) {
  TORCH_CHECK(x.dim() == 2, "rows: [N, D]");
  x = x.contiguous();
  const int64_t N = x.size(0), D = x.size(1);
  at::Tensor codes = at::empty({N, D}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({N}, x.options().dtype(at::kHalf)), low = at::zeros({N}, x.options().dtype(at::kHalf));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    for (int64_t r = 0; r < N; ++r) {
      const T* row = x.data_ptr<T>() + r * D;
      uint8_t* c = codes.data_ptr<uint8_t>() + r * D;
      uint16_t* s = reinterpret_cast<uint16_t*>(scale.data_ptr()) + r;
      if (format == KV_INT4)
        quantize_asym4(row, D, 1, c, s, reinterpret_cast<uint16_t*>(low.data_ptr()) + r);
      else
        quantize_scaled_row(row, D, format == KV_FP8, c, s);
    }
  };
  with_compute_type(x.scalar_type(), "rows: fp32 or bf16", run);
  return {codes, scale, low};
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
    for (int64_t r = begin; r < end; ++r) rms_norm(xp + r * hidden, wp, op + r * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

// Each row's argmax (torch.argmax's rule: the first index of the largest value, a NaN counting as the largest) of
// fp32 rows x [N, V] -> [N] int64: greedy decoding's and verification's next tokens over the head's logits, where
// torch's reduction reads one element at a time (68 us a 49k-token row against 10 here, both called from Python).
// Two passes over the row (it stays in L2): the largest value (four independent max chains, NaNs noted beside them),
// then the first index holding it (-0 and +0 compare equal, as in torch's comparison).
int64_t argmax_row(const float* x, int64_t V) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
  if (V >= 32) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, unordered = _mm256_setzero_ps();
    for (; i + 32 <= V; i += 32) {
      const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
      const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
      m0 = _mm256_max_ps(m0, v0);
      m1 = _mm256_max_ps(m1, v1);
      m2 = _mm256_max_ps(m2, v2);
      m3 = _mm256_max_ps(m3, v3);
      unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q), _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (const float v : lanes) top = std::max(top, v);
    nan = _mm256_movemask_ps(unordered) != 0;
  }
  for (; i < V; ++i) {
    nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 wanted = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= V; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
  for (; i < V; ++i)
    if (x[i] == top) return i;
  return 0;  // not reached: top is one of the row's values
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be [N, V] contiguous fp32 with V > 0");
  const int64_t n = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {  // up to 4 rows (~5 us each) on the calling thread
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// ---- prefill: quantized weights dequantized block by block, multiplied by torch's GEMM ------------------------
// A long prompt (hundreds of rows per call) runs faster as a GEMM over the dequantized weight than as 64-row chunks
// of the kernels above, which re-expand every code for every chunk. The layout suits it: column pair j of a tile
// holds 16 output rows side by side, so rows 2j and 2j + 1 of the transposed weight wt[k, n] are written straight
// from one pair, no transpose. wt[k, n] = (code - z) * s in fp32 (sub, then mul: QuantizedWeight.dequantize's
// math; FP8 reads e4m3 as fp16 bits (value / 256) against scales * 256, exact), rounded to bf16 for bf16
// activations; columns k in the layout's (group) order, so callers gather x's columns by perm instead.
// APPROXIMATE, as a dense bf16 layer's own prefill: the weight is rounded to the activation dtype and the GEMM's
// sum order depends on the shape. Decode steps and verifications keep the exact, row-invariant kernels.

// Codes of columns 2j (c0) and 2j + 1 (c1) of a tile's 16 rows, as fp32 code values (I8: code - 128; FP8: value
// / 256), scalar: the baseline and the reference for the AVX-512 version.
inline float tile_code(const Weight& w, const uint8_t* tile, int64_t k, int64_t r) {
  const int64_t j = k / 2, c = k & 1;
  if (w.kind == I4) {
    const uint8_t b = tile[j * NR + r];
    return static_cast<float>(c ? b >> 4 : b & 15);
  }
  const uint8_t b = tile[(j * NR + r) * 2 + c];
  if (w.kind == I8) return static_cast<float>(static_cast<int8_t>(b));
  return _cvtsh_ss(static_cast<uint16_t>(((b & 0x7f) << 7) | ((b & 0x80) << 8)));
}

// body(t, tile, at, kb, ke) for each tile t in [t0, t1) and each of its groups: the tile's codes, the index of the
// group's 16 scales / zeros, the group's input columns [kb, ke). The walk every dequantize family shares.
template <typename Body>
inline void each_tile_group(const Weight& w, int64_t t0, int64_t t1, Body&& body) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < w.ngroups; ++g)
      body(t, w.tile(t), (t * w.ngroups + g) * NR, g * w.group, std::min((g + 1) * w.group, w.K));
}

// run(kind) with w's quantized kind as a compile-time constant (std::integral_constant<int64_t, I8 / FP8 / I4>).
template <typename Run>
inline auto by_quant_kind(const Weight& w, Run&& run) {
  if (w.kind == I8) return run(std::integral_constant<int64_t, I8>());
  if (w.kind == FP8) return run(std::integral_constant<int64_t, FP8>());
  return run(std::integral_constant<int64_t, I4>());
}

// Tiles [t0, t1) into wt as bf16 bits (row stride ld; column 0 = row 16 * t0 of the layer): the AVX2 machines' bf16
// dequantize (fp32 output has its own AVX2 loop below; the prefill there multiplies in fp32).
void dequant_tiles_scalar(const Weight& w, int64_t t0, int64_t t1, int64_t tile_base, uint16_t* wt, int64_t ld) {
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  each_tile_group(w, t0, t1, [&](int64_t t, const uint8_t* tile, int64_t at, int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      uint16_t* row = wt + k * ld + (t - tile_base) * NR;
      for (int64_t r = 0; r < NR; ++r) row[r] = bf16_bits((tile_code(w, tile, k, r) - zc[at + r]) * sc[at + r]);
    }
  });
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace dequant512 {

// 16 e4m3 bytes (one per 32-bit lane) as fp32 value / 256: through fp16 bits (exponent and mantissa << 7, sign << 8).
inline __m512 e4m3_lanes(__m512i e) {
  const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(e, _mm512_set1_epi32(0x7f)), 7),
                                    _mm512_slli_epi32(_mm512_and_si512(e, _mm512_set1_epi32(0x80)), 8));
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
}

// c0, c1: the code values of columns 2j and 2j + 1 for the tile's 16 rows (one lane per row).
template <int64_t KIND>
inline void pair_codes(const uint8_t* tile, int64_t j, __m512& c0, __m512& c1) {
  if (KIND == I4) {  // byte = c0 | c1 << 4
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + j * NR)));
    c0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    c1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    return;
  }
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 2 * NR));
  if (KIND == I8) {  // one int16 per row, c0 | c1 << 8, sign-extended; each byte sign-extended in turn
    const __m512i v = _mm512_cvtepi16_epi32(b);
    c0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
    c1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
    return;
  }
  const __m512i v = _mm512_cvtepu16_epi32(b);  // one uint16 per row, c0 | c1 << 8
  c0 = e4m3_lanes(_mm512_and_si512(v, _mm512_set1_epi32(0xff)));
  c1 = e4m3_lanes(_mm512_srli_epi32(v, 8));
}

// Columns 2j and 2j + 1 of the tile's 16 rows dequantized in fp32: (code - z) * s (the prefill's weights).
template <int64_t KIND>
inline void dequant_pair(const uint8_t* tile, int64_t j, __m512 s, __m512 z, __m512& w0, __m512& w1) {
  __m512 c0, c1;
  pair_codes<KIND>(tile, j, c0, c1);
  w0 = _mm512_mul_ps(_mm512_sub_ps(c0, z), s);
  w1 = _mm512_mul_ps(_mm512_sub_ps(c1, z), s);
}

template <int64_t KIND, bool BF16_OUT>
void tiles(const Weight& w, int64_t t0, int64_t t1, int64_t tile_base, void* out, int64_t ld) {
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  each_tile_group(w, t0, t1, [&](int64_t t, const uint8_t* tile, int64_t at, int64_t kb, int64_t ke) {
    const int64_t col = (t - tile_base) * NR;
    const __m512 s = _mm512_loadu_ps(sc + at), z = load16(zc, at);
    for (int64_t j = kb / 2; j < (ke + 1) / 2; ++j) {
      __m512 w0, w1;
      dequant_pair<KIND>(tile, j, s, z, w0, w1);
      const bool second = 2 * j + 1 < w.K;  // an odd K's last pair holds one real column
      if constexpr (BF16_OUT) {
        uint16_t* o = static_cast<uint16_t*>(out) + 2 * j * ld + col;
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // [w0 as bf16, w1 as bf16]
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_castsi512_si256(both));
        if (second) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + ld), _mm512_extracti64x4_epi64(both, 1));
      } else {
        float* o = static_cast<float*>(out) + 2 * j * ld + col;
        _mm512_storeu_ps(o, w0);
        if (second) _mm512_storeu_ps(o + ld, w1);
      }
    }
  });
}

}  // namespace dequant512
#pragma GCC pop_options

namespace avx2 {

// Tiles [t0, t1) into fp32 wt, half a tile (8 rows) per vector: (code - z) * s as the scalar loop computes it, so
// the same bits; the fp32 GEMM of a CPU without native bf16 dot products multiplies it (prefill_linear).
template <int64_t KIND>
void dequant_tiles(const Weight& w, int64_t t0, int64_t t1, int64_t tile_base, float* wt, int64_t ld) {
  const float* sc = w.scales.data_ptr<float>();
  const ZeroTable zc(w);
  each_tile_group(w, t0, t1, [&](int64_t t, const uint8_t* tile, int64_t at, int64_t kb, int64_t ke) {
    for (int half = 0; half < 2; ++half) {
      const __m256 s = _mm256_loadu_ps(sc + at + 8 * half), z = zc.load8(at + 8 * half);
      float* col = wt + (t - tile_base) * NR + 8 * half;
      for (int64_t j = kb / 2; j < (ke + 1) / 2; ++j) {
        __m256 c0, c1;
        pair8<KIND>(tile, j, half, c0, c1);
        _mm256_storeu_ps(col + 2 * j * ld, _mm256_mul_ps(_mm256_sub_ps(c0, z), s));
        if (2 * j + 1 < w.K) _mm256_storeu_ps(col + (2 * j + 1) * ld, _mm256_mul_ps(_mm256_sub_ps(c1, z), s));
      }
    }
  });
}

}  // namespace avx2

// ---- prefill on AMX: many rows of a quantized bf16-activation layer through dequantized panels ------------------
// Each core dequantizes a panel of its tiles to bf16 in the AMX B layout (the weights the GEMM path multiplies:
// (code - z) * s in fp32, rounded as dequant512::tiles rounds), in L2, and multiplies every chunk of 16 activation
// rows by it on the tiles, 2 x 2 blocks. The GEMM path it replaces on AMX machines called torch's GEMM once per
// 128-row block (~40 calls a layer): a 128-token prefill of the int4 135M took 1.4x bf16's TTFT. APPROXIMATE as the
// GEMM path: the weight rounded to bf16, fp32 sums in the tiles' order.

void dequant_tiles(const Weight& w, int64_t t0, int64_t t1, int64_t tile_base, void* wt, int64_t ld, bool bf16);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace amx_prefill {

constexpr int64_t PANEL_BYTES = 768 * 1024;  // a core's panel: in its L2 beside two chunks of activation rows
// Calls of up to this many rows take the panels; longer ones dequantize the whole weight and make one call of
// torch's GEMM (whole), whose blocking wins there (at 128 rows the panels are 2x faster than the GEMM path and
// match a dense bf16 layer's F.linear).
constexpr int64_t MAX_ROWS = 512;

// panel[kb][t - t0]: the 16 x 64-byte B tile of k block kb for tile t (row r = pair column 16 kb + r: its 16 output
// rows' two columns interleaved, as pair_bf16 orders codes), filled a few column pairs at a time (step) so the
// prefill can dequantize the next panel between the tile matmuls of this one: the vector units and the tiles work
// side by side (dequantizing first and multiplying after left the tiles idle for a quarter of a 512-row call).
template <int64_t KIND>
class PanelFill {
 public:
  PanelFill(const Weight& w, int64_t t0, int64_t t1, int64_t kblocks, uint16_t* panel)
      : w_(w), sc_(w.scales.data_ptr<float>()), zc_(w), t0_(t0), t1_(t1), pairs_(kblocks * 16),
        kpairs_((w.K + 1) / 2), panel_(panel), t_(t0) {}

  int64_t total() const { return (t1_ - t0_) * pairs_; }

  // the next n column pairs in tile order (all that are left for n >= total()); pairs past K are zero (x is zero
  // there too; stale bits could be NaN)
  void step(int64_t n) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const int64_t nt = t1_ - t0_;
    while (n > 0 && t_ < t1_) {
      uint16_t* tile_rows = panel_ + (t_ - t0_) * 512;
      auto pair_row = [&](int64_t j) { return tile_rows + (j / 16) * nt * 512 + (j % 16) * 32; };
      int64_t end = std::min(pairs_, j_ + n);
      if (j_ < kpairs_) {  // within one group: its scales and zeros
        const int64_t g = 2 * j_ / w_.group, at = (t_ * w_.ngroups + g) * NR;
        end = std::min({end, kpairs_, ((g + 1) * w_.group + 1) / 2});
        const __m512 s = _mm512_loadu_ps(sc_ + at), z = load16(zc_, at);
        const uint8_t* tile = w_.tile(t_);
        for (int64_t j = j_; j < end; ++j) {
          __m512 w0, w1;
          dequant512::dequant_pair<KIND>(tile, j, s, z, w0, w1);
          const __m512 lo = _mm512_permutex2var_ps(w0, lo_idx, w1), hi = _mm512_permutex2var_ps(w0, hi_idx, w1);
          _mm512_storeu_si512(pair_row(j), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      } else {
        for (int64_t j = j_; j < end; ++j) _mm512_storeu_si512(pair_row(j), _mm512_setzero_si512());
      }
      n -= end - j_;
      j_ = end;
      if (j_ == pairs_) {
        ++t_;
        j_ = 0;
      }
    }
  }

 private:
  const Weight& w_;
  const float* sc_;
  const ZeroTable zc_;
  const int64_t t0_, t1_, pairs_, kpairs_;
  uint16_t* panel_;
  int64_t t_, j_ = 0;
};

// The activations' A tiles: chunk c (16 rows) at chunk(c), its k block kb kb_elems further, rows row_bytes apart.
// Rows of x itself where K is a multiple of 32 (full chunks; the last partial one and the zero chunk after an odd
// count from a padded copy), else a packed copy (each tile 1 KB, zero past K and M).
struct ARows {
  const uint16_t* full;
  int64_t full_chunks;
  const uint16_t* tail;
  int64_t chunk_elems, kb_elems, row_bytes;
  const uint16_t* chunk(int64_t c) const {
    return c < full_chunks ? full + c * chunk_elems : tail + (c - full_chunks) * chunk_elems;
  }
};

// y[m, n0 + n] for the panel's nt tiles and every row: C [16 m, 16 n] += x [16 m, 32 k] (tiles 4, 5) . panel (6,
// 7); accumulators 0..3. Each pair of accumulators is stored side by side, so a row's 32 outputs leave as one
// 64-byte line. next: the following panel, dequantized a few pairs after each k block.
template <int64_t KIND>
void panel_gemm(const Weight& w, const ARows& a, int64_t M, int64_t kblocks, const uint16_t* panel, int64_t t0,
                int64_t nt, const float* bias, uint16_t* y, PanelFill<KIND>* next) {
  const int64_t mchunks = (M + 15) / 16, N = w.N;
  const int64_t blocks = (mchunks + 1) / 2 * ((nt + 1) / 2);
  const int64_t per_kb = next ? (next->total() + blocks * kblocks - 1) / (blocks * kblocks) : 0;
  alignas(64) float c[16][32];  // c[m][16 u + n]: accumulators u, u + 1 of one chunk
  auto store = [&](int64_t mc, int64_t u) {  // c -> y rows of chunk mc, columns of tiles t0 + u, u + 1 (+ bias), bf16
    const int64_t width = u + 1 < nt ? 32 : 16;  // a last odd tile: the next columns are another panel's
    const int64_t n0 = (t0 + u) * NR, rows = std::min<int64_t>(16, M - mc * 16), cols = std::min(width, N - n0);
    const __mmask32 keep = static_cast<__mmask32>(cols >= 32 ? ~0u : (1u << cols) - 1);
    const __mmask16 lo = static_cast<__mmask16>(keep), hi = static_cast<__mmask16>(keep >> 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + n0 + 16) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c[m]), b0), v1 = _mm512_add_ps(_mm512_load_ps(c[m] + 16), b1);
      _mm512_mask_storeu_epi16(y + (mc * 16 + m) * N + n0, keep, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
  };
  for (int64_t mc = 0; mc < mchunks; mc += 2) {
    const bool two_m = mc + 1 < mchunks;
    const uint16_t* x0 = a.chunk(mc);
    const uint16_t* x1 = a.chunk(mc + 1);
    for (int64_t u = 0; u < nt; u += 2) {
      const bool two_n = u + 1 < nt;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        const uint16_t* b0 = panel + (kb * nt + u) * 512;
        _tile_loadd(4, x0 + kb * a.kb_elems, a.row_bytes);
        _tile_loadd(6, b0, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, b0 + 512, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, x1 + kb * a.kb_elems, a.row_bytes);
          _tile_dpbf16ps(2, 5, 6);
          if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
        if (next) next->step(per_kb);
      }
      _tile_stored(0, c, 128);
      _tile_stored(1, &c[0][16], 128);  // without two_n: zero (zeroed above) and not stored
      store(mc, u);
      if (two_m) {
        _tile_stored(2, c, 128);
        _tile_stored(3, &c[0][16], 128);
        store(mc + 1, u);
      }
    }
  }
}

// Longer calls: the whole weight dequantized to bf16 [K, N] by both cores, then one call of torch's GEMM, itself
// split over the cores (the blocked path runs each block's GEMM on one core). The rows are one line longer than
// the tiles: at 3072 columns (6 KB) the dequantization's 16 stores a pair went to two L1 sets (the 135M's 2048-row
// gate/up projection 3.00 -> 2.94 ms, the same bits).
at::Tensor whole(const Weight& w, const at::Tensor& x) {
  const int64_t tiles = w.tiles(), ld = tiles * NR + 32;
  thread_local at::Tensor buffer;  // the caller's: reused (a fresh one per call costs its page faults)
  if (!buffer.defined() || buffer.numel() < w.K * ld) buffer = at::empty({w.K * ld}, x.options());
  void* out = buffer.data_ptr();  // (the workers' own thread_local buffers are not this one)
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { dequant_tiles(w, t0, t1, 0, out, ld, true); });
  const at::Tensor wt = buffer.narrow(0, 0, w.K * ld).view({w.K, ld}).narrow(1, 0, w.N);
  if (w.bias.defined() && w.bias.numel()) return at::addmm(w.bias.to(x.scalar_type()), x, wt);
  return at::mm(x, wt);
}

// x [M, K] bf16 (columns in the weight's order) -> y [M, N] bf16 (+ bias).
at::Tensor run(const Weight& w, const at::Tensor& x) {
  const int64_t M = x.size(0), K = w.K, Kp = (K + KB - 1) / KB * KB, kblocks = Kp / KB;
  const int64_t mchunks = (M + 31) / 32 * 2;  // two chunks a pass: an odd last one reads a zero chunk
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // The caller's buffer for copies, reused (a fresh one per call cost its page faults and a one-core zero fill:
  // ~0.2 ms of the 135M's 0.8 ms down projection at 512 rows; the packed copy itself 10 % of it).
  thread_local std::vector<uint16_t> copy;
  ARows a;
  if (K % KB == 0) {  // x's own rows; a padded copy of the rows past the last full chunk
    const int64_t full = M / 16, rows = (mchunks - full) * 16;
    if (copy.size() < static_cast<size_t>(rows * K)) copy.resize(rows * K);
    if (rows) {
      std::memset(copy.data(), 0, rows * K * 2);
      std::memcpy(copy.data(), xs + full * 16 * K, (M - full * 16) * K * 2);
    }
    a = {xs, full, copy.data(), 16 * K, KB, K * 2};
  } else {  // packed: copy[chunk][k block] the A tile of 16 rows x 32 columns (1 KB), zero past K and M
    if (copy.size() < static_cast<size_t>(mchunks * kblocks * 512)) copy.resize(mchunks * kblocks * 512);
    uint16_t* xd = copy.data();
    over_rows(mchunks * 16, K, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          uint16_t* dst = xd + ((m / 16) * kblocks + kb) * 512 + (m % 16) * 32;
          const int64_t n = m < M ? std::min<int64_t>(KB, K - kb * KB) : 0;
          if (n) std::memcpy(dst, xs + m * K + kb * KB, n * 2);
          if (n < KB) std::memset(dst + n, 0, (KB - n) * 2);
        }
    });
    a = {xd, mchunks, xd, kblocks * 512, 512, 64};
  }
  at::Tensor y = at::empty({M, w.N}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::Tensor bias = w.bias.defined() && w.bias.numel() ? w.bias.to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  // Each core an equal share of the tiles (even bounds: a 9 / 8-panel split of the 135M's down projection left one
  // core idle 10 % of the call), cut into at least 4 panels (each filled while the one before multiplies) that
  // fit PANEL_BYTES.
  const int64_t tiles = w.tiles(), by_cache = std::max<int64_t>(2, PANEL_BYTES / (kblocks * 1024) / 2 * 2);
  const int64_t cores = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles / 2));
  auto bound = [&](int64_t i) { return std::min(tiles, (tiles * i / cores + 1) / 2 * 2); };
  auto share = [&](auto kind, int64_t s0, int64_t s1) {
    constexpr int64_t KIND = decltype(kind)::value;
    const int64_t n = s1 - s0;
    if (n <= 0) return;
    const int64_t count = std::max((n + by_cache - 1) / by_cache, std::min<int64_t>(4, (n + 1) / 2));
    const int64_t per = ((n + count - 1) / count + 1) / 2 * 2, size = per * kblocks * 512;
    amx::Tiles config;
    thread_local std::vector<uint16_t> buffers;
    if (buffers.size() < static_cast<size_t>(2 * size)) buffers.resize(2 * size);
    auto fill = [&](int64_t i) {
      return PanelFill<KIND>(w, s0 + i * per, std::min(s1, s0 + (i + 1) * per), kblocks, buffers.data() + (i % 2) * size);
    };
    const int64_t panels = (n + per - 1) / per;
    PanelFill<KIND> first = fill(0);
    first.step(first.total());
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t t0 = s0 + i * per, t1 = std::min(s1, t0 + per);
      const uint16_t* panel = buffers.data() + (i % 2) * size;
      if (i + 1 < panels) {
        PanelFill<KIND> next = fill(i + 1);
        panel_gemm<KIND>(w, a, M, kblocks, panel, t0, t1 - t0, bp, yp, &next);
        next.step(next.total());  // what the matmuls left
      } else {
        panel_gemm<KIND>(w, a, M, kblocks, panel, t0, t1 - t0, bp, yp, nullptr);
      }
    }
  };
  at::parallel_for(0, cores, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) by_quant_kind(w, [&](auto kind) { share(kind, bound(c), bound(c + 1)); });
  });
  return y;
}

}  // namespace amx_prefill
#pragma GCC pop_options

// Tiles [t0, t1) of a quantized weight into wt (fp32, or bf16 bits when bf16), columns from tile tile_base on.
void dequant_tiles(const Weight& w, int64_t t0, int64_t t1, int64_t tile_base, void* wt, int64_t ld, bool bf16) {
  if (isa() >= ISA_AVX512BF16) {
    return by_quant_kind(w, [&](auto kind) {
      constexpr int64_t KIND = decltype(kind)::value;
      if (bf16) return dequant512::tiles<KIND, true>(w, t0, t1, tile_base, wt, ld);
      dequant512::tiles<KIND, false>(w, t0, t1, tile_base, wt, ld);
    });
  }
  if (!bf16) {
    return by_quant_kind(w, [&](auto kind) {
      avx2::dequant_tiles<decltype(kind)::value>(w, t0, t1, tile_base, static_cast<float*>(wt), ld);
    });
  }
  dequant_tiles_scalar(w, t0, t1, tile_base, static_cast<uint16_t*>(wt), ld);  // bf16 bits here: tests only
}

// Whether a bf16 GEMM runs on native bf16 dot products (AVX512-BF16: torch's oneDNN kernels). Elsewhere torch's
// bf16 GEMM is a fallback ~7x slower than its fp32 GEMM (an AVX2 EPYC, notes/issue-39.md), so bf16 prefills
// multiply fp32 copies of their weight blocks and round the product to bf16 (prefill_linear).
bool native_bf16_gemm() { return isa() >= ISA_AVX512BF16; }

// The whole weight, transposed: wt [K, tiles * 16] (fp32 or bf16), columns in the layout's order. Tests compare
// it with the Python dequantization; the prefill below runs it a block at a time.
at::Tensor dequantize_t(const Weight& w, bool bf16) {
  TORCH_CHECK(w.quantized(), "dequantize takes a quantized weight");
  at::Tensor wt = at::empty({w.K, w.tiles() * NR}, at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  void* out = wt.data_ptr();
  at::parallel_for(0, w.tiles(), 1, [&](int64_t b, int64_t e) { dequant_tiles(w, b, e, 0, out, wt.size(1), bf16); });
  return wt.narrow(1, 0, w.N);
}

// y [M, N] = x [M, K] @ W^T (+ bias) in x's dtype (fp32 or bf16). Each core takes whole blocks of block_rows
// output rows: it dequantizes a block into its own scratch (K x block_rows: in L2 for K up to ~2k at 128 rows) and
// multiplies it there with a one-thread GEMM into y's columns. No barrier per block: a shared block dequantized by
// both cores and then multiplied by both left L2 and cost 1.8x a bf16 layer's GEMM on the 1.5B's layers at 128 rows,
// this 1.2x (notes/issue-39.md). x's columns are gathered by perm first (act-order). The GEMM runs in x's dtype,
// except bf16 without native bf16 dot products: fp32 blocks and x, the product rounded to bf16 (native_bf16_gemm).
// A dense bf16 weight takes the same path there, its rows widened to fp32 a block at a time. APPROXIMATE (the
// section's header).
at::Tensor prefill_linear(const Weight& w, at::Tensor x, int64_t block_rows) {
  TORCH_CHECK((w.quantized() || w.kind == BF16) && x.dim() == 2 && x.size(1) == w.K,
              "prefill_linear: a quantized or bf16 weight, x [M, K]");
  const bool bf16_in = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_in || x.scalar_type() == at::kFloat, "prefill_linear: fp32 or bf16 activations");
  const bool bf16 = bf16_in && native_bf16_gemm();  // the GEMM's dtype
  if (w.perm.defined()) x = x.index_select(1, w.perm);
  if (bf16_in && w.quantized() && w.bf16_act && isa() >= ISA_AMX && g_amx_mode != AMX_OFF) {
    if (x.size(0) <= amx_prefill::MAX_ROWS) return amx_prefill::run(w, x.contiguous());
    return amx_prefill::whole(w, x.contiguous());
  }
  x = x.to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
  const auto opts = x.options();
  at::Tensor y = at::empty({x.size(0), w.N}, opts);
  at::Tensor bias = w.bias.defined() ? w.bias.to(x.scalar_type()) : at::Tensor();
  const bool dense = !w.quantized();
  const int64_t unit = dense ? 1 : NR, units = dense ? w.N : w.tiles();  // a block: whole tiles, or weight rows
  const int64_t block_units = std::clamp<int64_t>(block_rows / unit, 1, units), width = block_units * unit;
  const int64_t blocks = (units + block_units - 1) / block_units;
  const at::ThreadLocalState caller;  // the workers run ATen ops: in the caller's modes (inference mode, grad)
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {  // ATen ops inside run on this thread alone
    at::ThreadLocalStateGuard modes(caller);
    thread_local at::Tensor scratch;  // reused: a fresh buffer per call costs page faults
    if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.numel() < w.K * width)
      scratch = at::empty({w.K * width}, opts);
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t u0 = blk * block_units, u1 = std::min(u0 + block_units, units);
      const int64_t n0 = u0 * unit, n = std::min(u1 * unit, w.N) - n0, ld = (u1 - u0) * unit;
      at::Tensor wt;  // [K, n]
      if (dense) {
        at::Tensor rows = scratch.narrow(0, 0, n * w.K).view({n, w.K});
        rows.copy_(w.data.view({w.N, w.K}).narrow(0, n0, n));  // bf16 -> the GEMM's dtype
        wt = rows.t();
      } else {
        dequant_tiles(w, u0, u1, u0, scratch.data_ptr(), ld, bf16);
        wt = scratch.narrow(0, 0, w.K * ld).view({w.K, ld}).narrow(1, 0, n);
      }
      at::Tensor yb = y.narrow(1, n0, n);
      if (bias.defined())
        at::addmm_out(yb, bias.narrow(0, n0, n), x, wt);
      else
        at::mm_out(yb, x, wt);
    }
  });
  return bf16_in ? y.to(at::kBFloat16) : y;
}

Weight make_weight(int64_t kind, int64_t N, int64_t K, int64_t group, bool bf16_act, at::Tensor data,
                   std::optional<at::Tensor> scales, std::optional<at::Tensor> zeros, std::optional<at::Tensor> perm,
                   std::optional<at::Tensor> bias, bool int8_act) {
  Weight w;
  TORCH_CHECK(!int8_act || kind == I8 || kind == I4, "int8 activations take int8 or int4 (2/3/4-bit) codes");
  w.int8_act = int8_act;
  w.kind = kind;
  w.N = N;
  w.K = K;
  w.bf16_act = bf16_act;
  w.data = data.contiguous();
  TORCH_CHECK(kind >= F32 && kind <= FP8, "unknown weight kind ", kind);
  if (kind == F32) TORCH_CHECK(data.scalar_type() == at::kFloat && data.numel() == N * K, "F32 weight: [N, K] fp32");
  if (kind == BF16)
    TORCH_CHECK(data.scalar_type() == at::kBFloat16 && data.numel() == N * K, "BF16 weight: [N, K] bf16");
  if (w.quantized()) {
    TORCH_CHECK(scales && zeros, "quantized weights need scales and zeros");
    w.group = group <= 0 ? K : group;
    w.ngroups = (K + w.group - 1) / w.group;
    TORCH_CHECK(w.group % 2 == 0 || w.ngroups == 1, "quantized groups must hold an even number of columns");
    const int64_t Kp = (K + KB - 1) / KB * KB;
    const int64_t expect = w.tiles() * (Kp / 2) * w.pair_bytes();
    TORCH_CHECK(data.numel() == expect && data.element_size() == 1, "quantized data: ", expect, " bytes expected, got ",
                data.numel());
    w.scales = scales->to(at::kFloat).contiguous();
    w.zeros = zeros->scalar_type() == at::kChar ? zeros->contiguous() : zeros->to(at::kFloat).contiguous();
    TORCH_CHECK(w.scales.numel() == w.tiles() * w.ngroups * NR && w.zeros.numel() == w.scales.numel(),
                "scales / zeros: [tiles, groups, 16] (scales fp32, zeros fp32 or int8)");
    if (int8_act && kind == I4) {
      const at::Tensor z = w.zeros.to(at::kFloat).round();  // as the kernels' conversion rounds: half to even
      w.codes_zeros = z.min().item<float>() >= 0.0f && z.max().item<float>() <= 15.0f;
    }
  }
  if (perm && perm->defined() && perm->numel()) {
    TORCH_CHECK(perm->numel() == K, "perm: one input column per K");
    w.perm = perm->to(at::kLong).contiguous();
  }
  if (bias && bias->defined() && bias->numel()) w.bias = bias->to(at::kFloat).contiguous();
  return w;
}

at::Tensor linear(const Weight& w, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, ", w.K, "]");
  x = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  Acts a;
  linear_into(w, x.data_ptr<float>(), x.size(0), w.K, y.data_ptr<float>(), w.N, a);
  return y;
}

// linear's outputs rounded to bf16 and kept as fp32, torch's .to(bfloat16).float() (NaN included): a bf16 head's
// logits in one pass over [M, N], where the bf16 tensor and its widened copy were two more (an 8-row
// verification's logits of the default model: 0.27 ms against 0.07 for a decode step's, on one core).
at::Tensor linear_bf16_values(const Weight& w, at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, ", w.K, "]");
  const int64_t M = x.size(0);
  const bool bias = w.bias.defined() && w.bias.numel();
  if (M >= 1 && M <= MAX_M && !bias && amx_dense(w, isa(), M)) {  // rounded by the kernel as it writes
    x = x.to(at::kFloat).contiguous();
    at::Tensor y = at::empty({M, w.N}, x.options());
    Acts a;
    prepare(w, x.data_ptr<float>(), M, w.K, a, isa());
    run_amx_dense(w, a, y.data_ptr<float>(), w.N, true);
    return y;
  }
  at::Tensor y = linear(w, x);
  float* p = y.data_ptr<float>();
  const int64_t N = y.size(1);
  over_rows(y.size(0), N, [&](int64_t m0, int64_t m1) {
    int64_t i = m0 * N;
    for (; i + 8 <= m1 * N; i += 8) _mm256_storeu_ps(p + i, bf16_values8(bf16_bits8<true>(_mm256_loadu_ps(p + i))));
    for (; i < m1 * N; ++i) p[i] = static_cast<float>(at::BFloat16(p[i]));
  });
  return y;
}

void set_isa(const std::string& name) {
  g_isa_cap = name == "avx2" ? ISA_AVX2 : name == "avx512" ? ISA_AVX512 : name == "avx512bf16" ? ISA_AVX512BF16 : ISA_AMX;
}

int64_t set_kv_piece(int64_t keys) {  // -> the previous setting
  TORCH_CHECK(keys > 0, "set_kv_piece: keys per piece must be positive, got ", keys);
  return std::exchange(g_kv_piece, keys);
}

const char* const AMX_MODE_NAMES[] = {"off", "exact", "approximate", "dense"};  // by AmxMode

void set_amx(const std::string& mode) {
  for (int i = 0; i < 4; ++i)
    if (mode == AMX_MODE_NAMES[i]) {
      g_amx_mode = i;
      return;
    }
  TORCH_CHECK(false, "AMX row policy: exact | dense | off | approximate, got ", mode);
}

std::string amx_mode() { return AMX_MODE_NAMES[g_amx_mode]; }

// Seconds per phase since the last call (norm+residual, qkv, rope+kv write, attention, o, gate_up, act, down),
// and whether to keep counting.
std::vector<double> profile(bool enable) {
  std::vector<double> out(g_phase, g_phase + P_COUNT);
  std::fill(g_phase, g_phase + P_COUNT, 0.0);
  g_profile = enable;
  return out;
}

std::string isa_name() {
  static const char* names[] = {"avx2", "avx512", "avx512bf16", "amx"};
  return names[isa()];
}

}  // namespace qspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<qspec::Weight>(m, "Weight")
      .def(py::init(&qspec::make_weight), py::arg("kind"), py::arg("N"), py::arg("K"), py::arg("group"),
           py::arg("bf16_act"), py::arg("data"), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("perm") = py::none(), py::arg("bias") = py::none(), py::arg("int8_act") = false)
      .def_readonly("kind", &qspec::Weight::kind)
      .def_readonly("N", &qspec::Weight::N)
      .def_readonly("K", &qspec::Weight::K);
  m.def("linear", &qspec::linear, "y = x @ W^T (+ bias) for 1..64 rows of x (fp32 out)");
  m.def("linear_bf16_values", &qspec::linear_bf16_values, "linear's outputs rounded to bf16, as fp32");
  py::class_<qspec::StepModel>(m, "StepModel")
      .def(py::init(&qspec::make_step_model))
      .def_property_readonly("layers", &qspec::StepModel::layers);
  m.def("step", &qspec::step, "every decoder layer for T new tokens per row (CPU; fp32 / bf16 compute)",
        py::arg("model"), py::arg("x"), py::arg("tokens"), py::arg("starts"), py::arg("counts"), py::arg("local"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("cos"), py::arg("sin"));
  m.def("step_quant", &qspec::step_quant, "the step over a quantized KV pool (int8 / fp8_e4m3 / int4, read in place)",
        py::arg("model"), py::arg("x"), py::arg("tokens"), py::arg("starts"), py::arg("counts"), py::arg("local"),
        py::arg("tables"), py::arg("cos"), py::arg("sin"), py::arg("format"), py::arg("lookahead"), py::arg("pool"));
  m.def("quantize_kv_rows", &qspec::quantize_kv_rows, "the step's KV writer on rows [N, D] (tests)");
  m.def("rms_norm_rows", &qspec::rms_norm_rows, "RMSNorm of fp32 rows (CPU)");
  m.def("argmax_rows", &qspec::argmax_rows, "each fp32 row's argmax (torch.argmax's rule: first maximum, NaN largest)");
  m.def("silu_mul_rows", &qspec::silu_mul_rows, "the step's SiLU(gate) * up of rows [N, 2 n] (tests)");
  m.def("dequantize_t", &qspec::dequantize_t, "a quantized weight dequantized, transposed: [K, N] (prefill)");
  m.def("prefill_linear", &qspec::prefill_linear, "x @ W^T for many rows: block dequantize + torch's GEMM",
        py::arg("weight"), py::arg("x"), py::arg("block_rows"));
  m.def("native_bf16_gemm", &qspec::native_bf16_gemm, "whether bf16 GEMMs run on native bf16 dot products");
  m.def("set_isa", &qspec::set_isa, "cap the kernel family: avx2 | avx512 | avx512bf16 (tests)");
  m.def("set_kv_piece", &qspec::set_kv_piece, "keys per piece of the quantized attention's long-context split (-> the previous)");
  m.def("set_amx", &qspec::set_amx, "AMX row policy: exact (default) | dense | off | approximate (see cpu_step.cpp)");
  m.def("amx_mode", &qspec::amx_mode, "the AMX row policy in use");
  m.attr("AMX_MIN_ROWS") = qspec::AMX_MIN_ROWS;
  m.attr("AMX_INT8_MIN_ROWS") = qspec::AMX_INT8_MIN_ROWS;
  m.def("profile", &qspec::profile, "seconds per step phase since the last call; enable: keep counting");
  m.def("isa", &qspec::isa_name, "the kernel family in use");
  m.def("set_quant_streams", [](int64_t s) { TORCH_CHECK(s == 0 || s == 8, "streams: 0 or 8"); qspec::g_quant_streams = s; },
        "quantized tiles a core reads as 8 streams side by side (8, the default) or one (0): the same bits, for A/B runs");
  m.def("set_quant_quads", [](int64_t on) { qspec::g_quant_quads = on ? 1 : 0; },
        "int4 codes unpacked four pair columns a load (1, the default) or one (0): the same bits, for A/B runs");
  m.def("set_dense_streams", [](int64_t s) { TORCH_CHECK(s >= 0 && s % 4 == 0, "streams: a multiple of 4"); qspec::g_dense_streams = s; },
        "weight streams a core reads side by side in dense calls (default 4; 0: one; A/B runs and tests)");
  m.def("set_vnni", [](bool on) { qspec::g_vnni = on; }, "allow AVX512-VNNI for int8-activation layers (tests)");
  m.def("int8_kernel", &qspec::i8act::kernel_name, "the kernel an int8-activation layer runs here for M rows",
        py::arg("weight"), py::arg("rows") = 1);
}
