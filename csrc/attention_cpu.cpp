// Fused attention on the CPU: flash-style blocked forward and backward.
//
// Forward, for one block of BM query rows (online softmax, Milakov & Gimelshein 2018):
//     for each tile of BN keys j:   S  = scale Q K_j^T + mask              (BM x BN)
//                                   m' = max(m, rowmax S);  P = exp(S - m')
//                                   l  = l exp(m - m') + rowsum P
//                                   O  = O exp(m - m') + (P * keep) V_j
//     out = O / (l (1 - p)),  lse = m + log l   (fp32; fp64 for fp64 inputs)
// m moves only when rowmax S passes it by more than ln 16 (m' = m otherwise): the result is
// the same for any m, and a tile that leaves m in place takes one pass over its scores.
// A row with no visible key keeps m = -inf and l = 0: out = 0 and lse = +inf, so the
// backward recomputes P = exp(S - lse) = 0 for it without a special case.
//
// Backward (FlashAttention-2, Dao 2023), per (query tile i, key tile j), in transposed form:
//     S^T  = K_j Q_i^T                 P^T  = exp(scale S^T + mask - lse_i)
//     dV_j += (P^T * keep / (1-p)) dO_i
//     dP^T = V_j dO_i^T                dS^T = P^T * (dP^T * keep / (1-p) - delta_i)
//     dK_j += scale dS^T Q_i           dQ_i  += scale dS K_j
// with delta_i = rowsum(dO_i * O_i). The transposed form gives the GEMMs of S^T and dP^T
// their B operand in K-major layout straight from a pre-transposed copy (Q^T and dO^T are
// made once per call), because the brgemm micro-kernel has no transpose flag; dQ's product
// transposes its dS^T tile in cache instead of reading a transposed copy of K.
// dS is also the gradient of an additive float mask.
//
// Determinism: no atomics. The "fused" schedule gives one work item per (batch, kv head):
// it owns dK/dV of that head and dQ of its query heads. When there are too few such items
// to fill the threads, the "split" schedule runs dK/dV per (batch, kv head, key tile) and
// then dQ per (batch, head, query tile), recomputing S and dP (7 GEMMs per tile instead of 5).
// FASTTRANS_CPU_ATTENTION_BWD=fused|split forces one (tests use it to cover both).
//
// Skipping: key tiles at or past key_lengths[b] and tiles entirely above the causal
// diagonal are never visited; only tiles crossing the diagonal pay for the causal mask.
// Likewise a bool mask's tiles are read before their GEMMs: those it hides entirely are
// skipped and those it allows entirely run unmasked (classify_mask_tile).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "common.h"
#include "cpu_allocator.h"
#include "ops.h"

namespace fasttrans::cpu {
namespace {

// Tile sizes (rows x keys), per machine and head dim: 64 x 128 forward and 64 x 64
// backward, halved (the longer side first, down to 16 x 16) until a tile step's working set
// fits in half the L2, which leaves the rest to a head's K^T copy and the prefetchers. Larger
// tiles bought nothing on the machines measured (benchmarks/README.md, "CPU attention tiles"),
// so the rule only shrinks them, for a small L2 or a large head dim.
//     forward:  S, the Q block and the O accumulator, the K^T and V tiles
//               (BM BN + 2 BM D + 2 BN D) elements of the accumulation dtype
//     backward: S^T, dP^T, dS; Q^T, dO^T and dQ; the K and V tiles and the dK, dV accumulators
//               (3 BM BN + 3 BM D + 4 BN D)
// FASTTRANS_CPU_ATTENTION_TILES="FMxFN,BMxBN" (forward, backward; read at the first call)
// replaces the rule, for tuning and for the tests' ragged tiles.
struct Tiles {
  int64_t fwd_m, fwd_n, bwd_m, bwd_n;
};

constexpr int64_t kMinTile = 16;
constexpr int64_t kDefaultL2Bytes = int64_t(1) << 20;  // when the machine does not say
// Below this a reported L2 size is taken as wrong (some virtual machines report a few KiB or
// an L1 size): x86 and Arm server cores of the last decade have 256 KiB or more.
constexpr int64_t kMinPlausibleL2Bytes = int64_t(128) << 10;

template <typename Fits>
std::pair<int64_t, int64_t> shrink_tile(int64_t bm, int64_t bn, Fits fits) {
  while (!fits(bm, bn) && std::max(bm, bn) > kMinTile) {
    if (bn > bm) bn /= 2;
    else bm /= 2;
  }
  return {bm, bn};
}

Tiles tiles_for_cache(int64_t D, int64_t elem, int64_t l2_bytes) {
  const int64_t budget = l2_bytes / 2;
  const auto [fm, fn] = shrink_tile(64, 128, [&](int64_t m, int64_t n) {
    return (m * n + 2 * m * D + 2 * n * D) * elem <= budget;
  });
  const auto [bm, bn] = shrink_tile(64, 64, [&](int64_t m, int64_t n) {
    return (3 * m * n + 3 * m * D + 4 * n * D) * elem <= budget;
  });
  return {fm, fn, bm, bn};
}

// Bytes of L2 per core: glibc's sysconf, else Linux's sysfs, else kDefaultL2Bytes.
int64_t machine_l2_bytes() {
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long sc = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (sc >= kMinPlausibleL2Bytes) return sc;
#endif
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level(dir + "level"), type(dir + "type"), size(dir + "size");
    int lv = 0;
    std::string ty, sz;
    if (!(level >> lv) || !(type >> ty) || !(size >> sz) || lv != 2 || ty == "Instruction") continue;
    char* end = nullptr;
    const long long n = std::strtoll(sz.c_str(), &end, 10);
    const int64_t unit = *end == 'K' ? 1024 : *end == 'M' ? 1024 * 1024 : 1;
    if (n * unit >= kMinPlausibleL2Bytes) return n * unit;
  }
  return kDefaultL2Bytes;
}

std::optional<Tiles> tiles_from_env() {
  const char* env = std::getenv("FASTTRANS_CPU_ATTENTION_TILES");
  if (!env || !*env) return std::nullopt;
  long long v[4] = {0, 0, 0, 0};
  int used = 0;
  const bool parsed = std::sscanf(env, "%lldx%lld,%lldx%lld%n", &v[0], &v[1], &v[2], &v[3], &used) == 4 &&
                      env[used] == '\0';
  TORCH_CHECK(parsed && std::all_of(v, v + 4, [](long long t) { return t >= 1 && t <= 1024; }),
              "FASTTRANS_CPU_ATTENTION_TILES: expected 'FMxFN,BMxBN' (forward and backward rows x keys, "
              "each from 1 to 1024), got '", env, "'");
  return Tiles{v[0], v[1], v[2], v[3]};
}

const std::optional<Tiles>& forced_tiles() {
  static const std::optional<Tiles> forced = tiles_from_env();  // a throw leaves it to the next call
  return forced;
}

int64_t this_machine_l2_bytes() {
  static const int64_t l2_bytes = machine_l2_bytes();
  return l2_bytes;
}

// The tiles the kernels use for head dim D and accumulation elements of elem bytes.
Tiles attention_tiles(int64_t D, int64_t elem) {
  if (forced_tiles()) return *forced_tiles();
  return tiles_for_cache(D, elem, this_machine_l2_bytes());
}

// The tile for a sequence of L rows (or keys) with base tile `base`: a sequence that fits in
// one and a half tiles is one tile, since a full tile plus a ragged remainder (64 + 27 rows
// at L = 91) runs every GEMM on two small operands instead of one (benchmarks/README.md,
// "Short shapes").
int64_t tile_for(int64_t L, int64_t base) {
  return L <= base + base / 2 ? std::max<int64_t>(L, 1) : base;
}

struct AttnParams {
  int64_t B = 0, H = 0, Hkv = 0, group = 1, Lq = 0, Lk = 0, D = 0;
  bool causal = false;
  int64_t causal_offset = 0;
  double scale = 1.0;
  double softcap = 0.0;  // > 0: scores soft-capped, softcap * tanh(scale s / softcap), before the masks
  const int32_t* key_lengths = nullptr;  // (B,) or null
  MaskView mask;
  Dropout dropout;

