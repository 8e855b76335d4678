"""Elementwise dropout in Triton: forward (mask generation fused with the scaling) and backward.

Math
----
Elements of the contiguous input are numbered 0, 1, 2, ... in memory order (the flat index
i). With ``threshold = round(p * 2**24)`` and ``scale = fp32(1 / (1 - p))`` (computed in
double on the host, then rounded once to fp32)::

    words(g) = philox4x32_10(counter = (g mod 2**32, g div 2**32, 0, 0x44524F50),
                             key     = (seed mod 2**32, seed div 2**32))
    keep[i]  = (words(i div 4)[i mod 4] >> 8) >= threshold          P(keep) = 1 - threshold / 2**24
    y[i]     = x[i] · (scale if keep[i] else 0)                        in fp32, rounded once to x's dtype
    dx[i]    = dy[i] · (scale if keep[i] else 0)

keep is a pure function of (seed, i): it does not depend on the block size, the launch
grid, the device or the dtype. The counter layout and the integer comparison are those of
``fasttrans::flat_dropout_words`` and ``dropout_keep_word`` in csrc/philox.h, and Triton's
``tl.philox`` is the same Philox4x32-10 (constants and round function), so the Triton, CPU
extension and CUDA extension masks are equal bit for bit for the same seed. One Philox call
gives the words of four consecutive elements, so the forward works on a (BLOCK / 4, 4) tile:
row r holds the elements 4g .. 4g+3 of group g and needs exactly one Philox call, with no
redundant generation and no cross-thread shuffle.

Multiplying by (scale or 0), rather than selecting 0, is ``x * keep * scale`` exactly,
including its edge cases: a dropped -x gives -0, a dropped inf or NaN gives NaN.

Limits and large tensors
------------------------
fp32, fp16 and bf16 (fp64 raises TypeError: the reference and extension backends run it).
Any numel, 0 included. Offsets are int32 while every offset the grid forms fits in int32
(``cdiv(numel, BLOCK) · BLOCK ≤ 2**31``); above that the launcher sets INDEX_64 and the
kernels compute program offsets, group indices and element offsets in int64. The group index
g enters Philox as two 32-bit counter words (low, high), so both paths give the same mask:
the high word is simply 0 below 2**32 groups.

Under Triton's interpreter (CPU tests) bf16 outputs are rounded to nearest even on the bits
(RNE_BF16), because the interpreter's own fp32 -> bf16 conversion truncates.

Launch configurations (below) follow from the register and spill counts ptxas reports for
sm_80 and sm_90 (``compile_targets()``, checked by ``python -m fasttrans compile-check``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct

import torch
import triton
import triton.language as tl

from fasttrans.dropout_spec import FLAT_DOMAIN, dropout_threshold

from . import cdiv, expansion, on_device
from ._launch import Launcher, Spec, int_class, remember, signature as sig

__all__ = ["dropout_fwd", "dropout_bwd", "dropout_site", "DropoutSite", "dropout_threshold", "dropout_scale",
           "compile_targets", "DropoutConfig", "CONFIG"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_LIMIT = 2**31


# --------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DropoutConfig:
    """One launch configuration: BLOCK elements per program, num_warps warps."""

    BLOCK: int  # a multiple of 4 (whole Philox groups) and a power of two
    num_warps: int

    @property
    def name(self) -> str:
        return f"b{self.BLOCK}_w{self.num_warps}"


# Forward and backward: 16 elements per thread: four Philox groups (one 4x32-bit call each)
# and, per tensor, four independent 4-element accesses (16 bytes for fp32, 8 for fp16/bf16,
# 4 for the mask) in flight per thread, for a bandwidth-bound kernel, far from the register
# limit (ptxas, sm_80 and sm_90: 25-64 registers, no spills, no shared memory).
CONFIG = DropoutConfig(BLOCK=2048, num_warps=4)
NUM_STAGES = 1  # no tl.dot: software pipelining has nothing to do
# Last Philox counter word of elementwise dropout ("DROP", kFlatDomain in csrc/philox.h);
# attention's dropout uses that word for the batch index, so the two never share counters.
# It and dropout_threshold come from fasttrans/dropout_spec.py, which the reference evaluates too.
_FLAT_DOMAIN = tl.constexpr(FLAT_DOMAIN)  # the kernels' copy (jit code reads only constexpr globals)


def dropout_scale(p: float) -> float:
    """1 / (1 - p) computed in double, rounded once to fp32 (returned as that fp32 value)."""
    return struct.unpack("f", struct.pack("f", 1.0 / (1.0 - float(p))))[0]


def _index_64(numel: int, block: int) -> bool:
    """Whether an offset the grid forms (up to cdiv(numel, block) · block - 1) exceeds int32."""
    return cdiv(numel, block) * block > _INT32_LIMIT


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _round_to_output(v, OUT_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 ``v`` rounded to nearest even in OUT_DTYPE.

    RNE_BF16 (interpreter only): Triton 3.9's interpreter converts fp32 to bf16 by truncation
    (runtime/interpreter.py, cast_impl), so bf16 is rounded here on the bits instead: add
    0x7FFF plus the lowest kept bit, drop the low 16 bits. A NaN stays a (quiet) NaN; on a
    GPU the plain conversion already rounds to nearest even.
    """
    if RNE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)  # keep NaN a NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(OUT_DTYPE)


