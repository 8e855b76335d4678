"""Fused LayerNorm, Add & Norm and RMSNorm in Triton: forward and backward.

Rows are the (M, N) view built by fasttrans.functional: ``stride(-1) == 1``, any row stride
(0 included). Inputs are fp32, fp16 or bf16; all arithmetic is fp32 and outputs are in the
input dtype; weight and bias are in the input dtype or fp32 (loaded and upcast either way).

Forward
-------
With a residual, h = x + r is rounded to the input dtype (that rounded h is what the caller
gets back and what the statistics see, exactly as ``x + residual`` in PyTorch), else h = x::

    LayerNorm: mean = h₀ + Σ(h - h₀) / N      var = Σ(h - mean)² / N      xhat = (h - mean) · rstd
    RMSNorm:   mean = 0           var = Σh² / N               xhat = h · rstd
    rstd = 1 / sqrt(var + eps)    y = xhat · w + b

with h₀ the row's first value, so that a row of one repeated value has exactly that mean
(and xhat = 0, as torch). The variance is centred (never E[h²] - E[h]², which cancels
catastrophically when |mean| ≫ std). mean and rstd (fp32, one per row) are saved for the backward.

Rows up to MAX_FUSED_N elements are held in registers: one read of x (and r), one write of
y (and h). Several rows share a program when N is small, so a program always has enough
bytes in flight. Longer rows take the split path: one program per row walks the row in
chunks twice. Pass 1 combines per-chunk statistics with Chan's parallel update (fp32)::

    chunk c: n_c elements, mean_c, M2_c = Σ(h - mean_c)²
    n' = n + n_c      d = mean_c - mean      mean' = mean + d · n_c / n'
    M2' = M2 + M2_c + d² · n · n_c / n'      var = M2 / N

and pass 2 re-reads x (and r, recomputing the same rounded h; re-reading h would read back
what other threads of the same program stored, with no ordering guarantee) to write y.

Backward
--------
With dxhat = dy · w (dy when there is no weight)::

    LayerNorm: dh = rstd · (dxhat - mean(dxhat) - xhat · mean(dxhat · xhat))
    RMSNorm:   dh = rstd · (dxhat - xhat · mean(dxhat · xhat))
    dW = Σ_rows dy · xhat        dB = Σ_rows dy

plus the gradient flowing into the h output, when there is one (the caller reuses dx as the
gradient of the residual: ∂h/∂x = ∂h/∂r = 1).

dx is fused per row. dW and dB are reduced deterministically in two stages, with no atomics
and no locks: stage 1 gives program p a fixed contiguous block of rows and writes its fp32
column sums to row p of a (P, N) partial buffer (P about the number of resident programs
the GPU holds); stage 2 sums the P partials of each column in a fixed order. For rows
longer than MAX_FUSED_N_BWD, stage 1 first walks each of its rows in chunks for the row
sums (Σ dxhat · xhat, Σ dxhat, Σ xhat), stores them, then walks its rows again chunk by
chunk: the two reads of a split forward, and the backward stays two launches (one when a
single program owns every row and the parameters are fp32: the partials are dW and dB).
With fewer rows than the GPU runs programs at once, the chunks are dealt out to groups of
programs (axis 1 of the grid), each recomputing its rows' sums: the rows are then few
enough that the repeated reads come from L2.

Launch configurations (below) follow from the register and spill counts ptxas reports for
sm_80 and sm_90 (``compile_targets()``, checked by ``python -m fasttrans compile-check``);
their speed is measured by benchmarks/ on a GPU.

Limits: fp64 is not supported (the launchers raise TypeError; the reference and extension
backends run it). M and N below 2**31; element offsets are computed in int64.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import (_current_cuda_device, cdiv, device_index, expansion, multiprocessors, next_power_of_2, on_device,
               strided_allocator)
from ._launch import Launcher, Spec, remember, signature as _sig

__all__ = ["norm_fwd", "norm_infer", "norm_bwd", "norm_site", "NormSite", "compile_targets", "MAX_FUSED_N", "MAX_FUSED_N_BWD"]

# --------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------
MAX_FUSED_N = 16384  # longest row the forward holds in registers (16 warps x 128 registers)
# The backward holds more per element (xhat, dxhat and two dW/dB accumulators): at 8192,
# every warp count from 8 to 32 spills on sm_80 or sm_90 for some dtype.
MAX_FUSED_N_BWD = 4096
SPLIT_BLOCK_N = 4096  # column chunk of the split-row forward
SPLIT_NUM_WARPS = 16
# The split backward walks its rows twice in one program (row sums, then dx and dW/dB by
# column chunk): 2048-column chunks, 4 elements per thread per tensor at 16 warps, keep both
# passes within 64 registers with no spills (compile-check), two programs per SM; the
# forward's 4096 do not.
SPLIT_BWD_BLOCK_N = 2048
MIN_BLOCK_N = 64  # narrower rows are padded: one configuration serves every N ≤ 64
TILE_ELEMENTS = 1024  # small rows are packed BLOCK_M to a program until a tile has this many
REDUCE_TILE_ELEMENTS = 2048  # stage-2 dW/dB tile (partials x columns), 16 per thread
REDUCE_MAX_BLOCK_N = 1024
# No load feeds a tl.dot, so software pipelining has nothing to do (the compiled code is the
# same for 1 and 3 stages); launches and compile-check both use 1 so they build one binary.
NUM_STAGES = 1
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_empty_like = torch.empty_like


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """One launch configuration: a (BLOCK_M, BLOCK_N) tile, warps, and whether rows are split."""

    BLOCK_M: int  # rows per tile
    BLOCK_N: int  # columns per tile: the padded row, or a chunk of it when split
    num_warps: int
    split: bool  # rows longer than one tile: chunked two-pass path

    @property
    def name(self) -> str:
        kind = "split" if self.split else "fused"
        return f"{kind}_m{self.BLOCK_M}_n{self.BLOCK_N}_w{self.num_warps}"


# Warps per program. ptxas (sm_90, Triton 3.9) gives these kernels about 5 registers per
# fp32 element a thread holds, so about 8 elements per thread per tensor (two 16-byte
# accesses) keeps them at 40-75 registers and 32-48 warps resident per SM; halving the warps
# doubles the registers and halves the warps in flight. Exceptions, from the same counts:
# a 16384-wide forward row spills with 32 warps (capped at 64 registers) and fits 16 warps
# in 128, but for Triton 3.8, whose build of it with a residual spills at 16 warps and fits 32;
# the backward holds more per element, so it uses twice the forward's warps.
_WIDEST_FWD_WARPS = 32 if triton.__version__.startswith("3.8.") else 16


def _fused_config(N: int, backward: bool) -> NormConfig:
    block_n = max(MIN_BLOCK_N, next_power_of_2(N))
    block_m = max(1, TILE_ELEMENTS // block_n)
    tile = block_m * block_n
    if backward:
        num_warps = min(max(tile // 128, 4), 32)
    else:
        num_warps = min(max(tile // 256, 4), 32 if tile <= 8192 else _WIDEST_FWD_WARPS)
    return NormConfig(block_m, block_n, num_warps, split=False)


@functools.lru_cache(maxsize=None)  # called per launch; a pure function of N
def fwd_config(N: int) -> NormConfig:
    """Forward configuration for rows of N elements."""
    if N > MAX_FUSED_N:
        return NormConfig(1, SPLIT_BLOCK_N, SPLIT_NUM_WARPS, split=True)
    return _fused_config(N, backward=False)


@functools.lru_cache(maxsize=None)  # called per launch; a pure function of N
def bwd_config(N: int) -> NormConfig:
    """Backward (dx and dW/dB partials) configuration for rows of N elements."""
    if N > MAX_FUSED_N_BWD:
        return NormConfig(1, SPLIT_BWD_BLOCK_N, SPLIT_NUM_WARPS, split=True)
    return _fused_config(N, backward=True)


@functools.lru_cache(maxsize=None)  # called per launch; a pure function of N
def reduce_config(N: int) -> NormConfig:
    """Stage-2 dW/dB configuration: a (partials x columns) tile, 32 columns up to N = 8192.

    Narrow column blocks give about 128 or more programs at the usual widths, each summing
    its partials in a few steps; wider rows take wider blocks (about 256 programs), which
    also keeps the interpreter from running thousands of tiny programs.
    """
    block_n = min(max(32, next_power_of_2(N) // 256), REDUCE_MAX_BLOCK_N)
    return NormConfig(REDUCE_TILE_ELEMENTS // block_n, block_n, 4, split=False)


def shipped_configs() -> tuple[list[NormConfig], list[NormConfig], list[NormConfig]]:
    """Every forward, backward and stage-2 configuration the launchers can choose."""
    sizes = [2**k for k in range(MIN_BLOCK_N.bit_length() - 1, MAX_FUSED_N.bit_length())]
    fwd = sorted({fwd_config(n) for n in sizes + [MAX_FUSED_N + 1]}, key=lambda c: (c.split, c.BLOCK_N))
    bwd = sorted({bwd_config(n) for n in sizes + [MAX_FUSED_N_BWD + 1]}, key=lambda c: (c.split, c.BLOCK_N))
    reduce = sorted({reduce_config(2**k) for k in range(32)}, key=lambda c: c.BLOCK_N)
    return fwd, bwd, reduce


def _resident_programs(device: torch.device, num_warps: int) -> int:
    """About how many programs of ``num_warps`` warps the device runs at once.

    This is the number P of dW/dB partials: enough programs to fill the GPU (32 warps per
    SM, what the register counts above allow), and no more, since stage 2 reads P x N fp32
    values. The interpreter gets a small P, so tests cover several row blocks per program.
    """
    if device.type != "cuda":
        return 4
    return multiprocessors(device_index(device)) * max(32 // num_warps, 1)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _first_h(x_ptrs, R, r_offsets, ok, H, HAS_RESIDUAL: tl.constexpr):
    """h at the first column of rows, fp32 (0 where not ok): x, or x + r rounded to h's dtype
    as the stored h is. The LayerNorm statistics are taken about it. R and H are None
    without a residual, so they are touched only under HAS_RESIDUAL."""
    first = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        first = (first + tl.load(R + r_offsets, mask=ok, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        first = first.to(tl.float32)
    return first


@triton.jit
def _norm_fwd_kernel(
    X,  # input, (M, N), row stride stride_x_m
    R,  # residual, (M, N) (None unless HAS_RESIDUAL)
    W,  # weight, (N,) (None unless HAS_WEIGHT)
    B,  # bias, (N,) (None unless HAS_BIAS)
    Y,  # output, (M, N) in X's dtype
    H,  # h = x + r, (M, N) in X's dtype (None unless HAS_RESIDUAL)
    MEAN,  # (M,) fp32 (None when IS_RMS or not STORE_STATS)
    RSTD,  # (M,) fp32 (None unless STORE_STATS)
    stride_x_m,
    stride_r_m,
    stride_y_m,
    stride_h_m,
    M,
    N,
    eps,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # ≥ N: the whole row is one tile
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr = True,  # False: inference, no backward will read mean and rstd
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)  # row * stride overflows int32 beyond 2**31 elements

    h = tl.load(X + rows[:, None] * stride_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # rounded to the input dtype: the statistics describe the h the caller gets back
        h_out = (h + r).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h_m + cols[None, :], h_out, mask=mask)
        h = h_out.to(tl.float32)

    # statistics in fp32; padded lanes hold 0 and are kept out of the centred sum
    if IS_RMS:
        var = tl.sum(h * h, axis=1) / N
        rstd = tl.rsqrt(var + eps)
        xhat = h * rstd[:, None]
    else:
        # the mean of h about each row's first value: exact for a row of one repeated value
        # (sum / N is not: 0.3 * 100 / 100 != 0.3), whose xhat must be 0, not rounding noise
        first = _first_h(X + rows * stride_x_m, R, rows * stride_r_m, row_mask, H, HAS_RESIDUAL)
        mean = first + tl.sum(tl.where(mask, h - first[:, None], 0.0), axis=1) / N
        diff = tl.where(mask, h - mean[:, None], 0.0)
        var = tl.sum(diff * diff, axis=1) / N
        rstd = tl.rsqrt(var + eps)
        xhat = diff * rstd[:, None]
        if STORE_STATS:
            tl.store(MEAN + rows, mean, mask=row_mask)
    if STORE_STATS:
        tl.store(RSTD + rows, rstd, mask=row_mask)

    y = xhat
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y_m + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_split_kernel(
    X,  # input, (M, N), row stride stride_x_m
    R,  # residual, (M, N) (None unless HAS_RESIDUAL)
    W,  # weight, (N,) (None unless HAS_WEIGHT)
    B,  # bias, (N,) (None unless HAS_BIAS)
    Y,  # output, (M, N) in X's dtype
    H,  # h = x + r, (M, N) in X's dtype (None unless HAS_RESIDUAL)
    MEAN,  # (M,) fp32 (None when IS_RMS or not STORE_STATS)
    RSTD,  # (M,) fp32 (None unless STORE_STATS)
    stride_x_m,
    stride_r_m,
    stride_y_m,
    stride_h_m,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,  # column chunk; one program per row
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = X + row * stride_x_m
    r_offset = row * stride_r_m  # R and H are None without a residual: offsets, not pointers
    h_offset = row * stride_h_m
    y_row = Y + row * stride_y_m

    # pass 1: statistics, chunk by chunk (Chan's combination of per-chunk mean and M2), of
    # h - first with first = h[0] (the rounded h): exact for a row of one repeated value
    first = 0.0
    if not IS_RMS:
        first = _first_h(x_row, R, r_offset, True, H, HAS_RESIDUAL)
    mean = tl.zeros((), dtype=tl.float32)
    m2 = tl.zeros((), dtype=tl.float32)  # Σ(h - mean)², or Σh² for RMSNorm
    n = tl.zeros((), dtype=tl.float32)  # elements combined so far
    for start in range(0, N, BLOCK_N):
        c = start + cols
        mask = c < N
        h = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h_out = (h + tl.load(R + r_offset + c, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + h_offset + c, h_out, mask=mask)
            h = h_out.to(tl.float32)
        if IS_RMS:
            m2 += tl.sum(h * h, axis=0)
        else:
            h = tl.where(mask, h - first, 0.0)
            n_c = tl.sum(mask.to(tl.float32), axis=0)
            mean_c = tl.sum(h, axis=0) / n_c
            diff = tl.where(mask, h - mean_c, 0.0)
            delta = mean_c - mean
            n_ac = n + n_c
            mean += delta * (n_c / n_ac)
            m2 += tl.sum(diff * diff, axis=0) + delta * delta * (n * (n_c / n_ac))
            n = n_ac
    rstd = tl.rsqrt(m2 / N + eps)
    mean = first + mean
    if STORE_STATS:
        if not IS_RMS:
            tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    # pass 2: normalise, recomputing the same rounded h from x and r
    for start in range(0, N, BLOCK_N):
        c = start + cols
        mask = c < N
        h = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + r_offset + c, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(H.dtype.element_ty).to(tl.float32)
        if IS_RMS:
            y = h * rstd
        else:
            y = (h - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_row_sums(
    H, W, DY, MEAN, RSTD,  # as in _norm_bwd_kernel
    SUM_DXHAT_XHAT, SUM_DXHAT, SUM_XHAT,  # out: (M,) fp32 row sums, as in _norm_bwd_kernel
    stride_h_m, stride_dy_m, N,
    row_start, row_end,  # the program's rows
    BLOCK_N: tl.constexpr,  # column chunk
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    # the row reductions of the backward, for rows too long to hold in registers: each row
    # walked in chunks; for LayerNorm, SUM_DXHAT_XHAT is taken over xhat - mean(xhat)
    cols = tl.arange(0, BLOCK_N)
    stride_h_m = stride_h_m.to(tl.int64)  # row offsets in int64
    stride_dy_m = stride_dy_m.to(tl.int64)
    for row in range(row_start, row_end):
        rstd = tl.load(RSTD + row)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(MEAN + row)
        acc_dxhat_xhat = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_dxhat = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_xhat = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            h = tl.load(H + row * stride_h_m + c, mask=mask, other=0.0).to(tl.float32)
            dxhat = tl.load(DY + row * stride_dy_m + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                dxhat = dxhat * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (h - mean) * rstd, 0.0)
            acc_dxhat_xhat += dxhat * xhat
            acc_dxhat += dxhat
            acc_xhat += xhat
        if IS_RMS:
            tl.store(SUM_DXHAT_XHAT + row, tl.sum(acc_dxhat_xhat, axis=0))
        else:
            sum_dxhat = tl.sum(acc_dxhat, axis=0)
            sum_xhat = tl.sum(acc_xhat, axis=0)
            # Σ dxhat · (xhat - mean(xhat)) = Σ dxhat · xhat - mean(xhat) · Σ dxhat
            tl.store(SUM_DXHAT_XHAT + row, tl.sum(acc_dxhat_xhat, axis=0) - sum_xhat / N * sum_dxhat)
            tl.store(SUM_DXHAT + row, sum_dxhat)
            tl.store(SUM_XHAT + row, sum_xhat)


@triton.jit
def _norm_bwd_columns(
    H, W, DY, DH, DX, MEAN, RSTD, SUM_DXHAT_XHAT, SUM_DXHAT, SUM_XHAT, DW_PARTIAL, DB_PARTIAL,  # as in _norm_bwd_kernel
    strides,  # (stride_h_m, stride_dy_m, stride_dh_m, stride_dx_m)
    N, pid, row_start, row_end,  # program pid owns rows [row_start, row_end)
    cols,  # (BLOCK_N,) the columns: the whole row, or one chunk of it when SPLIT
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DH: tl.constexpr,
):
    # dx of the program's rows at these columns, and their dW/dB partial sums
    stride_h_m, stride_dy_m, stride_dh_m, stride_dx_m = strides
    col_mask = cols < N
    # per-program partial sums, reduced over the tile's rows only once at the end
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block_start in range(row_start, row_end, BLOCK_M):
        rows = block_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)

        h = tl.load(H + rows[:, None] * stride_h_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
            # mean(xhat) is 0 in exact arithmetic: the stored mean's rounding shifts every
            # xhat by it, and it is subtracted (see norm_bwd in fasttrans/backends/__init__.py)
            if SPLIT:
                mean_xhat = tl.load(SUM_XHAT + rows, mask=row_mask, other=0.0) / N
            else:
                mean_xhat = tl.sum(xhat, axis=1) / N
            xhat = tl.where(mask, xhat - mean_xhat[:, None], 0.0)
        dxhat = dy
        if HAS_WEIGHT:
            # reloaded per row block (an L1 hit): holding w across the loop costs registers
            dxhat = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        # accumulated before the row reductions, so that dy is dead across them (registers)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy

        if SPLIT:
            mean_dxhat_xhat = tl.load(SUM_DXHAT_XHAT + rows, mask=row_mask, other=0.0) / N
        else:
            mean_dxhat_xhat = tl.sum(dxhat * xhat, axis=1) / N
        if IS_RMS:
            dx = (dxhat - xhat * mean_dxhat_xhat[:, None]) * rstd[:, None]
        else:
            if SPLIT:
                mean_dxhat = tl.load(SUM_DXHAT + rows, mask=row_mask, other=0.0) / N
            else:
                mean_dxhat = tl.sum(dxhat, axis=1) / N
            dx = (dxhat - mean_dxhat[:, None] - xhat * mean_dxhat_xhat[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows[:, None] * stride_dh_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx_m + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    partial = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _norm_bwd_kernel(
    H,  # h = x + r (or x), (M, N), row stride stride_h_m
    W,  # weight, (N,) (unused unless HAS_WEIGHT)
    DY,  # gradient of y, (M, N)
    DH,  # gradient flowing into the h output, (M, N) (unused unless HAS_DH)
    DX,  # out: gradient of h (= of x and of the residual), (M, N) in H's dtype
    MEAN,  # (M,) fp32 (unused when IS_RMS)
    RSTD,  # (M,) fp32
    SUM_DXHAT_XHAT,  # workspace: (groups, M) fp32, Σ dxhat · xhat per row (unused unless SPLIT)
    SUM_DXHAT,  # workspace: (groups, M) fp32, Σ dxhat per row (unused unless SPLIT and not IS_RMS)
    SUM_XHAT,  # workspace: (groups, M) fp32, Σ xhat per row (unused unless SPLIT and not IS_RMS)
    DW_PARTIAL,  # out: (P, N) fp32, row p = Σ dy · xhat over program p's rows (unused unless HAS_WEIGHT)
    DB_PARTIAL,  # out: (P, N) fp32, row p = Σ dy over program p's rows (unused unless HAS_BIAS)
    stride_h_m,
    stride_dy_m,
    stride_dh_m,
    stride_dx_m,
    M,
    N,
    rows_per_program,  # a multiple of BLOCK_M: program p owns rows [p·rows_per_program, ...)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # ≥ N, or a column chunk when SPLIT
    SPLIT: tl.constexpr,  # rows longer than BLOCK_N: row sums first, then the columns chunk by chunk;
    #                       axis 1 of the grid splits the chunks into groups
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DH: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    strides = (stride_h_m, stride_dy_m, stride_dh_m, stride_dx_m)
    if SPLIT:
        # axis 1: the groups of column chunks, each recomputing its rows' sums (from L2 when
        # the rows are few, which is when there is more than one group) into its own slots
        group, groups = tl.program_id(1), tl.num_programs(1)
        own = group.to(tl.int64) * M
        SUM_DXHAT_XHAT += own
        SUM_DXHAT += own
        SUM_XHAT += own
        _norm_bwd_row_sums(H, W, DY, MEAN, RSTD, SUM_DXHAT_XHAT, SUM_DXHAT, SUM_XHAT, stride_h_m, stride_dy_m, N,
                           row_start, row_end, BLOCK_N, IS_RMS, HAS_WEIGHT)
        tl.debug_barrier()  # the row sums, stored by some of the program's threads, are read by all
        for start in range(group * BLOCK_N, N, groups * BLOCK_N):
            _norm_bwd_columns(H, W, DY, DH, DX, MEAN, RSTD, SUM_DXHAT_XHAT, SUM_DXHAT, SUM_XHAT, DW_PARTIAL,
                              DB_PARTIAL, strides, N, pid, row_start, row_end, start + tl.arange(0, BLOCK_N),
                              BLOCK_M, BLOCK_N, SPLIT, IS_RMS, HAS_WEIGHT, HAS_BIAS, HAS_DH)
    else:
        _norm_bwd_columns(H, W, DY, DH, DX, MEAN, RSTD, SUM_DXHAT_XHAT, SUM_DXHAT, SUM_XHAT, DW_PARTIAL, DB_PARTIAL,
                          strides, N, pid, row_start, row_end, tl.arange(0, BLOCK_N),
                          BLOCK_M, BLOCK_N, SPLIT, IS_RMS, HAS_WEIGHT, HAS_BIAS, HAS_DH)


@triton.jit
def _norm_bwd_reduce_kernel(
    DW_PARTIAL,  # (P, N) fp32 (unused unless HAS_WEIGHT)
    DB_PARTIAL,  # (P, N) fp32 (unused unless HAS_BIAS)
    DW,  # out: (N,) in the weight's dtype
    DB,  # out: (N,) in the bias's dtype
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # stage 2: each column's P partials summed in a fixed order (deterministic)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw_acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p_start in range(0, P, BLOCK_P):
        p = p_start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_mask[None, :]
        offsets = p.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            dw_acc += tl.load(DW_PARTIAL + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(DB_PARTIAL + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(dw_acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db_acc, axis=0).to(DB.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------
# Launchers (the backend interface of fasttrans.backends)
# --------------------------------------------------------------------------------------
# Outputs and workspaces allocated here, in dtypes fixed by the inputs (see Launcher): not keyed
_FWD = Launcher(_norm_fwd_kernel, fresh=("Y", "H", "MEAN", "RSTD"))
_FWD_SPLIT = Launcher(_norm_fwd_split_kernel, fresh=("Y", "H", "MEAN", "RSTD"))
_BWD = Launcher(_norm_bwd_kernel, fresh=("DX", "SUM_DXHAT_XHAT", "SUM_DXHAT", "SUM_XHAT", "DW_PARTIAL", "DB_PARTIAL"))
_BWD_REDUCE = Launcher(_norm_bwd_reduce_kernel, fresh=("DW_PARTIAL", "DB_PARTIAL"))


def _check_rows(name: str, t: torch.Tensor, M: int, N: int) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: the triton backend supports float32, float16 and bfloat16, got {t.dtype} "
            "(use the 'reference' or 'extension' backend for float64)"
        )
    if t.shape != (M, N):
        raise ValueError(f"{name}: expected shape ({M}, {N}), got {tuple(t.shape)}")
    if N > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride along the last dim, got strides {t.stride()}")


def _vector(name: str, p: torch.Tensor | None, N: int) -> torch.Tensor | None:
    if p is None:
        return None
    if p.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name}: the triton backend supports float32, float16 and bfloat16, got {p.dtype}")
    if p.numel() != N:
        raise ValueError(f"{name}: expected {N} elements, got shape {tuple(p.shape)}")
    if p.dim() == 1 and p.stride(0) == 1:
        return p
    return p.reshape(N).contiguous()  # tiny: a dense copy is cheaper than a stride argument


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or for an absent tensor a live stand-in: its kernel flag keeps it unread."""
    return stand_in if t is None else t