  int64_t kv_len(int64_t b) const {
    return key_lengths ? std::clamp<int64_t>(key_lengths[b], 0, Lk) : Lk;
  }
  // Keys [0, kv_end) may be visible to some row of the query block [i0, i0 + bm).
  int64_t kv_end(int64_t b, int64_t i0, int64_t bm) const {
    int64_t end = kv_len(b);
    if (causal) end = std::min(end, std::max<int64_t>(0, i0 + bm + causal_offset));
    return end;
  }
  // First query row that may see key j0.
  int64_t q_begin(int64_t j0) const {
    return causal ? std::clamp<int64_t>(j0 - causal_offset, 0, Lq) : 0;
  }
  // True when some entry of the tile lies above the causal diagonal.
  bool crosses_diagonal(int64_t i0, int64_t j_last) const {
    return causal && j_last > i0 + causal_offset;
  }
};

AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& attn_mask,
                       const at::Tensor& key_lengths_i32, bool is_causal, int64_t causal_offset, double dropout_p,
                       double scale, int64_t seed, double softcap) {
  // fasttrans.attention turns dropout_p == 1 into zeros before any kernel runs
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a probability in [0, 1), got ", dropout_p);
  AttnParams p;
  p.B = q.size(0);
  p.H = q.size(1);
  p.Lq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.Lk = k.size(2);
  p.group = p.H / p.Hkv;
  p.causal = is_causal;
  // Offsets beyond these bounds change nothing (every key visible / none visible) and
  // would only risk overflow in the tile arithmetic.
  p.causal_offset = std::clamp<int64_t>(causal_offset, -(p.Lq + 1), p.Lk + 1);
  p.scale = scale;
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "softcap: expected a finite value > 0 (0: none), got ",
              softcap);
  p.softcap = softcap;
  p.key_lengths = key_lengths_i32.defined() ? key_lengths_i32.data_ptr<int32_t>() : nullptr;
  p.mask = make_mask_view(attn_mask);
  p.dropout = make_dropout(dropout_p, seed);
  return p;
}

// --------------------------------------------------------------------------------------
// Argument checks shared by forward and backward (the functional layer validated the
// user's call; these guard direct calls of the op)
// --------------------------------------------------------------------------------------
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "q: expected a 4-D (B, H, Lq, D) tensor, got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "k, v: expected equal 4-D (B, Hkv, Lk, D) shapes, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "k: expected batch ", q.size(0), " and head dim ",
              q.size(3), " (from q), got shape ", k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "k: number of kv heads (", k.size(1),
              ") must divide the number of query heads (", q.size(1), ")");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "k, v: expected the dtype of q (", q.scalar_type(), "), got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "q: expected a floating-point dtype, got ", q.scalar_type());
}

std::optional<at::Tensor> canonical_mask(const std::optional<at::Tensor>& attn_mask, const at::Tensor& q,
                                         const at::Tensor& k) {
  if (!attn_mask.has_value() || !attn_mask->defined()) return std::nullopt;
  checks::mask_broadcasts(*attn_mask, q.size(0), q.size(1), q.size(2), k.size(2));
  // expand() is a view: broadcast dims keep stride 0 and are never materialised
  return attn_mask->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

at::Tensor canonical_lengths(const std::optional<at::Tensor>& key_lengths, int64_t B) {
  if (!key_lengths.has_value() || !key_lengths->defined()) return at::Tensor();
  checks::key_lengths_shape(*key_lengths, B);
  return key_lengths->to(at::kInt).contiguous();
}

// A copy with standard strides (contiguous() may keep odd strides on size-1 dims).
at::Tensor dense_copy(const at::Tensor& t, at::ScalarType dtype) {
  return cpu::empty(t.sizes(), t.options().dtype(dtype)).copy_(t);
}

// Rows must be addressable as a matrix with leading dimension stride(2) >= D (the GEMMs
// read them in place); anything else (an expanded view, a non-unit inner stride) gets a copy.
at::Tensor rows_in_place(const at::Tensor& t) {
  const bool unit_inner = t.stride(3) == 1 || t.size(3) == 1;
  return unit_inner && t.stride(2) >= t.size(3) ? t : dense_copy(t, t.scalar_type());
}

// t in the accumulation dtype, rows addressable in place.
at::Tensor rows_as(const at::Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc ? rows_in_place(t) : dense_copy(t, acc);
}

// dst (D x bn, leading dimension ld_dst) = the bn x D rows of src (leading dimension ld_src)
// transposed, in kTile x kTile in-register blocks (see transpose_upto16).
template <typename T>
void transpose_tile(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int64_t bn, int64_t D) {
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < bn; r0 += kTile) {
    for (int64_t c0 = 0; c0 < D; c0 += kTile) {
      transpose_upto16<T>(src + r0 * ld_src + c0, ld_src, dst + c0 * ld_dst + r0, ld_dst,
                          static_cast<int>(std::min(kTile, bn - r0)), static_cast<int>(std::min(kTile, D - c0)));
    }
  }
}

// dst[b, h, c, r] = src[b, h, r, c] for a (B, H, R, C) src with unit inner stride and a
// (B, H, C, R) dst with unit inner stride, contiguous over (B, H) (see transposed_copy),
// converting the dtype on the way (rows are converted first, then transposed in the dst
// dtype). In parallel over (b, h, block of kTile rows); each kTile x kTile tile is one
// in-register transpose (transpose_tile). The padding of each dst row, from R to its stride,
// is zeroed.
template <typename S, typename T>
void transpose_last2(const at::Tensor& src, at::Tensor& dst) {
  constexpr int64_t kTile = 16;
  const int64_t B = src.size(0), H = src.size(1), R = src.size(2), C = src.size(3);
  const S* s = src.data_ptr<S>();
  T* d = dst.data_ptr<T>();
  const int64_t sb = src.stride(0), sh = src.stride(1), sr = src.stride(2);
  const int64_t dh = dst.stride(1), ld = dst.stride(2);
  const int64_t n_rt = (R + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(kTile * C, 1));
  at::parallel_for(0, B * H * n_rt, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> converted(std::is_same_v<S, T> ? 0 : kTile * C);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / n_rt, b = bh / H, h = bh % H;
      const int64_t r0 = (item % n_rt) * kTile, rn = std::min(kTile, R - r0);
      const T* rows;
      int64_t ld_rows;
      if constexpr (std::is_same_v<S, T>) {
        rows = s + b * sb + h * sh + r0 * sr;
        ld_rows = sr;
      } else {
        for (int64_t r = 0; r < rn; ++r) at::vec::convert(s + b * sb + h * sh + (r0 + r) * sr, converted.data() + r * C, C);
        rows = converted.data();
        ld_rows = C;
      }
      transpose_tile(rows, ld_rows, d + bh * dh + r0, ld, rn, C);
      if (r0 + rn == R) {
        for (int64_t c = 0; c < C; ++c) std::fill(d + bh * dh + c * ld + R, d + bh * dh + (c + 1) * ld, T(0));
      }
    }
  });
}

// The leading dimension for a K-major GEMM operand of L columns: rows a multiple of 1 KiB
// apart map a tile's rows to the same few L1 sets, and the GEMM's loads of one tile evict each
// other; one cache line more spreads them over every set.
int64_t padded_ld(int64_t L, int64_t elem_size) {
  const int64_t line = 64 / elem_size;
  const int64_t ld = (L + line - 1) / line * line;
  return (ld * elem_size) % 1024 == 0 ? ld + line : ld;
}

// (B, H, L, D) -> a (B, H, D, L) copy in the accumulation dtype, unit inner stride, rows
// padded_ld apart: read its leading dimension from stride(2). Each row has at least one cache
// line of zeros past L, so that the backward's GEMMs can read a last query tile rounded up to
// whole vectors (bwd_tile).
at::Tensor transposed_copy(const at::Tensor& t_in, at::ScalarType acc) {
  const at::Tensor t = rows_in_place(t_in);
  const int64_t L = t.size(2);
  const int64_t line = 64 / static_cast<int64_t>(c10::elementSize(acc));
  const int64_t ld = padded_ld(L + line, c10::elementSize(acc));
  at::Tensor out = cpu::empty({t.size(0), t.size(1), t.size(3), ld}, t.options().dtype(acc)).narrow(3, 0, L);
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "attention_transpose", [&] {
    if (acc == at::kDouble) {
      transpose_last2<scalar_t, double>(t, out);
    } else {
      transpose_last2<scalar_t, float>(t, out);
    }
  });
  return out;
}

// Strided view of a (B, H, L, D) tensor: the address of row (b, h, i).
template <typename T>
struct Rows {
  T* data;
  int64_t sb, sh, si;
  explicit Rows(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), sb(t.stride(0)), sh(t.stride(1)), si(t.stride(2)) {}
  T* operator()(int64_t b, int64_t h, int64_t i) const { return data + b * sb + h * sh + i * si; }
};

