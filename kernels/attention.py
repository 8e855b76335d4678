"""Fused scaled dot-product attention in Triton: forward, backward, every mask kind.

Math (per batch b, query head h, kv head h // (H // Hkv); log2 units inside the kernels)
----------------------------------------------------------------------------------------
Forward, one query tile of BLOCK_M rows against key tiles of BLOCK_N columns:

    S    = scale * Q K^T + M_float              M_float: additive float mask (or 0)
    S    = -inf where not allowed                allowed = bool mask & causal & key length
    m_j  = max(m_{j-1}, rowmax(S_j))             online softmax, fp32 accumulators
    P_j  = exp(S_j - m_j)
    l_j  = l_{j-1} exp(m_{j-1} - m_j) + rowsum(P_j)
    A_j  = A_{j-1} exp(m_{j-1} - m_j) + (P_j * Z_j) V_j    Z: dropout keep-mask
    O    = A / ((1 - p) l),  lse = m + log(l)     saved in fp32 for the backward

With scale > 0, FOLD_SCALE keeps the scores unscaled (except in loops that add a float
mask, which is added to scaled scores): m_j takes the row maximum of Q K^T times scale (the
same bits, as rounding is monotonic) and the scale enters exp2's argument in its fused
multiply-add, one multiply per score fewer in the loop.

A row with no allowed key ends with l = 0: O = 0 and lse = +inf, so that the backward's
exp(S - lse) recomputes P = 0 for it (never NaN). The running maximum is replaced by 0
while it is still -inf, so exp(-inf - (-inf)) never appears.

Backward, with P = exp(S - lse) recomputed tile by tile and Pd = P * Z / (1 - p):

    delta = rowsum(dO * O)                        (= rowsum(P * dP))
    dV    = Pd^T dO           dP = (dO V^T) * Z / (1 - p)
    dS    = P * (dP - delta)  dQ = scale dS K     dK = scale dS^T Q

dS is also the gradient of a float mask (it is added to the scaled scores). Two launches:
dQ, one program per query tile looping over key tiles, which first works out its rows'
delta (and the statistics below) and writes them for the other; then dK/dV, one program per
key tile looping over every query tile and, for grouped-query attention, over every query
head of its kv group. dO is read where autograd left it, and never copied. No atomics: each
output element is written by exactly one program, in a fixed order, so two backward passes
are bit-identical.

Rows of huge scores: lse = m + log(l) in one float32 loses log(l) once ulp(m) nears 1 (a
finite mask of -1e9 on every key of a row loses it entirely, ulp(1e9) = 64), and P = exp(S -
lse) would sum to l instead of 1. The dQ kernel recomputes m and l of the rows with |lse| >
EXACT_LSE (a tile without such a row only reads its lse), in a branch the common path never
enters, key tiles of EXACT_KEYS at a time so that the branch needs few registers, and
uses P = r exp(S - hi) with hi = m and r = 1 / l: its loop runs on exp(S - hi) unchanged and
the rows of dQ (and of the float mask's gradient) are scaled by r at the end. Every other
row gets hi = lse and r = 1. The kernel writes hi, delta and r per row, and a flag per
EXACT_ROWS rows. The dK/dV kernel sums over rows, so it scales P itself: a kv group with a
flag takes every query tile through its loop with per-element masks, which multiplies P by
r (the same bits where r = 1); the loop over full tiles, the common path, does not.

Dropout: keep(b, h, i, j) is a 16-bit half of a Philox4x32-10 word keyed by the seed,
compared with round(p 2^16) (csrc/philox.h defines it), so the Triton and extension
backends drop the same scores for a seed. It is a pure function of the position,
regenerated identically by the forward, both backward kernels and the debug entry point
``attention_dropout_mask``, with one Philox call per eight scores: rows (i, i + 8) x keys
(j, j + 1, j + 8, j + 9) of a 16 x 16 block, the scores one thread holds in the
tensor-core accumulator (_dropout_keep_tile).

Mask specialisation: the host classifies the masks into constexprs (MASK_KIND none / bool
/ float, HAS_KEY_LENGTHS, IS_CAUSAL, HAS_DROPOUT), so each combination compiles to its own
kernel. Key tiles split into "full" tiles, where every (row, column) is allowed by the
causal and key-length masks and which run without per-element masking, and boundary tiles
(the causal diagonal, the last partial tile); tiles entirely above the diagonal or past a
row's key length are never loaded. A dense mask is read through its strides (stride 0 on
broadcast dims), never expanded in memory.

Dense masks as a tile map: before its first use, a bool or float mask is classified by one
pass of _attention_tile_map_kernel on the device (no host sync), for every tile shape from
MAP_CELL x MAP_CELL to MAP_TILE x MAP_TILE in powers of two, so that a kernel reads one byte
per tile whatever its configuration: LIVE, some element may attend (bool True; any element
of a float mask, as a NaN score plus -inf is NaN in the reference); DENSE, some element
changes the scores (bool False, float not 0). A query tile's key loop (a key tile's query
loop in dK/dV) runs from its first to its last LIVE tile only, so the tiles of padding, of a
causal or a sliding-window mask written densely, are never loaded; a tile without DENSE
loads no mask (its load is predicated off). Dims the mask broadcasts over have one entry.
The map is cached with the mask tensor, or the tensor it is a view of (tile_map): the layers
of a model that share a mask, and the backward, reuse it while that tensor is the same object
with the same version counter and the view the same address and geometry.

Tile lists (the idea of FlexAttention's block mask): with the map, _attention_tile_lists_kernel
lists per row of LIST_TILE x LIST_TILE tiles (MAP_TILE on a GPU: every forward and dQ tile
fits whole in one) its full tiles (LIVE, not DENSE) and its partial ones (LIVE and DENSE), in
order, with prefix counts: (full count per column 0..tiles, partial count likewise, full
indices, partial indices), a row padded to a multiple of 16 entries; a bool mask's rows
follow as bits (packed by the same kernel), 16 keys to a word in the order one thread of
the accumulator holds them. The forward and dQ kernels run the listed tiles before full_end
(those no causal or key-length mask cuts) in two loops over their key tiles: the full ones
exactly as without a mask (no mask read, no select, the scale folded as FOLD_SCALE allows),
the partial ones with the mask read whole (a bool mask's bits: a bit test and a select per
score, the words loaded with the keys' pipeline);
the rest of the row (the tile that full_end cuts, the causal diagonal) runs by the map. A
listed partial tile's key tiles that the mask forbids entirely load no keys or values. The
loops carry the next entries of their list (_list_window) so that no load of keys waits on
the load of its index. Head dims above LISTS_MAX_HEAD_DIM keep the map alone. The dK/dV
kernel has no lists: a key tile whose query tiles, from its first live one to its last, are
all full in every head of its kv group (a padding mask's live keys) runs its loops as without
a mask, reading no map code and no mask; any other runs every tile by the map (3xTF32
launches always do: the copy of the loops would spill there).

The dK/dV kernel computes transposed, S^T = K Q^T (key rows, query columns), so that every
one of its matmuls has the key tile as the M dimension: Hopper's wgmma needs M >= 64, and
the query tile of its inner loop can then stay small. Head dims above 128 run it twice,
once for dV and once for dK, each with a single fp32 accumulator (two (BLOCK_N, 256) fp32
accumulators do not fit in registers next to the rest).

Loads: on compute capability >= 9, 16-bit launches of the light class read the tiles of their
loops through tensor descriptors (TMA) where the layout allows (_tma_layout): the forward and
dQ kernels keys and values, each program's (batch, kv head) as a (kv_len, HEAD_DIM) matrix;
the dK/dV kernel (head dims up to 128) queries and output gradients, its batch's as an
(H, Lq, HEAD_DIM) array. A tile load reads zeros outside them, which the masked pointer loads
read too, so both routes compute the same bits, and the loops issue no address arithmetic for
those loads. Every other launch loads through pointers (cp.async).

Limits: fp16, bf16, fp32 (fp64 runs on the reference and extension backends); head dims
1..256 (padded to a power of two >= 16, padded lanes masked); any Lq, Lk; H a multiple of
Hkv; q/k/v with stride(-1) == 1; batch and head offsets in int64, so tensors with more
than 2^31 elements work. Grids are (query or key tiles, heads, batch): at most 65535 heads
and 65535 batch entries. Each GPU configuration table has an sm_80 and an sm_90 entry
(compute capability >= 9 uses the sm_90 one), for 16-bit inputs and, separately, for fp32.

fp32 matmuls run on tensor cores as 3xTF32 (``input_precision="tf32x3"``): each operand is
split into a TF32 part and a TF32 remainder, and three TF32 products (big*big, big*small,
small*big) are summed in fp32. Its error is that of an fp32 matmul (the dropped small*small
term is about 2^-22 of each product), the scheme torch's memory-efficient SDPA kernel uses
for fp32 on sm_80 and later (CUTLASS's OpMultiplyAddFastF32). When torch's CUDA matmuls may
use TF32 (``allow_tf32``, ``fp32_precision = "tf32"``, ``set_float32_matmul_precision``),
the user has accepted TF32 for fp32 matmuls, and a single TF32 product is used (errors near
1e-3). The two halves of every operand take registers, so fp32 has launch tables of its own
with smaller tiles; the classes where no 3xTF32 tile compiles without register spills (head
dim 256; head dim 128 with a dense mask or dropout in the dQ kernel, and in sm_80's dK/dV)
run IEEE fp32 dots on FMA units instead, more exact and slower, whatever the TF32 setting
(FP32_IEEE_CLASSES). The 16-bit tiles in IEEE fp32 would spill registers (ptxas reports
kilobytes of spill stores and loads per thread for them).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import triton
import triton.language as tl

from fasttrans.dropout_spec import attention_dropout_threshold
from fasttrans.environ import getenv

from . import (_attention_targets, capability, cdiv, device_index, expansion, next_power_of_2, on_device,
               strided_allocator)
from ._attention_configs import (
    FWD_CONFIGS, FWD_CONFIGS_FP32, BWD_DKDV_CONFIGS,
    BWD_DKDV_CONFIGS_FP32, BWD_DQ_CONFIGS, BWD_DQ_CONFIGS_FP32,
    FP32_IEEE_CLASSES, BY_POINTERS, CAPPED,
    DROPOUT_MASK_CONFIG, TILE_MAP_CONFIG, INTERPRETER_CONFIGS, MASK_NONE, MASK_BOOL, MASK_FLOAT, dkdv_outputs,
)
from ._launch import Launcher, Spec, int_class, remember, signature as sig

__all__ = ["attention_fwd", "attention_bwd", "attention_dropout_mask", "attention_tile_map", "attention_tile_lists",
           "attention_site", "AttentionSite", "compile_targets", "MAP_CELL", "MAP_TILE", "MAP_LIVE", "MAP_DENSE"]

# --------------------------------------------------------------------------------------
# Constants and launch keys (the configuration tables and mask kinds: kernels/_attention_configs.py)
# --------------------------------------------------------------------------------------
LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in log2 units: exp(x) = exp2(x * log2(e))
# The largest float-mask magnitude that stays finite in log2 units (float32 max / log2(e),
# rounded down): a finite mask value beyond it (torch.finfo(torch.float32).min, say) would
# become an infinite score, masking for good what the other backends weigh.
MASK_LIMIT = tl.constexpr(2.35e38)
LN2 = tl.constexpr(0.6931471805599453)
EXACT_LSE = tl.constexpr(256.0)  # |lse| past which a row's statistics are recomputed (see above)
EXACT_ROWS = tl.constexpr(16)  # the rows of one flag of rows of huge scores
EXACT_KEYS = tl.constexpr(16)  # the key tile of their statistics' recomputation
# Dense-mask tile map (see the module docstring): a code per tile for every tile shape of
# MAP_CELL x MAP_CELL times powers of two up to MAP_TILE x MAP_TILE (the largest tile of any
# configuration), over the mask padded to whole MAP_TILE blocks. A code has the bit LIVE (some
# element may attend) and the bit DENSE (some element's mask value must be read).
MAP_CELL = tl.constexpr(16)
MAP_TILE = tl.constexpr(128)
MAP_LIVE = tl.constexpr(1)
MAP_DENSE = tl.constexpr(2)
# Tile lists (module docstring): built at one level of the map, LIST_TILE x LIST_TILE, which
# holds whole query and key tiles of every forward and dQ configuration: MAP_TILE on a GPU, the
# interpreter's 32 (its tiles are 32 x 16), so that the tests' short sequences have several.
LIST_TILE_INTERPRETER = 32
# Head dims up to which the forward and dQ kernels run their loops over listed tiles; above,
# the two extra loops make the shipped tiles spill registers (compile-check), and a dense
# mask is read by the tile map alone.
LISTS_MAX_HEAD_DIM = tl.constexpr(128)
LIST_CHUNK = tl.constexpr(128)  # the tile-list kernel's columns per step
BITS_CHUNK = tl.constexpr(4)  # and a bool mask's words per step (64 keys)


# Autotuning keys: sequence lengths enter only through power-of-two buckets (LQ_BUCKET,
# LK_BUCKET), so tuning runs at most once per bucket and feature combination.
_TUNE_KEY = ["HEAD_DIM", "MASK_KIND", "HAS_KEY_LENGTHS", "IS_CAUSAL", "HAS_DROPOUT", "LQ_BUCKET", "LK_BUCKET"]
_MAX_BUCKET = 1 << 16
_MAX_BUCKET_BITS = 16  # _MAX_BUCKET's bit length, minus one


def _precision_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16-bit"


def _gpu_arch(device: torch.device) -> str:
    return "sm_90" if capability(device_index(device))[0] >= 9 else "sm_80"


def _head_dim_class(block_d: int) -> int:
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def _weight(mask_kind: int, dropout: bool) -> str:
    """The launch's weight class (kernels/_attention_configs.py): "light" without a dense mask
    or dropout, "dropout" with dropout alone, "bool" with a dense bool mask (and dropout or
    not), "heavy" with a float mask. Capped scores (SOFTCAP) weigh as dropout does: the
    light tiles leave no registers for the cap (_class_weight)."""
    if mask_kind == MASK_NONE:
        return "dropout" if dropout else "light"
    return "bool" if mask_kind == MASK_BOOL else "heavy"


def _class_weight(constexprs: dict) -> str:
    """The weight class of a launch's constexprs (_weight), capped scores counted as dropout."""
    return _weight(constexprs["MASK_KIND"], constexprs["HAS_DROPOUT"] or constexprs.get("SOFTCAP", 0) > 0)


def _table_class(table: dict, block_d: int, weight: str) -> tuple[int, str]:
    """(head-dim class, weight) of the entry of ``table`` (one architecture's) a launch takes:
    the bool and dropout weights take the heavy entry where they have none of their own."""
    cls = (_head_dim_class(block_d), weight)
    return cls if cls in table or weight in ("light", "heavy") else (cls[0], "heavy")


def _bucket(n: int) -> int:
    return min(next_power_of_2(max(n, 1)), _MAX_BUCKET)


