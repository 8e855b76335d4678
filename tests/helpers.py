"""Shared test utilities: the low-precision error rule and mask factories."""

from __future__ import annotations

import torch

# Per-dtype floor added to the 2x rule: absolute error a correct kernel may always have.
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close_lowp(name: str, out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None, dtype=None):
    """flash-attention's rule: max|out - ref| <= 2 * max|baseline - ref| + floor.

    ``ref`` is computed in fp32 (fp64) from the same inputs; ``baseline`` is PyTorch in the
    same low precision as ``out`` (None for fp32/fp64, where the floor alone applies).
    """
    dtype = dtype or out.dtype
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    base = (baseline.double() - ref.double()).abs().max().item() if baseline is not None and out.numel() else 0.0
    bound = 2 * base + FLOOR[dtype] * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (baseline error {base:.3e})"


MASK_KINDS = ("none", "bool", "float", "key_lengths", "causal", "all")


def make_key_lengths(B: int, Lk: int, device, *, zero: bool = False) -> torch.Tensor:
    """(B,) int lengths in [0, Lk], including Lk itself and (optionally) 0."""
    kl = torch.randint(0, Lk + 1, (B,), device=device)
    kl[0] = Lk
    if zero and B > 1:
        kl[1] = 0
    return kl


def make_bool_mask(shape, device, p_keep: float = 0.7) -> torch.Tensor:
    return torch.rand(shape, device=device) < p_keep


def make_float_mask(shape, device, dtype=torch.float32, neg_inf_frac: float = 0.1) -> torch.Tensor:
    m = torch.randn(shape, device=device, dtype=dtype)
    return m.masked_fill(torch.rand(shape, device=device) < neg_inf_frac, float("-inf"))
