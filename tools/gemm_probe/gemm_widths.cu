// Probe: do tile widths that fill whole waves close the gap to cuBLAS at the held-out shapes?
//
// At per-GPU 3000 x 3072 x 4608 (Phi-3-mini qkv, AG) XLA's nvjet kernel runs 1.2-1.3x faster than
// our 128x256 GEMM (gemm_cublas_2026-11-30_s12.txt): 128x256 tiles make 24 x 18 = 432 tiles, 3.3
// waves on 132 SMs, so the slowest SMs run 4 tiles; nvjet picks a width per shape (128x288 there).
// In our orientation (128 rows of X by W columns of the weight) a persistent kernel lasts about
// ceil(tiles / SMs) tiles, and a tile about its width, so the span is ceil(tiles_W / SMs) * W:
//
//   Phi-3-mini qkv 3000 x 4608: W = 256: 432 tiles -> 4 x 256 = 1024; W = 216: 24 x 22 = 528 -> 4 x 216 = 864
//
// This times plain CUTLASS (no flux_jax hooks) at W = 256, 192 and four in-between widths (CuTe's
// extended m64nW atoms), next to cuBLAS, and prints the span model's ratio to W = 256 beside the
// measured one: if a width wins where the model says it should, the gated kernel can take a few
// more instances and ChooseBlockN a per-shape width.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <vector>

#include "cublas_loader.cuh"

namespace {

template <int TN>
using Plain = PlainGemm<RM, RM, RM, 128, TN, 1, cutlass::gemm::PersistentScheduler>;
constexpr int kWidths[] = {256, 192, 208, 216, 224, 240};
constexpr int kColumns = sizeof(kWidths) / sizeof(kWidths[0]);

float TimeWidth(int c, int m, int n, int k, const E* x, const E* w, E* d, int it, void* ws) {
  switch (kWidths[c]) {
    case 256: return TimePlain<Plain<256>>(m, n, k, x, w, d, it, ws, 8, false);
    case 192: return TimePlain<Plain<192>>(m, n, k, x, w, d, it, ws, 8, false);
    case 208: return TimePlain<Plain<208>>(m, n, k, x, w, d, it, ws, 8, false);
    case 216: return TimePlain<Plain<216>>(m, n, k, x, w, d, it, ws, 8, false);
    case 224: return TimePlain<Plain<224>>(m, n, k, x, w, d, it, ws, 8, false);
    case 240: return TimePlain<Plain<240>>(m, n, k, x, w, d, it, ws, 8, false);
  }
  return -1;
}

// The span model: ceil(tiles / SMs) * width.
double Span(int m, int n, int width, int sms) {
  const long tiles = (long)((m + 127) / 128) * ((n + width - 1) / width);
  return (double)((tiles + sms - 1) / sms) * width;
}

}  // namespace

int main() {
  const std::vector<Shape> shapes = {
      {3000, 3072, 4608, "Phi3 qkv 3000"},   {3000, 5120, 3584, "Qwen qkv 3000"},
      {3000, 2560, 5120, "Qwen out 3000"},   {6144, 6912, 5120, "Qwen down 6144"},
      {1500, 2560, 5120, "Qwen out 3000 RS"}, {3072, 2560, 5120, "Qwen out 6144 RS"},
      {12288, 2560, 5120, "Qwen out 12288"}, {12288, 3072, 8192, "Phi3 gate+up 12288"},
      {2048, 4096, 3072, "8B qkv 2048"},     {4096, 4096, 3072, "8B qkv 4096"},
      {8192, 8192, 8192, "8192^3"},
  };
  const ProbeBuffers buf(shapes, size_t{64} << 20);
  E *x = buf.x, *w = buf.w, *d = buf.d, *d2 = buf.d2;
  void* ws = buf.ws;
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  const int sms = prop.multiProcessorCount;
  Cublas cublas;
  const bool have_cublas = cublas.Load();

  printf("us per call, best of 7 loops. Per width: time, then measured / model ratio to W = 256\n");
  printf("%-18s %-17s %7s |", "layer", "MxKxN", "cuBLAS");
  for (int c = 0; c < kColumns; ++c) printf("  W=%-3d  meas/model  |", kWidths[c]);
  printf(" best/cuBLAS | worst check\n");
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& s : shapes) {
      const int M = s.m, K = s.k, N = s.n;
      const int it = std::max(3, (int)(20.0 * 8192.0 * 8192 * 8192 / ((double)M * N * K)));
      float worst = 0.f;
      if (pass == 0 && have_cublas) {  // every width against cuBLAS on the same inputs, outputs poisoned
        cublas.Run(M, N, K, x, w, d);
        for (int c = 0; c < kColumns; ++c) {
          cudaMemset(d2, 0xff, (size_t)M * N * 2);
          TimeWidth(c, M, N, K, x, w, d2, 1, ws);
          const float rel = RelativeDiff(d2, d, (size_t)M * N, buf.acc);
          worst = std::max(worst, std::isfinite(rel) ? rel : 1e30f);
        }
      }
      float t[kColumns + 1];
      auto run = [&](int c) {
        if (c == kColumns) t[c] = have_cublas ? BestUsPerCall([&] { cublas.Run(M, N, K, x, w, d); }, it, 7) : -1;
        else t[c] = TimeWidth(c, M, N, K, x, w, d, it, ws);
      };
      // The second pass in reverse column order, so drifting clocks favour no column.
      for (int c = 0; c <= kColumns; ++c) run(pass == 0 ? c : kColumns - c);
      float best = 1e30f;
      printf("%-18s %5dx%5dx%5d %7.1f |", s.what, M, K, N, t[kColumns]);
      for (int c = 0; c < kColumns; ++c) {
        best = std::min(best, t[c] > 0 ? t[c] : 1e30f);
        printf(" %7.1f %4.2f/%4.2f |", t[c], t[c] / t[0], Span(M, N, kWidths[c], sms) / Span(M, N, 256, sms));
      }
      printf(" %6.3f | %s\n", best / t[kColumns], pass == 0 ? (worst < 1e-2 ? "ok" : "MISMATCH") : "-");
      if (pass == 0 && worst >= 1e-2) printf("  worst relative difference %.3g\n", worst);
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return 0;
}
