"""Greedy decoding with a key/value cache, on the fused ops.

Re-decoding the whole prefix at every step costs O(T^2) decoder positions for T tokens.
The cache makes each step cost one position:

* cross-attention keys/values are a function of the memory alone: projected once per
  layer, before the first step;
* self-attention keys/values of earlier positions never change (the decoder is causal):
  each step appends the new positions' k/v and attends with the *bottom-right* causal
  mask, ``fasttrans.attention(q, k, v, is_causal=True, causal_offset=Lk - Lq)``, so new
  query i (absolute position Lk - Lq + i) sees keys 0 .. Lk - Lq + i.

The layer math is the decoder layer's own, re-expressed on its public parameters (torch's
names: ``self_attn.in_proj_weight``, ``multihead_attn``, ``linear1``, ``linear2``,
``norm1..3``, ``norm_first``, ``activation``) with ``fasttrans.attention`` and
``fasttrans.add_layer_norm`` (residual add + LayerNorm in one pass). Dropout is not applied:
decoding always runs the model as in eval mode. On the CPU extension, with nothing to
differentiate, each layer's step is one call of ``fasttrans::decoder_layer_step_fwd_extension``
(csrc/layer_cpu.cpp): the same op calls in C++, bit for bit :func:`_layer_step`, without
its Python work (see fasttrans/nn/fused_inference.py for where it applies).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import functional as ft
from ..nn import fused_inference, mask_translation

__all__ = ["DecoderCache", "build_cache", "decode_step", "greedy_decode"]


def _split_heads(x: torch.Tensor, nhead: int) -> torch.Tensor:
    B, L, d = x.shape
    return x.view(B, L, nhead, d // nhead).transpose(1, 2)  # (B, H, L, Dh)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, H, L, Dh = x.shape
    return x.transpose(1, 2).reshape(B, L, H * Dh)  # (B, L, d)


def _in_proj(attn, x: torch.Tensor, part: slice) -> torch.Tensor:
    """Rows ``part`` of the packed q;k;v projection of MultiheadAttention ``attn``."""
    bias = attn.in_proj_bias[part] if attn.in_proj_bias is not None else None
    return F.linear(x, attn.in_proj_weight[part], bias)


@dataclasses.dataclass
class _LayerCache:
    self_k: torch.Tensor  # (B, H, capacity, Dh), filled up to DecoderCache.length
    self_v: torch.Tensor
    cross_k: torch.Tensor  # (B, H, S, Dh)
    cross_v: torch.Tensor


@dataclasses.dataclass
class DecoderCache:
    """Per-layer keys/values for incremental decoding of one batch."""

    layers: list[_LayerCache]
    memory_mask: torch.Tensor | None  # (B, 1, 1, S) bool, True = may attend; None = no padding or lengths
    capacity: int  # target positions the self-attention buffers hold
    length: int = 0  # target positions decoded so far
    memory_lengths: torch.Tensor | None = None  # (B,) int32 source lengths when the padding is on the right


def build_cache(
    model, memory: torch.Tensor, memory_key_padding_mask: torch.Tensor | None, capacity: int
) -> DecoderCache:
    """Project the memory into every layer's cross-attention keys/values; empty self-attention buffers.

    ``model`` is a Seq2SeqTransformer; memory (B, S, d_model) comes from ``model.encode``;
    ``capacity`` is the number of target positions (the start token included) to make room for.
    """
    B, S, d = memory.shape
    layers = []
    for layer in model.transformer.decoder.layers:
        H = layer.self_attn.num_heads
        cross = layer.multihead_attn
        k = _split_heads(_in_proj(cross, memory, slice(d, 2 * d)), H)  # (B, H, S, Dh)
        v = _split_heads(_in_proj(cross, memory, slice(2 * d, 3 * d)), H)
        empty = memory.new_zeros(B, H, capacity, d // H)
        layers.append(_LayerCache(self_k=empty, self_v=empty.clone(), cross_k=k, cross_v=v))
    # the padding translated once for every step and layer: right padding (the usual case)
    # as key lengths, whose padded tiles the kernels skip; anything else as a dense mask
    mask = lengths = None
    if memory_key_padding_mask is not None:
        if memory_key_padding_mask.dtype == torch.bool and not torch.compiler.is_compiling():
            lengths = mask_translation.right_padded_lengths(memory_key_padding_mask)
        if lengths is None:
            mask = ~memory_key_padding_mask.view(B, 1, 1, S)  # torch.nn's True = pad -> the op's True = attend
    return DecoderCache(layers=layers, memory_mask=mask, memory_lengths=lengths, capacity=capacity)


def _self_attention(attn, x: torch.Tensor, lc: _LayerCache, start: int) -> torch.Tensor:
    """Self-attention of new positions start .. start + n - 1 over the cached prefix and themselves."""
    d, H = attn.embed_dim, attn.num_heads
    n = x.shape[1]
    q, k, v = (_split_heads(t, H) for t in F.linear(x, attn.in_proj_weight, attn.in_proj_bias).split(d, dim=-1))
    lc.self_k[:, :, start : start + n] = k
    lc.self_v[:, :, start : start + n] = v
    keys = lc.self_k[:, :, : start + n]  # (B, H, Lk, Dh), a view: stride(-1) == 1, no copy
    values = lc.self_v[:, :, : start + n]
    # bottom-right causal: new query i sits at absolute position start + i = (Lk - Lq) + i;
    # fasttrans.attention without its argument checks: the operands are the model's own
    out = ft.attention_prevalidated(q, keys, values, None, None, True, keys.shape[2] - n, 0.0, None)
    return attn.out_proj(_merge_heads(out))


def _cross_attention(attn, x: torch.Tensor, lc: _LayerCache, cache: DecoderCache) -> torch.Tensor:
    q = _split_heads(_in_proj(attn, x, slice(0, attn.embed_dim)), attn.num_heads)  # (B, H, n, Dh)
    out = ft.attention_prevalidated(q, lc.cross_k, lc.cross_v, cache.memory_mask, cache.memory_lengths, False, 0, 0.0, None)
    return attn.out_proj(_merge_heads(out))


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    return ft.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _add_norm(norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + residual), x + residual) in one fused pass."""
    return ft.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)


