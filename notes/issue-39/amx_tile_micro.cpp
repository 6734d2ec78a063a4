// AMX tile costs by activation rows M, alone (no codes, no epilogue): what a quantized tile's matmul costs a 1-row
// decode step against an 8-row verification. Per TDPBF16PS into 4 independent accumulators: (a) the matmuls only,
// (b) with a B tile load before each and an A tile load per 4 (as amx::quant), (c) plus storing the 4 accumulators
// every 2 k-blocks and reading each stored row back (a group-64 epilogue's tile stores). Build and run alone:
//
//     g++ -O2 -mamx-tile -mamx-bf16 -mavx512f notes/issue-39/amx_tile_micro.cpp -o /tmp/amx_tile_micro && /tmp/amx_tile_micro
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};
static void configure(int M) {  // tiles 0..4 (accumulators, A) get M rows, as amx::Tiles(5, M)
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t < 5 ? M : 16;
  }
  _tile_loadconfig(&c);
}
alignas(64) static uint16_t A[16 * 32 * 64];
alignas(64) static uint16_t B[64][512];
alignas(64) static float C[16 * 16];

template <typename F>
static double ns_per_tdp(long n, F&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) body(i);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (4.0 * n) * 1e9;
}

int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  for (auto& a : A) a = 0x3f80;         // bf16 1.0
  for (auto& row : B)
    for (auto& b : row) b = 0x3f80;
  const long n = 2000000;
  for (int M : {1, 2, 4, 8, 16}) {
    configure(M);
    { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    _tile_loadd(4, A, 64);
    _tile_loadd(5, B[0], 64);
    _tile_loadd(6, B[1], 64);
    _tile_loadd(7, B[2], 64);
    const double tdp = ns_per_tdp(n, [](long) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    });
    auto products = [](long i) {
      _tile_loadd(4, A + (i % 8) * 32, 64 * 16);
      _tile_loadd(5, B[(i * 4) % 64], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, B[(i * 4 + 1) % 64], 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, B[(i * 4 + 2) % 64], 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, B[(i * 4 + 3) % 64], 64);
      _tile_dpbf16ps(3, 4, 5);
    };
    const double loads = ns_per_tdp(n, products);
    float sink = 0.0f;
    const double stores = ns_per_tdp(n, [&](long i) {
      if (i % 2 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
      products(i);
      if (i % 2 == 1) {
        _tile_stored(0, C, 64);
        for (int m = 0; m < M; ++m) sink += C[m * 16];
        _tile_stored(1, C, 64);
        for (int m = 0; m < M; ++m) sink += C[m * 16];
        _tile_stored(2, C, 64);
        for (int m = 0; m < M; ++m) sink += C[m * 16];
        _tile_stored(3, C, 64);
        for (int m = 0; m < M; ++m) sink += C[m * 16];
      }
    });
    std::printf("M=%2d: matmuls %.2f ns, + tile loads %.2f ns, + stores every 2 blocks %.2f ns (per matmul)%s\n", M, tdp,
                loads, stores, sink < 0 ? " " : "");
  }
  _tile_release();
}