# --------------------------------------------------------------------------------------
# Shared jit helpers
# --------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32. DOT_FP32 upcasts the operands (the interpreter's bf16 dot is wrong)."""
    if DOT_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile; lanes outside (row_ok, d_ok) read 0 and are never touched."""
    if MASK_ROWS:
        if MASK_D:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if MASK_D:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dropout_keep_tile(seed, threshold, b, h, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       TRANSPOSED: tl.constexpr):
    """keep(b, h, i, j) of query rows i = start_m .. start_m + BLOCK_M - 1 and keys j =
    start_n .. start_n + BLOCK_N - 1 (both starts multiples of 16): (BLOCK_M, BLOCK_N), or
    (BLOCK_N, BLOCK_M) when TRANSPOSED. csrc/philox.h's attention mask, so the extension
    draws the same mask bit for bit: one Philox4x32-10 call decides the eight scores (i, i +
    8) x (j, j + 1, j + 8, j + 9) of a 16 x 16 block, by the 16-bit halves of its four words.
    Those eight lie in one thread of the tensor-core accumulator, so the reshapes below move
    no data in the forward and dQ (the transposed tile of dK/dV goes through shared memory)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles of whole 16 x 16 blocks")
    gi = (start_m // 2 + tl.arange(0, BLOCK_M // 2)).to(tl.uint32)[:, None]  # 8 (i // 16) + i % 8
    gj = (start_n // 4 + tl.arange(0, BLOCK_N // 4)).to(tl.uint32)[None, :]  # 4 (j // 16) + j % 8 // 2
    if TRANSPOSED:
        gi, gj = tl.trans(gi), tl.trans(gj)
    zero = gi * 0 + gj * 0  # the broadcast shape
    # the key group last: the first two rounds are then mostly the same on every key tile
    w0, w1, w2, w3 = tl.philox(seed, zero + gi, zero + h.to(tl.uint32), zero + b.to(tl.uint32), zero + gj)
    # half >= threshold, for both halves without extracting them: hi >= t <=> w >= t << 16
    t = threshold.to(tl.uint32) << 16
    x0 = tl.join((w0 << 16) >= t, w0 >= t)  # [..., j % 2]
    x1 = tl.join((w1 << 16) >= t, w1 >= t)
    x2 = tl.join((w2 << 16) >= t, w2 >= t)
    x3 = tl.join((w3 << 16) >= t, w3 >= t)
    # word 2 (i // 8 % 2) + j // 8 % 2: (i/2 groups, j/4 groups, j % 2, j // 8 % 2, i // 8 % 2)
    keep = tl.join(tl.join(x0, x1), tl.join(x2, x3))
    if TRANSPOSED:  # (j/4, i/2, ...) -> (j // 16, j // 8 % 2, j % 8 // 2, j % 2, i // 16, i // 8 % 2, i % 8)
        keep = tl.reshape(keep, (BLOCK_N // 16, 4, BLOCK_M // 16, 8, 2, 2, 2))
        keep = tl.reshape(tl.permute(keep, (0, 5, 1, 4, 2, 6, 3)), (BLOCK_N, BLOCK_M))
    else:  # -> (i // 16, i // 8 % 2, i % 8, j // 16, j // 8 % 2, j % 8 // 2, j % 2)
        keep = tl.reshape(keep, (BLOCK_M // 16, 8, BLOCK_N // 16, 4, 2, 2, 2))
        keep = tl.reshape(tl.permute(keep, (0, 6, 1, 2, 5, 3, 4)), (BLOCK_M, BLOCK_N))
    return keep


@triton.jit
def _apply_dense_mask(s, mask_ptrs, load_ok, dense, MASK_KIND: tl.constexpr):
    """Scores s (log2 units) with a dense bool/float mask tile applied; load_ok bounds the
    load and is all false on a tile that is not dense (_tile_flags), which then counts as all
    True or 0. Lanes not loaded read 0, which cp.async fills for free; a bool tile ORs in
    ``~dense`` after the load (a fill of ``~dense`` would take a select per score)."""
    mval = tl.load(mask_ptrs, mask=load_ok, other=0)
    if MASK_KIND == 1:  # MASK_BOOL: nonzero = may attend
        s = tl.where((mval != 0) | ~dense, s, float("-inf"))
    else:
        mf = mval.to(tl.float32)
        # finite values past MASK_LIMIT are clamped to it; infinities and NaN pass as they are
        clamped = tl.clamp(mf, -MASK_LIMIT, MASK_LIMIT, propagate_nan=tl.PropagateNan.ALL)
        s = s + tl.where(tl.abs(mf) == float("inf"), mf, clamped) * LOG2E
    return s


@triton.jit
def _map_level(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the level of (BLOCK_M, BLOCK_N) tiles starts in a (batch, head)'s tile map, in
    units of CM * CN / 64 codes (CM x CN: the MAP_CELL level). Levels run over tile rows of
    a = BLOCK_M / MAP_CELL = 1, 2, 4, 8, then columns b likewise; level (a, b) holds
    CM * CN / (a b) codes, so the levels before it hold 15 (16 - 16 / a) + 128 / a - 128 / (a b)
    units, and all of them 225."""
    a: tl.constexpr = BLOCK_M // MAP_CELL
    b: tl.constexpr = BLOCK_N // MAP_CELL
    return 15 * (16 - 16 // a) + 128 // a - 128 // (a * b)


@triton.jit
def _map_codes(Map_bh, stride_map_m, map_unit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(codes, row stride) of the (BLOCK_M, BLOCK_N) tiles in the tile map at Map_bh (one
    batch and head; stride_map_m and map_unit as the kernels take them, stride_map_m 0 where
    the mask's rows broadcast): the code of the tile at (start_m, start_n) is at
    codes + start_m // BLOCK_M * row stride + start_n // BLOCK_N."""
    b: tl.constexpr = BLOCK_N // MAP_CELL
    return Map_bh + map_unit * _map_level(BLOCK_M, BLOCK_N), stride_map_m // b


@triton.jit
def _map_row(Map_bh, stride_map_m, map_unit, start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The codes of the query tile at start_m against key tiles 0, 1, ... (_map_codes)."""
    codes, row_stride = _map_codes(Map_bh, stride_map_m, map_unit, BLOCK_M, BLOCK_N)
    return codes + start_m // BLOCK_M * row_stride


@triton.jit
def _tile_flags(Code, MASK_KIND: tl.constexpr):
    """(live, dense) of the tile whose code is at Code: dense, whether the tile must read its
    mask (else every element may attend with mask value 0: _apply_dense_mask loads nothing);
    live, whether any element may attend, else the forward and dQ kernels load none of its
    keys and values (module docstring). Without a dense mask, constants that fold away."""
    if MASK_KIND == 0:
        live = tl.full((), 1, tl.int1)
        dense = tl.full((), 0, tl.int1)
    else:
        code = tl.load(Code)
        live = (code & MAP_LIVE) != 0
        dense = (code & MAP_DENSE) != 0
    return live, dense


@triton.jit
def _live_full_span(codes, step, lo, hi, span, full):
    """span = (first, end) widened to the live codes among codes[i * step], i in [lo, hi)
    (tiles outside [first, end) of every span a loop merges are skipped, nothing loaded), and
    full plus the number of full codes (live, not dense) it read: where a span's full tiles
    number its length, every tile in it is full and no mask need be read."""
    first, end = span
    for i in range(lo, hi):
        code = tl.load(codes + i * step)
        live = (code & MAP_LIVE) != 0
        first = tl.where(live, tl.minimum(first, i), first)
        end = tl.where(live, tl.maximum(end, i + 1), end)
        full += (code == MAP_LIVE).to(tl.int32)
    return (first, end), full


@triton.jit
def _live_span(codes, step, lo, hi, span):
    """_live_full_span's span alone (the count is computed and dropped)."""
    span, _ = _live_full_span(codes, step, lo, hi, span, tl.full((), 0, tl.int32))
    return span


@triton.jit
def _key_loops(mask, listed_end, full_end, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_KIND: tl.constexpr):
    """(listed_end, full_end, full_end, hi): the key tiles of a query tile's two loops after its
    listed ones (_query_block_keys, _listed_tiles), narrowed with a dense mask to its first and
    last live tile (mask as _attention_fwd_inner's)."""
    lo1 = listed_end
    hi1 = full_end
    lo2 = full_end
    hi2 = hi
    if MASK_KIND != 0:
        tiles = tl.cdiv(hi, BLOCK_N)
        first, end = _live_span(mask[3], 1, listed_end // BLOCK_N, tiles, (tiles, 0))
        lo1 = first * BLOCK_N
        hi1 = tl.minimum(full_end, end * BLOCK_N)
        lo2 = tl.maximum(full_end, lo1)
        hi2 = tl.minimum(hi, end * BLOCK_N)
    return lo1, hi1, lo2, hi2


@triton.jit
def _listed_tiles(Lists_bh, stride_list_m, list_tiles, start_m, full_end, LIST_TILE: tl.constexpr):
    """(full tiles' indices, their count, partial tiles' indices, their count, listed_end) of
    the query tile at start_m among the LIST_TILE x LIST_TILE tiles of a dense mask's tile lists
    (module docstring) that lie before full_end: those the loops over listed tiles take; from
    listed_end on, the loops over a key range take the rest."""
    row = Lists_bh + (start_m // LIST_TILE) * stride_list_m
    listed = full_end // LIST_TILE
    full_index = row + 2 * (list_tiles + 1)
    return (full_index, tl.load(row + listed), full_index + list_tiles, tl.load(row + list_tiles + 1 + listed),
            listed * LIST_TILE)


@triton.jit
def _mask_bits_rows(Lists_bh, stride_list_m, list_tiles, start_m, LIST_TILE: tl.constexpr):
    """(the query tile's first row of a bool mask's bits, the int32 words of a row): the bits
    follow each tile row's list entries, LIST_TILE query rows of them (module docstring, "Tile
    lists"); _list_width and _bits_words on the host."""
    words = (list_tiles * LIST_TILE + 63) // 64 * 4
    row = Lists_bh + (start_m // LIST_TILE) * stride_list_m + (4 * list_tiles + 2 + 15) // 16 * 16
    return row + (start_m % LIST_TILE) * words, words


@triton.jit
def _mask_rows(Mask_rows, stride_mask_m, stride_mask_n, codes_row, Lists_bh, stride_list_m, list_tiles, start_m,
               MASK_KIND: tl.constexpr, LIST_TILE: tl.constexpr):
    """The ``mask`` the loops of a query tile take (_attention_fwd_inner's): the dense mask's
    rows and strides, its map's codes, and a bool mask's bits (_mask_bits_rows), which its
    listed partial tiles read."""
    if MASK_KIND == 1:
        bits_rows, bits_words = _mask_bits_rows(Lists_bh, stride_list_m, list_tiles, start_m, LIST_TILE)
    else:
        bits_rows, bits_words = Lists_bh, 0
    return Mask_rows, stride_mask_m, stride_mask_n, codes_row, bits_rows, bits_words


@triton.jit
def _list_window(index, n):
    """(entries 0 and 1) of a tile list of n entries at index (0 past n): the window a loop
    over listed tiles carries, :func:`_list_window_step`."""
    return tl.load(index, mask=n > 0, other=0), tl.load(index + 1, mask=n > 1, other=0)


@triton.jit
def _list_window_step(window, index, n, it, SUB: tl.constexpr):
    """The window after iteration it of a loop over the SUB key tiles of each listed entry:
    (the next iteration's entry, the one after it, loaded now). A loaded entry is first read
    an iteration later, so the loads of the keys and values it addresses never wait on it."""
    cur, nxt = window
    following = (it + 1) // SUB + 1
    return tl.where(it % SUB == SUB - 1, nxt, cur), tl.load(index + following, mask=following < n, other=0)


@triton.jit
def _loop_tile(it, window, codes, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, LISTED: tl.constexpr,
               LIST_TILE: tl.constexpr):
    """(start_n, live, dense) of iteration it of a key loop (_tile_flags; codes: the map's codes
    of the query tile's key tile 0): over a key range, it is the tile's first key; over listed
    tiles, it counts the key tiles of the window's entries, whose mask is read whole (one select
    per score where the map's flag would take two)."""
    if LISTED:
        start_n = window[0] * LIST_TILE + it % (LIST_TILE // BLOCK_N) * BLOCK_N
    else:
        start_n = it
    live, dense = _tile_flags(codes + start_n // BLOCK_N, MASK_KIND)
    if LISTED:
        dense = tl.full((), 1, tl.int1)
    return start_n, live, dense


@triton.jit
def _attention_tile_map_kernel(
    TileMap,  # (Bm, Hm, 225 * unit) int8 codes of every level (_map_level), contiguous, written
    Mask,  # the dense mask (uint8 bool or float), read through strides
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    Hm, Lq, Lk, CN, unit,  # CN: cells per row at the MAP_CELL level; unit: CM * CN / 64
    MASK_KIND: tl.constexpr,
):
    """The codes of one MAP_TILE x MAP_TILE block at every level: LIVE where an element is
    True (bool) or any element (float: a -inf score is still computed, so that a NaN one
    stays NaN), DENSE where an element is False (bool) or not 0 (float). Elements past Lq or
    Lk count for neither."""
    CELLS: tl.constexpr = MAP_TILE // MAP_CELL
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, MAP_TILE)
    rows = block_m * MAP_TILE + r[:, None]
    cols = block_n * MAP_TILE + r[None, :]
    ok = (rows < Lq) & (cols < Lk)
    x = tl.load(Mask + (bh // Hm) * stride_mask_b + (bh % Hm) * stride_mask_h + rows.to(tl.int64) * stride_mask_m
                + cols.to(tl.int64) * stride_mask_n, mask=ok, other=0)
    if MASK_KIND == 1:
        live = ok & (x != 0)
        dense = ok & (x == 0)
    else:
        live = ok
        dense = ok & (x != 0)  # NaN included
    # per MAP_CELL cell, then OR-pooled to each level
    live = tl.max(tl.max(tl.reshape(live.to(tl.int32), (CELLS, MAP_CELL, CELLS, MAP_CELL)), 3), 1)
    dense = tl.max(tl.max(tl.reshape(dense.to(tl.int32), (CELLS, MAP_CELL, CELLS, MAP_CELL)), 3), 1)
    Map_bh = TileMap + bh * 225 * unit
    for ai in tl.static_range(4):
        for bi in tl.static_range(4):
            _store_map_level(Map_bh, live, dense, block_m, block_n, CN, unit, 1 << ai, 1 << bi, CELLS)


@triton.jit
def _store_map_level(Map_bh, live, dense, block_m, block_n, CN, unit, a: tl.constexpr, b: tl.constexpr,
                     CELLS: tl.constexpr):
    """The codes of a block's (a MAP_CELL, b MAP_CELL) tiles, OR-pooled from its cells' live
    and dense bits (CELLS x CELLS), stored at their level (_map_level)."""
    code = tl.max(tl.max(tl.reshape(live, (CELLS // a, a, CELLS // b, b)), 3), 1) * MAP_LIVE \
        + tl.max(tl.max(tl.reshape(dense, (CELLS // a, a, CELLS // b, b)), 3), 1) * MAP_DENSE
    tr = tl.arange(0, CELLS // a)
    tc = tl.arange(0, CELLS // b)
    tl.store(Map_bh + unit * _map_level(a * MAP_CELL, b * MAP_CELL)
             + (block_m * (CELLS // a) + tr[:, None]) * (CN // b) + block_n * (CELLS // b) + tc[None, :],
             code.to(tl.int8))


@triton.jit
def _attention_tile_lists_kernel(
    Lists,  # (Bm, Hm, rows, width) int32, contiguous, written (module docstring)
    TileMap,  # the codes of _attention_tile_map_kernel, contiguous
    Mask,  # with PACK_BITS, the bool mask as uint8, read at (b, h, i, j) through the strides; else unused
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,  # 0 on the dims it broadcasts over
    Hm, Lq, Lk,  # the map's heads; the query rows to read (all where it broadcasts over queries), keys
    rows, tiles, width, unit,  # tile rows and columns of the LIST_TILE level, a row's entries; the map's unit
    LIST_TILE: tl.constexpr,
    PACK_BITS: tl.constexpr,  # a bool mask: its bits follow each row's lists
):
    """One tile row's lists at the LIST_TILE level: the prefix counts of its full tiles (LIVE,
    not DENSE) and of its partial ones (LIVE and DENSE), then their column indices in order;
    with PACK_BITS, the bits of its LIST_TILE query rows of the mask after them."""
    r = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    codes = TileMap + bh * 225 * unit + unit * _map_level(LIST_TILE, LIST_TILE) + r * tiles
    row = Lists + (bh * rows + r) * width
    full_count = row
    part_count = row + tiles + 1
    full_index = row + 2 * (tiles + 1)
    part_index = full_index + tiles
    tl.store(full_count, 0)
    tl.store(part_count, 0)
    n_full = 0
    n_part = 0
    offs = tl.arange(0, LIST_CHUNK)
    for c0 in range(0, tiles, LIST_CHUNK):
        j = c0 + offs
        ok = j < tiles
        code = tl.load(codes + j, mask=ok, other=0).to(tl.int32)
        live = (code & MAP_LIVE) != 0
        dense = (code & MAP_DENSE) != 0
        full = (live & ~dense).to(tl.int32)
        part = (live & dense).to(tl.int32)
        at_full = tl.cumsum(full, 0) + n_full
        at_part = tl.cumsum(part, 0) + n_part
        tl.store(full_count + 1 + j, at_full, mask=ok)
        tl.store(part_count + 1 + j, at_part, mask=ok)
        tl.store(full_index + at_full - 1, j, mask=ok & (full != 0))
        tl.store(part_index + at_part - 1, j, mask=ok & (part != 0))
        n_full += tl.sum(full, 0)
        n_part += tl.sum(part, 0)
    if PACK_BITS:
        # query row i's word w holds at bit t key 64 (w // 4) + 8 (t // 2) + 2 (w % 4) + t % 2
        # (the order _masked_scores reads them in); keys past Lk and rows past Lq are 0, and a
        # mask broadcast over queries (stride_mask_m 0) gives every row its one row
        bits, words = _mask_bits_rows(Lists + bh * rows * width, width, tiles, r * LIST_TILE, LIST_TILE)
        i = tl.arange(0, LIST_TILE)
        row_ok = r * LIST_TILE + i < Lq
        mask_rows = Mask + (bh // Hm) * stride_mask_b + (bh % Hm) * stride_mask_h \
            + (r * LIST_TILE + i).to(tl.int64) * stride_mask_m
        t = tl.arange(0, 16)
        for w0 in range(0, words, BITS_CHUNK):
            w = w0 + tl.arange(0, BITS_CHUNK)
            j = (64 * (w // 4) + 2 * (w % 4))[None, :, None] + (8 * (t // 2) + t % 2)[None, None, :]
            m = tl.load(mask_rows[:, None, None] + j * stride_mask_n, mask=row_ok[:, None, None] & (j < Lk), other=0)
            word = tl.sum((m != 0).to(tl.int32) << t[None, None, :], axis=2)
            tl.store(bits + i[:, None] * words + w[None, :], word)


@triton.jit
def _softcap(y, CAP: tl.constexpr):
    """(CAP tanh(x), r) for y = 2 x log2(e): tanh(x) = 1 - 2r with r = 1 / (2^y + 1), and
    1 - tanh(x)^2 = 4r (1 - r), the derivative. exp2 and an approximate reciprocal (both
    run by Triton's interpreter, where libdevice's tanh is not). 1 - 2r cancels for small x:
    the capped score's absolute error is about 1.2e-7 CAP (docs/semantics.md), what a score
    of the cap's size rounds to anyway, and more than small scores' own rounding under a
    cap far above them. y = +-inf gives +-CAP, NaN stays NaN."""
    e = tl.math.exp2(y) + 1.0
    r = tl.math.rsqrt(e * e)  # 1 / e in two instructions (e >= 1; e * e = inf gives 0)
    return r * (-2.0 * CAP) + CAP, r  # the tensor first: the interpreter's constexpr would wrap it


@triton.jit
def _score_scale(scale, SOFTCAP: tl.constexpr):
    """The factor the score loops apply to the products q.k: the scale in log2 units, or
    with a cap (SOFTCAP > 0) _softcap's argument for x = scale q.k / SOFTCAP."""
    f = scale * LOG2E
    if SOFTCAP > 0:
        f = scale * (2.0 * LOG2E / SOFTCAP)
    return f


@triton.jit
def _masked_scores(
    q, k,  # (BLOCK_M, BLOCK_D) query tile, (BLOCK_N, BLOCK_D) key tile
    tile,  # (offs_m, row_ok, d_ok): query rows (BLOCK_M,), rows < Lq, head-dim lanes < HEAD_DIM
    key_tile,  # (start_n64, cols, col_ok): the key tile's first key, its keys (BLOCK_N,), keys < kv_len
    mask,  # (Mask_rows, stride_mask_m, stride_mask_n, ...): as _attention_fwd_inner's
    dense,  # whether this tile's mask must be read (_tile_flags)
    causal_offset, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ELEMENT_MASKED: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False, BITS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """(scores, g): scores q k^T * scale (log2 units) of one tile pair, -inf wherever a mask
    forbids; with FOLD_SCALE (no float mask, scale > 0), q k^T unscaled, for
    _online_softmax_step to scale. With BITS (a listed partial tile of a bool mask) the mask
    is read from its bits, mask[4:6]. With SOFTCAP > 0 the scores are capped before the masks,
    SOFTCAP tanh(q k^T scale / SOFTCAP) (qk_scale is _score_scale's), and g = 1 - tanh^2 is
    their derivative by the scaled products, which the dQ backward multiplies its score
    gradient by; without a cap g is s (unused).

    Shared by the forward and the dQ backward so both see exactly the same masked scores.
    """
    offs_m, row_ok, _ = tile
    start_n64, cols, col_ok = key_tile
    Mask_rows, stride_mask_m, stride_mask_n = mask[0], mask[1], mask[2]
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_FP32, INPUT_PRECISION)
    g = s
    if FOLD_SCALE:
        tl.static_assert(MASK_KIND != 2, "a float mask is added to scaled scores")
        tl.static_assert(SOFTCAP == 0, "capped scores are scaled here")
    elif SOFTCAP > 0:
        s, r = _softcap(s * qk_scale, SOFTCAP * LOG2E)
        g = 4.0 * r * (1.0 - r)
    else:
        s = s * qk_scale
    if MASK_KIND != 0:
        mask_ptrs = Mask_rows + start_n64 * stride_mask_n + rows[:, None] * stride_mask_m \
            + offs_n[None, :] * stride_mask_n
        rows_read = tl.where(dense, row_ok, False)  # nothing on a tile that is not dense
        if BITS:
            tl.static_assert(MASK_KIND == 1 and not ELEMENT_MASKED, "the bits of a bool mask's partial tiles")
            # word 4 (j // 64) + (j % 8) // 2 of a row holds key j at bit 2 ((j % 64) // 8) + j % 2:
            # a word holds the columns one thread holds in the accumulator, so each score tests
            # one bit of a word its thread loaded (_attention_tile_lists_kernel packs them). 16
            # bits a word: 64-key groups need no shift in tiles of 64 keys or more.
            if BLOCK_N <= 64:
                K8: tl.constexpr = BLOCK_N // 8
                words = tl.load(mask[4] + rows[:, None] * mask[5] + (start_n64 >> 6) * 4 + tl.arange(0, 4)[None, :],
                                mask=rows_read[:, None], other=0)
                if BLOCK_N < 64:  # the tile's columns of its 64-key group
                    words = words >> ((start_n64 & 63) >> 2).to(tl.int32)
                bit = tl.arange(0, K8)[None, :, None, None] * 2 + tl.arange(0, 2)[None, None, None, :]
                allowed = (tl.broadcast_to(words[:, None, :, None], (BLOCK_M, K8, 4, 2)) & (1 << bit)) != 0
            else:
                G: tl.constexpr = BLOCK_N // 64
                at = (start_n64 >> 6) * 4 + tl.arange(0, G)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
                words = tl.load(mask[4] + rows[:, None, None] * mask[5] + at, mask=rows_read[:, None, None], other=0)
                bit = tl.arange(0, 8)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
                allowed = (tl.broadcast_to(words[:, :, None, :, None], (BLOCK_M, G, 8, 4, 2)) & (1 << bit)) != 0
            s = tl.where(tl.reshape(allowed, (BLOCK_M, BLOCK_N)), s, float("-inf"))
        elif ELEMENT_MASKED:
            s = _apply_dense_mask(s, mask_ptrs, rows_read[:, None] & col_ok[None, :], dense, MASK_KIND)
        else:
            s = _apply_dense_mask(s, mask_ptrs, rows_read[:, None], dense, MASK_KIND)
    if ELEMENT_MASKED:
        allowed = col_ok[None, :]
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(allowed, s, float("-inf"))
    return s, g


@triton.jit
def _query_block_keys(KeyLengths, off_b, Lk, start_m, Lq, causal_offset, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """(kv_len, full_end, hi) of the query block at start_m: its batch's key length; [0,
    full_end) the key tiles every row of the block may see entirely; [full_end, hi) boundary
    tiles (causal diagonal, last partial tile); beyond hi nothing is loaded."""
    kv_len = Lk
    if HAS_KEY_LENGTHS:
        kv_len = tl.minimum(tl.maximum(tl.load(KeyLengths + off_b), 0), Lk)  # unchecked on a GPU
    hi = kv_len
    full_end = kv_len
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.minimum(start_m + BLOCK_M, Lq) + causal_offset)
        full_end = tl.minimum(full_end, start_m + causal_offset + 1)
    return kv_len, tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N, tl.maximum(hi, 0)


@triton.jit
def _key_operands(K_head, stride_k_n, V_head, stride_v_n, kv_len, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """(keys, values) of one (batch, kv head), as the key loops take them: (base, row stride),
    and with TMA a descriptor of the (kv_len, HEAD_DIM) matrix, whose tile loads read zeros
    outside it as the masked loads do (128 bytes of global scratch each per program)."""
    if TMA:
        keys = (K_head, stride_k_n, tl.make_tensor_descriptor(
            K_head, [tl.maximum(kv_len, 1), HEAD_DIM], [stride_k_n, 1], [BLOCK_N, BLOCK_D]))
        values = (V_head, stride_v_n, tl.make_tensor_descriptor(
            V_head, [tl.maximum(kv_len, 1), HEAD_DIM], [stride_v_n, 1], [BLOCK_N, BLOCK_D]))
    else:
        keys = (K_head, stride_k_n)
        values = (V_head, stride_v_n)
    return keys, values


@triton.jit
def _key_tile_scores(
    q, tile, keys, mask, flags,  # as _attention_fwd_inner's; flags: the tile's (live, dense), _tile_flags
    start_n, kv_len, causal_offset, qk_scale,  # the key tile's first key; keys < kv_len exist
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, ELEMENT_MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr = False,
    SKIP_DEAD: tl.constexpr = False, TMA: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0,
):
    """The key tile at start_n, loaded, and the query tile's masked scores against it:
    (scores, (start_n as int64, key columns, columns < kv_len, keys to load)); unscaled with
    FOLD_SCALE. With SKIP_DEAD the keys to load are none on a tile the mask forbids entirely.
    With TMA (light launches, which never skip), the keys come through the descriptor keys[2]."""
    _, _, d_ok = tile
    K_head, stride_k_n = keys[0], keys[1]
    live, dense = flags
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    start_n64 = tl.cast(start_n, tl.int64)
    cols = start_n + offs_n
    col_ok = cols < kv_len
    k_ptrs = K_head + start_n64 * stride_k_n + offs_n[:, None] * stride_k_n + offs_d[None, :]
    if TMA:  # the descriptor's zeros past kv_len stand for the masked load's
        load_ok = col_ok
        k = keys[2].load([start_n, 0])
    elif SKIP_DEAD:
        load_ok = tl.where(live, col_ok, False)
        k = _load_tile(k_ptrs, load_ok, d_ok, True, MASK_D)
    else:
        load_ok = col_ok
        k = _load_tile(k_ptrs, col_ok, d_ok, ELEMENT_MASKED, MASK_D)
    key_tile = (start_n64, cols, col_ok, load_ok)
    s, _ = _masked_scores(q, k, tile, key_tile[:3], mask, dense, causal_offset, qk_scale, BLOCK_M, BLOCK_N,
                          MASK_KIND, IS_CAUSAL, ELEMENT_MASKED, DOT_FP32, INPUT_PRECISION, FOLD_SCALE,
                          SKIP_DEAD and MASK_KIND == 1, SOFTCAP)
    return s, key_tile


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
@triton.jit
def _max_propagating_nan(a, b):
    # tl.max compiles to max.f32, which returns the other operand when one is NaN: a row of NaN
    # scores would then look fully masked (output 0) instead of NaN, as in the reference
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _online_softmax_step(s, l_i, m_i, qk_scale, FOLD_SCALE: tl.constexpr):
    """One key tile of the online softmax: (P, the rescale of the old sums, new l, new m).

    With FOLD_SCALE, s is unscaled and qk_scale > 0: the row maximum is taken before scaling
    (max(x) c rounds to max(x c) for c > 0, the same bits) and the scale enters exp2's
    argument as one fused multiply-add, instead of a multiply per score of its own.
    """
    if FOLD_SCALE:
        row_max = tl.reduce(s, 1, _max_propagating_nan) * qk_scale
    else:
        row_max = tl.reduce(s, 1, _max_propagating_nan)
    m_new = tl.maximum(m_i, row_max, propagate_nan=tl.PropagateNan.ALL)
    # while a row has seen no allowed key its maximum is -inf: subtract 0 instead
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    if FOLD_SCALE:
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    else:
        p = tl.math.exp2(s - m_safe[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attention_fwd_inner(
    state,  # (acc, l_i, m_i): running output (BLOCK_M, BLOCK_D), row sums and row maxima (BLOCK_M,), fp32
    q,  # (BLOCK_M, BLOCK_D) query tile
    tile,  # (offs_m, row_ok, d_ok): query rows (BLOCK_M,), rows < Lq, head-dim lanes < HEAD_DIM
    keys, values,  # (K_head, stride_k_n[, descriptor with TMA]), likewise V: this (batch, kv head) at key 0
    mask,  # (Mask_rows, stride_mask_m, stride_mask_n, Codes_row, Bits_rows, words): the dense mask at
    #        (batch, head, tile row 0, key 0), the tile map's codes of (batch, head, this query
    #        tile, key tile 0), a bool mask's bits at tile row 0 and their words a row (_mask_rows)
    dropout,  # (dropout_p, dropout_threshold, seed, the query tile's first row)
    off_b, off_h,  # batch and head (the dropout mask's counter)
    lo, hi, kv_len, causal_offset, qk_scale,  # key tiles [lo, hi); keys < kv_len exist
    index,  # with LISTED: [lo, hi) counts BLOCK_N tiles of the LIST_TILE tiles listed here
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ELEMENT_MASKED: tl.constexpr,  # False on full tiles: no per-element causal/length masking
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr,
    LISTED: tl.constexpr = False, LIST_TILE: tl.constexpr = MAP_TILE, TMA: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
):
    acc, l_i, m_i = state
    offs_m, _, d_ok = tile
    V_head, stride_v_n = values[0], values[1]
    dropout_p, dropout_threshold, seed, start_m = dropout
    # Tile pointers are rebuilt each iteration from scalar bases: a loop-carried pointer tensor
    # would hold a 64-bit address per element in registers.
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    SUB: tl.constexpr = LIST_TILE // BLOCK_N
    window = _list_window(index, hi // SUB) if LISTED else (0, 0)
    for it in range(lo, hi, 1 if LISTED else BLOCK_N):
        start_n, live, dense = _loop_tile(it, window, mask[3], BLOCK_N, MASK_KIND, LISTED, LIST_TILE)
        # a listed partial tile may lie between tiles the mask forbids entirely: those load nothing
        SKIP_DEAD: tl.constexpr = LISTED and MASK_KIND != 0
        s, key_tile = _key_tile_scores(
            q, tile, keys, mask, (live, dense), start_n, kv_len, causal_offset, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D,
            MASK_D, MASK_KIND, IS_CAUSAL, ELEMENT_MASKED, DOT_FP32, INPUT_PRECISION, FOLD_SCALE, SKIP_DEAD, TMA,
            SOFTCAP,
        )
        start_n64, cols, col_ok, load_ok = key_tile
        p, alpha, l_i, m_new = _online_softmax_step(s, l_i, m_i, qk_scale, FOLD_SCALE)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = _dropout_keep_tile(seed, dropout_threshold, off_b, off_h, start_m, start_n, BLOCK_M, BLOCK_N, False)
            # 1 / (1 - p) is applied to the output. A zero the compiler cannot fold keeps this
            # select on fp32 scores: past a constant 0 it moves the select behind the 16-bit
            # packing, a byte permute per score more.
            p = tl.where(keep, p, dropout_p * 0.0)
        if TMA:
            v = values[2].load([start_n, 0])
        else:
            v = _load_tile(V_head + start_n64 * stride_v_n + offs_n[:, None] * stride_v_n + offs_d[None, :],
                           load_ok, d_ok, ELEMENT_MASKED or SKIP_DEAD, MASK_D)
        acc = _dot(p.to(v.dtype), v, acc, DOT_FP32, INPUT_PRECISION)
        m_i = m_new
        if LISTED:
            window = _list_window_step(window, index, hi // SUB, it, SUB)
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_kernel(
    Q,  # (B, H, Lq, D) queries, stride(-1) == 1
    K, V,  # (B, Hkv, Lk, D) keys and values, stride(-1) == 1
    Out,  # (B, H, Lq, D) output, written
    Lse,  # (B, H, Lq) fp32 log-sum-exp (natural log), contiguous, written
    Mask,  # (B, H, Lq, Lk) dense mask (uint8 bool or float) read through strides, or unused
    TileMap,  # the mask's int8 tile map (module docstring) read through strides, or unused
    Lists,  # its int32 tile lists read through strides, or unused
    KeyLengths,  # (B,) int32 key lengths, or unused
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_o_b, stride_o_h, stride_o_m,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,  # 0 on broadcast dims
    stride_map_b, stride_map_h, stride_map_m, map_unit,  # the tile map's, 0 where the mask's are
    stride_list_b, stride_list_h, stride_list_m, list_tiles,  # the tile lists', likewise
    H, GROUP,  # query heads, query heads per kv head
    Lq, Lk, causal_offset,  # query i may attend key j <= i + causal_offset when IS_CAUSAL
    scale, dropout_p, dropout_threshold, seed,
    LQ_BUCKET, LK_BUCKET,  # unused in the body: the autotuning key
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr,  # scale > 0, no dropout: see _online_softmax_step
    LIST_TILE: tl.constexpr,  # the tile lists' level (module docstring)
    TMA: tl.constexpr,  # keys and values through tensor descriptors (TMA on sm_90), see _tma_layout
    SOFTCAP: tl.constexpr = 0.0,  # > 0: scores capped, SOFTCAP tanh(scale q.k / SOFTCAP), before the masks
):
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    off_hkv = off_h // GROUP
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    tl.static_assert(not TMA or (MASK_KIND == 0 and not HAS_DROPOUT), "TMA: the light class only (_tma_layout)")

    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    start_m64 = tl.cast(start_m, tl.int64)

    kv_len, full_end, hi = _query_block_keys(KeyLengths, off_b, Lk, start_m, Lq, causal_offset, BLOCK_M, BLOCK_N,
                                             HAS_KEY_LENGTHS, IS_CAUSAL)

    q_ptrs = Q + off_b * stride_q_b + off_h * stride_q_h + start_m64 * stride_q_m \
        + rows[:, None] * stride_q_m + offs_d[None, :]
    q = _load_tile(q_ptrs, row_ok, d_ok, True, MASK_D)
    K_head = K + off_b * stride_k_b + off_hkv * stride_k_h
    V_head = V + off_b * stride_v_b + off_hkv * stride_v_h
    Mask_rows = Mask + off_b * stride_mask_b + off_h * stride_mask_h + start_m64 * stride_mask_m
    codes_row = _map_row(TileMap + off_b * stride_map_b + off_h * stride_map_h, stride_map_m, map_unit, start_m,
                         BLOCK_M, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    qk_scale = _score_scale(scale, SOFTCAP)

    tile = (offs_m, row_ok, d_ok)
    keys, values = _key_operands(K_head, stride_k_n, V_head, stride_v_n, kv_len, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    mask = _mask_rows(Mask_rows, stride_mask_m, stride_mask_n, codes_row,
                      Lists + off_b * stride_list_b + off_h * stride_list_h, stride_list_m, list_tiles, start_m,
                      MASK_KIND, LIST_TILE)
    dropout = (dropout_p, dropout_threshold, seed, start_m)
    listed_end = 0
    # a float mask is added to scaled scores: unscaled ones only where no mask is read
    FOLD_MASKED: tl.constexpr = FOLD_SCALE and MASK_KIND != 2
    if MASK_KIND != 0 and BLOCK_D <= LISTS_MAX_HEAD_DIM:
        # the listed tiles before full_end: full ones as without a mask, then partial ones
        full_index, n_full, part_index, n_part, listed_end = _listed_tiles(
            Lists + off_b * stride_list_b + off_h * stride_list_h, stride_list_m, list_tiles, start_m, full_end,
            LIST_TILE)
        SUB: tl.constexpr = LIST_TILE // BLOCK_N
        acc, l_i, m_i = _attention_fwd_inner(
            (acc, l_i, m_i), q, tile, keys, values, mask, dropout, off_b, off_h,
            0, n_full * SUB, kv_len, causal_offset, qk_scale, full_index,
            BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, 0, IS_CAUSAL, HAS_DROPOUT, False, DOT_FP32, INPUT_PRECISION,
            FOLD_SCALE, True, LIST_TILE, TMA, SOFTCAP,
        )
        acc, l_i, m_i = _attention_fwd_inner(
            (acc, l_i, m_i), q, tile, keys, values, mask, dropout, off_b, off_h,
            0, n_part * SUB, kv_len, causal_offset, qk_scale, part_index,
            BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, False, DOT_FP32, INPUT_PRECISION,
            FOLD_MASKED, True, LIST_TILE, TMA, SOFTCAP,
        )
    lo1, hi1, lo2, hi2 = _key_loops(mask, listed_end, full_end, hi, BLOCK_M, BLOCK_N, MASK_KIND)
    acc, l_i, m_i = _attention_fwd_inner(
        (acc, l_i, m_i), q, tile, keys, values, mask, dropout, off_b, off_h,
        lo1, hi1, kv_len, causal_offset, qk_scale, codes_row,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, False, DOT_FP32, INPUT_PRECISION,
        FOLD_MASKED, False, MAP_TILE, TMA, SOFTCAP,
    )
    acc, l_i, m_i = _attention_fwd_inner(
        (acc, l_i, m_i), q, tile, keys, values, mask, dropout, off_b, off_h,
        lo2, hi2, kv_len, causal_offset, qk_scale, codes_row,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, True, DOT_FP32, INPUT_PRECISION,
        FOLD_MASKED, False, MAP_TILE, TMA, SOFTCAP,
    )

    # rows that saw no allowed key: l = 0 -> output 0, lse = +inf
    empty = l_i == 0.0
    if HAS_DROPOUT:  # the kept weights' 1 / (1 - p), once per output element
        acc = acc * (1.0 / (1.0 - dropout_p))
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = Out + off_b * stride_o_b + off_h * stride_o_h + start_m64 * stride_o_m \
        + rows[:, None] * stride_o_m + offs_d[None, :]
    if MASK_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + (off_b * H + off_h) * Lq + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------
@triton.jit
def _attention_row_stats(
    q, tile, keys, mask,  # as _attention_fwd_inner's
    hi, kv_len, causal_offset, qk_scale,  # keys [0, hi); keys < kv_len exist
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Row sums l and maxima m (log2 units) of a query tile's scores over keys [0, hi): the
    forward's statistics, from the same _masked_scores the forward and the dQ kernel use."""
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    no_lo, no_hi, lo, hi = _key_loops(mask, 0, 0, hi, BLOCK_M, BLOCK_N, MASK_KIND)  # one loop: [lo, hi)
    for start_n in range(lo, hi, BLOCK_N):
        flags = _tile_flags(mask[3] + start_n // BLOCK_N, MASK_KIND)
        s, _ = _key_tile_scores(
            q, tile, keys, mask, flags, start_n, kv_len, causal_offset, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D,
            MASK_D, MASK_KIND, IS_CAUSAL, True, DOT_FP32, INPUT_PRECISION, SOFTCAP=SOFTCAP,
        )
        _, _, l_i, m_i = _online_softmax_step(s, l_i, m_i, qk_scale, False)
    return l_i, m_i


@triton.jit
def _exact_rows(lse):
    """The rows whose statistics the backward recomputes (module docstring)."""
    return (tl.abs(lse) > EXACT_LSE) & (tl.abs(lse) < float("inf"))


@triton.jit
def _any_set(Flags, n):
    """Whether any of the n int8 flags from Flags is set."""
    found = tl.full((), 0, tl.int32)
    offs = tl.arange(0, 512)
    for start in range(0, n, 512):
        flags = tl.load(Flags + start + offs, mask=start + offs < n, other=0)
        found = tl.maximum(found, tl.max(flags.to(tl.int32), 0))
    return found != 0


@triton.jit
def _exact_rows_stats(
    Q_rows, stride_q_m, keys,  # ROWS query rows from start_m; keys as _attention_fwd_inner's
    Mask_rows, stride_mask_m, stride_mask_n, Map_bh, stride_map_m, map_unit,  # the mask at those rows, its map
    Lse_bh, Hi_bh, R_bh,  # this (batch, head)'s rows
    start_m, Lq, hi, kv_len, causal_offset, qk_scale,  # keys [0, hi) as the forward visited them
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Hi = m and R = 1 / l of the rows of huge scores among ROWS rows from start_m,
    from the same _masked_scores the forward and the dQ loop use (l is the sum before dropout,
    as the forward's)."""
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    rows = tl.arange(0, ROWS)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    exact = row_ok & _exact_rows(tl.load(Lse_bh + offs_m, mask=row_ok, other=float("inf")))
    if tl.max(exact.to(tl.int32), 0) != 0:
        q = _load_tile(Q_rows + rows[:, None] * stride_q_m + offs_d[None, :], row_ok, d_ok, True, MASK_D)
        mask = (Mask_rows, stride_mask_m, stride_mask_n,
                _map_row(Map_bh, stride_map_m, map_unit, start_m, ROWS, EXACT_KEYS))
        l_x, m_x = _attention_row_stats(
            q, (offs_m, row_ok, d_ok), keys, mask, hi, kv_len, causal_offset, qk_scale,
            ROWS, EXACT_KEYS, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, DOT_FP32, INPUT_PRECISION, SOFTCAP,
        )
        tl.store(Hi_bh + offs_m, m_x, mask=exact)
        tl.store(R_bh + offs_m, 1.0 / tl.where(exact, l_x, 1.0), mask=exact)  # l >= 1: the maximum's exp(0)


@triton.jit
def _attention_bwd_dkdv_inner(
    acc,  # (dk, dv): (BLOCK_N, BLOCK_D) fp32 accumulators
    k, v,  # (BLOCK_N, BLOCK_D) key/value tile
    tile,  # (start_n, cols, col_ok, d_ok): first key, key columns (BLOCK_N,), columns < kv_len, lanes < HEAD_DIM
    queries, grads,  # (Q_b, stride_q_h, stride_q_m), (DO_b, stride_do_h, stride_do_m): this batch at (head 0, row 0)
    mask,  # (Mask_b, stride_mask_h, stride_mask_m, stride_mask_n, Codes_col, stride_map_h, row_stride): the
    #        dense mask at (batch, head 0, row 0, first key of the tile); the code of the tile map's
    #        (batch, head 0, query tile 0, this key tile), its head and query tile strides (_map_codes)
    stats,  # (Hi_b, Delta_b, R_b): this batch's (H, Lq) hi, delta and r (see the module docstring)
    dropout,  # (dropout_p, dropout_threshold, seed)
    off_b,  # batch (the dropout mask's counter)
    heads,  # (head0, GROUP): query heads head0 .. head0 + GROUP - 1
    rescale,  # whether P is scaled by r per row (only in loops with ELEMENT_MASKED)
    lo, num_tiles,  # each head's num_tiles query tiles from row lo
    Lq, causal_offset, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ELEMENT_MASKED: tl.constexpr,  # False on full tiles: no per-element causal/length masking
    OUTPUT: tl.constexpr,  # "dkdv", or "dk" / "dv" alone (one accumulator: large head dims)
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,  # as _masked_scores's (qk_scale is then _score_scale's)
):
    dk, dv = acc
    start_n, cols, col_ok, d_ok = tile
    Q_b, stride_q_h, stride_q_m = queries[0], queries[1], queries[2]
    DO_b, stride_do_h, stride_do_m = grads[0], grads[1], grads[2]
    Mask_b, stride_mask_h, stride_mask_m, stride_mask_n, Codes_col, stride_map_h, row_stride = mask
    Hi_b, Delta_b, R_b = stats
    dropout_p, dropout_threshold, seed = dropout
    head0, GROUP = heads
    # One flat loop over (query head of the group, query tile), heads in a fixed order: a
    # nested loop over heads would keep two pipelined loops' state alive at once.
    # Everything is computed transposed, (key columns, query rows), so that every matmul has
    # the key tile as its M dimension (BLOCK_N >= 64 gives Hopper's wgmma) while the query
    # tile BLOCK_M can stay small; lse and delta are then per-column vectors.
    rows_local = tl.arange(0, BLOCK_M)
    cols_local = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # The tile's head and row are carried from one iteration to the next (t // num_tiles
    # would divide on every tile).
    g = 0
    i = 0
    # Without a dense mask at head dim 128 (two accumulators of 128 lanes), the loops over
    # tiles masked per element, a few per key tile, run unpipelined: pipelined, they made the
    # light entries spill under Triton 3.9; elsewhere unpipelined ones spilled (compile-check).
    UNPIPELINED: tl.constexpr = ELEMENT_MASKED and BLOCK_D == 128 and MASK_KIND == 0
    for t in tl.range(0, GROUP * num_tiles, num_stages=1 if UNPIPELINED else None):
        start_m = lo + i * BLOCK_M
        off_h = head0 + g
        _, dense = _tile_flags(Codes_col + off_h * stride_map_h + start_m // BLOCK_M * row_stride, MASK_KIND)
        start_m64 = tl.cast(start_m, tl.int64)
        rows = start_m + rows_local
        row_ok = rows < Lq  # all True on full tiles, whose rows are below Lq
        if TMA:  # zeros past Lq, as the masked loads read
            q = tl.reshape(queries[3].load([off_h.to(tl.int32), start_m, 0]), (BLOCK_M, BLOCK_D))
            do = tl.reshape(grads[3].load([off_h.to(tl.int32), start_m, 0]), (BLOCK_M, BLOCK_D))
        else:
            q = _load_tile(Q_b + off_h * stride_q_h + start_m64 * stride_q_m + rows_local[:, None] * stride_q_m
                           + offs_d[None, :], row_ok, d_ok, ELEMENT_MASKED, MASK_D)
            do = _load_tile(DO_b + off_h * stride_do_h + start_m64 * stride_do_m + rows_local[:, None] * stride_do_m
                            + offs_d[None, :], row_ok, d_ok, ELEMENT_MASKED, MASK_D)
        # rows of this batch's (H, Lq) statistics, in int32 (2**31 rows of q would take 256 GiB)
        row_base = off_h.to(tl.int32) * Lq + rows
        if ELEMENT_MASKED:  # rows past Lq read hi = +inf, hence P = 0
            row_hi = tl.load(Hi_b + row_base, mask=row_ok, other=float("inf"))
            delta = tl.load(Delta_b + row_base, mask=row_ok, other=0.0)
        else:
            row_hi = tl.load(Hi_b + row_base)
            delta = tl.load(Delta_b + row_base)
        s_t = _dot(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), DOT_FP32, INPUT_PRECISION)
        if SOFTCAP > 0:  # capped as _masked_scores caps, keeping what gives the derivative
            s_t, r_t = _softcap(s_t * qk_scale, SOFTCAP * LOG2E)
        else:
            s_t = s_t * qk_scale  # S^T, (BLOCK_N, BLOCK_M)
        if MASK_KIND != 0:
            mask_ptrs = Mask_b + off_h * stride_mask_h + start_m64 * stride_mask_m \
                + cols_local[:, None] * stride_mask_n + rows_local[None, :] * stride_mask_m
            rows_read = tl.where(dense, row_ok, False)  # nothing on a tile that is not dense
            if ELEMENT_MASKED:
                s_t = _apply_dense_mask(s_t, mask_ptrs, col_ok[:, None] & rows_read[None, :], dense, MASK_KIND)
            else:
                s_t = _apply_dense_mask(s_t, mask_ptrs, rows_read[None, :], dense, MASK_KIND)
        if ELEMENT_MASKED:
            allowed = col_ok[:, None]
            if IS_CAUSAL:
                allowed = allowed & (cols[:, None] <= rows[None, :] + causal_offset)
            s_t = tl.where(allowed, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - row_hi[None, :])
        if ELEMENT_MASKED:
            # query rows past Lq (loaded as q = 0, do = 0) carry no weight; 0 * inf in a key
            # would otherwise make their scores NaN, and exp2(NaN - inf) NaN. P = r exp2(S - hi)
            # on the rows of huge scores (module docstring; r = 1 elsewhere, the same bits)
            r = tl.load(R_b + row_base, mask=tl.where(rescale, row_ok, False), other=1.0)
            p_t = tl.where(row_ok[None, :], p_t * r[None, :], 0.0)
        # dS takes P times the cap's derivative 1 - tanh^2: folded in here, so that only one
        # score tile outlives dV's product, as without a cap
        pg_t = p_t
        if SOFTCAP > 0 and OUTPUT != "dv":
            pg_t = p_t * (4.0 * r_t * (1.0 - r_t))
        if HAS_DROPOUT:
            keep_t = _dropout_keep_tile(seed, dropout_threshold, off_b, off_h, start_m, start_n, BLOCK_M, BLOCK_N, True)
            inv_keep = 1.0 / (1.0 - dropout_p)
        if OUTPUT != "dk":
            pd_t = p_t
            if HAS_DROPOUT:  # dV takes 1 / (1 - dropout_p) once, after the loops
                pd_t = tl.where(keep_t, p_t, 0.0)
            dv = _dot(pd_t.to(do.dtype), do, dv, DOT_FP32, INPUT_PRECISION)
        if OUTPUT != "dv":
            dp_t = _dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), DOT_FP32, INPUT_PRECISION)
            if HAS_DROPOUT:  # a select and an FMA per score: the scale times the kept dP, less delta
                ds_t = pg_t * (tl.where(keep_t, dp_t, 0.0) * inv_keep - delta[None, :])
            else:
                ds_t = pg_t * (dp_t - delta[None, :])
            dk = _dot(ds_t.to(q.dtype), q, dk, DOT_FP32, INPUT_PRECISION)
        i += 1
        wrap = i == num_tiles
        g = tl.where(wrap, g + 1, g)
        i = tl.where(wrap, 0, i)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_loops(
    acc, k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, rescale,
    bounds,  # (lo, split, mid, end): query tiles [lo, split) and [mid, end) masked per element
    Lq, causal_offset, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, OUTPUT: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """A key tile's three loops over query tiles (arguments as _attention_bwd_dkdv_inner's)."""
    lo, split, mid, end = bounds
    acc = _attention_bwd_dkdv_inner(
        acc, k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, rescale,
        lo, (split - lo) // BLOCK_M, Lq, causal_offset, qk_scale,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, True, OUTPUT, DOT_FP32,
        INPUT_PRECISION, TMA, SOFTCAP,
    )
    acc = _attention_bwd_dkdv_inner(
        acc, k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, False,
        split, (mid - split) // BLOCK_M, Lq, causal_offset, qk_scale,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, False, OUTPUT, DOT_FP32,
        INPUT_PRECISION, TMA, SOFTCAP,
    )
    return _attention_bwd_dkdv_inner(  # empty where rescale: nothing of it lives across the loops
        acc, k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, False,
        mid, (end - mid) // BLOCK_M, Lq, causal_offset, qk_scale,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, True, OUTPUT, DOT_FP32,
        INPUT_PRECISION, TMA, SOFTCAP,
    )


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,  # (B, H, Lq, D) queries, stride(-1) == 1
    K, V,  # (B, Hkv, Lk, D) keys and values, stride(-1) == 1
    DO,  # (B, H, Lq, D) output gradient, stride(-1) == 1
    R, Exact,  # the dQ kernel's: r per row (B, H, Lq) fp32, its flags (B, H, cdiv(Lq, EXACT_ROWS)) int8
    Hi, Delta,  # (B, H, Lq) fp32, contiguous
    DK, DV,  # (B, Hkv, Lk, D) gradients, written (summed over the kv group's query heads)
    Mask,  # (B, H, Lq, Lk) dense mask read through strides, or unused
    TileMap,  # its tile map read through strides, or unused
    KeyLengths,  # (B,) int32, or unused
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_m,
    stride_dk_b, stride_dk_h, stride_dk_n,
    stride_dv_b, stride_dv_h, stride_dv_n,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_map_b, stride_map_h, stride_map_m, map_unit,
    H, GROUP, Lq, Lk, causal_offset,
    scale, dropout_p, dropout_threshold, seed,
    LQ_BUCKET, LK_BUCKET,  # unused in the body: the autotuning key
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    OUTPUT: tl.constexpr,  # "dkdv"; or "dk" / "dv": two launches, each with one accumulator
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,  # queries and output gradients through tensor descriptors (_tma_layout)
    SOFTCAP: tl.constexpr = 0.0,  # as the forward's
):
    start_n = tl.program_id(0) * BLOCK_N
    off_hkv = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    tl.static_assert(not TMA or (MASK_KIND == 0 and not HAS_DROPOUT), "TMA: the light class only (_tma_layout)")

    cols_local = tl.arange(0, BLOCK_N)
    cols = start_n + cols_local
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    start_n64 = start_n.to(tl.int64)

    kv_len = Lk
    if HAS_KEY_LENGTHS:
        kv_len = tl.minimum(tl.maximum(tl.load(KeyLengths + off_b), 0), Lk)  # unchecked on a GPU
    col_ok = cols < kv_len  # keys past the length are never loaded; their gradients are 0
    k = _load_tile(K + off_b * stride_k_b + off_hkv * stride_k_h + start_n64 * stride_k_n
                   + cols_local[:, None] * stride_k_n + offs_d[None, :], col_ok, d_ok, True, MASK_D)
    v = _load_tile(V + off_b * stride_v_b + off_hkv * stride_v_h + start_n64 * stride_v_n
                   + cols_local[:, None] * stride_v_n + offs_d[None, :], col_ok, d_ok, True, MASK_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    # Query tiles [lo, split) need per-element masking (the causal diagonal, or every tile when
    # this key tile is partial), [split, end) are full but for a last partial tile, masked too;
    # rows before lo never see this tile.
    end = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
    lo = 0
    split = 0
    if IS_CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        split = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
    split = tl.where(start_n + BLOCK_N > kv_len, end, split)
    lo = tl.where(start_n >= kv_len, end, lo)
    lo = tl.minimum(lo, end)
    codes, row_stride = _map_codes(TileMap + off_b * stride_map_b, stride_map_m, map_unit, BLOCK_M, BLOCK_N)
    Codes_col = codes + start_n // BLOCK_N
    # whether every query tile left to this key tile is full in every head of the group: the
    # loops then run as without a mask (a padding mask's live columns, say). Not in 3xTF32
    # launches, whose operand halves leave no registers for the second copy of the loops.
    UNMASKED_COPY: tl.constexpr = MASK_KIND != 0 and INPUT_PRECISION != "tf32x3"
    unmasked = False
    if MASK_KIND != 0:  # narrowed to the first and last live query tile of any head of the group
        span = (end // BLOCK_M, lo // BLOCK_M)
        full = 0
        for g in range(0, GROUP):
            span, full = _live_full_span(Codes_col + (off_hkv * GROUP + g) * stride_map_h, row_stride,
                                         lo // BLOCK_M, end // BLOCK_M, span, full)
        lo = tl.maximum(lo, span[0] * BLOCK_M)
        end = tl.maximum(tl.minimum(end, span[1] * BLOCK_M), lo)
        unmasked = full == GROUP * ((end - lo) // BLOCK_M)
    split = tl.minimum(tl.maximum(split, lo), end)
    mid = tl.maximum(split, tl.minimum(end, Lq // BLOCK_M * BLOCK_M))  # [mid, end): Lq's partial tile
    qk_scale = _score_scale(scale, SOFTCAP)

    Q_b = Q + off_b * stride_q_b
    DO_b = DO + off_b * stride_do_b
    Mask_b = Mask + off_b * stride_mask_b + start_n64 * stride_mask_n
    rows_b = off_b * H * Lq  # this batch's first row of hi, delta and r
    heads = (off_hkv * GROUP, GROUP)
    stats = (Hi + rows_b, Delta + rows_b, R + rows_b)
    tile = (start_n, cols, col_ok, d_ok)
    if TMA:  # this batch's (H, Lq, HEAD_DIM) queries and output gradients
        queries = (Q_b, stride_q_h, stride_q_m, tl.make_tensor_descriptor(
            Q_b, [H, Lq, HEAD_DIM], [stride_q_h, stride_q_m, 1], [1, BLOCK_M, BLOCK_D]))
        grads = (DO_b, stride_do_h, stride_do_m, tl.make_tensor_descriptor(
            DO_b, [H, Lq, HEAD_DIM], [stride_do_h, stride_do_m, 1], [1, BLOCK_M, BLOCK_D]))
    else:
        queries = (Q_b, stride_q_h, stride_q_m)
        grads = (DO_b, stride_do_h, stride_do_m)
    mask = (Mask_b, stride_mask_h, stride_mask_m, stride_mask_n, Codes_col, stride_map_h, row_stride)
    dropout = (dropout_p, dropout_threshold, seed)
    # a kv group with rows of huge scores (module docstring) takes every query tile through
    # the first loop, with per-element masks, which scales P by its rows' r
    exact_blocks = tl.cdiv(Lq, EXACT_ROWS)
    rescale = _any_set(Exact + (off_b * H + off_hkv * GROUP) * exact_blocks, GROUP * exact_blocks)
    split = tl.where(rescale, end, split)
    mid = tl.where(rescale, end, mid)
    bounds = (lo, split, mid, end)
    if UNMASKED_COPY and unmasked:
        dk, dv = _attention_bwd_dkdv_loops(
            (dk, dv), k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, rescale, bounds,
            Lq, causal_offset, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, 0, IS_CAUSAL, HAS_DROPOUT,
            OUTPUT, DOT_FP32, INPUT_PRECISION, TMA, SOFTCAP)
    else:
        dk, dv = _attention_bwd_dkdv_loops(
            (dk, dv), k, v, tile, queries, grads, mask, stats, dropout, off_b, heads, rescale, bounds,
            Lq, causal_offset, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT,
            OUTPUT, DOT_FP32, INPUT_PRECISION, TMA, SOFTCAP)

    dk = dk * scale
    if HAS_DROPOUT:  # the loops' P is unscaled (_attention_bwd_dkdv_inner)
        dv = dv * (1.0 / (1.0 - dropout_p))
    store_ok = (cols < Lk)[:, None]
    if MASK_D:
        store_ok = store_ok & d_ok[None, :]
    if OUTPUT != "dv":
        tl.store(DK + off_b * stride_dk_b + off_hkv * stride_dk_h + start_n64 * stride_dk_n
                 + cols_local[:, None] * stride_dk_n + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=store_ok)
    if OUTPUT != "dk":
        tl.store(DV + off_b * stride_dv_b + off_hkv * stride_dv_h + start_n64 * stride_dv_n
                 + cols_local[:, None] * stride_dv_n + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=store_ok)


@triton.jit
def _attention_bwd_dq_inner(
    dq,  # (BLOCK_M, BLOCK_D) fp32 accumulator
    query_rows,  # (q, do, row_hi, delta, r): query tile, its output gradient, hi, delta and r rows
    tile,  # (offs_m, row_ok, d_ok): query rows (BLOCK_M,), rows < Lq, head-dim lanes < HEAD_DIM
    keys, values,  # (K_head, stride_k_n), (V_head, stride_v_n): this (batch, kv head) at key 0
    mask,  # as _attention_fwd_inner's
    dmask,  # (DMask_rows, Lk): its gradient at the same place, contiguous rows of Lk keys
    dropout,  # (dropout_p, dropout_threshold, seed, the query tile's first row)
    off_b, off_h,  # batch and head (the dropout mask's counter)
    lo, hi, kv_len, causal_offset, qk_scale,  # key tiles [lo, hi); keys < kv_len exist
    index,  # as _attention_fwd_inner's
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
    ELEMENT_MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    LISTED: tl.constexpr = False, LIST_TILE: tl.constexpr = MAP_TILE, TMA: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,
):
    q, do, row_hi, delta, r = query_rows
    offs_m, row_ok, d_ok = tile
    K_head, stride_k_n = keys[0], keys[1]
    V_head, stride_v_n = values[0], values[1]
    DMask_rows, Lk = dmask
    dropout_p, dropout_threshold, seed, start_m = dropout
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_M)
    SUB: tl.constexpr = LIST_TILE // BLOCK_N
    window = _list_window(index, hi // SUB) if LISTED else (0, 0)
    for it in range(lo, hi, 1 if LISTED else BLOCK_N):
        start_n, live, dense = _loop_tile(it, window, mask[3], BLOCK_N, MASK_KIND, LISTED, LIST_TILE)
        # v is loaded before the scores are computed: computing them first, through
        # _key_tile_scores, made several shipped builds spill (compile-check)
        start_n64 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        col_ok = cols < kv_len
        # as the forward's: nothing of a listed tile the mask forbids entirely
        SKIP_DEAD: tl.constexpr = LISTED and MASK_KIND != 0
        load_ok = tl.where(live, col_ok, False) if SKIP_DEAD else col_ok
        if TMA:
            k = keys[2].load([start_n, 0])
            v = values[2].load([start_n, 0])
        else:
            k = _load_tile(K_head + start_n64 * stride_k_n + offs_n[:, None] * stride_k_n + offs_d[None, :],
                           load_ok, d_ok, ELEMENT_MASKED or SKIP_DEAD, MASK_D)
            v = _load_tile(V_head + start_n64 * stride_v_n + offs_n[:, None] * stride_v_n + offs_d[None, :],
                           load_ok, d_ok, ELEMENT_MASKED or SKIP_DEAD, MASK_D)
        s, g = _masked_scores(q, k, tile, (start_n64, cols, col_ok), mask, dense, causal_offset, qk_scale,
                              BLOCK_M, BLOCK_N, MASK_KIND, IS_CAUSAL, ELEMENT_MASKED, DOT_FP32, INPUT_PRECISION,
                              False, SKIP_DEAD and MASK_KIND == 1, SOFTCAP)
        p = tl.math.exp2(s - row_hi[:, None])
        if SOFTCAP > 0 and MASK_KIND != 2:
            # without a float mask the capped scores give r back (masked ones, -inf, give r = 1
            # and the factor 0): g's tile need not live through the masking
            r_s = tl.minimum((s - SOFTCAP * LOG2E) * (-0.5 / (SOFTCAP * LOG2E)), 1.0)
            g = 4.0 * r_s * (1.0 - r_s)
        if SOFTCAP > 0 and not MASK_GRAD:  # dS's factor 1 - tanh^2 folded into P, as dK/dV does
            p = p * g
        dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_FP32, INPUT_PRECISION)
        if HAS_DROPOUT:
            keep = _dropout_keep_tile(seed, dropout_threshold, off_b, off_h, start_m, start_n, BLOCK_M, BLOCK_N, False)
        if HAS_DROPOUT and BLOCK_D <= 128:  # a select and an FMA per score: the scaled kept dP, less delta
            ds = p * (tl.where(keep, dp, 0.0) * (1.0 / (1.0 - dropout_p)) - delta[:, None])
        else:  # head dims of 256 spill in that form (compile-check)
            if HAS_DROPOUT:
                dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
            ds = p * (dp - delta[:, None])
        if MASK_GRAD:
            # every (row, column) is visited by exactly one program: plain stores, zeros elsewhere
            tl.store(DMask_rows + start_n64 + rows[:, None] * Lk + offs_n[None, :], ds * r[:, None],
                     mask=row_ok[:, None] & (cols < Lk)[None, :])
        if SOFTCAP > 0 and MASK_GRAD:  # the products' gradient; the float mask's is the one before the cap's
            ds = ds * g
        dq = _dot(ds.to(k.dtype), k, dq, DOT_FP32, INPUT_PRECISION)
        if LISTED:
            window = _list_window_step(window, index, hi // SUB, it, SUB)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    Q,  # (B, H, Lq, D) queries, stride(-1) == 1
    K, V,  # (B, Hkv, Lk, D) keys and values, stride(-1) == 1
    DO,  # (B, H, Lq, D) output gradient, stride(-1) == 1
    Out,  # (B, H, Lq, D) forward output, stride(-1) == 1
    Lse,  # (B, H, Lq) fp32 log-sum-exp of the forward, contiguous
    Hi, Delta, R,  # (B, H, Lq) fp32, contiguous, written: hi, r delta and r (module docstring)
    Exact,  # (B, H, cdiv(Lq, EXACT_ROWS)) int8, contiguous, written: whether those rows have one of huge scores
    DQ,  # (B, H, Lq, D) gradient, written
    DMask,  # (B, H, Lq, Lk) fp32 contiguous gradient of a float mask (MASK_GRAD), zero-filled
    Mask,  # (B, H, Lq, Lk) dense mask read through strides, or unused
    TileMap,  # its tile map read through strides, or unused
    Lists,  # its tile lists read through strides, or unused
    KeyLengths,  # (B,) int32, or unused
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_m,
    stride_o_b, stride_o_h, stride_o_m,
    stride_dq_b, stride_dq_h, stride_dq_m,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_map_b, stride_map_h, stride_map_m, map_unit,
    stride_list_b, stride_list_h, stride_list_m, list_tiles,
    H, GROUP, Lq, Lk, causal_offset,
    scale, dropout_p, dropout_threshold, seed,
    LQ_BUCKET, LK_BUCKET,  # unused in the body: the autotuning key
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    MASK_GRAD: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    LIST_TILE: tl.constexpr,  # the tile lists' level (module docstring)
    TMA: tl.constexpr,  # keys and values through tensor descriptors, as the forward's
    SOFTCAP: tl.constexpr = 0.0,  # as the forward's
):
    """dQ of one query tile, after its rows' backward statistics: delta = rowsum(dO * O), hi =
    lse (log2 units) and r = 1, or on the module docstring's rows of huge scores hi = m and r
    = 1 / l, recomputed in a branch the common path never enters. hi, delta and r go to Hi,
    Delta and R, and a flag per EXACT_ROWS rows (BLOCK_M holds whole blocks of them) to Exact,
    for the dK/dV kernel."""
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    off_hkv = off_h // GROUP
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    tl.static_assert(not TMA or (MASK_KIND == 0 and not HAS_DROPOUT), "TMA: the light class only (_tma_layout)")

    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    start_m64 = tl.cast(start_m, tl.int64)

    kv_len, full_end, hi = _query_block_keys(KeyLengths, off_b, Lk, start_m, Lq, causal_offset, BLOCK_M, BLOCK_N,
                                             HAS_KEY_LENGTHS, IS_CAUSAL)  # the forward's tile split

    row_base = (off_b * H + off_h) * Lq
    lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf"))  # rows past Lq: P = 0
    row_hi = lse * LOG2E
    r = tl.full((BLOCK_M,), 1.0, tl.float32)
    exact = row_ok & _exact_rows(lse)
    K_head = K + off_b * stride_k_b + off_hkv * stride_k_h
    V_head = V + off_b * stride_v_b + off_hkv * stride_v_h
    Q_rows = Q + off_b * stride_q_b + off_h * stride_q_h + start_m64 * stride_q_m
    Mask_rows = Mask + off_b * stride_mask_b + off_h * stride_mask_h + start_m64 * stride_mask_m
    Map_bh = TileMap + off_b * stride_map_b + off_h * stride_map_h
    qk_scale = _score_scale(scale, SOFTCAP)
    tile = (offs_m, row_ok, d_ok)
    keys = (K_head, stride_k_n)
    tl.store(Hi + row_base + offs_m, row_hi, mask=row_ok & ~exact)
    tl.store(R + row_base + offs_m, r, mask=row_ok & ~exact)
    if tl.max(exact.to(tl.int32), 0) != 0:
        # hi = m and r = 1 / l of the tile's rows of huge scores, STATS_ROWS rows at a time
        # (the branch keeps its registers few), through Hi and R
        STATS_ROWS: tl.constexpr = BLOCK_M if BLOCK_M < 64 else 64  # wgmma's M where the tile has it
        for sub in range(0, BLOCK_M, STATS_ROWS):
            _exact_rows_stats(Q_rows + sub * stride_q_m, stride_q_m, keys, Mask_rows + sub * stride_mask_m,
                              stride_mask_m, stride_mask_n, Map_bh, stride_map_m, map_unit, Lse + row_base, Hi + row_base,
                              R + row_base, start_m + sub, Lq, hi, kv_len, causal_offset, qk_scale, STATS_ROWS,
                              HEAD_DIM, BLOCK_D, MASK_KIND, IS_CAUSAL, DOT_FP32, INPUT_PRECISION, SOFTCAP)
        tl.debug_barrier()  # the other threads' rows
        row_hi = tl.load(Hi + row_base + offs_m, mask=row_ok, other=float("inf"))
        r = tl.load(R + row_base + offs_m, mask=row_ok, other=1.0)
    o = _load_tile(Out + off_b * stride_o_b + off_h * stride_o_h + start_m64 * stride_o_m
                   + rows[:, None] * stride_o_m + offs_d[None, :], row_ok, d_ok, True, MASK_D)
    do = _load_tile(DO + off_b * stride_do_b + off_h * stride_do_h + start_m64 * stride_do_m
                    + rows[:, None] * stride_do_m + offs_d[None, :], row_ok, d_ok, True, MASK_D)
    # P = r exp2(S - hi) in the rows of huge scores: this kernel's loop leaves r to the rows
    # of dQ at the end, the dK/dV kernel (which sums over rows) scales P
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    q = _load_tile(Q_rows + rows[:, None] * stride_q_m + offs_d[None, :], row_ok, d_ok, True, MASK_D)
    tl.store(Delta + row_base + offs_m, delta, mask=row_ok)
    blocks = tl.cdiv(Lq, EXACT_ROWS)
    block = start_m // EXACT_ROWS + tl.arange(0, BLOCK_M // EXACT_ROWS)
    flags = tl.max(tl.reshape(exact.to(tl.int32), (BLOCK_M // EXACT_ROWS, EXACT_ROWS)), 1)
    tl.store(Exact + (off_b * H + off_h) * blocks + block, flags.to(tl.int8), mask=block < blocks)
    codes_row = _map_row(Map_bh, stride_map_m, map_unit, start_m, BLOCK_M, BLOCK_N)

    DMask_rows = DMask + (row_base + start_m64) * Lk
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    query_rows = (q, do, row_hi, delta, r)
    keys, values = _key_operands(K_head, stride_k_n, V_head, stride_v_n, kv_len, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    mask = _mask_rows(Mask_rows, stride_mask_m, stride_mask_n, codes_row,
                      Lists + off_b * stride_list_b + off_h * stride_list_h, stride_list_m, list_tiles, start_m,
                      MASK_KIND, LIST_TILE)
    dmask = (DMask_rows, Lk)
    dropout = (dropout_p, dropout_threshold, seed, start_m)
    listed_end = 0
    if MASK_KIND != 0 and BLOCK_D <= LISTS_MAX_HEAD_DIM:  # as the forward's (the float mask's gradient is stored
        # on full tiles too)
        full_index, n_full, part_index, n_part, listed_end = _listed_tiles(
            Lists + off_b * stride_list_b + off_h * stride_list_h, stride_list_m, list_tiles, start_m, full_end,
            LIST_TILE)
        SUB: tl.constexpr = LIST_TILE // BLOCK_N
        dq = _attention_bwd_dq_inner(
            dq, query_rows, tile, keys, values, mask, dmask, dropout, off_b, off_h,
            0, n_full * SUB, kv_len, causal_offset, qk_scale, full_index,
            BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, 0, IS_CAUSAL, HAS_DROPOUT, MASK_GRAD, False,
            DOT_FP32, INPUT_PRECISION, True, LIST_TILE, TMA, SOFTCAP,
        )
        dq = _attention_bwd_dq_inner(
            dq, query_rows, tile, keys, values, mask, dmask, dropout, off_b, off_h,
            0, n_part * SUB, kv_len, causal_offset, qk_scale, part_index,
            BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, MASK_GRAD, False,
            DOT_FP32, INPUT_PRECISION, True, LIST_TILE, TMA, SOFTCAP,
        )
    lo1, hi1, lo2, hi2 = _key_loops(mask, listed_end, full_end, hi, BLOCK_M, BLOCK_N, MASK_KIND)
    dq = _attention_bwd_dq_inner(
        dq, query_rows, tile, keys, values, mask, dmask, dropout, off_b, off_h,
        lo1, hi1, kv_len, causal_offset, qk_scale, codes_row,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, MASK_GRAD, False,
        DOT_FP32, INPUT_PRECISION, False, MAP_TILE, TMA, SOFTCAP,
    )
    dq = _attention_bwd_dq_inner(
        dq, query_rows, tile, keys, values, mask, dmask, dropout, off_b, off_h,
        lo2, hi2, kv_len, causal_offset, qk_scale, codes_row,
        BLOCK_M, BLOCK_N, BLOCK_D, MASK_D, MASK_KIND, IS_CAUSAL, HAS_DROPOUT, MASK_GRAD, True,
        DOT_FP32, INPUT_PRECISION, False, MAP_TILE, TMA, SOFTCAP,
    )

    dq = dq * (r * scale)[:, None]
    store_ok = row_ok[:, None]
    if MASK_D:
        store_ok = store_ok & d_ok[None, :]
    tl.store(DQ + off_b * stride_dq_b + off_h * stride_dq_h + start_m64 * stride_dq_m
             + rows[:, None] * stride_dq_m + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=store_ok)


# --------------------------------------------------------------------------------------
# Dropout keep-mask (debug entry point)
# --------------------------------------------------------------------------------------
@triton.jit
def _attention_dropout_mask_kernel(
    Keep,  # (B, H, Lq, Lk) uint8 keep-mask, contiguous, written
    H, Lq, Lk, dropout_threshold, seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Lq
    out_rows = ((off_b * H + off_h) * Lq + offs_m) * Lk
    for start_n in range(0, Lk, BLOCK_N):
        cols = start_n + offs_n
        keep = _dropout_keep_tile(seed, dropout_threshold, off_b, off_h, start_m, start_n, BLOCK_M, BLOCK_N, False)
        tl.store(Keep + out_rows[:, None] + cols[None, :], keep.to(tl.uint8),
                 mask=row_ok[:, None] & (cols < Lk)[None, :])


# --------------------------------------------------------------------------------------
# Autotuned wrappers (GPU): one per kernel, head-dim class and weight
# --------------------------------------------------------------------------------------
# Outputs each launcher allocates whole, in dtypes the other arguments fix (kernels._launch)
_FRESH = {
    _attention_fwd_kernel: ("Out", "Lse"),
    _attention_bwd_dkdv_kernel: ("DK", "DV"),
    _attention_bwd_dq_kernel: ("Hi", "Delta", "R", "Exact", "DQ", "DMask"),
    _attention_dropout_mask_kernel: ("Keep",),
    _attention_tile_map_kernel: ("TileMap",),
    _attention_tile_lists_kernel: ("Lists",),
}


# kernels that may make tensor descriptors on the device (TMA), which take global scratch
_SCRATCH_KERNELS = {_attention_fwd_kernel, _attention_bwd_dq_kernel, _attention_bwd_dkdv_kernel}


def _autotuned(kernel, stage: str, *extra_key: str) -> dict:
    """{(precision class, arch, head-dim class, weight): autotuner over that entry's
    configurations}, and {(..., "pointers"): ...} over BY_POINTERS's entries (_launch)."""
    key = _TUNE_KEY + list(extra_key)
    tables = {(precision, arch, *k): cfgs for precision, stages in _TABLES.items()
              for arch, table in stages[stage].items() for k, cfgs in table.items()}
    tables.update({("16-bit", "sm_90", *k, "pointers"): cfgs for k, cfgs in BY_POINTERS.get(stage, {}).items()})
    tables.update({(precision, arch, *k, "capped"): cfgs for (s, precision, arch, k), cfgs in CAPPED.items()
                   if s == stage})
    return {k: Launcher(triton.autotune(configs=cfgs, key=key)(kernel), _FRESH[kernel], kernel in _SCRATCH_KERNELS)
            for k, cfgs in tables.items()}


_TABLES = {"16-bit": {"fwd": FWD_CONFIGS, "dkdv": BWD_DKDV_CONFIGS, "dq": BWD_DQ_CONFIGS},
           "fp32": {"fwd": FWD_CONFIGS_FP32, "dkdv": BWD_DKDV_CONFIGS_FP32, "dq": BWD_DQ_CONFIGS_FP32}}
_FWD_TUNED = _autotuned(_attention_fwd_kernel, "fwd", "FOLD_SCALE", "TMA")
_DKDV_TUNED = _autotuned(_attention_bwd_dkdv_kernel, "dkdv", "OUTPUT", "TMA")
_DQ_TUNED = _autotuned(_attention_bwd_dq_kernel, "dq", "MASK_GRAD", "TMA")


# --------------------------------------------------------------------------------------
# Launchers (the backend interface of fasttrans.backends)
# --------------------------------------------------------------------------------------
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    # read at launch time: the test suite switches the interpreter on before importing triton
    return getenv("TRITON_INTERPRET") == "1"


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"q: the triton attention kernels take float16, bfloat16 or float32, got {q.dtype} "
            "(float64 runs on the reference and extension backends)"
        )


_PLAIN = {kernel: Launcher(kernel, fresh, kernel in _SCRATCH_KERNELS) for kernel, fresh in _FRESH.items()}

# The tiles of the attention kernels' loops through tensor descriptors (see _tma_layout). The
# tests turn it on under the interpreter, which runs descriptors too, to check the route's results.
TMA_ENABLED = getenv("FASTTRANS_TMA") != "0" and hasattr(tl, "make_tensor_descriptor")
TMA_UNDER_INTERPRETER = False
# head dims up to which dK/dV loads through TMA: at 256 its loop took more instructions with TMA
# than by pointers (compile-check)
DKDV_TMA_MAX_HEAD_DIM = 128


def _tma_layout(a: torch.Tensor, b: torch.Tensor, spec: Spec, max_head_dim: int = 256) -> bool:
    """Whether a kernel loads the two (B, heads, L, D) tensors its loop walks (the forward's
    and dQ's keys and values, dK/dV's queries and output gradients) through tensor
    descriptors (the Tensor Memory Accelerator): on compute capability 9 and above, in 16
    bits, in the light class (no dense mask, no dropout: the builds compile-check holds to
    the loop goals; with dropout, TMA's loops took more instructions), for padded head dims
    up to ``max_head_dim``, when every head of both starts and every row steps on a 16-byte
    boundary, as TMA requires. Otherwise, or with FASTTRANS_TMA=0, by pointer loads
    (cp.async). Decided when a call site is made: the site's key holds what it depends on."""
    c = spec.constexprs
    if _class_weight(c) != "light" or c["BLOCK_D"] > max_head_dim:
        return False
    if _interpreting():
        if not TMA_UNDER_INTERPRETER:
            return False
    elif not TMA_ENABLED or a.dtype == torch.float32 or _gpu_arch(a.device) != "sm_90":
        return False
    size = a.element_size()
    return all(_data_ptr(t) % 16 == 0 and all(stride > 0 and stride * size % 16 == 0 for stride in t.stride()[:3])
               for t in (a, b))


# Launch specs (constexprs and options) are made once per configuration and derived ones
# cached, so a launch passes the same Spec object each time (plans are keyed by identity).
@functools.lru_cache(maxsize=None)
def _spec_with(spec: Spec, **constexprs) -> Spec:
    return Spec({**spec.constexprs, **constexprs}, **spec.options)


@functools.lru_cache(maxsize=None)
def _spec_for_config(spec: Spec, cfg: triton.Config) -> Spec:
    return Spec({**spec.constexprs, **cfg.kwargs}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


_NO_CONSTEXPRS = Spec({})


def _run(kernel, cfg: triton.Config, grid, args, spec: Spec):
    """Run ``kernel`` with one fixed configuration (the caller holds the device guard);
    returns the bound launch (Launcher.bind) for later calls of the same site."""
    return _PLAIN[kernel].bind(grid(cfg.kwargs), args, _spec_for_config(spec, cfg), args[0].device.index)


def _launch(tuned: dict, kernel, stage: str, grid, args, spec: Spec):
    """Run ``kernel`` with the interpreter's fixed configuration, or its GPU autotuner;
    returns the bound launch (Launcher.bind) for later calls of the same site.

    ``grid`` maps the launch meta-parameters (BLOCK_M, BLOCK_N) to the launch grid.
    """
    if _interpreting():
        return _run(kernel, INTERPRETER_CONFIGS[stage], grid, args, spec)
    q = args[0]  # every launch passes q first
    arch, precision = _gpu_arch(q.device), _precision_class(q.dtype)
    c = spec.constexprs
    cls = _table_class(_TABLES[precision][stage][arch], c["BLOCK_D"], _class_weight(c))
    if precision == "fp32" and cls in FP32_IEEE_CLASSES[stage][arch]:
        spec = _spec_with(spec, INPUT_PRECISION="ieee")
    key = (precision, arch, *cls)
    if arch == "sm_90" and precision == "16-bit" and not c["TMA"] and cls in BY_POINTERS.get(stage, ()):
        key += ("pointers",)  # tiles chosen for TMA's loops that spill loading by pointers
    if c.get("SOFTCAP", 0) > 0 and (stage, precision, arch, cls) in CAPPED:
        key += ("capped",)
    return tuned[key].bind(grid, args, spec, q.device.index)


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for q/k/v of ``dtype`` (see the module docstring): 3xTF32 for
    fp32, single TF32 once torch's CUDA matmuls may use TF32 for fp32; 16-bit operands ignore
    it. Read at every launch, like torch reads its setting at every matmul."""
    if dtype != torch.float32:
        return "ieee"
    return "tf32" if _tf32_allowed() else "tf32x3"


def _tf32_allowed() -> bool:
    """Whether torch's CUDA matmuls may run fp32 as TF32, by whichever API the user set it.

    torch >= 2.9 has ``torch.backends.cuda.matmul.fp32_precision`` ("tf32", "ieee", or "none":
    inherit ``torch.backends.fp32_precision``), which also reflects the legacy ``allow_tf32`` and
    ``torch.set_float32_matmul_precision``; reading the legacy flag after the new API was
    used raises a RuntimeError there, so it is read only on an older torch. The settings are
    read through the C getters behind those attributes where torch has them, which skip the
    attribute's Python layer.
    """
    if _fp32_precision is None:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    precision = _fp32_precision("cuda", "matmul")
    if precision == "none":
        precision = _fp32_precision("generic", "all")
    return precision == "tf32"


def _precision_getter():
    """torch's C getter of an fp32 precision setting, or None before torch had them."""
    if getattr(torch.backends.cuda.matmul, "fp32_precision", None) is None:
        return None
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is not None and getter("cuda", "matmul") == torch.backends.cuda.matmul.fp32_precision:
        return getter
    return lambda backend, op: (torch.backends.cuda.matmul.fp32_precision if backend == "cuda"
                                else getattr(torch.backends, "fp32_precision", "none"))


_fp32_precision = _precision_getter()


def _mask_operand(attn_mask: torch.Tensor | None, q: torch.Tensor):
    """(tensor, MASK_KIND, strides) for the kernels; a bool mask is read as uint8 (same bytes)."""
    if attn_mask is None:
        return q, MASK_NONE, (0, 0, 0, 0)
    if attn_mask.dtype == torch.bool:
        return attn_mask.view(torch.uint8), MASK_BOOL, attn_mask.stride()
    return attn_mask, MASK_FLOAT, attn_mask.stride()


# --------------------------------------------------------------------------------------
# Dense-mask tile maps
# --------------------------------------------------------------------------------------
_TILE_MAP_CONFIG = TILE_MAP_CONFIG
_NO_MAP = (0, 0, 0, 0, 0, 0, 0, 0)  # map and list strides, unit and tiles without a dense mask


def _map_ints(geometry) -> tuple:
    """The kernels' integers of a tile map and its lists: the map's strides and unit, the
    lists' strides and tiles (_map_geometry); zeros without a dense mask."""
    return _NO_MAP if geometry is None else (*geometry[3], *geometry[4][3])


def _list_tile() -> int:
    """The tile lists' level (LIST_TILE): the interpreter's own, MAP_TILE on a GPU."""
    return LIST_TILE_INTERPRETER if _interpreting() else MAP_TILE.value


def _list_width(tiles: int) -> int:
    """A tile row's int32 entries in the tile lists: 4 tiles + 2, padded to a multiple of 16
    (the strides Triton then specialises as such)."""
    return cdiv(4 * tiles + 2, 16) * 16


def _bits_words(tiles: int, list_tile: int) -> int:
    """The int32 words of one query row of a bool mask's bits: four per 64 of the tile lists'
    columns, 16 bits each (_attention_tile_lists_kernel writes them, _mask_bits_rows finds them)."""
    return cdiv(tiles * list_tile, 64) * 4


def _list_row(mask_kind: int, tiles: int, list_tile: int) -> int:
    """A tile row's int32 words in the tile lists: its entries, then for a bool mask the bits
    of its list_tile query rows."""
    return _list_width(tiles) + (list_tile * _bits_words(tiles, list_tile) if mask_kind == MASK_BOOL else 0)


def _map_geometry(mask_kind: int, mstride: tuple, B: int, H: int, Lq: int, Lk: int):
    """The tile map of a dense mask with broadcast strides ``mstride`` at (B, H, Lq, Lk):
    (mask kind, mstride, (Bm, Hm, CM, CN), (stride_b, stride_h, stride_m, unit), lists); CM x
    CN cells at the MAP_CELL level, unit = CM CN / 64, each (batch, head) 225 units of codes
    (_map_level). Dims the mask broadcasts over (stride 0) have one entry with stride 0, the
    batch, head and query ones, so that a key-padding mask (B, 1, 1, Lk) maps one block row.
    lists = (LIST_TILE, rows, tiles, (stride_b, stride_h, stride_m, tiles)): the tile lists'
    level, its tile rows and columns, and the strides the kernels read them by."""
    Bm, Hm = (B if mstride[0] else 1), (H if mstride[1] else 1)
    tile, cells = MAP_TILE.value, MAP_TILE.value // MAP_CELL.value
    CM = cdiv(Lq, tile) * cells if mstride[2] else cells
    CN = cdiv(Lk, tile) * cells
    unit = CM * CN // 64
    strides = (Hm * 225 * unit if mstride[0] else 0, 225 * unit if mstride[1] else 0, CN if mstride[2] else 0, unit)
    list_tile = _list_tile()
    rows, tiles = CM * MAP_CELL.value // list_tile, CN * MAP_CELL.value // list_tile
    width = _list_row(mask_kind, tiles, list_tile)
    lists = (list_tile, rows, tiles, (Hm * rows * width if mstride[0] else 0, rows * width if mstride[1] else 0,
                                      width if mstride[2] else 0, tiles))
    return mask_kind, mstride, (Bm, Hm, CM, CN), strides, lists


# The map's two launches, bound on their first call per (geometry, mask signature, Lq, Lk):
# a model's masks of one shape (a new tensor every forward) launch them directly.
_MAP_LAUNCHES: dict = {}


def _build_tile_map(mask: torch.Tensor, geometry, Lq: int, Lk: int) -> torch.Tensor:
    """The int8 tile map of ``mask`` (the kernels' operand), built on mask's device."""
    kind, mstride, (Bm, Hm, CM, CN), (_, _, _, unit), _ = geometry
    tile_map = torch.empty((Bm, Hm, 225 * unit), dtype=torch.int8, device=mask.device)
    args = (tile_map, mask, *mstride, Hm, Lq, Lk, CN, unit)
    key = ("map", geometry, sig(mask), Lq, Lk)
    launch = _MAP_LAUNCHES.get(key)
    with on_device(mask):
        if launch is not None:
            launch(args)
        else:
            cells = MAP_TILE.value // MAP_CELL.value
            remember(_MAP_LAUNCHES, key, _run(_attention_tile_map_kernel, _TILE_MAP_CONFIG,
                                              lambda meta: (CM // cells, CN // cells, Bm * Hm), args,
                                              _tile_map_spec(kind)))
    return tile_map


def _build_tile_lists(codes: torch.Tensor, mask: torch.Tensor, geometry, Lq: int, Lk: int) -> torch.Tensor:
    """The int32 tile lists (module docstring) of the tile map ``codes``, with a bool mask's
    bits (``mask``: the kernels' operand), on codes' device."""
    kind, mstride, (Bm, Hm, _, _), (_, _, _, unit), (list_tile, rows, tiles, _) = geometry
    width = _list_row(kind, tiles, list_tile)
    lists = torch.empty((Bm, Hm, rows, width), dtype=torch.int32, device=codes.device)
    bits = kind == MASK_BOOL  # only a bool mask is read, for its bits (codes: a placeholder otherwise)
    read = (mask, *mstride, Hm, Lq if mstride[2] else rows * list_tile, Lk) if bits else (codes, 0, 0, 0, 0, Hm, 0, 0)
    args = (lists, codes, *read, rows, tiles, width, unit)
    # codes and lists: fresh, contiguous; a bool mask's layout and lengths specialise the launch too
    key = ("lists", geometry, sig(mask), Lq, Lk) if bits else ("lists", geometry, codes.get_device())
    launch = _MAP_LAUNCHES.get(key)
    with on_device(codes):
        if launch is not None:
            launch(args)
        else:
            remember(_MAP_LAUNCHES, key, _run(_attention_tile_lists_kernel, _TILE_MAP_CONFIG,
                                              lambda meta: (rows, Bm * Hm), args,
                                              _tile_lists_spec(list_tile, bits)))
    return lists


@functools.lru_cache(maxsize=None)
def _tile_map_spec(kind: int) -> Spec:
    return Spec(dict(MASK_KIND=kind))


@functools.lru_cache(maxsize=None)
def _tile_lists_spec(list_tile: int, pack_bits: bool) -> Spec:
    return Spec(dict(LIST_TILE=list_tile, PACK_BITS=pack_bits))


# One map per dense mask, reused while the mask is the same tensor object, unchanged (its
# version counter) and read at the same geometry: every layer of a model that shares a mask,
# and the backward, read the map its first use built. Entries leave with their mask.
_TILE_MAPS: dict = {}
_TILE_MAPS_MAX = 64


def _forget_tile_map(key: int, ref) -> None:
    entry = _TILE_MAPS.get(key)
    if entry is not None and entry[0] is ref:
        del _TILE_MAPS[key]


def tile_map(attn_mask: torch.Tensor, mask: torch.Tensor, geometry, Lq: int, Lk: int) -> tuple:
    """(tile map, tile lists) of ``attn_mask`` (``mask``: the kernels' view of it) at
    ``geometry`` (_map_geometry), built on first use and cached with the tensor attn_mask is a
    view of (the per-call views of the layers above share it) at the same address and
    geometry. Inference tensors (no version counter) and CUDA graph captures (whose replays
    must rebuild them) build them on every call."""
    owner = attn_mask._base if attn_mask._base is not None else attn_mask
    key, where = id(owner), (geometry, mask.data_ptr())
    try:
        version = owner._version
    except RuntimeError:  # an inference tensor: in-place changes cannot be seen
        version = None
    entry = _TILE_MAPS.get(key)
    if entry is not None and entry[0]() is owner and entry[1] == version and entry[2] == where \
            and version is not None:
        return entry[3]
    codes = _build_tile_map(mask, geometry, Lq, Lk)
    built = codes, _build_tile_lists(codes, mask, geometry, Lq, Lk)
    if version is not None and not (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        if len(_TILE_MAPS) >= _TILE_MAPS_MAX:
            del _TILE_MAPS[next(iter(_TILE_MAPS))]
        _TILE_MAPS[key] = (weakref.ref(owner, functools.partial(_forget_tile_map, key)), version, where, built)
    return built


def _tile_map_of(attn_mask: torch.Tensor, shape: tuple) -> tuple:
    """(codes, lists, geometry) of a dense mask broadcast to ``shape``, as the kernels build and
    cache them (the backend interfaces below)."""
    B, H, Lq, Lk = shape
    full = attn_mask.expand(B, H, Lq, Lk)
    operand, kind, mstride = _mask_operand(full, full)
    geometry = _map_geometry(kind, mstride, B, H, Lq, Lk)
    with on_device(full):
        codes, lists = tile_map(attn_mask, operand, geometry, Lq, Lk)
    return codes, lists, geometry


def attention_tile_map(attn_mask: torch.Tensor, shape: tuple, tile: tuple = (16, 16)) -> torch.Tensor:
    """Backend interface (tests, debugging): the codes the kernels read for (BLOCK_M, BLOCK_N)
    = ``tile`` tiles of a dense mask broadcast to ``shape`` = (B, H, Lq, Lk), an int8 (B or 1,
    H or 1, tile rows, tile columns) tensor of MAP_LIVE | MAP_DENSE codes (one tile row where
    the mask's rows broadcast), padded with 0 to whole MAP_TILE blocks; built and cached as
    the kernels build and cache it."""
    codes, _, geometry = _tile_map_of(attn_mask, shape)
    _, _, (Bm, Hm, CM, CN), (_, _, stride_m, unit), _ = geometry
    a, b = tile[0] // MAP_CELL.value, tile[1] // MAP_CELL.value
    start = unit * (15 * (16 - 16 // a) + 128 // a - 128 // (a * b))
    rows, cols = (CM // a if stride_m else 1), CN // b
    return codes[:, :, start:start + CM // a * cols].view(Bm, Hm, CM // a, cols)[:, :, :rows]


def attention_tile_lists(attn_mask: torch.Tensor, shape: tuple) -> tuple:
    """Backend interface (tests, debugging): the tile lists the forward and dQ kernels read for
    a dense mask broadcast to ``shape`` = (B, H, Lq, Lk), built and cached as the kernels build
    and cache them: (list tile, full counts, partial counts, full indices, partial indices),
    the counts (B or 1, H or 1, tile rows, tiles + 1) int32 prefix counts, the indices (..., tiles)
    with -1 past each row's count; tile rows and columns of the list tile over the mask padded
    to whole MAP_TILE blocks (one tile row where the mask's rows broadcast)."""
    _, lists, geometry = _tile_map_of(attn_mask, shape)
    list_tile, rows, tiles, (_, _, stride_m, _) = geometry[4]
    lists = lists[:, :, :rows if stride_m else 1]
    full_count, part_count = lists[..., :tiles + 1], lists[..., tiles + 1:2 * (tiles + 1)]
    at = torch.arange(tiles, device=lists.device)
    full_index = lists[..., 2 * (tiles + 1):2 * (tiles + 1) + tiles]
    part_index = lists[..., 2 * (tiles + 1) + tiles:2 * (tiles + 1) + 2 * tiles]
    full_index = torch.where(at < full_count[..., -1:], full_index, -1)
    part_index = torch.where(at < part_count[..., -1:], part_index, -1)
    return list_tile, full_count, part_count, full_index, part_index


def _lengths_operand(key_lengths: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels read key_lengths[b] at offset b: contiguous int32 (q as a placeholder when absent)."""
    if key_lengths is None:
        return q
    return key_lengths.to(device=q.device, dtype=torch.int32).contiguous()


def _features(q, attn_mask, key_lengths, is_causal, dropout_p) -> Spec:
    """The launch's constexprs from its inputs (shared: derive others with _spec_with)."""
    mask_kind = MASK_NONE if attn_mask is None else MASK_BOOL if attn_mask.dtype == torch.bool else MASK_FLOAT
    dtype = q.dtype
    # the TF32 flag is read per call, as torch reads it per matmul; 16-bit inputs ignore it.
    # The interpreter's bf16 tl.dot is wrong: DOT_FP32 upcasts the operands there.
    precision = input_precision(dtype) if dtype == torch.float32 else "ieee"
    return _features_of(q.shape[3], mask_kind, key_lengths is not None, bool(is_causal), dropout_p > 0.0,
                        dtype == torch.bfloat16 and _interpreting(), precision)


@functools.lru_cache(maxsize=None)
def _features_of(D: int, mask_kind: int, has_key_lengths: bool, is_causal: bool, has_dropout: bool,
                 dot_fp32: bool, input_precision: str) -> Spec:
    return Spec(dict(
        HEAD_DIM=D, BLOCK_D=max(16, next_power_of_2(D)), MASK_KIND=mask_kind,
        HAS_KEY_LENGTHS=has_key_lengths, IS_CAUSAL=is_causal, HAS_DROPOUT=has_dropout,
        DOT_FP32=dot_fp32, INPUT_PRECISION=input_precision,
    ))


def _call_flags(q, dropout_p, seed) -> tuple:
    """The part of a site's key (kernels/_launch.py, "Call sites") that is not in the
    tensors: dropout_p, the seed's integer class only with dropout, the TF32 setting only for
    fp32 (read per call, as torch reads it per matmul), and whether the interpreter runs."""
    dtype = q.dtype
    return (dropout_p, int_class(int(seed)) if dropout_p > 0.0 else None,
            input_precision(dtype) if dtype == torch.float32 else None, _interpreting())


def _site_key(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, seed) -> tuple:
    """What the backward's launches depend on beyond its tensors' addresses (the forward keys
    k and v without their length, see attention_fwd)."""
    return (sig(q), sig(k), sig(v), sig(attn_mask), sig(key_lengths), bool(is_causal), int(causal_offset),
            _call_flags(q, dropout_p, seed))


_FWD_SITES: dict = {}
_BWD_SITES: dict = {}
_INF = float("inf")
_data_ptr = torch.Tensor.data_ptr
_empty_like = torch.empty_like


def _kv_signature(t: torch.Tensor) -> tuple:
    """A key or value tensor's signature without its length, which the forward takes as an
    integer argument: decoding steps over a growing key/value cache share one site."""
    B, H, _, D = t.shape
    return B, H, D, t.stride(), t.dtype, t.get_device(), _data_ptr(t) & 15


def _fwd_key(q, k, v, attn_mask, key_lengths, is_causal, causal_offset: int, dropout_p, scale, seed,
             softcap=0.0) -> tuple:
    """The forward site's key: Lk and the causal offset by their integer classes and Lk's
    tuning bucket (see _kv_signature), whether scale > 0 (FOLD_SCALE), and the cap (SOFTCAP)."""
    Lk = k.shape[2]
    return (sig(q), _kv_signature(k), _kv_signature(v), sig(attn_mask), sig(key_lengths), bool(is_causal),
            int_class(Lk), _bucket(Lk), int_class(causal_offset), scale > 0, _call_flags(q, dropout_p, seed),
            softcap)


def _softcap_constexprs(softcap) -> dict:
    """The kernels' SOFTCAP where a call caps its scores (the kernels specialise on its value:
    a model's layers share one), none otherwise."""
    return {"SOFTCAP": float(softcap)} if softcap else {}


def attention_fwd(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap=0.0):
    """Backend interface: (out (B, H, Lq, D) in q.dtype, lse (B, H, Lq) fp32; +inf on empty rows)."""
    Lk, causal_offset = k.shape[2], int(causal_offset)
    key = _fwd_key(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap)
    site = _FWD_SITES.get(key)
    (B, H, Lq, D), q_strides = key[0][0], key[0][1]
    # empty_like costs the host half of what torch.empty(shape, dtype=, device=) does
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if Lk == 0:  # no key at all: every row is empty
        return out.zero_(), lse.fill_(_INF)
    if site is None:
        _check_dtype(q)
        # the integers the key fixes: strides, sizes, dropout threshold, tuning buckets
        Hkv = k.shape[1]
        _, kind, mstride = _mask_operand(attn_mask, q)
        geometry = None if attn_mask is None else _map_geometry(kind, mstride, B, H, Lq, Lk)
        ints = (*k.stride()[:3], *v.stride()[:3], H * Lq * D, Lq * D, D, *mstride,
                *_map_ints(geometry), H, H // Hkv, Lq)
        tail = (attention_dropout_threshold(dropout_p), int(seed), _bucket(Lq), _bucket(Lk))
    else:
        launch, ints, tail, geometry = site
        if dropout_p > 0.0:
            tail = (tail[0], int(seed), tail[2], tail[3])
    mask = q if attn_mask is None else attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
    tmap, lists = (q, q) if attn_mask is None else tile_map(attn_mask, mask, geometry, Lq, Lk)
    args = (q, k, v, out, lse, mask, tmap, lists, q if key_lengths is None else _lengths_operand(key_lengths, q),
            *q_strides[:3], *ints, Lk, causal_offset, float(scale), float(dropout_p), *tail)
    with on_device(q):
        if site is not None:
            launch(args)
        else:
            spec = _features(q, attn_mask, key_lengths, is_causal, dropout_p)
            # the row maximum before the scale, which must be positive to commute with it (and
            # come after any cap)
            spec = _spec_with(spec, FOLD_SCALE=scale > 0 and not softcap, LIST_TILE=_list_tile(),
                              TMA=_tma_layout(k, v, spec), **_softcap_constexprs(softcap))
            launch = _launch(_FWD_TUNED, _attention_fwd_kernel, "fwd", lambda meta: (cdiv(Lq, meta["BLOCK_M"]), H, B),
                             args, spec)
            remember(_FWD_SITES, key, (launch, ints, tail, geometry))
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
                  dropout_p, scale, seed, mask_grad, softcap=0.0):
    """Backend interface: (dq, dk, dv, dmask fp32 (B, H, Lq, Lk) or None), deterministic."""
    lse = lse.contiguous()
    key = (_site_key(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, seed), sig(dout), sig(out),
           sig(lse), bool(mask_grad), softcap)
    return _attention_bwd(key, _BWD_SITES, dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal,
                          causal_offset, dropout_p, scale, seed, mask_grad, softcap)


def _attention_bwd(key, sites: dict, dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
                   dropout_p, scale, seed, mask_grad, softcap=0.0):
    """The backward, its launches looked up in ``sites`` under ``key``: a key that fixes
    every argument but the tensors' addresses, the seed and (on a site's first call, which
    reads its strides) the full-shape mask (see kernels/_launch.py, "Call sites")."""
    site = sites.get(key)
    if site is None:
        _check_dtype(q)
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        if Lk == 0:
            return (q.new_zeros((B, H, Lq, D)), k.new_empty((B, Hkv, 0, D)), v.new_empty((B, Hkv, 0, D)),
                    q.new_zeros((B, H, Lq, 0), dtype=torch.float32) if mask_grad else None)
        # templates of the outputs and workspaces (see expansion)
        like = (expansion(q.dtype, q.device, (B, H, Lq, D)), expansion(k.dtype, k.device, (B, Hkv, Lk, D)),
                expansion(v.dtype, v.device, (B, Hkv, Lk, D)), expansion(torch.float32, q.device, (B, H, Lq)),
                expansion(torch.float32, q.device, (B, H, Lq, Lk)),
                expansion(torch.int8, q.device, (B, H, cdiv(Lq, EXACT_ROWS.value))))
        # the integers the key fixes, per launch: strides (fresh outputs are contiguous), sizes
        contiguous = (H * Lq * D, Lq * D, D)
        qs, ks, vs = q.stride()[:3], k.stride()[:3], v.stride()[:3]
        _, kind, mstride = _mask_operand(attn_mask, q)
        geometry = None if attn_mask is None else _map_geometry(kind, mstride, B, H, Lq, Lk)
        mstride = (*mstride, *_map_ints(geometry))  # with the map's (and the lists', for dQ)
        sizes = (H, H // Hkv, Lq, Lk, int(causal_offset))
        kv_contiguous = (Hkv * Lk * D, Lk * D, D)
        ds = dout.stride()[:3]
        ints = ((*qs, *ks, *vs, *ds, *out.stride()[:3], *contiguous, *mstride, *sizes),
                (*qs, *ks, *vs, *ds, *kv_contiguous, *kv_contiguous, *mstride[:8], *sizes))
        tail = (float(dropout_p), attention_dropout_threshold(dropout_p), int(seed), _bucket(Lq), _bucket(Lk))
    else:
        launches, ints, tail, like, geometry = site
        if dropout_p > 0.0:
            tail = (*tail[:2], int(seed), *tail[3:])
    q_like, k_like, v_like, row_like, mask_like, exact_like = like
    dq, dk, dv = _empty_like(q_like), _empty_like(k_like), _empty_like(v_like)
    # tiles a program skips (above the diagonal, past a key length) are never written: zeros
    dmask = torch.zeros_like(mask_like) if mask_grad else None
    mask = q if attn_mask is None else attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
    tmap, lists = (q, q) if attn_mask is None else tile_map(attn_mask, mask, geometry, q.shape[2], k.shape[2])
    kl = q if key_lengths is None else _lengths_operand(key_lengths, q)
    # per row hi, r delta and r, and the flags of rows of huge scores (the module docstring)
    hi, delta, r, exact = _empty_like(row_like), _empty_like(row_like), _empty_like(row_like), \
        _empty_like(exact_like)
    scale = float(scale)
    args = (  # in launch order: the dK/dV kernel reads what the dQ kernel writes
        (q, k, v, dout, out, lse, hi, delta, r, exact, dq, q if dmask is None else dmask, mask, tmap, lists, kl,
         *ints[0], scale, *tail),
        (q, k, v, dout, r, exact, hi, delta, dk, dv, mask, tmap, kl, *ints[1], scale, *tail),
    )
    with on_device(q):
        if site is not None:
            # dQ (with the rows' statistics), dK/dV (one launch per output group)
            dq_launch, dkdv = launches
            dq_launch(args[0])
            for launch in dkdv:
                launch(args[1])
        else:
            launches = _bwd_first(q, attn_mask, key_lengths, is_causal, dropout_p, mask_grad, args, softcap)
            remember(sites, key, (launches, ints, tail, like, geometry))
    return dq, dk, dv, dmask


def _bwd_first(q, attn_mask, key_lengths, is_causal, dropout_p, mask_grad, args, softcap) -> tuple:
    """The backward's launches on a site's first call: (dQ, dK/dV launches), each run once,
    in that order, and returned bound."""
    B, H, Lq, D = q.shape
    Hkv, Lk = args[1][1].shape[1], args[1][1].shape[2]
    feats = _features(q, attn_mask, key_lengths, is_causal, dropout_p)
    if softcap:
        feats = _spec_with(feats, **_softcap_constexprs(softcap))
    dq_launch = _launch(_DQ_TUNED, _attention_bwd_dq_kernel, "dq", lambda meta: (cdiv(Lq, meta["BLOCK_M"]), H, B),
                        args[0], _spec_with(feats, MASK_GRAD=bool(mask_grad), LIST_TILE=_list_tile(),
                                            TMA=_tma_layout(args[0][1], args[0][2], feats)))
    dkdv = tuple(
        _launch(_DKDV_TUNED, _attention_bwd_dkdv_kernel, "dkdv", lambda meta: (cdiv(Lk, meta["BLOCK_N"]), Hkv, B),
                args[1], _spec_with(feats, OUTPUT=output,
                                    TMA=_tma_layout(args[1][0], args[1][3], feats, DKDV_TMA_MAX_HEAD_DIM)))
        for output in dkdv_outputs(feats.constexprs["BLOCK_D"]))
    return dq_launch, dkdv


def attention_dropout_mask(q, k, dropout_p, seed):
    """Backend interface: the bool (B, H, Lq, Lk) keep-mask attention_fwd uses for ``seed``."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    keep = torch.empty((B, H, Lq, Lk), dtype=torch.uint8, device=q.device)
    if Lk == 0:
        return keep.view(torch.bool)
    cfg = INTERPRETER_CONFIGS["dropout_mask"] if _interpreting() else DROPOUT_MASK_CONFIG
    with on_device(q):
        _run(_attention_dropout_mask_kernel, cfg, lambda meta: (cdiv(Lq, meta["BLOCK_M"]), H, B),
             (keep, H, Lq, Lk, attention_dropout_threshold(dropout_p), int(seed)), _NO_CONSTEXPRS)
    return keep.view(torch.bool)


# --------------------------------------------------------------------------------------
# Public calls (fasttrans.functional's common case, through fasttrans.backends)
# --------------------------------------------------------------------------------------


class AttentionSite:
    """The launches of one kind of public attention call: q (B, H, Lq, D)
    and k, v (B, Hkv, Lk, D) strided with unit inner stride; the mask None, bool, or float in
    q's dtype or fp32, broadcastable to (B, H, Lq, Lk) and read through the strides of that
    broadcast (never expanded per call); key lengths None or (B,) integers. Lk and the
    causal offset are the call's own, within the classes the site was made for (see
    :func:`attention_site`): decoding over a growing key/value cache keeps one site. Dropout
    launches are kept per (dropout_p, the seed's integer class), which Triton specialises
    on. Made by :func:`attention_site`; ``forward`` and ``backward`` launch."""

    __slots__ = ("B", "H", "Lq", "D", "is_causal", "scale", "bool_mask", "lse_like", "kernel", "dropout_kernels",
                 "q_strides", "bwd_sites", "alloc", "dtype", "out_layout", "lse_layout")

    def __init__(self, q, attn_mask, is_causal: bool):
        self.B, self.H, self.Lq, self.D = B, H, Lq, D = q.shape
        self.is_causal = is_causal
        self.scale = 1.0 / math.sqrt(D)  # the default
        self.bool_mask = attn_mask is not None and attn_mask.dtype == torch.bool
        self.lse_like = expansion(torch.float32, q.device, (B, H, Lq))
        # out and lse are allocated contiguous, through the allocator of q's device
        self.alloc, self.dtype = strided_allocator(q.device), q.dtype
        self.out_layout = ((B, H, Lq, D), (H * Lq * D, Lq * D, D, 1))
        self.lse_layout = ((B, H, Lq), (H * Lq, Lq, 1))
        self.kernel = None  # the forward's (launch, ints, tail, map geometry), from its first call
        self.dropout_kernels: dict = {}  # the same with dropout, by (dropout_p, the seed's int_class)
        self.q_strides = q.stride()[:3]
        self.bwd_sites: dict = {}  # backward launches by the output gradient's layout, Lk and offset

    def offset(self, causal_offset: int, Lk: int) -> int:
        """The causal offset clamped to [-Lq, Lk]: the same masks (past Lk - 1 every query sees
        every key, at -Lq or below none sees any), in the int64 range the kernels take."""
        return max(-self.Lq, min(causal_offset, Lk))

    def mask(self, attn_mask, Lk: int):
        """attn_mask at (B, H, Lq, Lk), as the backend interface takes it (a view)."""
        return None if attn_mask is None else attn_mask.expand(self.B, self.H, self.Lq, Lk)

    def lengths(self, key_lengths):
        """key_lengths as the contiguous int32 (B,) tensor the kernels read."""
        return None if key_lengths is None else _lengths_operand(key_lengths, self.lse_like)

    def forward(self, q, k, v, attn_mask, key_lengths, causal_offset: int, scale, dropout_p: float = 0.0,
                seed: int = 0):
        """(out (B, H, Lq, D), lse (B, H, Lq) fp32), as attention_fwd returns them; dropout_p
        a float in [0, 1), seed an int (fasttrans.functional draws it)."""
        kernel = self.kernel if dropout_p == 0.0 else self.dropout_kernels.get((dropout_p, int_class(seed)))
        if kernel is None:
            return self._first(q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed)
        launch, ints, tail, geometry = kernel
        if dropout_p != 0.0:
            tail = (tail[0], seed, tail[2], tail[3])
        Lk = k.shape[2]
        # the mask as it is: the strides of its broadcast are among ints
        mask = q if attn_mask is None else attn_mask.view(torch.uint8) if self.bool_mask else attn_mask
        tmap, lists = (q, q) if attn_mask is None else tile_map(attn_mask, mask, geometry, self.Lq, Lk)
        kl = q if key_lengths is None else (key_lengths if key_lengths.dtype == torch.int32
                                             and key_lengths.is_contiguous() else _lengths_operand(key_lengths, q))
        args = (mask, tmap, lists, kl, *self.q_strides, *ints, Lk,
                max(-self.Lq, min(causal_offset, Lk)),
                self.scale if scale is None else scale, dropout_p, *tail)
        with on_device(q):  # the allocator allocates on the current device
            alloc = self.alloc
            out = alloc(*self.out_layout, self.dtype)
            lse = alloc(*self.lse_layout, torch.float32)
            launch((q, k, v, out, lse) + args)
        return out, lse

    def _first(self, q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed):
        Lk = k.shape[2]
        offset, scale = self.offset(causal_offset, Lk), self.scale if scale is None else scale
        mask, kl = self.mask(attn_mask, Lk), self.lengths(key_lengths)
        out, lse = attention_fwd(q, k, v, mask, kl, self.is_causal, offset, dropout_p, scale, seed)
        # the kernel site just made (absent where attention_fwd keeps none): later calls
        # launch it; its key holds the same classes of Lk and the offset as this site's
        kernel = _FWD_SITES.get(_fwd_key(q, k, v, mask, kl, self.is_causal, offset, dropout_p, scale, seed))
        if dropout_p == 0.0:
            self.kernel = kernel
        elif kernel is not None:
            if len(self.dropout_kernels) >= 8:  # a dropout_p that changes call by call: start over
                self.dropout_kernels.clear()
            self.dropout_kernels[(dropout_p, int_class(seed))] = kernel
        return out, lse

    def backward(self, dout, q, k, v, out, lse, attn_mask, key_lengths, causal_offset: int, scale,
                 dropout_p: float = 0.0, seed: int = 0):
        """(dq, dk, dv) of what :meth:`forward` returned (with its dropout_p and seed). dout
        has out's shape, dtype and device, as autograd hands gradients over; only its layout
        and alignment vary."""
        if dout.stride(3) != 1:
            dout = dout.contiguous()
        Lk = k.shape[2]
        offset = self.offset(causal_offset, Lk)
        key = (dout.stride(), _data_ptr(dout) & 15, Lk, offset,
               None if dropout_p == 0.0 else (dropout_p, int_class(seed)))
        # the full-shape mask only for a first call, which reads its strides
        mask = attn_mask if key in self.bwd_sites else self.mask(attn_mask, Lk)
        dq, dk, dv, _ = _attention_bwd(key, self.bwd_sites, dout, q, k, v, out, lse, mask, self.lengths(key_lengths),
                                       self.is_causal, offset, dropout_p, self.scale if scale is None else scale,
                                       seed, False)
        return dq, dk, dv


_ATTENTION_SITES: dict = {}
_INT32_END = 2**31


def attention_site(q, k, v, attn_mask, key_lengths, is_causal: bool, causal_offset: int, scale: float | None,
                   max_head_dim: int, common_case) -> AttentionSite | None:
    """The :class:`AttentionSite` of a public attention call, or None where
    the call is not of that kind (the general route takes it, and reports what is invalid).
    The tensors must be plain (no subclass), is_causal a bool, causal_offset an int, scale
    None or a finite float. Looked up by the tensors' shapes (k's and v's without their
    length), strides, dtypes, devices and alignment; is_causal; the classes Triton
    specialises Lk and the clamped causal offset on, and Lk's tuning bucket (Lk itself when
    there is a mask, whose shape depends on it); whether scale is given, and if so whether it
    is positive (the forward kernel's FOLD_SCALE); and, for fp32, the
    TF32 setting the kernels follow, and max_head_dim. The first call of a kind asks
    ``common_case(q, k, v, attn_mask, key_lengths, max_head_dim)``
    (fasttrans.backends.common_case) whether the call is of it.
    The values of key lengths are the caller's to check."""
    dtype = q.dtype
    try:
        qsig, Lk = sig(q), k.shape[2]
        if Lk == 0:
            return None
        offset = max(-qsig[0][2], min(causal_offset, Lk))
        # Lk and the offset as Triton specialises integers (kernels/_launch.py, int_class),
        # and Lk's tuning bucket (_bucket) by its bit length
        key = (qsig, _kv_signature(k), _kv_signature(v), sig(attn_mask), sig(key_lengths), is_causal,
               (Lk & 15) == 0, Lk == 1, Lk < _INT32_END, min((Lk - 1).bit_length(), _MAX_BUCKET_BITS),
               (offset & 15) == 0, offset == 1, -_INT32_END <= offset < _INT32_END,
               None if attn_mask is None else Lk, None if scale is None else scale > 0,
               input_precision(dtype) if dtype == torch.float32 else None, max_head_dim)
    except (RuntimeError, IndexError):  # a layout without strides or storage; fewer than three dims
        return None
    site = _ATTENTION_SITES.get(key)
    if site is None:
        ok = dtype in _SUPPORTED_DTYPES and common_case(q, k, v, attn_mask, key_lengths, max_head_dim)
        site = AttentionSite(q, attn_mask, is_causal) if ok else False
        remember(_ATTENTION_SITES, key, site)
    return site or None


# --------------------------------------------------------------------------------------
# Compile targets (python -m fasttrans compile-check; built in kernels/_attention_targets.py)
# --------------------------------------------------------------------------------------
def compile_targets() -> list[dict]:
    """Every kernel in every shipped GPU configuration, for ``python -m fasttrans compile-check``."""
    return _attention_targets.compile_targets(
        fwd=_attention_fwd_kernel, dkdv=_attention_bwd_dkdv_kernel, dq=_attention_bwd_dq_kernel,
        dropout_mask=_attention_dropout_mask_kernel, tile_map=_attention_tile_map_kernel,
        tile_lists=_attention_tile_lists_kernel, list_tile=MAP_TILE.value,
        lists_max_head_dim=LISTS_MAX_HEAD_DIM.value, dkdv_tma_max_head_dim=DKDV_TMA_MAX_HEAD_DIM,
    )
