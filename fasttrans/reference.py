"""Pure-PyTorch reference implementations: the oracle every backend is tested against.

Written for clarity, not speed: attention materialises the full (B, H, Lq, Lk) score
matrix, and every mask kind of the op contract (docs/design.md) is applied in the most
literal way. Nothing here is fused and nothing is clever. :class:`ReferenceImpl` (at the end)
is the reference backend: these functions behind the backend interface of fasttrans.backends,
with the backward formulas written out.

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

from .dropout_spec import FLAT_DOMAIN, attention_dropout_threshold, dropout_threshold  # noqa: F401

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
    "ReferenceImpl",
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


def _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast=True, softcap=0.0):
    """fp32 scores (B, H, Lq, Lk) with -inf where masked; soft-capped (before the masks) when softcap > 0."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # expand k to H heads for grouped-query attention: head h reads kv head h // (H // Hkv)
    k = k.repeat_interleave(H // max(Hkv, 1), dim=1)  # (B, H, Lk, D); no heads at all: H = Hkv = 0
    acc = _compute_dtype(q, upcast)  # fp32 (fp64 for fp64) unless asked for the low-precision baseline
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
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
    softcap: float = 0.0,
) -> torch.Tensor:
    """Softmax probabilities (B, H, Lq, Lk) in fp32 (fp64 for fp64 inputs; q's dtype if not upcast).

    Rows where no key is allowed (every score -inf) are all zeros, not NaN.
    """
    s = _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast, softcap)
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
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, H, Lq, D) in q's dtype, and the fp32 log-sum-exp (B, H, Lq).

    out = dropout(softmax(q k^T * scale + float_mask, masked)) @ v, where dropout keeps the
    entries of ``dropout_mask`` and rescales them by 1 / (1 - dropout_p). A row with no
    allowed key has output 0 and log-sum-exp +inf (so exp(s - lse) recomputes to 0).

    ``sinks`` (H,), or broadcastable to (B, H, Lq): one more logit per query head (or row) in
    every row's softmax, whose weight goes to no value (gpt-oss's attention sinks); the
    log-sum-exp includes it, and a row with no allowed key gives the sink all its weight:
    output 0.

    ``softcap`` > 0 soft-caps the scaled scores before the masks, as Gemma 2 does:
    softcap * tanh(q k^T * scale / softcap); 0 leaves them as they are.

    ``upcast=False`` computes everything in the input dtype: the "same-precision PyTorch"
    baseline of the low-precision error rule used by the tests.
    """
    s = _scores(q, k, attn_mask, key_lengths, is_causal, causal_offset, scale, upcast, softcap)
    if sinks is not None:
        B, H, Lq, _ = s.shape
        rows = sinks.view(1, H, 1) if sinks.dim() == 1 else sinks  # (H,): one per head
        column = rows.to(s.dtype).unsqueeze(-1).expand(B, H, Lq, 1)
        lse = torch.logsumexp(torch.cat([s, column], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    # -inf on rows with no allowed key (and no sink, or one of -inf): +inf, so that exp(s - lse) is 0
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    if sinks is not None:
        p = torch.exp(s - lse.unsqueeze(-1))
    else:
        p = attention_probs(
            q, k, attn_mask=attn_mask, key_lengths=key_lengths,
            is_causal=is_causal, causal_offset=causal_offset, scale=scale, upcast=upcast, softcap=softcap,
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
    """The (B, H, Lq, Lk) bool keep-mask of attention dropout, the mask every backend draws
    (csrc/philox.h): Philox4x32-10 at the counter (8 (i // 16) + i % 8, h, b, 4 (j // 16) +
    j % 8 // 2) decides rows (i, i + 8) x keys (j, j + 1, j + 8, j + 9) of a 16 x 16 block;
    score (i, j) takes the 16-bit half j % 2 of word 2 (i // 8 % 2) + j // 8 % 2."""
    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=device).view(shape)

    # one call per counter, as the kernels make: (B, H, row groups, key groups, word)
    words = torch.stack(philox4x32_10(index(8 * -(-Lq // 16), 2), index(H, 1), index(B, 0),
                                      index(4 * -(-Lk // 16), 3), seed), dim=-1)
    i = torch.arange(Lq, dtype=torch.int64, device=device)[:, None]
    j = torch.arange(Lk, dtype=torch.int64, device=device)[None, :]
    word = words[:, :, 8 * (i // 16) + i % 8, 4 * (j // 16) + j % 8 // 2, 2 * (i // 8 % 2) + j // 8 % 2]
    return ((word >> (16 * (j % 2))) & 0xFFFF) >= attention_dropout_threshold(p)


def dropout_keep(seed: int, p: float, shape, device: torch.device | str | None = None) -> torch.Tensor:
    """The bool keep-mask of elementwise dropout over a tensor of ``shape`` (flat index e in
    memory order): word e % 4 of Philox4x32-10 at (g mod 2^32, g div 2^32, 0, FLAT_DOMAIN),
    g = e // 4, the mask every backend draws."""
    n = math.prod(shape)
    g = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    words = philox4x32_10(g & _MASK32, g >> 32, zero, zero + FLAT_DOMAIN, seed)
    return _keep(words, n, p).view(shape)


# --------------------------------------------------------------------------------------
# The backend interface (fasttrans.backends) on these functions, with explicit backward
# formulas: the reference backend
# --------------------------------------------------------------------------------------
class ReferenceImpl:
    """Backend interface on top of fasttrans.reference; gradients by autograd on recompute."""

    # whole-op forms for fasttrans.functional's fallbacks (empty inputs, torch.func transforms),
    # reached through backends.reference_impl(): plain PyTorch that autograd sees through
    attention_probs = staticmethod(attention_probs)
    layer_norm = staticmethod(layer_norm)
    add_layer_norm = staticmethod(add_layer_norm)
    rms_norm = staticmethod(rms_norm)
    accumulation_dtype = staticmethod(accumulation_dtype)

    @staticmethod
    def attention_dropout_mask(q, k, dropout_p, seed):
        B, H, Lq, _ = q.shape
        return attention_dropout_keep(int(seed), dropout_p, B, H, Lq, k.shape[2], q.device)

    @classmethod
    def _keep(cls, q, k, dropout_p, seed):
        return cls.attention_dropout_mask(q, k, dropout_p, seed) if dropout_p > 0 else None

    @classmethod
    def attention_fwd(cls, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
                      softcap=0.0):
        return attention_with_lse(
            q, k, v, attn_mask=attn_mask, key_lengths=key_lengths, is_causal=is_causal,
            causal_offset=causal_offset, dropout_p=dropout_p, scale=scale,
            dropout_mask=cls._keep(q, k, dropout_p, seed), softcap=softcap,
        )

    @classmethod
    def attention_with_sinks(cls, q, k, v, attn_mask, sinks, key_lengths, is_causal, causal_offset, dropout_p, scale,
                             seed, softcap=0.0):
        """attention_fwd's output with the sink logits ``sinks``, (H,) or broadcastable to
        (B, H, Lq), in PyTorch ops that autograd differentiates (sinks included)."""
        return attention_with_lse(
            q, k, v, attn_mask=attn_mask, key_lengths=key_lengths, is_causal=is_causal,
            causal_offset=causal_offset, dropout_p=dropout_p, scale=scale,
            dropout_mask=cls._keep(q, k, dropout_p, seed), sinks=sinks, softcap=softcap,
        )[0]

    @classmethod
    def attention_bwd(cls, dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
                      dropout_p, scale, seed, mask_grad, softcap=0.0):
        # Explicit formulas (custom-op bodies run below autograd, so no autograd here):
        #   P = softmax(S), Pd = P * keep / (1 - p), O = Pd V
        #   dV = Pd^T dO      dPd = dO V^T      dP = dPd * keep / (1 - p)
        #   dS = P * (dP - rowsum(dO * O))      dQ = scale dS K      dK = scale dS^T Q
        # and dS is also the gradient of an additive float mask. Soft-capped scores,
        # S = c tanh(R / c) with R = scale q k^T, multiply dS by dS/dR = 1 - tanh(R / c)^2.
        B, H, Lq, D = q.shape
        group = H // k.shape[1]
        acc = accumulation_dtype(q)
        p = attention_probs(
            q, k, attn_mask=attn_mask, key_lengths=key_lengths, is_causal=is_causal,
            causal_offset=causal_offset, scale=scale, softcap=softcap,
        ).to(acc)  # (B, H, Lq, Lk)
        keep = cls._keep(q, k, dropout_p, seed)
        drop = keep.to(acc) / (1.0 - dropout_p) if keep is not None else None
        pd = p * drop if drop is not None else p
        kf = k.to(acc).repeat_interleave(group, dim=1)  # (B, H, Lk, D)
        vf = v.to(acc).repeat_interleave(group, dim=1)
        do = dout.to(acc)
        dv = pd.transpose(-1, -2) @ do  # (B, H, Lk, D)
        dp = do @ vf.transpose(-1, -2)  # (B, H, Lq, Lk)
        if drop is not None:
            dp = dp * drop
        delta = (do * out.to(acc)).sum(-1, keepdim=True)  # (B, H, Lq, 1)
        ds = p * (dp - delta)
        dmask = ds if mask_grad else None  # fp32 (fp64 for fp64 inputs)
        if softcap:
            ds = ds * (1.0 - torch.tanh(torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale / softcap).square())
        dq = scale * ds @ kf
        dk = scale * ds.transpose(-1, -2) @ q.to(acc)

        def per_kv_head(t):  # (B, H, Lk, D) -> (B, Hkv, Lk, D): sum over the query heads of a group
            return t.view(B, H // group, group, *t.shape[2:]).sum(2)

        return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype), dmask

    @staticmethod
    def norm_fwd(x, residual, weight, bias, eps, rms):
        h = x + residual if residual is not None else x
        hf = h.to(accumulation_dtype(h))
        if rms:
            mean = None
            rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
            y = rms_norm(h, (h.shape[-1],), weight, eps)
        else:
            mean = hf.mean(-1)
            rstd = torch.rsqrt((hf - mean[:, None]).pow(2).mean(-1) + eps)
            y = layer_norm(h, (h.shape[-1],), weight, bias, eps)
        return y, (h if residual is not None else None), mean, rstd

    @staticmethod
    def norm_bwd(dy, dh, h, weight, bias, mean, rstd, rms):
        # d/dh of y = xhat * w + b with xhat = (h - mean) * rstd (mean = 0 for RMSNorm):
        #   dxhat = dy * w
        #   dh    = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   [LayerNorm]
        #   dh    = rstd * (dxhat - xhat * mean(dxhat * xhat))                 [RMSNorm]
        # LayerNorm re-centres xhat. The saved mean is rounded (δ ≈ ulp(mean) / 2), which
        # shifts every xhat by δ·rstd and dx by up to δ·rstd²·|dxhat|: on rows whose spread is
        # small against their mean, with var near eps, that is a large part of dx itself (the
        # terms of dx nearly cancel there). mean(xhat), 0 in exact arithmetic, measures the
        # shift; subtracting it took the p99 relative dx error over such rows from 1e-4 to
        # 6e-7 (a probe over 2,000 random batches; tests/test_functional.py::
        # test_norm_backward_on_rows_near_their_mean checks such rows against torch's error).
        acc = accumulation_dtype(h)
        hf, dyf = h.to(acc), dy.to(acc)
        xhat = (hf if rms else hf - mean[:, None]) * rstd[:, None]
        if not rms:
            xhat = xhat - xhat.mean(-1, keepdim=True)
        dxhat = dyf * weight.to(acc) if weight is not None else dyf
        proj = (dxhat * xhat).mean(-1, keepdim=True)
        centred = dxhat if rms else dxhat - dxhat.mean(-1, keepdim=True)
        dx = rstd[:, None] * (centred - xhat * proj)
        if dh is not None:
            dx = dx + dh.to(acc)
        dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
        db = dyf.sum(0).to(bias.dtype) if bias is not None else None
        return dx.to(h.dtype), dw, db

    @staticmethod
    def _dropout_scale(x, p):
        acc = accumulation_dtype(x)
        return acc, torch.tensor(1.0 / (1.0 - p), dtype=acc).item()  # 1/(1-p) rounded to acc

    @classmethod
    def dropout_fwd(cls, x, p, seed):
        keep = dropout_keep(int(seed), p, x.shape, x.device)
        return cls.dropout_bwd(x, keep, p), keep

    @classmethod
    def dropout_bwd(cls, dy, keep, p):
        acc, scale = cls._dropout_scale(dy, p)
        factor = keep.to(acc) * scale  # a product, not a select: a dropped inf or NaN gives NaN
        return (dy.to(acc) * factor).to(dy.dtype)