@triton.jit
def _block_groups(BLOCK: tl.constexpr, INDEX_64: tl.constexpr):
    """This program's Philox groups g (BLOCK / 4 of them) and the (BLOCK / 4, 4) tile of
    element offsets 4g + j: row r is group g[r], column j its element and word j."""
    GROUPS: tl.constexpr = BLOCK // 4
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    g = pid * GROUPS + tl.arange(0, GROUPS)
    return g, g[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _dropout_fwd_kernel(
    X,  # input, (numel,) contiguous
    Y,  # output, (numel,) in X's dtype
    Keep,  # output keep-mask, (numel,) uint8 (the bytes of a torch.bool tensor)
    numel,  # number of elements
    seed,  # Philox key, in [0, 2**63)
    threshold,  # round(p · 2**24): keep = (word >> 8) >= threshold
    scale,  # fp32(1 / (1 - p))
    BLOCK: tl.constexpr,  # elements per program, a multiple of 4
    INDEX_64: tl.constexpr,  # offsets in int64 (numel beyond int32)
    RNE_BF16: tl.constexpr,  # interpreter only: round bf16 outputs on the bits
):
    g, offsets = _block_groups(BLOCK, INDEX_64)
    lo = g.to(tl.uint32)  # truncates the int64 index to its low word
    if INDEX_64:
        hi = (g >> 32).to(tl.uint32)
    else:
        hi = lo * 0
    zero = lo * 0
    w0, w1, w2, w3 = tl.philox(seed, lo, hi, zero, zero + _FLAT_DOMAIN)

    j = tl.arange(0, 4)[None, :]  # word j of a group decides element 4g + j
    word = tl.where(j == 0, w0[:, None], tl.where(j == 1, w1[:, None], tl.where(j == 2, w2[:, None], w3[:, None])))
    keep = (word >> 8).to(tl.int32) >= threshold  # 24-bit integers: exact on every device
    mask = offsets < numel

    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.where(keep, scale, 0.0)  # fp32, then one rounding to the output dtype
    tl.store(Y + offsets, _round_to_output(y, Y.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(Keep + offsets, keep.to(tl.uint8), mask=mask)


@triton.jit
def _dropout_bwd_kernel(
    DY,  # gradient of y, (numel,) contiguous
    Keep,  # keep-mask of the forward, (numel,) uint8
    DX,  # output gradient of x, (numel,) in DY's dtype
    numel,  # number of elements
    scale,  # fp32(1 / (1 - p))
    BLOCK: tl.constexpr,  # elements per program, a multiple of 4
    INDEX_64: tl.constexpr,  # offsets in int64 (numel beyond int32)
    RNE_BF16: tl.constexpr,  # interpreter only: round bf16 outputs on the bits
):
    # the forward's (BLOCK / 4, 4) tile: the uint8 keep-mask and dy then share one register
    # layout (a 1-D block gives each its own vector width and a shuffle through shared memory)
    _, offsets = _block_groups(BLOCK, INDEX_64)
    mask = offsets < numel
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    keep = tl.load(Keep + offsets, mask=mask, other=0) != 0
    dx = dy * tl.where(keep, scale, 0.0)
    tl.store(DX + offsets, _round_to_output(dx, DX.dtype.element_ty, RNE_BF16), mask=mask)


# --------------------------------------------------------------------------------------
# Launchers (the backend interface of fasttrans.backends)
# --------------------------------------------------------------------------------------
def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: the triton backend supports float32, float16 and bfloat16, got {t.dtype} "
            "(use the 'reference' or 'extension' backend for float64)"
        )


def _rne_bf16(dtype: torch.dtype) -> bool:
    # read at launch time: the test suite switches the interpreter on before importing triton
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)  # asked per call; a pure function of its arguments
def _spec(cfg: DropoutConfig, index_64: bool, rne_bf16: bool) -> Spec:
    return Spec(dict(BLOCK=cfg.BLOCK, INDEX_64=index_64, RNE_BF16=rne_bf16), num_warps=cfg.num_warps,
                num_stages=NUM_STAGES)


# outputs allocated here, in dtypes fixed by the inputs (see kernels._launch.Launcher)
_FWD = Launcher(_dropout_fwd_kernel, fresh=("Y", "Keep"))
_BWD = Launcher(_dropout_bwd_kernel, fresh=("DX",))


_FWD_SITES: dict = {}
_BWD_SITES: dict = {}


def dropout_fwd(x: torch.Tensor, p: float, seed: int, *, config: DropoutConfig | None = None):
    """(y, keep): see fasttrans.backends for the contract; 0 < p < 1, seed in [0, 2**63).

    ``config`` overrides the launch configuration (tests use it to show that keep does not
    depend on the block size).
    """
    # a site per input signature (kernels/_launch.py, "Call sites"); the seed's integer
    # class and p (which fixes the threshold) complete the key
    key = (sig(x), p, int_class(int(seed))) if config is None else None
    launch = _FWD_SITES.get(key) if key is not None else None
    if launch is None:
        _check_dtype("x", x)
    cfg = config or CONFIG
    x = x.contiguous()  # a no-op for the contiguous inputs of the contract
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    keep = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    numel = x.numel()
    if numel:
        args = (x, y, keep, numel, int(seed), dropout_threshold(p), dropout_scale(p))
        with on_device(x):
            _launch_at(_FWD_SITES, key, launch, _FWD, numel, cfg, x, args)
    return y, keep.view(torch.bool)


def dropout_bwd(dy: torch.Tensor, keep: torch.Tensor, p: float, *, config: DropoutConfig | None = None):
    """dx = dy · keep · scale: see fasttrans.backends for the contract."""
    key = (sig(dy), sig(keep), p) if config is None else None
    launch = _BWD_SITES.get(key) if key is not None else None
    if launch is None:
        _check_dtype("dy", dy)
        if keep.shape != dy.shape:
            raise ValueError(f"keep: expected the shape of dy {tuple(dy.shape)}, got {tuple(keep.shape)}")
    cfg = config or CONFIG
    # gradients often arrive expanded (stride 0, from y.sum().backward()): copy on purpose
    dy = dy.contiguous()
    keep = keep.contiguous().view(torch.uint8)
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    numel = dy.numel()
    if numel:
        args = (dy, keep, dx, numel, dropout_scale(p))
        with on_device(dy):
            _launch_at(_BWD_SITES, key, launch, _BWD, numel, cfg, dy, args)
    return dx


def _launch_at(sites: dict, key, launch, launcher: Launcher, numel: int, cfg: DropoutConfig, x, args) -> None:
    """Launch through a site's bound launch, or bind it on the site's first call (and keep
    it under key unless key is None: a launch configuration of the caller's own)."""
    if launch is not None:
        launch(args)
        return
    launch = launcher.bind((cdiv(numel, cfg.BLOCK),), args, _spec(cfg, _index_64(numel, cfg.BLOCK), _rne_bf16(x.dtype)),
                           x.device.index)
    if key is not None:
        remember(sites, key, launch)


# --------------------------------------------------------------------------------------
# Public calls (fasttrans.functional's common case, through fasttrans.backends)
# --------------------------------------------------------------------------------------
_empty_like = torch.empty_like
_data_ptr = torch.Tensor.data_ptr


class DropoutSite:
    """The launches of one kind of public dropout call: a contiguous x of a supported dtype
    with at least one element, and 0 < p < 1. Forward launches are kept per integer class
    of the seed (which Triton specialises on), backward ones per alignment of the gradient.
    Made by :func:`dropout_site`; ``forward`` and ``backward`` launch."""

    __slots__ = ("p", "numel", "threshold", "scale", "keep_like", "fwd", "bwd")

    def __init__(self, x: torch.Tensor, p: float):
        self.p, self.numel, self.threshold, self.scale = p, x.numel(), dropout_threshold(p), dropout_scale(p)
        self.keep_like = expansion(torch.uint8, x.device, tuple(x.shape))  # keep's template (see expansion)
        self.fwd: dict = {}
        self.bwd: dict = {}

    def forward(self, x: torch.Tensor, seed: int):
        """(y, keep as uint8), as dropout_fwd returns them (keep viewed as bool there)."""
        launch = self.fwd.get(int_class(seed))
        if launch is None:
            y, keep = dropout_fwd(x, self.p, seed)
            self.fwd[int_class(seed)] = _FWD_SITES.get((sig(x), self.p, int_class(seed)))
            return y, keep.view(torch.uint8)
        y, keep = _empty_like(x), _empty_like(self.keep_like)
        with on_device(x):
            launch((x, y, keep, self.numel, seed, self.threshold, self.scale))
        return y, keep

    def backward(self, dy: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """dx of what :meth:`forward` returned; dy has y's shape, dtype and device."""
        if not dy.is_contiguous():  # gradients often arrive expanded (stride 0)
            dy = dy.contiguous()
        align = _data_ptr(dy) & 15
        launch = self.bwd.get(align)
        if launch is None:
            dx = dropout_bwd(dy, keep, self.p)
            self.bwd[align] = _BWD_SITES.get((sig(dy), sig(keep), self.p))
            return dx
        dx = _empty_like(dy)
        with on_device(dy):
            launch((dy, keep, dx, self.numel, self.scale))
        return dx


_DROPOUT_SITES: dict = {}


def dropout_site(x: torch.Tensor, p: float) -> DropoutSite | None:
    """The :class:`DropoutSite` of a public dropout call on a plain tensor, or None where the
    call is not of that kind (the general route takes it). Looked up by x's shape, strides,
    dtype, device and alignment, and p."""
    key = (x.shape, x.stride(), x.dtype, x.get_device(), _data_ptr(x) & 15, p)
    site = _DROPOUT_SITES.get(key)
    if site is None:
        ok = x.dtype in _SUPPORTED_DTYPES and x.is_contiguous() and x.numel() > 0 and 0.0 < p < 1.0
        site = DropoutSite(x, p) if ok else False
        remember(_DROPOUT_SITES, key, site)
    return site or None


# --------------------------------------------------------------------------------------
# Compile-check targets
# --------------------------------------------------------------------------------------
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_DATA_TENSORS = ("X", "Y", "DY", "DX")  # in the input dtype


def _target(fn, cfg: DropoutConfig, dtype: str, index_64: bool, divisible: bool) -> dict:
    """One compile-check entry: argument types follow from the argument names."""
    constexprs = dict(BLOCK=cfg.BLOCK, INDEX_64=index_64, RNE_BF16=False)  # GPUs round bf16 themselves
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in _DATA_TENSORS:
            signature[arg] = f"*{dtype}"
        elif arg == "Keep":
            signature[arg] = "*u8"
        elif arg == "numel":
            signature[arg] = "i64" if index_64 else "i32"
        elif arg == "seed":
            # the widest type a seed gets (Triton passes seeds below 2**31 as i32, which only
            # drops the high key word's computation)
            signature[arg] = "i64"
        elif arg == "threshold":
            signature[arg] = "i32"
        else:  # scale
            signature[arg] = "fp32"
    flags = "_".join(f for f, on in (("i64", index_64), ("div16", divisible)) if on) or "plain"
    return dict(
        kernel=fn.__name__, fn=fn, config=f"{cfg.name}_{dtype}_{flags}", signature=signature,
        constexprs=constexprs, num_warps=cfg.num_warps, num_stages=NUM_STAGES, matmul=False,
        # Triton's launcher marks numel divisible by 16 when it is (the usual sizes), which
        # gives unmasked-width vector accesses; odd sizes compile to scalar accesses
        divisible_by_16=["numel"] if divisible else [],
    )


def compile_targets() -> list[dict]:
    """Every shipped kernel configuration, for ``python -m fasttrans compile-check``.

    Per kernel and input dtype: numel divisible by 16 (vector accesses: the common case),
    not divisible (scalar accesses), and the int64-offset variant for numel beyond int32.
    """
    targets = []
    for dtype in _TRITON_DTYPE.values():
        for fn in (_dropout_fwd_kernel, _dropout_bwd_kernel):
            for index_64, divisible in ((False, True), (False, False), (True, True)):
                targets.append(_target(fn, CONFIG, dtype, index_64, divisible))
    return targets
