// The CUDA attention dropout mask (attention_dropout_mask_cuda, csrc/attention_cuda.cu) against the CPU Philox of
// csrc/philox_cpu.h, bit for bit. Exits non-zero on any mismatch.
#include "shim.h"
#include "attention_cuda.h"
#include "philox_cpu.h"
using namespace fasttrans;
int main() {
  int64_t B = 2, H = 3, Lq = 37, Lk = 70; uint64_t seed = 0xdeadbeefcafe1234ULL; uint32_t thr = attention_dropout_threshold(0.37);
  int64_t rows = B * H * Lq;
  std::vector<uint8_t> keep(rows * Lk, 7);
  if (const char* e = cuda_kernels::attention_dropout_mask_cuda(B, H, Lq, Lk, seed, thr, (bool*)keep.data(), nullptr)) {
    printf("launcher error: %s\n", e);
    return 1;
  }
  int bad = 0;
  for (int64_t row = 0; row < rows; ++row) {
    int64_t b = row / (H * Lq), h = (row / Lq) % H, i = row % Lq;
    for (int64_t j = 0; j < Lk;) {  // dropout_keep_row from common.h, j0 = 0
      int64_t count = std::min<int64_t>(64, Lk - j);
      uint64_t bits = cpu::attention_keep_bits64_scalar(i, h, b, j >> 4, seed, thr);
      for (int64_t c = 0; c < count; ++c) bad += keep[row * Lk + j + c] != ((bits >> c) & 1);
      j += count;
    }
  }
  printf("mismatches %d\n", bad);
  return bad != 0;
}