@functools.lru_cache(maxsize=None)  # asked per call; a pure function of its arguments
def _fwd_launch(N: int, rms: bool, has_residual: bool, has_weight: bool, has_bias: bool, stats: bool) -> tuple:
    """(launcher, spec, rows per program) of the forward for rows of N elements."""
    cfg = fwd_config(N)
    flags = dict(IS_RMS=rms, HAS_RESIDUAL=has_residual, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
                 STORE_STATS=stats)
    if cfg.split:
        return _FWD_SPLIT, Spec(dict(BLOCK_N=cfg.BLOCK_N, **flags), num_warps=cfg.num_warps, num_stages=NUM_STAGES), 1
    spec = Spec(dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, **flags), num_warps=cfg.num_warps, num_stages=NUM_STAGES)
    return _FWD, spec, cfg.BLOCK_M


def _plain_vector(p: torch.Tensor | None) -> bool:
    return p is None or (p.dim() == 1 and p.stride(0) == 1)


# Inputs that need a copy first (a weight that is not a contiguous vector) always take the
# first-call route of a site (see kernels/_launch.py, "Call sites").
_FWD_SITES: dict = {}


def norm_infer(x, residual, weight, bias, eps, rms):
    """(y, h or None, None, None): the forward without the statistics only a backward reads."""
    return norm_fwd(x, residual, weight, bias, eps, rms, stats=False)


