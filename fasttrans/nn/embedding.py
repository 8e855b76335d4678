"""Seed building blocks: token embedding and sinusoidal positional encoding.

Both work on batch-first tensors: tokens (B, L) -> embeddings (B, L, d_model).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._script import NotScriptable
from .dropout import Dropout

__all__ = ["TokenEmbedding", "PositionalEncoding", "sinusoidal_table"]

_VARIANTS = ("paper", "double_exponent", "cos_sin")


class TokenEmbedding(nn.Module):
    """``nn.Embedding`` with an optional ``sqrt(d_model)`` scale (section 3.4 of the paper).

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        padding_idx: id whose row is zero and receives no gradient (as in ``nn.Embedding``);
            seed 003 uses 1, seeds 000/004 pad with 0, seed 001 has no padding.
        scale: multiply the looked-up rows by ``sqrt(d_model)``, as the paper and seed 002 do.
            Seeds 000, 001, 003 and 004 do not scale.
        init_std: standard deviation of the initial weights; None keeps ``nn.Embedding``'s
            N(0, 1). With ``scale=True`` the usual choice is ``d_model ** -0.5``, so that the
            scaled rows are N(0, 1) again and the same size as the positional encoding.

    Shapes: tokens (B, L) int64 -> (B, L, d_model).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        padding_idx: int | None = None,
        scale: bool = False,
        init_std: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if vocab_size <= 0 or d_model <= 0:
            raise ValueError(f"vocab_size, d_model: expected positive sizes, got {vocab_size} and {d_model}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.scale = scale
        self.init_std = init_std
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx, device=device, dtype=dtype)
        self.reset_parameters()

    @property
    def padding_idx(self) -> int | None:
        return self.embedding.padding_idx

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def reset_parameters(self) -> None:
        if self.init_std is None:
            self.embedding.reset_parameters()
            return
        nn.init.normal_(self.embedding.weight, std=self.init_std)
        if self.embedding.padding_idx is not None:
            with torch.no_grad():
                self.embedding.weight[self.embedding.padding_idx].zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (B, L, d_model)
        return x * math.sqrt(self.d_model) if self.scale else x

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.d_model}, padding_idx={self.padding_idx}, scale={self.scale}"


def sinusoidal_table(max_len: int, d_model: int, variant: str = "paper") -> torch.Tensor:
    """The (max_len, d_model) fp32 sinusoid table.

    ``paper`` (section 3.5; seeds 001 and 003)::

        PE[pos, 2i]     = sin(pos / 10000^(2i / d_model))
        PE[pos, 2i + 1] = cos(pos / 10000^(2i / d_model))

    ``double_exponent`` (seed 000): the loop index already steps over even columns, and the
    exponent doubles it again, ``10000^(2 * 2i / d_model)``; the wavelengths reach
    10000^2 instead of 10000, so the slow half of the columns barely moves.
    ``cos_sin`` (seed 002): cosine in the even columns and sine in the odd ones.
    An odd d_model is allowed: the last (even) column is a sine.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(_VARIANTS)}, got {variant!r}")
    if max_len <= 0 or d_model <= 0:
        raise ValueError(f"max_len, d_model: expected positive sizes, got {max_len} and {d_model}")
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(d/2),): the even column indices
    exponent = two_i / d_model if variant != "double_exponent" else 2 * two_i / d_model
    angle = position * 10000.0 ** -exponent  # (max_len, ceil(d/2)), in fp64 so large positions stay exact
    first, second = (torch.cos, torch.sin) if variant == "cos_sin" else (torch.sin, torch.cos)
    pe = torch.empty(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = first(angle)
    pe[:, 1::2] = second(angle[:, : d_model // 2])
    return pe.float()


class PositionalEncoding(NotScriptable, nn.Module):
    """Adds the fixed sinusoidal encoding to embeddings, then applies dropout.

    Args:
        d_model: embedding width.
        dropout: dropout on the sum, as in every seed that has one (paper: 0.1).
        max_len: longest sequence; the table is a non-persistent buffer of (max_len, d_model)
            (it is a function of the arguments, so it is not stored in checkpoints).
        variant: ``"paper"`` (default), or a seed's formula: ``"double_exponent"`` (seed 000)
            or ``"cos_sin"`` (seed 002); see :func:`sinusoidal_table`.

    forward(x, offset=0): x (B, L, d_model) -> x + PE[offset : offset + L], dropped out.
    ``offset`` is the position of x's first row, for decoding one step at a time.
    """

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000, variant: str = "paper") -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.variant = variant
        self.dropout = Dropout(dropout)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model, variant), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected shape (B, L, {self.d_model}), got {tuple(x.shape)}")
        length = x.shape[1]
        if offset < 0 or offset + length > self.max_len:
            raise ValueError(
                f"positions {offset}..{offset + length - 1} exceed max_len={self.max_len} of the positional encoding"
            )
        pe = self.pe[offset : offset + length].to(x.dtype)  # (L, d_model), broadcast over the batch
        return self.dropout(x + pe)

    def extra_repr(self) -> str:
        return f"{self.d_model}, max_len={self.max_len}, variant={self.variant!r}"