def _feed_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return layer.linear2(layer.activation(layer.linear1(x)))


def _layer_step(layer, x: torch.Tensor, lc: _LayerCache, cache: DecoderCache, start: int) -> torch.Tensor:
    """One decoder layer on the new positions x (B, n, d_model); same math as its forward in eval mode."""
    if layer.norm_first:
        # x + SA(LN1(x)), then + CA(LN2(.)), then + FF(LN3(.)); h carries the residual stream
        sa = _self_attention(layer.self_attn, _norm(layer.norm1, x), lc, start)
        y, h = _add_norm(layer.norm2, sa, x)
        ca = _cross_attention(layer.multihead_attn, y, lc, cache)
        y, h = _add_norm(layer.norm3, ca, h)
        return h + _feed_forward(layer, y)
    # post-norm: LN1(x + SA(x)), LN2(. + CA(.)), LN3(. + FF(.))
    x, _ = _add_norm(layer.norm1, _self_attention(layer.self_attn, x, lc, start), x)
    x, _ = _add_norm(layer.norm2, _cross_attention(layer.multihead_attn, x, lc, cache), x)
    x, _ = _add_norm(layer.norm3, _feed_forward(layer, x), x)
    return x


def decode_step(model, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
    """Decoder states (B, n, d_model) for n new target tokens (B, n), appended to the cache.

    Equivalent to ``model.decode(all_tokens_so_far, ...)[:, -n:]`` without recomputing the
    prefix. n may be more than one (a forced prefix is decoded in one call).
    """
    n = tokens.shape[1]
    start = cache.length
    if start + n > cache.capacity:
        raise ValueError(f"tokens: {start + n} target positions exceed the cache capacity {cache.capacity}")
    x = model.positional_encoding(model.tgt_embed(tokens), offset=start)  # (B, n, d_model)
    for layer, lc in zip(model.transformer.decoder.layers, cache.layers):
        fused = fused_inference.decoder_layer_step(layer, x, lc.self_k, lc.self_v, start, lc.cross_k, lc.cross_v,
                                              cache.memory_mask, cache.memory_lengths)
        x = _layer_step(layer, x, lc, cache, start) if fused is None else fused
    cache.length = start + n
    norm = model.transformer.decoder.norm
    return _norm(norm, x) if norm is not None else x


@torch.no_grad()
def greedy_decode(
    model,
    src: torch.Tensor,
    max_new_tokens: int,
    bos_idx: int,
    eos_idx: int | None = None,
    *,
    use_cache: bool = True,
    return_logits: bool = False,
    src_key_padding_mask: torch.Tensor | None = None,
):
    """Greedy decoding from ``bos_idx`` for at most ``max_new_tokens`` steps.

    Args:
        model: a Seq2SeqTransformer (run as in eval mode; its training flag is restored).
        src: (B, S) source token ids.
        eos_idx: a row that produced it is finished; later positions get the target pad index
            (or eos_idx when there is none). Decoding stops when every row is finished.
        use_cache: False re-decodes the whole prefix at every step (the slow path, kept as
            the oracle the cached path is tested against).
        return_logits: also return the (B, steps, tgt_vocab) scores of every step.

    Returns:
        tokens (B, 1 + steps) starting with bos_idx; with return_logits, (tokens, logits).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected at least 1, got {max_new_tokens}")
    modes = [(m, m.training) for m in model.modules()]  # restored one by one: a frozen part may be in eval mode
    model.eval()
    try:
        if src_key_padding_mask is None:
            src_key_padding_mask = model.src_padding_mask(src)
        memory = model.encode(src, src_key_padding_mask)  # (B, S, d_model)
        B = src.shape[0]
        tokens = torch.full((B, 1), bos_idx, dtype=torch.long, device=src.device)
        finished = torch.zeros(B, dtype=torch.bool, device=src.device)
        fill = model.config.tgt_pad_idx if model.config.tgt_pad_idx is not None else eos_idx
        cache = build_cache(model, memory, src_key_padding_mask, 1 + max_new_tokens) if use_cache else None
        step_logits = []
        for _ in range(max_new_tokens):
            if cache is not None:
                states = decode_step(model, tokens[:, -1:], cache)  # (B, 1, d_model)
            else:
                # every generated token is a real token here, pad id or not: no target padding
                # mask, exactly as the cached path (which never masks its own keys)
                no_padding = torch.zeros_like(tokens, dtype=torch.bool)
                states = model.decode(tokens, memory, src_key_padding_mask, no_padding)[:, -1:]
            logits = model.project(states)[:, -1]  # (B, V)
            step_logits.append(logits)
            next_token = logits.argmax(dim=-1)
            if eos_idx is not None:
                next_token = torch.where(finished, torch.full_like(next_token, fill), next_token)
                finished |= next_token == eos_idx
            tokens = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
            if eos_idx is not None and bool(finished.all()):
                break
    finally:
        for m, training in modes:
            m.training = training
    if return_logits:
        return tokens, torch.stack(step_logits, dim=1)
    return tokens