def norm_fwd(x, residual, weight, bias, eps, rms, stats: bool = True):
    """(y, h or None, mean or None, rstd): see fasttrans.backends for the contract."""
    key = (_sig(x), _sig(residual), _sig(weight), None if rms else _sig(bias), bool(rms), stats)
    launch = _FWD_SITES.get(key)
    M, N = x.shape
    if launch is None:
        _check_rows("x", x, M, N)
        if residual is not None:
            _check_rows("residual", residual, M, N)
            if residual.dtype != x.dtype:
                raise TypeError(f"residual: expected the dtype of x ({x.dtype}), got {residual.dtype}")
        cached = _plain_vector(weight) and (rms or _plain_vector(bias))
        weight = _vector("weight", weight, N)
        bias = None if rms else _vector("bias", bias, N)
    elif rms:
        bias = None

    x_stride = x.stride(0)
    # empty_like costs the host half of what torch.empty(shape, dtype=, device=) does
    y = torch.empty_like(x) if x_stride == N else torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else None
    mean = rstd = None
    if stats:
        mean = None if rms else torch.empty((M,), dtype=torch.float32, device=x.device)
        rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    args = (  # absent tensors pass as None: Triton makes them constexprs, and they cost no launch time
        x, residual, weight, bias, y, h, mean, rstd,
        x_stride, x_stride if residual is None else residual.stride(0), N, N,  # y and h are fresh (M, N) rows
        M, N, float(eps),
    )
    if launch is not None:
        with on_device(x):
            launch(args)
        return y, h, mean, rstd
    launcher, spec, rows = _fwd_launch(N, bool(rms), residual is not None, weight is not None, bias is not None,
                                       stats)
    with on_device(x):
        launch = launcher.bind((cdiv(M, rows),), args, spec, x.device.index)
    if cached:
        remember(_FWD_SITES, key, launch)
    return y, h, mean, rstd