// What a dense mask does to the block of rows [i0, i0 + bm) x keys [j0, j0 + bn) of head
// (b, h). A bool block that allows no key is skipped like keys past a key length (its keys
// and values are never read, so an inf or NaN there stays out, as on the Triton kernels), and
// one that allows every key is computed as if unmasked. A float mask's blocks are always
// applied: a NaN score plus -inf stays NaN.
enum class MaskTile { kNone, kDead, kPartial };

MaskTile classify_mask_tile(const MaskView& m, int64_t b, int64_t h, int64_t i0, int64_t bm, int64_t j0, int64_t bn) {
  if (!m) return MaskTile::kNone;
  if (m.kind != MaskKind::kBool) return MaskTile::kPartial;
  // bytes, not bools: a bool tensor viewed from other bytes may hold values other than 0 and 1
  const auto* base = static_cast<const uint8_t*>(m.data) + b * m.stride_b + h * m.stride_h + j0 * m.stride_j;
  const int64_t row_len = m.stride_j == 0 ? 1 : bn;  // a key-broadcast mask: one value per row
  const int64_t rows = m.stride_i == 0 ? 1 : bm;      // a query-broadcast one (padding): one row
  bool seen_allowed = false, seen_hidden = false;
  for (int64_t r = 0; r < rows && !(seen_allowed && seen_hidden); ++r) {
    const uint8_t* row = base + (i0 + r) * m.stride_i;
    int64_t allowed = 0;
    if (m.stride_j == 1) {
      for (int64_t c = 0; c < row_len; ++c) allowed += row[c] != 0;
    } else {
      for (int64_t c = 0; c < row_len; ++c) allowed += row[c * m.stride_j] != 0;
    }
    seen_allowed |= allowed > 0;
    seen_hidden |= allowed < row_len;
  }
  if (!seen_allowed) return MaskTile::kDead;
  return seen_hidden ? MaskTile::kPartial : MaskTile::kNone;
}

// Scores s[0, n) of row (b, h, i), keys from j0: scaled, then masked (a bool mask's hidden
// entries become -inf, a float mask is added), in one pass where the mask's keys are
// contiguous; row is scratch of n elements for the other layouts.
template <typename T>
void scale_and_mask_row(const MaskView& m, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, T scale, T* s,
                        T* row) {
  const int64_t off = b * m.stride_b + h * m.stride_h + i * m.stride_i + j0 * m.stride_j;
  if (m.stride_j == 1 && m.kind == MaskKind::kBool) {
    const uint8_t* allowed = static_cast<const uint8_t*>(m.data) + off;
    for (int64_t c = 0; c < n; ++c) {
      const T x = s[c] * scale;
      s[c] = allowed[c] != 0 ? x : neg_inf<T>();
    }
    return;
  }
  if (m.stride_j == 1 && m.kind == MaskKind::kFloat && std::is_same_v<T, float>) {
    const float* add = static_cast<const float*>(m.data) + off;
    for (int64_t c = 0; c < n; ++c) s[c] = s[c] * scale + static_cast<T>(add[c]);  // two roundings: no contraction
    return;
  }
  scale_row(s, n, scale);
  load_mask_row(m, b, h, i, j0, n, row);
  apply_mask_row(m, row, s, n, 1);
}

// s[0, n) <- cap tanh(s scale / cap): products scaled and soft-capped, as Gemma 2 caps its
// logits; with g, also g[0, n) <- 1 - tanh^2, the capped scores' derivative by the scaled ones.
template <typename T>
void softcap_row(T* s, int64_t n, T scale, T cap, T* g) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> a(scale / cap), c(cap), one(T(1));
  for (int64_t k = 0; k < n; k += W) {
    const int64_t w = std::min(W, n - k);
    const Vec<T> t = (Vec<T>::loadu(s + k, w) * a).tanh();
    (t * c).store(s + k, w);
    if (g) (one - t * t).store(g + k, w);
  }
}

// --------------------------------------------------------------------------------------
// Forward
// --------------------------------------------------------------------------------------
// K^T, the K-major B operand of S = Q K^T, comes either from a per-thread transposed copy of
// the visible keys of the head at hand, made when a thread's first block of that head (or kv
// head, under GQA) starts and reused by its later ones, or, when a head has a single query
// block, from each tile of K transposed into an L1-resident buffer as it is visited. The
// head's copy (D x Lk) stays in L2 for the blocks that share it, skips padded keys and needs
// no call-wide buffer; with one block per head nothing would amortise it.
//
// A block of at most kFwdDotRows query rows takes its scores as dot products with the rows
// of K and transposes nothing (dots() in common.h: sixteen keys per reduce-transpose, about
// two shuffles and one add per score and query row, against four shuffles per key for a
// 16 x 16 in-register transpose, shared by the rows but followed by a GEMM), so for a few
// rows the dots win; past 4 rows they stopped gaining on this project's CPU machines.
constexpr int64_t kFwdDotRows = 4;
// How far a tile's max may pass the row's running max before the forward rescales (ln 16).
template <typename T>
constexpr T kRescaleSlack = T(2.772588722239781);

