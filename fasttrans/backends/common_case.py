"""The common case of a public norm or attention call: the tensors the fast eager entries
take as they are (fasttrans.functional's own fast path, the Triton kernels' launch sites,
which ask it once per kind of call; the extension checks the same in C++, csrc/eager.cpp).
Any other call takes the general route, which checks it and reports what is wrong."""

from __future__ import annotations

import torch

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # no subclass: those keep the registered ops
_STRIDED = torch.strided
_INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def plain_vector(p: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """p is None or a plain strided (n,) tensor of unit stride in ``dtype`` on ``device``."""
    return p is None or (type(p) in PLAIN_TENSORS and p.layout is _STRIDED and p.dtype == dtype
                         and p.shape == (n,) and p.stride(0) == 1 and p.device == device)


def norm_tensors(x: torch.Tensor, residual, weight, bias, n: int) -> bool:
    """x a plain strided contiguous tensor of at least one row whose last dim has n > 0
    elements; residual None or a plain contiguous tensor like x; weight and bias as
    :func:`plain_vector` takes them in x's dtype and device."""
    shape, dtype, device = x.shape, x.dtype, x.device
    if (type(x) not in PLAIN_TENSORS or x.layout is not _STRIDED or not shape or shape[-1] != n or n == 0
            or x.numel() == 0 or not x.is_contiguous()):
        return False
    if not (plain_vector(weight, n, dtype, device) and plain_vector(bias, n, dtype, device)):
        return False
    return residual is None or (type(residual) in PLAIN_TENSORS and residual.layout is _STRIDED
                                and residual.dtype == dtype and residual.shape == shape
                                and residual.device == device and residual.is_contiguous())


def attention_tensors(q, k, v, attn_mask, key_lengths, max_head_dim: int) -> bool:
    """q (B, H, Lq, D) and k, v (B, Hkv, Lk, D) plain strided tensors of one float dtype and
    device with unit inner stride, none of the sizes zero, Hkv dividing H, D at most
    max_head_dim; attn_mask None, or a plain strided bool mask or one in q's dtype or fp32
    on q's device, broadcastable to (B, H, Lq, Lk); key_lengths None or a plain strided (B,)
    integer tensor on q's device (its values are the caller's to check)."""
    dtype, device = q.dtype, q.device
    for t in (q, k, v):
        if (type(t) not in PLAIN_TENSORS or t.layout is not _STRIDED or t.dim() != 4 or t.stride(3) != 1
                or t.dtype != dtype or t.device != device):
            return False
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if (0 in (B, H, Lq, D, Hkv, Lk) or D > max_head_dim or H % Hkv or k.shape[0] != B or k.shape[3] != D
            or v.shape != k.shape):
        return False
    m = attn_mask
    if m is not None and (type(m) not in PLAIN_TENSORS or m.layout is not _STRIDED or m.dim() > 4
                          or m.device != device or m.dtype not in (torch.bool, dtype, torch.float32)
                          or any(size not in (1, full) for size, full in zip(reversed(m.shape), (Lk, Lq, H, B)))):
        return False
    t = key_lengths
    return t is None or (type(t) in PLAIN_TENSORS and t.layout is _STRIDED and t.dim() == 1 and t.shape[0] == B
                         and t.device == device and t.dtype in _INTEGER_DTYPES)
