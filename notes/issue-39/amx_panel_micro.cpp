// The AMX prefill's panel GEMM loop alone (no dequantization): M rows in chunks of 16, a panel of nt tiles of 16
// outputs, kblocks of 32 columns, 2 x 2 blocks; variants of loop order, streaming tile loads and the epilogue (one
// 64-byte line a row for two accumulators, deferred into the next block). Build and run alone; arguments: chunks, nt,
// kblocks, total output tiles (the output's row stride):
//
//     g++ -O2 -march=sapphirerapids notes/issue-39/amx_panel_micro.cpp -o /tmp/amx_panel_micro && /tmp/amx_panel_micro 32 24 18 192
// panel GEMM loop variants: M rows (mchunks of 16), nt tiles of 16 outputs, kblocks of 32
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {0}; uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
static void configure() { TileConfig c; for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; } _tile_loadconfig(&c); }
int64_t MCH = 32, NT = 24, KBL = 18, NTOT = 24, T0 = 0;
alignas(64) float cbuf[16][16];
alignas(64) float cpair[16][32];
int EPI2 = 0;
alignas(64) float cdef[32][32];
int64_t pend_m = -1, pend_n = 0;
uint16_t *X, *P, *Y;
template <int ORDER, bool EPI, bool T1A, bool T1B = false>
void run() {
  int64_t N = NTOT * 16;
  auto body = [&](int64_t mc, int64_t u) {
    const uint16_t* x0 = X + mc * KBL * 512; const uint16_t* x1 = x0 + KBL * 512;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KBL; ++kb) {
      const uint16_t* b0 = P + (kb * NT + u) * 512;
      if (T1A) _tile_stream_loadd(4, x0 + kb * 512, 64); else _tile_loadd(4, x0 + kb * 512, 64);
      if (T1B) _tile_stream_loadd(6, b0, 64); else _tile_loadd(6, b0, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (T1B) _tile_stream_loadd(7, b0 + 512, 64); else _tile_loadd(7, b0 + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (T1A) _tile_stream_loadd(5, x1 + kb * 512, 64); else _tile_loadd(5, x1 + kb * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    auto st = [&](int64_t m0, int64_t n0) {
      for (int m = 0; m < 16; ++m)
        _mm256_storeu_si256((__m256i*)(Y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(cbuf[m])));
    };
    if (EPI2) {
      auto st2 = [&](int64_t m0, int64_t n0) {
        for (int m = 0; m < 16; ++m)
          _mm512_storeu_si512((Y + (m0 + m) * N + n0), (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(cpair[m] + 16), _mm512_load_ps(cpair[m])));
      };
      _tile_stored(0, cpair, 128); _tile_stored(1, &cpair[0][16], 128); st2(mc * 16, (T0 + u) * 16);
      _tile_stored(2, cpair, 128); _tile_stored(3, &cpair[0][16], 128); st2(mc * 16 + 16, (T0 + u) * 16);
      return;
    }
    _tile_stored(0, cbuf, 64); if (EPI) st(mc * 16, (T0 + u) * 16);
    _tile_stored(1, cbuf, 64); if (EPI) st(mc * 16, (T0 + u) * 16 + 16);
    _tile_stored(2, cbuf, 64); if (EPI) st(mc * 16 + 16, (T0 + u) * 16);
    _tile_stored(3, cbuf, 64); if (EPI) st(mc * 16 + 16, (T0 + u) * 16 + 16);
  };
  if (ORDER == 0) { for (int64_t mc = 0; mc < MCH; mc += 2) for (int64_t u = 0; u < NT; u += 2) body(mc, u); }
  else { for (int64_t u = 0; u < NT; u += 2) for (int64_t mc = 0; mc < MCH; mc += 2) body(mc, u); }
}
template <int ORDER, bool EPI, bool T1A, bool T1B = false>
void bench(const char* name) {
  run<ORDER, EPI, T1A, T1B>();
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; ++i) { T0 = (i % (NTOT / NT)) * NT; run<ORDER, EPI, T1A, T1B>(); }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / 20;
    if (ns < best) best = ns;
  }
  double dps = MCH * NT * KBL;
  printf("%-28s %.2f ns per dp  (%.1f us a panel)\n", name, best / dps, best / 1e3);
}
template <bool T1B>
void run_def() {
  int64_t N = NTOT * 16;
  pend_m = -1;
  auto conv = [&](int r) {  // row r of the pending 32 x 32 block
    _mm512_storeu_si512((Y + (pend_m + r) * N + pend_n), (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(cdef[r] + 16), _mm512_load_ps(cdef[r])));
  };
  for (int64_t mc = 0; mc < MCH; mc += 2) for (int64_t u = 0; u < NT; u += 2) {
    const uint16_t* x0 = X + mc * KBL * 512; const uint16_t* x1 = x0 + KBL * 512;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    int done = 0;
    for (int64_t kb = 0; kb < KBL; ++kb) {
      const uint16_t* b0 = P + (kb * NT + u) * 512;
      _tile_loadd(4, x0 + kb * 512, 64);
      if (T1B) _tile_stream_loadd(6, b0, 64); else _tile_loadd(6, b0, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (T1B) _tile_stream_loadd(7, b0 + 512, 64); else _tile_loadd(7, b0 + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x1 + kb * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      if (pend_m >= 0) for (int e = 0; e < 2 && done < 32; ++e) conv(done++);
    }
    if (pend_m >= 0) while (done < 32) conv(done++);
    _tile_stored(0, cdef[0], 128); _tile_stored(1, &cdef[0][16], 128);
    _tile_stored(2, cdef[16], 128); _tile_stored(3, &cdef[16][16], 128);
    pend_m = mc * 16; pend_n = (T0 + u) * 16;
  }
  for (int r = 0; r < 32; ++r) conv(r);
}
template <bool T1B>
void bench_def(const char* name) {
  run_def<T1B>();
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; ++i) { T0 = (i % (NTOT / NT)) * NT; run_def<T1B>(); }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / 20;
    if (ns < best) best = ns;
  }
  double dps = MCH * NT * KBL;
  printf("%-28s %.2f ns per dp  (%.1f us a panel)\n", name, best / dps, best / 1e3);
}
int main(int argc, char** argv) {
  if (argc > 1) { MCH = atoi(argv[1]); NT = atoi(argv[2]); KBL = atoi(argv[3]); }
  if (argc > 4) NTOT = atoi(argv[4]);
  syscall(SYS_arch_prctl, 0x1023, 18);
  X = (uint16_t*)aligned_alloc(64, MCH * KBL * 1024); P = (uint16_t*)aligned_alloc(64, NT * KBL * 1024);
  Y = (uint16_t*)aligned_alloc(64, MCH * 16 * NTOT * 16 * 2);
  for (int64_t i = 0; i < MCH * KBL * 512; ++i) X[i] = 0x3f80 ^ (i & 7);
  for (int64_t i = 0; i < NT * KBL * 512; ++i) P[i] = 0x3f80 ^ (i & 3);
  configure();
  printf("M=%ld rows, nt=%ld tiles, kblocks=%ld: A %ld KB, panel %ld KB\n", MCH * 16, NT, KBL, MCH * KBL, NT * KBL);
  bench<0, false, false>("m outer, no epilogue");
  bench<0, true, false>("m outer");
  bench<1, true, false>("u outer");
  bench<1, true, true>("u outer, A streamed");
  bench<0, true, true>("m outer, A streamed");
  bench<0, true, false, true>("m outer, B streamed");
  EPI2 = 1;
  bench<0, true, false, false>("m outer, pair epilogue");
  bench<0, true, false, true>("m outer, B streamed, pair epi");
  EPI2 = 0;
  bench_def<false>("deferred epilogue");
  bench_def<true>("deferred, B streamed");
  bench<1, true, true, false>("u outer, A streamed");
  bench<0, true, true, true>("m outer, both streamed");
}