// kn: K in the accumulation dtype, as rows (B, Hkv, Lk, D).
template <typename scalar_t>
void attention_fwd_kernel(const AttnParams& p, const at::Tensor& q, const at::Tensor& kn, const at::Tensor& vn,
                          at::Tensor& out, at::Tensor& lse) {
  using T = acc_t<scalar_t>;
  const int64_t D = p.D, Lk = p.Lk;
  const Tiles tiles = attention_tiles(D, sizeof(T));
  const int64_t BM = tile_for(p.Lq, tiles.fwd_m);
  const int64_t BN = tiles.fwd_n;
  const int64_t n_qb = (p.Lq + BM - 1) / BM;
  const bool tile_transpose = BM >= p.Lq;
  constexpr int64_t W = Vec<T>::size();

  const Rows<const scalar_t> q_rows(q);
  const int64_t ld_kt = padded_ld(Lk, sizeof(T));  // of a head's K^T copy (D x Lk)
  const Rows<const T> k_rows(kn);                                    // (B, Hkv, Lk, D)
  const Rows<const T> v_rows(vn);
  const int64_t ld_v = vn.stride(2);
  const Rows<scalar_t> out_rows(out);
  T* lse_data = lse.data_ptr<T>();  // (B, H, Lq)

  struct Scratch {
    std::vector<T> q, s, o, m, l, sum, row;
    cpu::ScratchBuffer<T> kt;  // a whole head's K^T at long key lengths: cached, not faulted in per call
    int64_t kt_head = -1;  // the kv head (b * Hkv + hk) whose K^T kt holds, when !tile_transpose
  };
  auto make_scratch = [&] {
    Scratch s;
    s.q.resize(BM * D);
    s.kt = cpu::ScratchBuffer<T>(tile_transpose ? D * BN : D * ld_kt);
    s.s.resize(BM * BN);
    s.o.resize(BM * D);
    s.m.resize(BM);
    s.l.resize(BM * W);
    s.sum.resize(BM);
    s.row.resize(BN);
    return s;
  };

  parallel_items(p.B * p.H * n_qb, make_scratch, [&](int64_t item, Scratch& s) {
    const int64_t bh = item / n_qb;
    const int64_t b = bh / p.H, h = bh % p.H, hk = h / p.group;
    // causal: the late (expensive) blocks of a head are claimed first
    const int64_t qb = p.causal ? n_qb - 1 - item % n_qb : item % n_qb;
    const int64_t i0 = qb * BM, bm = std::min(BM, p.Lq - i0);
    const int64_t kv_end = p.kv_end(b, i0, bm);
    T* lse_row = lse_data + bh * p.Lq + i0;

    if (kv_end <= 0) {  // no key is visible to any row of the block
      for (int64_t r = 0; r < bm; ++r) {
        std::fill(out_rows(b, h, i0 + r), out_rows(b, h, i0 + r) + D, scalar_t(0));
        lse_row[r] = std::numeric_limits<T>::infinity();
      }
      return;
    }

    for (int64_t r = 0; r < bm; ++r) load_scaled(q_rows(b, h, i0 + r), s.q.data() + r * D, D, T(1));
    if (!tile_transpose && s.kt_head != b * p.Hkv + hk) {
      transpose_tile(k_rows(b, hk, 0), k_rows.si, s.kt.data(), ld_kt, p.kv_len(b), D);
      s.kt_head = b * p.Hkv + hk;
    }

    // exact: the probabilities by std::exp, which keeps the subnormal ones exp_u20 flushes to 0
    auto visit_keys = [&](bool exact) {
      std::fill(s.m.begin(), s.m.end(), neg_inf<T>());
      std::fill(s.l.begin(), s.l.end(), T(0));
      std::fill(s.o.begin(), s.o.end(), T(0));
      for (int64_t j0 = 0; j0 < kv_end; j0 += BN) {
        const int64_t bn = std::min(BN, kv_end - j0);
        const MaskTile mask_tile = classify_mask_tile(p.mask, b, h, i0, bm, j0, bn);
        if (mask_tile == MaskTile::kDead) continue;
        const bool apply_mask = mask_tile == MaskTile::kPartial;
        if (tile_transpose && bm <= kFwdDotRows) {
          for (int64_t r = 0; r < bm; ++r) dots(s.q.data() + r * D, k_rows(b, hk, j0), k_rows.si, bn, D, s.s.data() + r * BN);
        } else if (tile_transpose) {
          transpose_tile(k_rows(b, hk, j0), k_rows.si, s.kt.data(), BN, bn, D);
          gemm_nn(bm, bn, D, s.q.data(), D, s.kt.data(), BN, s.s.data(), BN, false);  // S = Q K^T
        } else {
          gemm_nn(bm, bn, D, s.q.data(), D, s.kt.data() + j0, ld_kt, s.s.data(), BN, false);
        }
        // scaled after the products, as the reference's (q . k) * scale: a scaled q can overflow
        // (or underflow to 0, and 0 * inf = NaN) where the scores are finite (or -inf). Without a
        // mask or the diagonal, and for scale > 0, the scale rides on the exponent's FMA,
        // exp(scale s - m), and the row max is taken of the raw products.
        // Soft-capped scores leave the softmax scaled and capped, as masked ones do.
        const bool capped = p.softcap > 0;
        const bool masked = apply_mask || capped || p.crosses_diagonal(i0, j0 + bn - 1);
        const bool fold = !masked && p.scale > 0;
        if (capped) {
          for (int64_t r = 0; r < bm; ++r) {
            T* srow = s.s.data() + r * BN;
            softcap_row(srow, bn, T(p.scale), T(p.softcap), static_cast<T*>(nullptr));
            if (apply_mask) scale_and_mask_row(p.mask, b, h, i0 + r, j0, bn, T(1), srow, s.row.data());
          }
        } else if (apply_mask) {
          for (int64_t r = 0; r < bm; ++r) {
            scale_and_mask_row(p.mask, b, h, i0 + r, j0, bn, T(p.scale), s.s.data() + r * BN, s.row.data());
          }
        } else if (masked) {
          for (int64_t r = 0; r < bm; ++r) scale_row(s.s.data() + r * BN, bn, T(p.scale));
        }
        if (p.crosses_diagonal(i0, j0 + bn - 1)) {
          for (int64_t r = 0; r < bm; ++r) {
            const int64_t first_hidden = std::clamp<int64_t>(i0 + r + p.causal_offset + 1 - j0, 0, bn);
            std::fill(s.s.data() + r * BN + first_hidden, s.s.data() + r * BN + bn, neg_inf<T>());
          }
        }

        for (int64_t r = 0; r < bm; ++r) {
          T* srow = s.s.data() + r * BN;
          T* lrow = s.l.data() + r * W;  // the row's sum of weights, lane by lane
          // The row's first visible tile sets its running max m; later ones move it only when
          // their max passes it by more than kRescaleSlack, so that rescaling (and its
          // unpredictable branch) is rare after the first tile. out = O / l and lse = m + log l
          // hold for any m; one below the row's max by at most the slack keeps every weight at
          // most e^slack = 16. Such a tile takes one pass (exp_row_in_one_pass); the others, the
          // row max's pass first.
          T a = masked ? T(1) : T(p.scale);  // the scale the exponent applies
          if (exact || !exp_row_in_one_pass(srow, bn, a, s.m[r], kRescaleSlack<T>, lrow)) {
            T tile_max;
            if (masked) {
              tile_max = row_max(srow, bn);
            } else if (fold) {
              // max(scale s) = scale max(s) for scale > 0, rounding included
              tile_max = row_max(srow, bn) * T(p.scale);
              if (tile_max == std::numeric_limits<T>::infinity()) {  // a product overflows, as in the reference
                scale_row(srow, bn, T(p.scale));
                a = T(1);
              }
            } else {
              tile_max = scale_row_max(srow, bn, T(p.scale));
              a = T(1);
            }
            const T m_old = s.m[r];
            const T m_new = nan_max(m_old, tile_max);
            if (m_new == neg_inf<T>()) {  // nothing visible to this row yet: P = 0
              std::fill(srow, srow + bn, T(0));
              continue;
            }
            if (std::isnan(m_new)) {  // a NaN score: the row is NaN (exp_u20 would map NaN to inf)
              std::fill(srow, srow + bn, m_new);
              s.m[r] = m_new;
              std::fill(lrow, lrow + W, m_new);
              scale_row(s.o.data() + r * D, D, m_new);
              continue;
            }
            Vec<T> l = Vec<T>::loadu(lrow);
            if (!(tile_max <= m_old + kRescaleSlack<T>)) {
              if (m_old != neg_inf<T>()) {  // rescale what the earlier tiles summed
                const T alpha = std::exp(m_old - tile_max);
                l = l * Vec<T>(alpha);
                scale_row(s.o.data() + r * D, D, alpha);
              }
              s.m[r] = tile_max;
            }
            if (exact) {
              l = l + Vec<T>::set(Vec<T>(T(0)), Vec<T>(exp_affine_sum_exact(srow, bn, a, s.m[r])), 1);
            } else {
              l = l + exp_affine_lanes(srow, bn, a, s.m[r]);
            }
            l.store(lrow);
          }
          if (p.dropout.enabled) {  // l keeps the undropped sum: dropout acts after the softmax
            dropout_keep_row(p.dropout, b, h, i0 + r, j0, bn, s.row.data());
            for (int64_t c = 0; c < bn; ++c) srow[c] *= s.row[c];
          }
        }
        gemm_nn(bm, D, bn, s.s.data(), BN, v_rows(b, hk, j0), ld_v, s.o.data(), D, true);  // O += P V
      }
      for (int64_t r = 0; r < bm; ++r) s.sum[r] = lane_sum(Vec<T>::loadu(s.l.data() + r * W));
    };
    visit_keys(false);
    // A weight below FLT_MIN flushed to 0 meets an inf in v as 0 * inf = NaN where the exact
    // weight gives inf, as the reference does; the check is one pass over the block's output.
    if (flushed_weight_hit_inf(s.o.data(), s.m.data(), bm, D)) visit_keys(true);

    for (int64_t r = 0; r < bm; ++r) {
      scalar_t* orow = out_rows(b, h, i0 + r);
      if (!(s.sum[r] == T(0))) {  // NaN scores give NaN rows, as in the reference
        store_scaled(s.o.data() + r * D, orow, D, static_cast<T>(p.dropout.inv_keep / s.sum[r]));
        lse_row[r] = s.m[r] + std::log(s.sum[r]);
      } else {
        std::fill(orow, orow + D, scalar_t(0));
        lse_row[r] = std::numeric_limits<T>::infinity();
      }
    }
  });
}

// --------------------------------------------------------------------------------------
// Backward
// --------------------------------------------------------------------------------------
// acc + x * y as gemm_nn's products are summed: one rounding in float32 (an FMA), two in
// float64.
template <typename T>
inline T gemm_step(T x, T y, T acc) {
  if constexpr (std::is_same_v<T, float>) {
    return std::fma(x, y, acc);
  } else {
    return acc + x * y;
  }
}

// A score as gemm_nn forms it, so that S - m is the same in exact_large_lse and the backward's
// tiles (bwd_tile's GEMM; bwd_rows calls this on such rows): one product after the other in the
// order of d, a chain of FMAs in float32 as the brgemm sums (separate multiplies and adds in the
// float64 loop nest). The vectorised dot() sums in another order, and near scores of a few
// hundred its rounding would no longer cancel in S - m.
template <typename T>
inline T gemm_dot(const T* x, const T* y, int64_t n) {
  T acc = T(0);
  for (int64_t d = 0; d < n; ++d) acc = gemm_step(x[d], y[d], acc);
  return acc;
}

template <typename T>
struct BwdOperands {
  Rows<const T> q, dout, out, k, v;  // natural layout rows (B, H|Hkv, L, D)
  const T* qt;                       // (B, H, D, Lq), rows ld_t apart
  const T* dout_t;                   // (B, H, D, Lq), rows ld_t apart
  int64_t ld_t;
  const T* lse;                      // (B, H, Lq): lse, or the row max m where lse_lo is log l
  const T* lse_lo;                   // (B, H, Lq) or null: see exact_large_lse
  const T* delta;                    // (B, H, Lq): see compute_delta; unused when Lq <= kBwdRowsMax
  T* dq;                             // (B, H, Lq, D) accumulator, zeroed
  T* dmask;                          // (B, H, Lq, Lk) or null
};