_BWD_SITES: dict = {}


def norm_bwd(dy, dh, h, weight, bias, mean, rstd, rms):
    """(dx, dweight or None, dbias or None): see fasttrans.backends for the contract."""
    key = (_sig(h), _sig(dy), _sig(dh), _sig(weight), None if rms else _sig(bias),
           None if rms else _sig(mean), _sig(rstd), bool(rms))
    with on_device(h):
        return _norm_bwd(dy, dh, h, weight, bias, mean, rstd, rms, key, _BWD_SITES)


def _norm_bwd(dy, dh, h, weight, bias, mean, rstd, rms, key, sites: dict, rows: tuple | None = None):
    """The backward, its launches looked up in ``sites`` under ``key``: a key that fixes
    every argument but the tensors' addresses (see kernels/_launch.py, "Call sites"). h, dy
    and dh are (M, N) rows, or, with ``rows`` = (M, N) and a site under ``key``, contiguous
    tensors of any shape holding them (dx comes back in h's shape)."""
    site = sites.get(key)
    M, N = h.shape if rows is None else rows
    if site is not None:
        launches, num_partials, rows_per_program, groups, partial_like, row_like = site
        w, b, mean = weight, None if rms else bias, None if rms else mean
    else:
        _check_rows("h", h, M, N)
        _check_rows("dy", dy, M, N)
        if dh is not None:
            _check_rows("dh", dh, M, N)
        if not rms and mean is None:
            raise ValueError("mean: required for LayerNorm (rms=False), got None")
        cached = _plain_vector(weight) and (rms or _plain_vector(bias))
        w = _vector("weight", weight, N)
        b = None if rms else _vector("bias", bias, N)
        mean = None if rms else mean
        launches = None
        num_partials, rows_per_program, groups = _bwd_partials(h.device, M, N)
    device = h.device
    cfg = bwd_config(N)
    # With one partial row and fp32 parameters the partials are dW and dB themselves: no
    # reduction launch (the decoding and small-batch case)
    direct = num_partials == 1 and (w is None or w.dtype == torch.float32) and (b is None or b.dtype == torch.float32)
    if site is None:  # the fp32 workspaces are allocated like these (see expansion)
        partial_like = expansion(torch.float32, device, (N,) if direct else (num_partials, N))
        row_like = expansion(torch.float32, device, (groups * M,))
    dx = _empty_like(h)  # contiguous: h's rows have unit stride (checked above)
    dw_partial = None if w is None else _empty_like(partial_like)
    db_partial = None if b is None else _empty_like(partial_like)
    sum_dxhat_xhat = sum_dxhat = sum_xhat = None
    if cfg.split:
        sum_dxhat_xhat = _empty_like(row_like)
        sum_dxhat = None if rms else _empty_like(row_like)
        sum_xhat = None if rms else _empty_like(row_like)
    if direct:
        dw, db = dw_partial, db_partial
    else:
        dw = _empty_like(w) if w is not None else None  # (N,) vectors of unit stride
        db = _empty_like(b) if b is not None else None
    args = (
        (h, _or(w, h), dy, _or(dh, dy), dx, _or(mean, rstd), rstd, _or(sum_dxhat_xhat, rstd), _or(sum_dxhat, rstd),
         _or(sum_xhat, rstd), _or(dw_partial, rstd), _or(db_partial, rstd),
         *((h.stride(0), dy.stride(0), _or(dh, dy).stride(0), dx.stride(0)) if rows is None else (N, N, N, N)),
         M, N, rows_per_program),
        (_or(dw_partial, rstd), _or(db_partial, rstd), _or(dw, rstd), _or(db, rstd), num_partials, N)
        if not direct and (w is not None or b is not None) else None,
    )
    if launches is None:
        # dx with the dW/dB partials, dW/dB from the partials
        specs = _bwd_specs(N, bool(rms), w is not None, b is not None, dh is not None)
        grids = ((num_partials, groups), (cdiv(N, specs[1].constexprs["BLOCK_N"]),))
        launches = tuple(None if a is None else launcher.bind(grid, a, spec, device.index)
                         for launcher, grid, a, spec in zip((_BWD, _BWD_REDUCE), grids, args, specs))
        if cached:
            remember(sites, key, (launches, num_partials, rows_per_program, groups, partial_like, row_like))
    else:
        for launch, a in zip(launches, args):
            if a is not None:
                launch(a)
    return dx, _like(dw, weight), _like(db, bias)


