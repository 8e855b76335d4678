"""Pure-PyTorch reference implementations: the oracle every backend is tested against.

Written for clarity, not speed: attention materialises the full (B, H, Lq, Lk) score
matrix, and every mask kind of the op contract (docs/design.md) is applied in the most
literal way. Nothing here is fused and nothing is clever.

Shapes
------
q            (B, H, Lq, D)
k, v         (B, Hkv, Lk, D)          H % Hkv == 0 (grouped-query attention)
attn_mask    broadcastable to (B, H, Lq, Lk); bool (True = may attend) or float (added)
key_lengths  (B,) integer; key j of batch b is masked when j >= key_lengths[b]
dropout_mask (B, H, Lq, Lk) bool keep-mask (True = keep), or None
"""

from __future__ import annotations

import math

import torch

from .dropout_spec import FLAT_DOMAIN, dropout_threshold  # noqa: F401  (the shared definition)

__all__ = [
    "attention",
    "attention_with_lse",
    "attention_probs",
    "allowed_mask",
    "layer_norm",
    "add_layer_norm",
    "rms_norm",
    "attention_dropout_keep",
    "dropout_keep",
    "philox4x32_10",
    "accumulation_dtype",
]


def allowed_mask(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    *,
    attn_mask: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool (B, H, Lq, Lk): True where query i may attend key j under the *boolean* masks.

    A float ``attn_mask`` is additive and therefore not part of this mask (its -inf
    entries are handled by the softmax in :func:`attention_with_lse`).
    """
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=device)
    if is_causal:
        i = torch.arange(Lq, device=device).view(Lq, 1)
        j = torch.arange(Lk, device=device).view(1, Lk)
        allowed = allowed & (j <= i + causal_offset)  # (Lq, Lk) broadcast
    if key_lengths is not None:
        j = torch.arange(Lk, device=device).view(1, 1, 1, Lk)
        allowed = allowed & (j < key_lengths.to(device).view(B, 1, 1, 1))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    return allowed


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype statistics and sums are taken in: float64 for float64 tensors, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _compute_dtype(q: torch.Tensor, upcast: bool) -> torch.dtype:
    return accumulation_dtype(q) if upcast else q.dtype


def _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast=True):
    """fp32 scores (B, H, Lq, Lk) with -inf where masked, and the bool allowed mask."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # expand k to H heads for grouped-query attention: head h reads kv head h // (H // Hkv)
    k = k.repeat_interleave(H // max(Hkv, 1), dim=1)  # (B, H, Lk, D); no heads at all: H = Hkv = 0
    acc = _compute_dtype(q, upcast)  # fp32 (fp64 for fp64) unless asked for the low-precision baseline
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(s.dtype)
    allowed = allowed_mask(
        B, H, Lq, Lk,
        attn_mask=attn_mask, key_lengths=key_lengths,
        is_causal=is_causal, causal_offset=causal_offset, device=q.device,
    )
    s = s.masked_fill(~allowed, float("-inf"))
    return s


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    scale: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Softmax probabilities (B, H, Lq, Lk) in fp32 (fp64 for fp64 inputs; q's dtype if not upcast).

    Rows where no key is allowed (every score -inf) are all zeros, not NaN.
    """
    s = _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast)
    if s.shape[-1] == 0:  # no keys at all: every row is fully masked
        return s.clone()
    row_max = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(row_max)  # (B, H, Lq, 1): fully masked rows
    p = torch.exp(s - torch.where(empty, torch.zeros_like(row_max), row_max))
    denom = p.sum(dim=-1, keepdim=True)
    return torch.where(empty, torch.zeros_like(p), p / torch.where(empty, torch.ones_like(denom), denom))


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
    dropout_mask: torch.Tensor | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, H, Lq, D) in q's dtype, and the fp32 log-sum-exp (B, H, Lq).

    out = dropout(softmax(q k^T * scale + float_mask, masked)) @ v, where dropout keeps the
    entries of ``dropout_mask`` and rescales them by 1 / (1 - dropout_p). A row with no
    allowed key has output 0 and log-sum-exp +inf (so exp(s - lse) recomputes to 0).

    ``upcast=False`` computes everything in the input dtype: the "same-precision PyTorch"
    baseline of the low-precision error rule used by the tests.
    """
    s = _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq); -inf on fully masked rows
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    p = attention_probs(
        q, k, attn_mask=attn_mask, key_lengths=key_lengths,
        is_causal=is_causal, causal_offset=causal_offset, scale=scale, upcast=upcast,
    )
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("reference.attention: dropout_p > 0 needs an explicit dropout_mask")
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    H, Hkv = q.shape[1], k.shape[1]
    v = v.repeat_interleave(H // max(Hkv, 1), dim=1)  # (B, H, Lk, D)
    out = torch.matmul(p, v.to(p.dtype))  # (B, H, Lq, D)
    return out.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse


def attention(q, k, v, **kwargs) -> torch.Tensor:
    """Attention output only; see :func:`attention_with_lse` for the arguments."""
    return attention_with_lse(q, k, v, **kwargs)[0]


def layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, statistics in fp32 (two-pass).

    The mean is taken of the values shifted by each row's first one (a constant, so the
    gradients are unchanged): a row of one repeated value then has exactly that mean and
    variance 0, instead of the rounding noise of ``sum / N``.
    """
    dims = tuple(range(-len(normalized_shape), 0))
    xf = x.to(accumulation_dtype(x))
    shift = xf[(..., *(slice(0, 1),) * len(dims))].detach()  # each row's first value, kept dims
    mean = shift + (xf - shift).mean(dim=dims, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=dims, keepdim=True)  # centred: no E[x²]−E[x]² cancellation
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (in x's dtype), y = LayerNorm(h) over the last dim. Returns (y, h)."""
    h = x + residual
    return layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """RMSNorm as ``F.rms_norm``: x / sqrt(mean(x²) + eps) * weight; eps=None means the
    machine epsilon of the statistics' dtype (float32's for float16/bfloat16), as torch computes."""
    dims = tuple(range(-len(normalized_shape), 0))
    if eps is None:
        eps = torch.finfo(accumulation_dtype(x)).eps
    xf = x.to(accumulation_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------
# Dropout keep-masks: csrc/philox.h's definitions, in torch integer arithmetic
# --------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (Weyl sequence)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m, for int64 a < 2^32 and m < 2^32, from 16-bit
    halves (the 64-bit product itself would overflow int64)."""
    ah, al = a >> 16, a & 0xFFFF
    mh, ml = m >> 16, m & 0xFFFF
    mid = ah * ml + al * mh
    low = al * ml + ((mid & 0xFFFF) << 16)
    return (ah * mh + (mid >> 16) + (low >> 32)) & _MASK32, low & _MASK32


def philox4x32_10(c0, c1, c2, c3, seed: int) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the counter words (int64 tensors of 32-bit values, broadcast
    together) with the key (seed mod 2^32, seed div 2^32): the four output words."""
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def _keep(words: tuple[torch.Tensor, ...], n: int, p: float) -> torch.Tensor:
    """Interleave the words of consecutive groups (group g gives elements 4g .. 4g+3) along
    the last dim, keep the first n, compare."""
    word = torch.stack(words, dim=-1).flatten(-2)[..., :n]
    return (word >> 8) >= dropout_threshold(p)


def attention_dropout_keep(seed: int, p: float, B: int, H: int, Lq: int, Lk: int,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """The (B, H, Lq, Lk) bool keep-mask of attention dropout: keep(b, h, i, j) is word j % 4
    of Philox4x32-10 at the counter (j // 4, i, h, b), the mask every backend draws."""
    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=device).view(shape)

    words = philox4x32_10(index((Lk + 3) // 4, 3), index(Lq, 2), index(H, 1), index(B, 0), seed)
    return _keep(words, Lk, p)


def dropout_keep(seed: int, p: float, shape, device: torch.device | str | None = None) -> torch.Tensor:
    """The bool keep-mask of elementwise dropout over a tensor of ``shape`` (flat index e in
    memory order): word e % 4 of Philox4x32-10 at (g mod 2^32, g div 2^32, 0, FLAT_DOMAIN),
    g = e // 4, the mask every backend draws."""
    n = math.prod(shape)
    g = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    words = philox4x32_10(g & _MASK32, g >> 32, zero, zero + FLAT_DOMAIN, seed)
    return _keep(words, n, p).view(shape)