template <typename T>
struct BwdScratch {
  std::vector<T> st, pdt, dpt, ds, keep, dk, dv, row, cap;  // cap: the tile's 1 - tanh^2 (softcap_row)
  BwdScratch(int64_t BM, int64_t BN, int64_t D, bool dropout, bool softcap)
      : st(BN * BM), dpt(BN * BM), ds(BM * BN), dk(BN * D), dv(BN * D), row(std::max(BM, BN)) {
    if (dropout) {
      pdt.resize(BN * BM);
      keep.resize(BN * BM);
    }
    if (softcap) cap.resize(BN * BM);
  }
};

// One (query tile, key tile) step of the backward; tiles are stored key-major (ld = BM, a
// whole number of vectors). A tile's bm rows are computed as n, bm rounded up to whole vectors:
// the rows past bm read the zeros past Lq in the transposed copies and zero lse and delta, so
// they stay finite, and no product into an output reads them. Every pass over the tile then
// runs on whole vectors: with masked ones, each pass would reload what the last one stored with
// masked stores, which the CPU cannot forward from one to the next.
template <typename T>
void bwd_tile(const AttnParams& p, const BwdOperands<T>& x, BwdScratch<T>& s, int64_t BM, int64_t b, int64_t h,
              int64_t i0, int64_t bm, int64_t j0, int64_t bn, bool apply_mask, bool want_dkdv, bool want_dq) {
  const int64_t D = p.D, Lq = p.Lq, Lk = p.Lk, hk = h / p.group;
  const int64_t bh = b * p.H + h;
  T* st = s.st.data();
  T* dpt = s.dpt.data();
  constexpr int64_t W = Vec<T>::size();
  const int64_t n = std::min((bm + W - 1) / W * W, BM);
  // lse, delta etc. of rows [r, r + W): 0 past bm
  auto rows_at = [&](const T* v, int64_t r) { return Vec<T>::loadu(v + r, std::min(W, bm - r)); };

  // S^T = K_j Q_i^T; P^T = exp(scale S^T (+ mask) - lse), or exp((scale S^T (+ mask) - m) - log l)
  // when some row of the call needed exact_large_lse (a second instantiation, so that the
  // usual loop has no extra load); lse = +inf on empty rows gives 0. Without a mask the scale
  // is applied in the exp pass: one pass over the tile fewer.
  gemm_nn(bn, n, D, x.k(b, hk, j0), x.k.si, x.qt + bh * D * x.ld_t + i0, x.ld_t, st, BM, false);
  const bool capped = p.softcap > 0;  // then S^T is scaled and capped here, its derivative kept in s.cap
  if (capped) {
    for (int64_t c = 0; c < bn; ++c) {
      softcap_row(st + c * BM, n, static_cast<T>(p.scale), static_cast<T>(p.softcap), s.cap.data() + c * BM);
    }
  }
  if (apply_mask) {
    // the mask's block row by row into ds (free until dQ's product), transposed to the tile's
    // key-major layout in registers into dpt (free until dP's product), then applied along the
    // rows: every pass on unit strides and without branches (a random mask would mispredict)
    T* rows = s.ds.data();
    const bool is_bool = p.mask.kind == MaskKind::kBool;
    for (int64_t r = 0; r < bm; ++r) load_mask_row(p.mask, b, h, i0 + r, j0, bn, rows + r * bn);
    T* mt = dpt;
    transpose_tile(rows, bn, mt, BM, bm, bn);
    const Vec<T> scale(capped ? T(1) : static_cast<T>(p.scale)), zero(T(0));
    for (int64_t c = 0; c < bn; ++c) {
      T* col = st + c * BM;
      const T* mc = mt + c * BM;
      for (int64_t r = 0; r < bm; r += W) {
        const int64_t w = std::min(W, bm - r);
        const Vec<T> x = Vec<T>::loadu(col + r, w) * scale, m = Vec<T>::loadu(mc + r, w);
        // a bool mask's hidden entries (-inf) replace the score, NaN included; a float one is added
        (is_bool ? Vec<T>::blendv(m, x, m == zero) : x + m).store(col + r, w);
      }
    }
  }
  const T* lse = x.lse + bh * Lq + i0;
  auto exp_tile = [&](auto with_lo, auto with_scale) {
    constexpr bool kLo = decltype(with_lo)::value, kScale = decltype(with_scale)::value;
    const T* lo = kLo ? x.lse_lo + bh * Lq + i0 : nullptr;
    const Vec<T> scale(static_cast<T>(p.scale));
    for (int64_t c = 0; c < bn; ++c) {
      T* row = st + c * BM;
      for (int64_t r = 0; r < n; r += W) {
        Vec<T> e = Vec<T>::loadu(row + r);
        if constexpr (kScale) e = e * scale;
        e = e - rows_at(lse, r);
        if constexpr (kLo) e = e - rows_at(lo, r);
        vexp(e).store(row + r);
      }
    }
  };
  const bool fold_scale = !apply_mask && !capped;
  if (x.lse_lo && fold_scale) {
    exp_tile(std::true_type{}, std::true_type{});
  } else if (x.lse_lo) {
    exp_tile(std::true_type{}, std::false_type{});
  } else if (fold_scale) {
    exp_tile(std::false_type{}, std::true_type{});
  } else {
    exp_tile(std::false_type{}, std::false_type{});
  }
  if (p.crosses_diagonal(i0, j0 + bn - 1)) {
    for (int64_t c = 0; c < bn; ++c) {  // key j0 + c is hidden from rows i < j0 + c - offset
      const int64_t rows_hidden = std::clamp<int64_t>(j0 + c - p.causal_offset - i0, 0, bm);
      std::fill(st + c * BM, st + c * BM + rows_hidden, T(0));
    }
  }
  if (std::any_of(lse, lse + bm, [](T v) { return std::isnan(v); })) {  // the rows NaN in forward
    for (int64_t c = 0; c < bn; ++c) {
      for (int64_t r = 0; r < bm; ++r) {
        if (std::isnan(lse[r])) st[c * BM + r] = lse[r];
      }
    }
  }

  // dropout: Pd^T = P^T * keep / (1 - p)
  const T* pd = st;
  const T inv_keep = static_cast<T>(p.dropout.inv_keep);
  if (p.dropout.enabled) {
    for (int64_t r = 0; r < bm; ++r) {
      dropout_keep_row(p.dropout, b, h, i0 + r, j0, bn, s.row.data());
      for (int64_t c = 0; c < bn; ++c) s.keep[c * BM + r] = s.row[c] * inv_keep;
    }
    for (int64_t c = 0; c < bn; ++c) {
      for (int64_t r = 0; r < bm; ++r) s.pdt[c * BM + r] = st[c * BM + r] * s.keep[c * BM + r];
    }
    pd = s.pdt.data();
  }

  const T* dout_i = x.dout(b, h, i0);
  if (want_dkdv) gemm_nn(bn, D, bm, pd, BM, dout_i, x.dout.si, s.dv.data(), D, true);  // dV += Pd^T dO

  // dP^T = V_j dO_i^T;  dS^T = P^T * (dP^T * keep / (1 - p) - delta)
  gemm_nn(bn, n, D, x.v(b, hk, j0), x.v.si, x.dout_t + bh * D * x.ld_t + i0, x.ld_t, dpt, BM, false);
  // both remaining products carry the score scale: it goes into dS in the same pass, unless
  // dS itself is wanted (the gradient of an additive mask)
  const T* delta = x.delta + bh * Lq + i0;
  const bool want_dmask = x.dmask && want_dkdv;
  auto ds_tile = [&](auto with_scale) {
    constexpr bool kScale = decltype(with_scale)::value;
    const T scale = static_cast<T>(p.scale);
    const Vec<T> vscale(scale);
    for (int64_t c = 0; c < bn; ++c) {
      T* dp = dpt + c * BM;
      const T* pr = st + c * BM;
      if (p.dropout.enabled) {
        const T* kr = s.keep.data() + c * BM;
        for (int64_t r = 0; r < bm; ++r) {
          dp[r] = pr[r] * (dp[r] * kr[r] - delta[r]);
          if constexpr (kScale) dp[r] = dp[r] * scale;
        }
        continue;
      }
      for (int64_t r = 0; r < n; r += W) {
        Vec<T> d = Vec<T>::loadu(pr + r) * (Vec<T>::loadu(dp + r) - rows_at(delta, r));
        if constexpr (kScale) d = d * vscale;
        d.store(dp + r);
      }
    }
  };
  // soft-capped scores: the products take dS (1 - tanh^2), the mask's gradient dS itself
  auto uncap = [&](T scale) {
    const Vec<T> vscale(scale);
    for (int64_t c = 0; c < bn; ++c) {
      T* d = dpt + c * BM;
      const T* g = s.cap.data() + c * BM;
      for (int64_t r = 0; r < n; r += W) (Vec<T>::loadu(d + r) * Vec<T>::loadu(g + r) * vscale).store(d + r);
    }
  };
  if (want_dmask) {
    ds_tile(std::false_type{});
    T* dm = x.dmask + (bh * Lq + i0) * Lk + j0;
    for (int64_t c = 0; c < bn; ++c) {
      for (int64_t r = 0; r < bm; ++r) dm[r * Lk + c] = dpt[c * BM + r];
    }
    if (capped) {
      uncap(static_cast<T>(p.scale));
    } else {
      for (int64_t c = 0; c < bn; ++c) scale_row(dpt + c * BM, bm, T(p.scale));
    }
  } else if (capped) {
    ds_tile(std::false_type{});
    uncap(static_cast<T>(p.scale));
  } else {
    ds_tile(std::true_type{});
  }

  if (want_dkdv) gemm_nn(bn, D, bm, dpt, BM, x.q(b, h, i0), x.q.si, s.dk.data(), D, true);  // dK += dS^T Q
  if (want_dq) {
    // dQ += dS K_j, with dS transposed here from the key-major tile: the tile is in L1,
    // where a transposed copy of K for the whole call (the other way to take this product,
    // dQ^T += K_j^T dS^T) is a pass over memory.
    transpose_tile(dpt, BM, s.ds.data(), bn, bn, bm);
    gemm_nn(bm, D, bn, s.ds.data(), bn, x.k(b, hk, j0), x.k.si, x.dq + (bh * Lq + i0) * D, D, true);
  }
}