def _bwd_partials(device: torch.device, M: int, N: int) -> tuple[int, int, int]:
    """(P, rows per program, column groups): P programs per column group, each owning a
    contiguous block of rows_per_program rows and writing its columns of row p of the
    (P, N) dW/dB partials. Rows split into chunks take as many groups of chunks as fill the
    GPU when there are fewer rows than programs it runs at once."""
    cfg = bwd_config(N)
    row_tiles = cdiv(M, cfg.BLOCK_M)
    resident = _resident_programs(device, cfg.num_warps)
    num_partials = min(row_tiles, resident)
    rows_per_program = cdiv(row_tiles, num_partials) * cfg.BLOCK_M
    num_partials = cdiv(M, rows_per_program)  # no program without rows
    groups = min(cdiv(N, cfg.BLOCK_N), max(1, resident // num_partials)) if cfg.split else 1
    return num_partials, rows_per_program, groups


def _like(grad: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's (N,) gradient in the parameter's shape."""
    return grad if grad is None or param.dim() == 1 else grad.view(param.shape)


@functools.lru_cache(maxsize=None)  # asked per call; a pure function of its arguments
def _bwd_specs(N: int, rms: bool, has_weight: bool, has_bias: bool, has_dh: bool) -> tuple:
    """Specs of the backward's dx and dW/dB-partials launch and its stage-2 launch."""
    cfg, red = bwd_config(N), reduce_config(N)
    options = dict(num_warps=cfg.num_warps, num_stages=NUM_STAGES)
    return (
        Spec(dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SPLIT=cfg.split, IS_RMS=rms, HAS_WEIGHT=has_weight,
                  HAS_BIAS=has_bias, HAS_DH=has_dh), **options),
        Spec(dict(BLOCK_P=red.BLOCK_M, BLOCK_N=red.BLOCK_N, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias),
             num_warps=red.num_warps, num_stages=NUM_STAGES),
    )


# --------------------------------------------------------------------------------------
# Public calls (fasttrans.functional's common case, through fasttrans.backends)
# --------------------------------------------------------------------------------------
_data_ptr = torch.Tensor.data_ptr


class NormSite:
    """The launches of one kind of public norm call: contiguous x (any number of dims, the
    last of N elements) and residual, (N,) contiguous weight and bias, all of x's dtype and
    device. Every row stride is N, so the tensors pass to the kernels as they are, with no
    (M, N) view, and the outputs are allocated in x's shape. Made by :func:`norm_site` once
    per kind of call; ``infer`` (no statistics), ``forward`` and ``backward`` launch."""

    __slots__ = ("M", "N", "rms", "rows", "ints", "size", "stride", "dtype", "alloc", "launches", "bwd_sites")

    def __init__(self, x: torch.Tensor, rms: bool, n: int):
        self.M, self.N, self.rms = x.numel() // n, n, rms
        self.rows = x.dim() == 2
        self.ints = (n, n, n, n, self.M, n)  # row strides of x, residual, y, h; M, N
        # the outputs' layout: x's (contiguous), and the allocator of x's device
        self.size, self.stride, self.dtype = tuple(x.shape), x.stride(), x.dtype
        self.alloc = strided_allocator(x.device)
        self.launches = [None, None]  # bound forward launches, without and with statistics
        self.bwd_sites: dict = {}  # backward launches by the gradients' alignment

    def _forward(self, x, residual, weight, bias, eps, stats: bool):
        with on_device(x):  # the allocator allocates on the current device
            alloc, size, stride = self.alloc, self.size, self.stride
            y = alloc(size, stride, self.dtype)
            h = None if residual is None else alloc(size, stride, self.dtype)
            mean = rstd = None
            if stats:
                mean = None if self.rms else alloc((self.M,), (1,), torch.float32)
                rstd = alloc((self.M,), (1,), torch.float32)
            args = (x, residual, weight, bias, y, h, mean, rstd, *self.ints, eps)  # absent ones: None (constexprs)
            launch = self.launches[stats]
            if launch is not None:
                launch(args)
            else:
                launcher, spec, rows = _fwd_launch(self.N, self.rms, residual is not None, weight is not None,
                                                   bias is not None, stats)
                self.launches[stats] = launcher.bind((cdiv(self.M, rows),), args, spec, x.device.index)
        return y, h, mean, rstd

    def infer(self, x, residual, weight, bias, eps: float):
        """(y, h or None) in x's shape, without the statistics a backward reads."""
        launch = self.launches[0]
        if launch is None or x.is_cuda and x.get_device() != _current_cuda_device():
            y, h, _, _ = self._forward(x, residual, weight, bias, eps, False)
            return y, h
        # _forward's launch, in one frame: every eager call without a gradient runs it
        y = self.alloc(self.size, self.stride, self.dtype)
        if residual is None:
            launch((x, None, weight, bias, y, None, None, None, *self.ints, eps))
            return y, None
        h = self.alloc(self.size, self.stride, self.dtype)
        launch((x, residual, weight, bias, y, h, None, None, *self.ints, eps))
        return y, h

    def forward(self, x, residual, weight, bias, eps: float):
        """(y, h or None, mean or None, rstd): the statistics for :meth:`backward`."""
        return self._forward(x, residual, weight, bias, eps, True)

    def backward(self, dy, dh, h, weight, bias, mean, rstd):
        """(dx in x's shape, dweight or None, dbias or None) of what :meth:`forward` returned
        (h: the input x without a residual). dy and dh have y's shape, dtype and device, as
        autograd hands gradients over; only their layout and alignment vary."""
        if not dy.is_contiguous():
            dy = dy.contiguous()
        if dh is not None and not dh.is_contiguous():
            dh = dh.contiguous()
        key = (_data_ptr(dy) & 15, None if dh is None else _data_ptr(dh) & 15)
        bias = None if self.rms else bias
        if key in self.bwd_sites:  # the launches read the rows of the tensors as they are
            with on_device(h):
                return _norm_bwd(dy, dh, h, weight, bias, mean, rstd, self.rms, key, self.bwd_sites,
                                 (self.M, self.N))
        if not self.rows:
            M, N = self.M, self.N
            dy, h = dy.view(M, N), h.view(M, N)
            dh = None if dh is None else dh.view(M, N)
        with on_device(h):
            dx, dw, db = _norm_bwd(dy, dh, h, weight, bias, mean, rstd, self.rms, key, self.bwd_sites)
        return (dx if self.rows else dx.view(self.size)), dw, db


_NORM_SITES: dict = {}


def norm_site(x, residual, weight, bias, rms: bool, n: int, common_case) -> NormSite | None:
    """The :class:`NormSite` of a public norm call over x's last dim of ``n`` elements, or
    None where the call is not of that kind (the general route takes it). The tensors must
    be plain (no subclass). The site is looked up by everything its launches depend on: the
    tensors' shapes, strides, dtypes, devices and alignment; the first call of a kind asks
    ``common_case(x, residual, weight, bias, n)`` (fasttrans.backends.common_case) whether
    the call is of it."""
    try:  # signature() of each tensor, inlined: this runs on every call
        key = (x.shape, x.stride(), x.dtype, x.get_device(), _data_ptr(x) & 15, rms, n,
               None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                              residual.get_device(), _data_ptr(residual) & 15),
               None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.get_device(),
                                            _data_ptr(weight) & 15),
               None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device(),
                                          _data_ptr(bias) & 15))
    except RuntimeError:  # a layout without strides or storage
        return None
    site = _NORM_SITES.get(key)
    if site is None:
        ok = x.dtype in _SUPPORTED_DTYPES and not (rms and bias is not None) and common_case(x, residual, weight,
                                                                                            bias, n)
        site = NormSite(x, rms, n) if ok else False
        remember(_NORM_SITES, key, site)
    return site or None


