// Int8 weight codes x bf16 activations, in cache: the CPU step's conversion (sign-extend to dwords, to fp32, to bf16;
// one vdpbf16ps a 32 codes) against a nibble split (code = 16 hi + lo as bf16 words 16 + nibble, exact; two
// vdpbf16ps a 32 codes, the hi words against 16 x the activations), for TB tiles x MB activation rows; and a check
// that the nibble words decode back to every code. A kernel probe, not a speed claim (notes/issue-39.md, 27th session).
//   g++ -O3 -march=native -o /tmp/i8mb notes/issue-39/int8_conversion_micro.cpp && /tmp/i8mb 1024 128 400
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cstdlib>
#include <cmath>
constexpr int NR = 16;
static inline __m512i convA(const uint8_t* p) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
// 64 bytes = pair columns j, j+1 (row r's two codes at word r, then word 16 + r): signed codes s = u - 128.
// lo words: bf16(16 + lo) = 0x4180 | lo << 3; hi words: bf16(16 + (hi ^ 8)) where u's high nibble = s's ^ 8.
// byte-level: lo byte = (v << 3) & 0x78 | 0x80, hi byte 0x41; word = unpack(lob, 0x41)
static inline void convN(const uint8_t* p, __m512i (&w)[4]) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i lob = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), _mm512_set1_epi8(0x78), _mm512_set1_epi8((char)0x80), 0xEA);  // (A&B)|C
  const __m512i hib = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), _mm512_set1_epi8(0x78), _mm512_set1_epi8((char)0xC0), 0x6A);  // (A&B)^C
  const __m512i e = _mm512_set1_epi8(0x41);
  w[0] = _mm512_unpacklo_epi8(lob, e);  // words: in-lane bytes 0..7 of each 128-bit lane
  w[1] = _mm512_unpackhi_epi8(lob, e);
  w[2] = _mm512_unpacklo_epi8(hib, e);
  w[3] = _mm512_unpackhi_epi8(hib, e);
}
template <int TB, int MB, bool NIB>
void run(const uint8_t* codes, int64_t tile_bytes, int64_t tiles, int64_t K, const uint32_t* pairs, const uint32_t* pairs16, float* out) {
  for (int64_t t = 0; t < tiles; t += TB) {
    __m512 acc[TB][MB];
    for (int u = 0; u < TB; ++u) for (int i = 0; i < MB; ++i) acc[u][i] = _mm512_setzero_ps();
    if (!NIB) {
      for (int64_t j = 0; j < K / 2; ++j) {
        __m512i xp[MB];
        for (int i = 0; i < MB; ++i) xp[i] = _mm512_set1_epi32(pairs[i * K / 2 + j]);
        for (int u = 0; u < TB; ++u) {
          __m512i wv = convA(codes + (t + u) * tile_bytes + j * 32);
          for (int i = 0; i < MB; ++i) acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)wv, (__m512bh)xp[i]);
        }
      }
    } else {
      for (int64_t j = 0; j < K / 2; j += 2) {
        for (int u = 0; u < TB; ++u) {
          __m512i w[4];
          convN(codes + (t + u) * tile_bytes + j * 32, w);
          for (int i = 0; i < MB; ++i) {
            // w[0]: lane-ordered words of pair j (rows 0..3 in lane0 ... ) -- order irrelevant for timing
            acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)w[0], (__m512bh)_mm512_set1_epi32(pairs[i * K / 2 + j]));
            acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)w[1], (__m512bh)_mm512_set1_epi32(pairs[i * K / 2 + j + 1]));
            acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)w[2], (__m512bh)_mm512_set1_epi32(pairs16[i * K / 2 + j]));
            acc[u][i] = _mm512_dpbf16_ps(acc[u][i], (__m512bh)w[3], (__m512bh)_mm512_set1_epi32(pairs16[i * K / 2 + j + 1]));
          }
        }
      }
    }
    for (int u = 0; u < TB; ++u) for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + ((t + u) * MB + i) * 16, acc[u][i]);
  }
}
template <int TB, int MB>
void bench(const char* name, std::vector<uint8_t>& codes, int64_t tile_bytes, int64_t tiles, int64_t K, int reps) {
  std::vector<uint32_t> pairs(MB * K / 2, 0x3f803f80u), pairs16(MB * K / 2, 0x41803f80u);
  std::vector<float> out(tiles * MB * 16 + 64);
  double best[2] = {1e9, 1e9};
  for (int round = 0; round < 7; ++round)
    for (int v = 0; v < 2; ++v) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) {
        if (v == 0) run<TB, MB, false>(codes.data(), tile_bytes, tiles, K, pairs.data(), pairs16.data(), out.data());
        else run<TB, MB, true>(codes.data(), tile_bytes, tiles, K, pairs.data(), pairs16.data(), out.data());
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < best[v]) best[v] = s;
    }
  const double macs = double(K) * tiles * 16 * MB * reps;
  printf("%s TB=%d MB=%d  A %6.1f  N %6.1f GMAC/s  N/A %.2f\n", name, TB, MB, macs / best[0] * 1e-9, macs / best[1] * 1e-9, best[0] / best[1]);
}
int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? atoll(argv[1]) : 1024, N = argc > 2 ? atoll(argv[2]) : 128;
  const int reps = argc > 3 ? atoi(argv[3]) : 500;
  const int64_t tiles = N / NR, tile_bytes = K * NR;
  std::vector<uint8_t> codes(tiles * tile_bytes);
  for (auto& c : codes) c = rand() & 255;
  const char* n = "cache";
  bench<8, 1>(n, codes, tile_bytes, tiles, K, reps);
  bench<4, 1>(n, codes, tile_bytes, tiles, K, reps);
  bench<4, 2>(n, codes, tile_bytes, tiles, K, reps / 2);
  bench<2, 4>(n, codes, tile_bytes, tiles, K, reps / 4);
  bench<1, 8>(n, codes, tile_bytes, tiles, K, reps / 8);
  // exactness of the nibble words: decode them back
  alignas(64) uint8_t b[64]; for (int i = 0; i < 64; ++i) b[i] = (uint8_t)(i * 37 + 11);
  __m512i w[4]; convN(b, w);
  alignas(64) uint16_t ws[4][32]; for (int q = 0; q < 4; ++q) _mm512_store_si512(ws[q], w[q]);
  int bad = 0;
  for (int lane = 0; lane < 4; ++lane) for (int k = 0; k < 8; ++k) {
    int byte_lo = lane * 16 + k, byte_hi = lane * 16 + 8 + k;
    for (int which = 0; which < 2; ++which) {
      int byte = which ? byte_hi : byte_lo;
      int8_t s = (int8_t)b[byte];
      auto f = [](uint16_t h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; };
      float lo = f(ws[which ? 1 : 0][lane * 8 + k]), hi = f(ws[which ? 3 : 2][lane * 8 + k]);
      float val = lo + 16 * hi - 272 - 128;  // (16 + lo) + 16 (16 + hi) - 272 = u; s = u - 128
      if (val != s) { ++bad; if (bad < 4) printf("byte %d s %d got %g (lo %g hi %g)\n", byte, s, val, lo, hi); }
    }
  }
  printf("nibble words decode check: %d bad\n", bad);
}