// y[0, n) += sum over r < m of a[r * lda] x_r[0, n), x_r = x + r * ldx: y loaded and stored
// once per vector, the m products accumulated in registers between.
template <typename T>
inline void axpy_rows(const T* a, int64_t lda, const T* x, int64_t ldx, int64_t m, T* y, int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  for (int64_t k = 0; k < n; k += W) {
    const int64_t w = std::min(W, n - k);
    Vec<T> acc = Vec<T>::loadu(y + k, w);
    for (int64_t r = 0; r < m; ++r) acc = at::vec::fmadd(Vec<T>(a[r * lda]), Vec<T>::loadu(x + r * ldx + k, w), acc);
    acc.store(y + k, w);
  }
}

// bwd_tile for a tile of at most kBwdRowsMax query rows (a single query, or the last rows of a
// longer sequence), stored query-major (ld = bn) so that its vectors run along the keys:
// bwd_tile would compute a whole vector of rows for it. Scores and dP are dot products with the
// rows of K and V, and the products into dV, dK and dQ are sums of rows (axpy_rows), so
// nothing is transposed.
constexpr int64_t kBwdRowsMax = 2;

template <typename T>
void bwd_rows(const AttnParams& p, const BwdOperands<T>& x, BwdScratch<T>& s, int64_t b, int64_t h, int64_t i0,
              int64_t bm, int64_t j0, int64_t bn, bool apply_mask, bool want_dkdv, bool want_dq) {
  const int64_t D = p.D, Lq = p.Lq, Lk = p.Lk, hk = h / p.group;
  const int64_t bh = b * p.H + h;
  constexpr int64_t W = Vec<T>::size();
  const T scale = static_cast<T>(p.scale);
  const Vec<T> vscale(scale);
  const bool capped = p.softcap > 0;  // see bwd_tile
  const T* lse = x.lse + bh * Lq + i0;
  const T* lo = x.lse_lo ? x.lse_lo + bh * Lq + i0 : nullptr;
  T* P = s.st.data();    // bm x bn
  T* dS = s.dpt.data();  // bm x bn
  T* Pd = p.dropout.enabled ? s.pdt.data() : P;
  for (int64_t r = 0; r < bm; ++r) {
    // P = exp(scale S (+ mask) - lse) over the keys this row sees, 0 past them; NaN on rows NaN in forward
    T* pr = P + r * bn;
    if (lo) {  // S as exact_large_lse formed it
      for (int64_t c = 0; c < bn; ++c) pr[c] = gemm_dot(x.q(b, h, i0 + r), x.k(b, hk, j0 + c), D);
    } else {
      dots(x.q(b, h, i0 + r), x.k(b, hk, j0), x.k.si, bn, D, pr);
    }
    T* gr = capped ? s.cap.data() + r * bn : nullptr;
    if (capped) softcap_row(pr, bn, scale, static_cast<T>(p.softcap), gr);
    if (apply_mask) scale_and_mask_row(p.mask, b, h, i0 + r, j0, bn, capped ? T(1) : scale, pr, s.row.data());
    const int64_t seen = p.causal ? std::clamp<int64_t>(i0 + r + p.causal_offset - j0 + 1, 0, bn) : bn;
    const Vec<T> l(lse[r]), l_lo(lo ? lo[r] : T(0));
    for (int64_t c = 0; c < seen; c += W) {
      const int64_t w = std::min(W, seen - c);
      Vec<T> e = Vec<T>::loadu(pr + c, w);
      if (!apply_mask && !capped) e = e * vscale;
      e = e - l;
      if (lo) e = e - l_lo;
      vexp(e).store(pr + c, w);
    }
    std::fill(pr + seen, pr + bn, T(0));
    if (std::isnan(lse[r])) std::fill(pr, pr + bn, lse[r]);

    // dropout: Pd = P * keep / (1 - p)
    T* kr = s.keep.data() + r * bn;
    if (p.dropout.enabled) {
      dropout_keep_row(p.dropout, b, h, i0 + r, j0, bn, kr);
      for (int64_t c = 0; c < bn; ++c) {
        kr[c] *= static_cast<T>(p.dropout.inv_keep);
        Pd[r * bn + c] = pr[c] * kr[c];
      }
    }

    // dP = dO V_j^T;  dS = P * (dP * keep / (1 - p) - delta), then scaled for the products below.
    // delta = dO . O is summed here as dots() sums dP (see compute_delta).
    T* dr = dS + r * bn;
    dots(x.dout(b, h, i0 + r), x.v(b, hk, j0), x.v.si, bn, D, dr);
    T delta;
    dots(x.dout(b, h, i0 + r), x.out(b, h, i0 + r), 0, 1, D, &delta);
    if (p.dropout.enabled) {
      for (int64_t c = 0; c < bn; ++c) dr[c] = pr[c] * (dr[c] * kr[c] - delta);
    } else {
      const Vec<T> d(delta);
      for (int64_t c = 0; c < bn; c += W) {
        const int64_t w = std::min(W, bn - c);
        (Vec<T>::loadu(pr + c, w) * (Vec<T>::loadu(dr + c, w) - d)).store(dr + c, w);
      }
    }
    if (x.dmask && want_dkdv) std::copy(dr, dr + bn, x.dmask + (bh * Lq + i0 + r) * Lk + j0);
    if (capped) {
      for (int64_t c = 0; c < bn; ++c) dr[c] *= gr[c];
    }
    scale_row(dr, bn, scale);
  }
  if (want_dkdv) {
    for (int64_t c = 0; c < bn; ++c) {
      axpy_rows(Pd + c, bn, x.dout(b, h, i0), x.dout.si, bm, s.dv.data() + c * D, D);  // dV += Pd^T dO
      axpy_rows(dS + c, bn, x.q(b, h, i0), x.q.si, bm, s.dk.data() + c * D, D);        // dK += dS^T Q
    }
  }
  if (want_dq) {
    for (int64_t r = 0; r < bm; ++r) {  // dQ += dS K_j
      axpy_rows(dS + r * bn, 1, x.k(b, hk, j0), x.k.si, bn, x.dq + (bh * Lq + i0 + r) * D, D);
    }
  }
}

