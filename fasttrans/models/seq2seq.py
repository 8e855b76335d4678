"""The seeds' encoder-decoder model, built on the drop-in ``fasttrans.nn.Transformer``.

    tokens ─► TokenEmbedding ─► PositionalEncoding ─► Transformer ─► generator ─► logits
    (B, L)     (B, L, d_model)                         (B, T, d_model)  (B, T, tgt_vocab)

Padding masks come from the pad indices (True = pad, torch.nn's convention), the target
gets the causal mask, and the memory is masked where the source is padded. Everything is
batch-first. ``generate`` decodes greedily with a key/value cache (fasttrans.models.decoding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..nn import PositionalEncoding, TokenEmbedding, Transformer

__all__ = ["Seq2SeqConfig", "Seq2SeqTransformer"]


@dataclasses.dataclass
class Seq2SeqConfig:
    """Everything needed to rebuild a Seq2SeqTransformer (stored in checkpoints as a dict).

    The Transformer fields carry torch.nn.Transformer's names and defaults (the paper's base
    model). The others:

        tgt_vocab_size      None: same as src_vocab_size.
        src_pad_idx, tgt_pad_idx
                            token ids that are padding (masked as keys, zero embedding rows);
                            None: the sequences are never padded (seed 001).
        share_embeddings    one TokenEmbedding for source and target (seeds 001 and 002);
                            needs equal vocabularies and pad indices.
        scale_embedding     multiply embeddings by sqrt(d_model) (paper, seed 002).
        embedding_init_std  initial std of the embedding rows; None: N(0, 1) (nn.Embedding),
                            or d_model ** -0.5 when scale_embedding, so that scaled token
                            vectors and the positional encoding have comparable size.
        positional_variant  "paper", or a seed's formula ("double_exponent", "cos_sin").
        max_len             longest sequence the positional encoding covers.
        log_softmax         the generator returns log-probabilities (seed 002) instead of logits.
    """

    src_vocab_size: int
    tgt_vocab_size: int | None = None
    d_model: int = 512
    nhead: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    bias: bool = True
    src_pad_idx: int | None = None
    tgt_pad_idx: int | None = None
    share_embeddings: bool = False
    scale_embedding: bool = True
    embedding_init_std: float | None = None
    positional_variant: str = "paper"
    max_len: int = 5000
    log_softmax: bool = False

    def __post_init__(self) -> None:
        if self.tgt_vocab_size is None:
            self.tgt_vocab_size = self.src_vocab_size
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "nhead", "num_encoder_layers",
                     "num_decoder_layers", "dim_feedforward", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.d_model % self.nhead != 0:
            raise ValueError(f"d_model: expected a multiple of nhead ({self.nhead}), got {self.d_model}")
        for name in ("src_pad_idx", "tgt_pad_idx"):
            idx, size = getattr(self, name), self.src_vocab_size if name == "src_pad_idx" else self.tgt_vocab_size
            if idx is not None and not 0 <= idx < size:
                raise ValueError(f"{name}: expected an id in [0, {size}), got {idx}")
        if self.share_embeddings and (
            self.src_vocab_size != self.tgt_vocab_size or self.src_pad_idx != self.tgt_pad_idx
        ):
            raise ValueError(
                "share_embeddings: needs src_vocab_size == tgt_vocab_size and src_pad_idx == tgt_pad_idx, got "
                f"{self.src_vocab_size}/{self.tgt_vocab_size} and {self.src_pad_idx}/{self.tgt_pad_idx}"
            )
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"activation: expected 'relu' or 'gelu', got {self.activation!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Seq2SeqConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model config: unknown fields {unknown}")
        return cls(**d)


class Seq2SeqTransformer(nn.Module):
    """Token-level encoder-decoder Transformer (the model of every seed).

    Shapes (batch first):
        src (B, S) and tgt (B, T) int64 token ids
        forward(src, tgt) -> (B, T, tgt_vocab_size) logits (log-probabilities if log_softmax)
        encode(src) -> memory (B, S, d_model)
        decode(tgt, memory, memory_key_padding_mask) -> (B, T, d_model) decoder states
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        init_std = c.embedding_init_std
        if init_std is None and c.scale_embedding:
            init_std = c.d_model**-0.5
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model, c.src_pad_idx, c.scale_embedding, init_std)
        self.tgt_embed = (
            self.src_embed
            if c.share_embeddings
            else TokenEmbedding(c.tgt_vocab_size, c.d_model, c.tgt_pad_idx, c.scale_embedding, init_std)
        )
        self.positional_encoding = PositionalEncoding(c.d_model, c.dropout, c.max_len, c.positional_variant)
        self.transformer = Transformer(
            d_model=c.d_model,
            nhead=c.nhead,
            num_encoder_layers=c.num_encoder_layers,
            num_decoder_layers=c.num_decoder_layers,
            dim_feedforward=c.dim_feedforward,
            dropout=c.dropout,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
            bias=c.bias,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)

    # ---------------------------------------------------------------------------------
    # masks
    # ---------------------------------------------------------------------------------
    def src_padding_mask(self, src: torch.Tensor) -> torch.Tensor | None:
        """(B, S) bool, True at padding; None when the source has no pad index."""
        return None if self.config.src_pad_idx is None else src == self.config.src_pad_idx

    def tgt_padding_mask(self, tgt: torch.Tensor) -> torch.Tensor | None:
        """(B, T) bool, True at padding; None when the target has no pad index."""
        return None if self.config.tgt_pad_idx is None else tgt == self.config.tgt_pad_idx

    @staticmethod
    def causal_mask(length: int, device=None) -> torch.Tensor:
        """(T, T) bool mask, True above the diagonal (blocked), in torch.nn's convention.

        Bool rather than generate_square_subsequent_mask's float form, so that it has the
        dtype of the bool padding masks (torch.nn warns when the two differ).
        """
        return torch.ones(length, length, dtype=torch.bool, device=device).triu_(1)

    # ---------------------------------------------------------------------------------
    # model
    # ---------------------------------------------------------------------------------
    def _check_tokens(self, name: str, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"{name}: expected (batch, length) token ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: expected int64 token ids, got {tokens.dtype}")
        if tokens.shape[1] > self.config.max_len:
            raise ValueError(f"{name}: length {tokens.shape[1]} exceeds max_len={self.config.max_len}")

    def encode(self, src: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Memory (B, S, d_model). The padding mask defaults to ``src == src_pad_idx``."""
        self._check_tokens("src", src)
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_padding_mask(src)
        x = self.positional_encoding(self.src_embed(src))  # (B, S, d_model)
        return self.transformer.encoder(x, src_key_padding_mask=src_key_padding_mask)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        memory_key_padding_mask: torch.Tensor | None = None,
        tgt_key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder states (B, T, d_model) under the causal mask; apply ``generator`` for logits.

        ``tgt_key_padding_mask`` defaults to ``tgt == tgt_pad_idx``; the memory mask must be
        given (it is the source's padding mask, see ``encode``).
        """
        self._check_tokens("tgt", tgt)
        if tgt_key_padding_mask is None:
            tgt_key_padding_mask = self.tgt_padding_mask(tgt)
        length = tgt.shape[1]
        y = self.positional_encoding(self.tgt_embed(tgt))  # (B, T, d_model)
        return self.transformer.decoder(
            y,
            memory,
            tgt_mask=self.causal_mask(length, device=tgt.device),
            tgt_is_causal=True,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """Decoder states -> logits, or log-probabilities when ``config.log_softmax``."""
        logits = self.generator(states)
        return torch.log_softmax(logits, dim=-1) if self.config.log_softmax else logits

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_key_padding_mask: torch.Tensor | None = None,
        tgt_key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits (B, T, tgt_vocab_size) for target inputs ``tgt``.

        Padding masks default to the pad indices; pass them explicitly to mask other positions.
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.src_padding_mask(src)
        memory = self.encode(src, src_key_padding_mask)
        states = self.decode(tgt, memory, src_key_padding_mask, tgt_key_padding_mask)
        return self.project(states)

    @torch.no_grad()
    def generate(
        self,
        src: torch.Tensor,
        max_new_tokens: int,
        bos_idx: int,
        eos_idx: int | None = None,
        *,
        use_cache: bool = True,
        return_logits: bool = False,
        src_key_padding_mask: torch.Tensor | None = None,
    ):
        """Greedy decoding; see :func:`fasttrans.models.decoding.greedy_decode`."""
        from .decoding import greedy_decode

        return greedy_decode(
            self, src, max_new_tokens, bos_idx, eos_idx,
            use_cache=use_cache, return_logits=return_logits, src_key_padding_mask=src_key_padding_mask,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