# --------------------------------------------------------------------------------------
# Compile-check targets
# --------------------------------------------------------------------------------------
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Flag sets compiled for every configuration: the heaviest variant of each norm, and plain
# LayerNorm (every other combination compiles too; these bound the register use).
_FWD_FLAGS = (  # (IS_RMS, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS)
    (False, True, True, True), (True, True, True, False), (False, False, False, False),
)
_BWD_FLAGS = (  # (IS_RMS, HAS_WEIGHT, HAS_BIAS, HAS_DH)
    (False, True, True, True), (True, True, False, True), (False, False, False, False),
)
_ROW_TENSORS = ("X", "R", "Y", "H", "DY", "DH", "DX")  # (M, N), in the input dtype
_PARAM_TENSORS = ("W", "B", "DW", "DB")  # (N,), in the parameters' dtype
_INT_SCALARS = ("M", "N", "P", "rows_per_program")


def _target(fn, config: str, num_warps: int, constexprs: dict, dtype: str, param_dtype: str) -> dict:
    """One compile-check entry: argument types follow from the argument names."""
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in _ROW_TENSORS:
            signature[arg] = f"*{dtype}"
        elif arg in _PARAM_TENSORS:
            signature[arg] = f"*{param_dtype}"
        elif arg in _INT_SCALARS or arg.startswith("stride_"):
            signature[arg] = "i32"
        elif arg == "eps":
            signature[arg] = "fp32"
        else:  # statistics, row sums, partials
            signature[arg] = "*fp32"
    # Triton's launcher marks integers divisible by 16 (and aligned pointers); rows whose
    # stride is a multiple of 16 (the usual widths) then get vectorised accesses, and the
    # marks reproduce that code. Without them (odd widths) the kernels also compile with
    # zero spills (checked with ptxas for sm_80 and sm_90 when these targets were set).
    divisible = [arg for arg in fn.arg_names if arg.startswith("stride_")]
    flags = "+".join(k.lower() for k, v in constexprs.items() if k.startswith(("IS_", "HAS_")) and v) or "plain"
    return dict(
        kernel=fn.__name__, fn=fn, config=f"{config}_{dtype}_{param_dtype}w_{flags}", signature=signature,
        constexprs=constexprs, num_warps=num_warps, num_stages=NUM_STAGES, matmul=False,
        divisible_by_16=divisible,
    )