// One (query tile, key tile) step of the backward, in the layout that suits the tile; none
// for a tile a bool mask hides entirely (see classify_mask_tile).
template <typename T>
void bwd_step(const AttnParams& p, const BwdOperands<T>& x, BwdScratch<T>& s, int64_t ld_m, int64_t b, int64_t h,
              int64_t i0, int64_t bm, int64_t j0, int64_t bn, bool want_dkdv, bool want_dq) {
  const MaskTile mask_tile = classify_mask_tile(p.mask, b, h, i0, bm, j0, bn);
  if (mask_tile == MaskTile::kDead) return;
  const bool apply_mask = mask_tile == MaskTile::kPartial;
  if (bm <= kBwdRowsMax) {
    bwd_rows(p, x, s, b, h, i0, bm, j0, bn, apply_mask, want_dkdv, want_dq);
  } else {
    bwd_tile(p, x, s, ld_m, b, h, i0, bm, j0, bn, apply_mask, want_dkdv, want_dq);
  }
}

enum class BwdSchedule { kFused, kSplit };

BwdSchedule choose_schedule(int64_t n_fused_items) {
  const char* env = std::getenv("FASTTRANS_CPU_ATTENTION_BWD");
  const std::string mode = env ? env : "";
  if (mode == "fused") return BwdSchedule::kFused;
  if (mode == "split") return BwdSchedule::kSplit;
  TORCH_CHECK(mode.empty() || mode == "auto", "FASTTRANS_CPU_ATTENTION_BWD: expected 'fused', 'split' or 'auto', got '",
              mode, "'");
  // The split schedule costs 7/5 of the GEMM work, so it only pays when the fused items
  // would leave more than ~30% of the threads idle in the last round.
  const int64_t threads = at::get_num_threads();
  const int64_t rounds = (n_fused_items + threads - 1) / threads;
  const double occupancy = static_cast<double>(n_fused_items) / static_cast<double>(rounds * threads);
  return occupancy >= 0.7 ? BwdSchedule::kFused : BwdSchedule::kSplit;
}

template <typename scalar_t>
void attention_bwd_kernel(const AttnParams& p, const BwdOperands<acc_t<scalar_t>>& x, at::Tensor& dk, at::Tensor& dv) {
  using T = acc_t<scalar_t>;
  const int64_t D = p.D;
  const Tiles tiles = attention_tiles(D, sizeof(T));
  const int64_t BM = tile_for(p.Lq, tiles.bwd_m), BN = tile_for(p.Lk, tiles.bwd_n);
  constexpr int64_t W = Vec<T>::size();
  const int64_t ld_m = (BM + W - 1) / W * W;  // bwd_tile's ld: whole vectors of rows
  const int64_t n_kb = (p.Lk + BN - 1) / BN;
  const Rows<scalar_t> dk_rows(dk), dv_rows(dv);
  auto make_scratch = [&] { return BwdScratch<T>(ld_m, BN, D, p.dropout.enabled, p.softcap > 0); };

  // dK, dV of key tile [j0, j0 + BN) of kv head hk (all its query heads), plus dQ if asked.
  auto key_tile = [&](BwdScratch<T>& s, int64_t b, int64_t hk, int64_t kb, bool want_dq) {
    const int64_t j0 = kb * BN, bn = std::min(BN, p.Lk - j0);
    const int64_t visible = std::clamp<int64_t>(p.kv_len(b) - j0, 0, bn);  // keys past key_lengths: zero grads
    std::fill(s.dk.begin(), s.dk.end(), T(0));
    std::fill(s.dv.begin(), s.dv.end(), T(0));
    if (visible > 0) {
      for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
        for (int64_t i0 = p.q_begin(j0); i0 < p.Lq; i0 += BM) {
          bwd_step(p, x, s, ld_m, b, h, i0, std::min(BM, p.Lq - i0), j0, visible, true, want_dq);
        }
      }
    }
    for (int64_t c = 0; c < bn; ++c) {
      store_scaled(s.dk.data() + c * D, dk_rows(b, hk, j0 + c), D, T(1));
      store_scaled(s.dv.data() + c * D, dv_rows(b, hk, j0 + c), D, T(1));
    }
  };

  if (choose_schedule(p.B * p.Hkv) == BwdSchedule::kFused) {
    parallel_items(p.B * p.Hkv, make_scratch, [&](int64_t item, BwdScratch<T>& s) {
      for (int64_t kb = 0; kb < n_kb; ++kb) key_tile(s, item / p.Hkv, item % p.Hkv, kb, true);
    });
    return;
  }
  parallel_items(p.B * p.Hkv * n_kb, make_scratch, [&](int64_t item, BwdScratch<T>& s) {
    key_tile(s, item / (p.Hkv * n_kb), (item / n_kb) % p.Hkv, item % n_kb, false);
  });
  const int64_t n_qb = (p.Lq + BM - 1) / BM;
  parallel_items(p.B * p.H * n_qb, make_scratch, [&](int64_t item, BwdScratch<T>& s) {
    const int64_t bh = item / n_qb, b = bh / p.H, h = bh % p.H;
    const int64_t i0 = (item % n_qb) * BM, bm = std::min(BM, p.Lq - i0);
    const int64_t kv_end = p.kv_end(b, i0, bm);
    for (int64_t j0 = 0; j0 < kv_end; j0 += BN) {
      bwd_step(p, x, s, ld_m, b, h, i0, bm, j0, std::min(BN, kv_end - j0), false, true);
    }
  });
}

// The backward recomputes P = exp(S - lse), and a float32 lse = m + log l keeps log l only
// to within half an ulp of m: for a row whose scores are all near -1e9 (a finite mask such as
// -1e9 or finfo.min over every key) log l is lost entirely (ulp(1e9) = 64) and every P comes
// out 1 instead of 1/l, multiplying the row's gradients by l. Rows with |lse| > kExactLse
// (where the relative error of P, up to |lse| 2^-24, would pass 2^-16) get their max m and
// sum l recomputed here from their scores, one dot product per visible key, and the
// backward takes P = exp((S - m) - log l): S - m is exact near the max. Returns the per-row
// log l (0 elsewhere) and overwrites lse[row] with m, or returns an undefined tensor when
// no row qualifies (the common case: scores of order one, a scan of lse).
constexpr double kExactLse = 256.0;

template <typename T>
at::Tensor exact_large_lse(const AttnParams& p, const Rows<const T>& q, const Rows<const T>& k, at::Tensor& lse) {
  const int64_t rows = lse.numel();
  const T* l_data = lse.data_ptr<T>();
  std::vector<int64_t> large;
  for (int64_t row = 0; row < rows; ++row) {
    if (std::isfinite(l_data[row]) && std::abs(l_data[row]) > T(kExactLse)) large.push_back(row);
  }
  if (large.empty()) return at::Tensor();
  at::Tensor lo = cpu::zeros(lse.sizes(), lse.options());
  lse = lse.clone();  // the caller's lse is the forward's saved output
  T* hi_data = lse.data_ptr<T>();
  T* lo_data = lo.data_ptr<T>();
  const int64_t D = p.D;
  at::parallel_for(0, static_cast<int64_t>(large.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<T> s(p.Lk), mask_row(p.Lk);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = large[t];
      const int64_t b = row / (p.H * p.Lq), h = (row / p.Lq) % p.H, i = row % p.Lq, hk = h / p.group;
      const int64_t n = p.kv_end(b, i, 1);  // key lengths and the causal diagonal
      if (p.softcap > 0) {  // capped as the backward's tiles cap them
        for (int64_t j = 0; j < n; ++j) s[j] = gemm_dot(q(b, h, i), k(b, hk, j), D);
        softcap_row(s.data(), n, T(p.scale), T(p.softcap), static_cast<T*>(nullptr));
      } else {
        for (int64_t j = 0; j < n; ++j) s[j] = gemm_dot(q(b, h, i), k(b, hk, j), D) * T(p.scale);
      }
      if (p.mask) {
        load_mask_row(p.mask, b, h, i, 0, n, mask_row.data());
        apply_mask_row(p.mask, mask_row.data(), s.data(), n, 1);
      }
      const T m = row_max(s.data(), n);
      if (!std::isfinite(m)) continue;  // (the lse was finite: not reached)
      hi_data[row] = m;
      lo_data[row] = std::log(exp_sub_sum(s.data(), n, m));
    }
  });
  return lo;
}

// gemm_step on each lane: the same bits, lane by lane.
template <typename T>
inline Vec<T> gemm_step(const Vec<T>& x, const Vec<T>& y, const Vec<T>& acc) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return at::vec::fmadd(x, y, acc);  // vfmadd: one rounding, as std::fma
#else
    __at_align__ T a[Vec<T>::size()], b[Vec<T>::size()], c[Vec<T>::size()];
    x.store(a);
    y.store(b);
    acc.store(c);
    for (int64_t l = 0; l < Vec<T>::size(); ++l) c[l] = std::fma(a[l], b[l], c[l]);
    return Vec<T>::loadu(c);
#endif
  } else {
    return acc + x * y;
  }
}

// delta[b, h, i] = rowsum(dO * O): the softmax-Jacobian term shared by a row's tiles, summed
// as gemm_dot sums, the order in which bwd_tile's GEMM forms dP = dO V^T. Where a row's
// weights are one-hot in float32, O is that key's row of V, and dP - delta is then exactly
// 0 there, as the reference's P (dP - sum(P dP)) is, rather than a rounding error of dP that
// the products into dK multiply by Q, of any size. (bwd_rows, which forms dP by dots(), sums
// its rows' delta its own way.) Sixteen rows at a time, one per lane: dO from its transposed
// copy, O transposed sixteen columns at a time.
template <typename T>
void compute_delta(const at::Tensor& out, const T* dout_t, int64_t ld_t, at::Tensor& delta) {
  constexpr int64_t kTile = 16, W = Vec<T>::size();
  static_assert(kTile % W == 0, "a block of rows is a whole number of vectors");
  const Rows<const T> out_rows(out);
  const int64_t H = out.size(1), L = out.size(2), D = out.size(3);
  const int64_t n_rt = (L + kTile - 1) / kTile;
  T* data = delta.data_ptr<T>();
  at::parallel_for(0, out.size(0) * H * n_rt, 16, [&](int64_t begin, int64_t end) {
    __at_align__ T ot[kTile * kTile] = {};  // (column, row) of a 16 x 16 block of O
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / n_rt, b = bh / H, h = bh % H;
      const int64_t r0 = (item % n_rt) * kTile, rn = std::min(kTile, L - r0);
      const T* xt = dout_t + bh * D * ld_t + r0;
      Vec<T> acc[kTile / W];
      for (auto& a : acc) a = Vec<T>(T(0));
      for (int64_t c0 = 0; c0 < D; c0 += kTile) {
        const int64_t cn = std::min(kTile, D - c0);
        transpose_upto16<T>(out_rows(b, h, r0) + c0, out_rows.si, ot, kTile, static_cast<int>(rn),
                            static_cast<int>(cn));
        for (int64_t d = 0; d < cn; ++d) {
          for (int64_t g = 0; g * W < rn; ++g) {
            const Vec<T> x = Vec<T>::loadu(xt + (c0 + d) * ld_t + g * W, std::min(W, rn - g * W));
            acc[g] = gemm_step(x, Vec<T>::loadu(ot + d * kTile + g * W), acc[g]);
          }
        }
      }
      for (int64_t g = 0; g * W < rn; ++g) acc[g].store(data + bh * L + r0 + g * W, std::min(W, rn - g * W));
    }
  });
}

}  // namespace

std::vector<int64_t> cpu_attention_tiles(int64_t head_dim, int64_t element_size, int64_t l2_bytes) {
  TORCH_CHECK(head_dim >= 1, "cpu_attention_tiles: head_dim must be at least 1, got ", head_dim);
  TORCH_CHECK(element_size == 4 || element_size == 8,
              "cpu_attention_tiles: element_size must be 4 (float32 accumulation) or 8 (float64), got ",
              element_size);
  if (l2_bytes >= 0) {
    const Tiles t = tiles_for_cache(head_dim, element_size, l2_bytes);
    return {t.fwd_m, t.fwd_n, t.bwd_m, t.bwd_n, l2_bytes};
  }
  const Tiles t = attention_tiles(head_dim, element_size);
  return {t.fwd_m, t.fwd_n, t.bwd_m, t.bwd_n, forced_tiles() ? 0 : this_machine_l2_bytes()};
}

// --------------------------------------------------------------------------------------
// Op entry points
// --------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 const std::optional<at::Tensor>& key_lengths, bool is_causal,
                                                 int64_t causal_offset, double dropout_p, double scale, int64_t seed,
                                                 double softcap) {
  check_qkv(q_in, k, v);
  const at::Tensor q = rows_in_place(q_in);
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto mask = canonical_mask(attn_mask, q, k);
  const at::Tensor lengths = canonical_lengths(key_lengths, q.size(0));
  const AttnParams p = make_params(q, k, mask, lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap);

  at::Tensor out = cpu::empty(q.sizes(), q.options());  // contiguous
  at::Tensor lse = cpu::empty({p.B, p.H, p.Lq}, q.options().dtype(acc));
  if (out.numel() == 0) return {out, lse};
  const at::Tensor kn = rows_as(k, acc);
  const at::Tensor vn = rows_as(v, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_fwd_extension", [&] {
    attention_fwd_kernel<scalar_t>(p, q, kn, vn, out, lse);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_lengths,
    bool is_causal, int64_t causal_offset, double dropout_p, double scale, int64_t seed, bool mask_grad,
    double softcap) {
  check_qkv(q, k, v);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "dout, out: expected the shape of q ",
              q.sizes(), ", got ", dout.sizes(), " and ", out.sizes());
  checks::floating(dout, "dout");
  checks::floating(out, "out");
  checks::floating(lse, "lse");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "lse: expected shape (B, H, Lq) = ", q.sizes().slice(0, 3), ", got ", lse.sizes());
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto mask = canonical_mask(attn_mask, q, k);
  TORCH_CHECK(!mask_grad || (mask.has_value() && mask->scalar_type() != at::kBool),
              "mask_grad: the gradient of attn_mask needs a floating-point attn_mask");
  const at::Tensor lengths = canonical_lengths(key_lengths, q.size(0));
  const AttnParams p = make_params(q, k, mask, lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap);

  at::Tensor dq = cpu::empty(q.sizes(), q.options());
  at::Tensor dk = cpu::empty(k.sizes(), k.options());
  at::Tensor dv = cpu::empty(v.sizes(), v.options());
  at::Tensor dmask = mask_grad ? cpu::zeros({p.B, p.H, p.Lq, p.Lk}, q.options().dtype(acc))
                               : cpu::empty({0}, q.options().dtype(acc));
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask};
  }

  // Operands in the accumulation dtype; the transposed copies are the K-major B operands.
  const at::Tensor qn = rows_as(q, acc), kn = rows_as(k, acc), vn = rows_as(v, acc);
  const at::Tensor dout_n = rows_as(dout, acc), out_n = rows_as(out, acc);
  const at::Tensor qt = transposed_copy(q, acc), dout_t = transposed_copy(dout, acc);
  at::Tensor lse_c = lse.to(acc).contiguous();
  at::Tensor delta = cpu::empty({p.B, p.H, p.Lq}, q.options().dtype(acc));
  // dQ accumulates in place when it is in the accumulation dtype (contiguous, zeroed)
  at::Tensor dq_acc = dq.scalar_type() == acc ? dq.zero_() : cpu::zeros(q.sizes(), q.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_bwd_extension", [&] {
    using T = acc_t<scalar_t>;
    // (every tile of a call with at most kBwdRowsMax query rows goes to bwd_rows)
    if (p.Lq > kBwdRowsMax) compute_delta<T>(out_n, dout_t.data_ptr<T>(), dout_t.stride(2), delta);
    const at::Tensor lse_lo = exact_large_lse<T>(p, Rows<const T>(qn), Rows<const T>(kn), lse_c);
    const BwdOperands<T> x{Rows<const T>(qn),
                           Rows<const T>(dout_n),
                           Rows<const T>(out_n),
                           Rows<const T>(kn),
                           Rows<const T>(vn),
                           qt.data_ptr<T>(),
                           dout_t.data_ptr<T>(),
                           qt.stride(2),
                           lse_c.data_ptr<T>(),
                           lse_lo.defined() ? lse_lo.data_ptr<T>() : nullptr,
                           delta.data_ptr<T>(),
                           dq_acc.data_ptr<T>(),
                           mask_grad ? dmask.data_ptr<T>() : nullptr};
    attention_bwd_kernel<scalar_t>(p, x, dk, dv);
  });
  if (!dq_acc.is_same(dq)) dq.copy_(dq_acc);
  return {dq, dk, dv, dmask};
}

at::Tensor attention_dropout_mask(const at::Tensor& q, const at::Tensor& k, double dropout_p, int64_t seed) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "q, k: expected 4-D tensors, got shapes ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a probability in [0, 1), got ", dropout_p);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  at::Tensor keep = cpu::empty({B, H, Lq, Lk}, q.options().dtype(at::kBool));
  const Dropout d = make_dropout(dropout_p, seed);
  bool* data = keep.data_ptr<bool>();
  at::parallel_for(0, B * H * Lq, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      dropout_keep_row(d, row / (H * Lq), (row / Lq) % H, row % Lq, 0, Lk, data + row * Lk);
    }
  });
  return keep;
}

}  // namespace fasttrans::cpu