def compile_targets() -> list[dict]:
    """Every shipped kernel configuration, for ``python -m fasttrans compile-check``.

    One entry per kernel, configuration, input dtype and flag set (``_FWD_FLAGS``,
    ``_BWD_FLAGS``), with weight/bias in the input dtype, plus the heaviest flag set with
    fp32 weight/bias for fp16/bf16 inputs. ``divisible_by_16`` names the row strides, which
    Triton's launcher marks divisible at the usual widths.
    """
    fwd_configs, bwd_configs, reduce_configs = shipped_configs()
    targets = []
    for t in _TRITON_DTYPE.values():
        for param_t in dict.fromkeys((t, "fp32")):
            n_flags = len(_FWD_FLAGS) if param_t == t else 1
            for cfg in fwd_configs:
                fn = _norm_fwd_split_kernel if cfg.split else _norm_fwd_kernel
                for is_rms, has_res, has_w, has_b in _FWD_FLAGS[:n_flags]:
                    const = dict(BLOCK_N=cfg.BLOCK_N) if cfg.split else dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N)
                    const.update(IS_RMS=is_rms, HAS_RESIDUAL=has_res, HAS_WEIGHT=has_w, HAS_BIAS=has_b)
                    targets.append(_target(fn, cfg.name, cfg.num_warps, const, t, param_t))
            for cfg in bwd_configs:
                for is_rms, has_w, has_b, has_dh in _BWD_FLAGS[:n_flags]:
                    const = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SPLIT=cfg.split, IS_RMS=is_rms,
                                 HAS_WEIGHT=has_w, HAS_BIAS=has_b, HAS_DH=has_dh)
                    targets.append(_target(_norm_bwd_kernel, cfg.name, cfg.num_warps, const, t, param_t))
        # stage 2 only sees fp32 partials and writes dW/dB in the parameters' dtype
        for cfg in reduce_configs:
            const = dict(BLOCK_P=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HAS_WEIGHT=True, HAS_BIAS=True)
            name = f"reduce_p{cfg.BLOCK_M}_n{cfg.BLOCK_N}_w{cfg.num_warps}"
            targets.append(_target(_norm_bwd_reduce_kernel, name, cfg.num_warps, const, t, t))
    return targets
