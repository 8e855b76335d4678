"""Inference of a whole encoder or decoder layer in one fused op call.

A TransformerEncoderLayer's forward is about twenty Python-level op calls (projections,
head views, mask translation, attention, Add & Norm, the feed-forward). At a batch of one
short sequence on a CPU, their Python work costs about as much as the kernels. In eval mode
with nothing to differentiate, the layers instead hand their parameters and translated
masks to ``fasttrans::transformer_layer_fwd_extension`` (csrc/layer_cpu.cpp), which makes
the same calls to the same kernels in C++, so the output is the module path's, bit for bit.

The fused call is taken only where it computes exactly what the module path would:

- inference: the layer and every dropout in it in eval mode, and no gradient to record
  (grad mode off, or no parameter or input that requires one); no autocast;
- the extension backend runs attention and the norms (automatic on CPU, or forced), in
  eager mode outside torch.func transforms (fasttrans.functional.inference_op);
- the layer's parts are the stock ones: fasttrans MultiheadAttention with a packed
  in_proj and no bias_k / bias_v / add_zero_attn, torch.nn.Linear feed-forward layers,
  fasttrans LayerNorms over the last dim, relu or gelu (the functions, or nn.ReLU /
  nn.GELU), fasttrans or torch Dropout; none of them replaced, hooked or pinned to another
  backend (``fasttrans.convert(..., backend=)``);
- plain CPU tensors of the parameters' dtype and device, none of them empty.

Anywhere else :func:`encoder_layer` / :func:`decoder_layer` return None and the layer runs
its modules. Argument errors are the module path's: the same checks run first.

A MultiheadAttention on its own (or in a layer that does not take the call above) runs in
inference as one ``fasttrans::multihead_attention_fwd_extension`` call
(:func:`multihead_attention`): the projections and the fused attention kernel, bit for bit
the module path's; with ``need_weights`` the attention is computed from the materialised
softmax weights instead, which it returns (within rounding of the module path's, NaN for a
query with no allowed key, as torch): by ATen's batched matmuls and softmax, or for few
scores (a batch of one short sequence) in one loop nest, where those calls would cost more
than their arithmetic.

Incremental decoding (fasttrans.models.decoding) runs each decoder layer's step the same way,
under the same conditions: :func:`decoder_layer_step` calls
``fasttrans::decoder_layer_step_fwd_extension``, which also writes the new positions' keys
and values into the layer's cache.

The modules do not import this module: importing ``fasttrans.nn`` sets each class's
``_fused_inference`` attribute to the function here that reproduces its forward, and the
forward takes the result unless it is None. This is a second copy of those forwards, in
C++: a change to ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (``forward``,
``_sa_block``, ``_mha_block``, ``_ff_block``), ``MultiheadAttention.forward``, ``_add_norm``
or the decoding step changes ``csrc/layer_cpu.cpp`` and the checks here with it;
``tests/test_layer_inference.py`` holds the two bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Linear, Module

from .. import functional as FT
from . import mask_translation
from .attention import MultiheadAttention
from .dropout import Dropout
from .normalization import LayerNorm
from .transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["encoder_layer", "decoder_layer", "decoder_layer_step", "multihead_attention", "install"]

_RELU, _GELU, _GELU_TANH = 0, 1, 2  # the op's activation codes


def _activation_code(activation) -> int | None:
    if activation is F.relu:
        return _RELU
    if activation is F.gelu:
        return _GELU
    if type(activation) is torch.nn.ReLU:
        return _RELU
    if type(activation) is torch.nn.GELU:
        return {"none": _GELU, "tanh": _GELU_TANH}.get(activation.approximate)
    return None


def _plain(m: Module) -> bool:
    """No hooks on m and no backend pinned on it."""
    d = m.__dict__  # direct reads: this runs for a dozen modules per layer call
    if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]:
        return False
    return d.get("_fasttrans_backend") in (None, "extension")


def _dropout_off(m: Module) -> bool:
    return type(m) in (Dropout, torch.nn.Dropout) and not m.training and 0.0 <= m.p <= 1.0 and _plain(m)


def _attention_supported(m: Module) -> bool:
    """A MultiheadAttention whose forward the ops compute: eval mode, one packed in-projection,
    no appended keys, heads the kernels take."""
    return (not m.training and m._qkv_same_embed_dim and m.bias_k is None and m.bias_v is None
            and not m.add_zero_attn and m.head_dim <= FT.MAX_HEAD_DIM)


def _attention_ok(m: Module, E: int) -> bool:
    """A layer's attention part: also exactly fasttrans's class, E features, no hooks or pin."""
    return type(m) is MultiheadAttention and m.embed_dim == E and _attention_supported(m) and _plain(m)


def _attention_parameters(m: Module) -> tuple:
    """(in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias), read from the
    _parameters dicts: a module attribute lookup of a parameter goes through Module.__getattr__."""
    own, out = m._parameters, m._modules["out_proj"]._parameters
    return own["in_proj_weight"], own["in_proj_bias"], out["weight"], out["bias"]


def _norm_ok(m: Module, E: int) -> bool:
    return type(m) is LayerNorm and m.normalized_shape == (E,) and _plain(m)


def _linear_ok(m: Module) -> bool:
    return type(m) is Linear and _plain(m)


def _input_ok(t) -> bool:
    """A plain, non-empty strided tensor (no subclass, nested or sparse tensor)."""
    return type(t) is Tensor and t.layout == torch.strided and not t.is_nested and t.numel() > 0


def _no_grad_same_dtype(tensors: list, x: Tensor) -> bool:
    """Every tensor given (None allowed) is a CPU tensor in the dtype of x (a CPU tensor), and
    neither x nor any of them records a gradient."""
    dtype = x.dtype
    if not torch.is_grad_enabled():
        return all(t is None or (t.dtype is dtype and t.is_cpu) for t in tensors)
    return not x.requires_grad and all(
        t is None or (t.dtype is dtype and t.is_cpu and not t.requires_grad) for t in tensors)


def _masks_need_grad(*masks) -> bool:
    return torch.is_grad_enabled() and any(isinstance(m, Tensor) and m.requires_grad for m in masks)


# the submodules each layer kind calls: (attentions, norms, dropouts)
_ENCODER_PARTS = (("self_attn",), ("norm1", "norm2"), ("dropout", "dropout1", "dropout2"))
_DECODER_PARTS = (("self_attn", "multihead_attn"), ("norm1", "norm2", "norm3"),
                  ("dropout", "dropout1", "dropout2", "dropout3"))


# Exact types only: a subclass may override what the ops reproduce (_sa_block, _ff_block, ...).
_LAYERS = (TransformerEncoderLayer, TransformerDecoderLayer)


def _layer_parts(layer: Module, x: Tensor, parts: tuple, kind: str = "layer"):
    """(op, attention modules, linear1, linear2, norms, activation code) when the layer may
    take the fused call on x (see the module docstring), else None. kind: the op's, as
    :func:`fasttrans.functional.inference_op` names it."""
    if type(layer) not in _LAYERS or layer.training or not _input_ok(x) or x.dim() not in (2, 3):
        return None
    op = FT.inference_op(kind, x)
    if op is None or torch.is_autocast_enabled("cpu"):
        return None
    g = torch.nn.modules.module
    if (g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
            or g._global_backward_pre_hooks):
        return None
    attention_names, norm_names, dropout_names = parts
    modules = layer._modules
    E = x.shape[-1]
    attentions = [modules.get(n) for n in attention_names]
    norms = [modules.get(n) for n in norm_names]
    linear1, linear2 = modules.get("linear1"), modules.get("linear2")
    # the attribute the module path calls: a deep copy of a decoder layer whose activation is
    # a module also has F.relu in its __dict__ (torch's __setstate__), which wins
    activation = getattr(layer, "activation", None)
    code = _activation_code(activation)
    if (code is None or (isinstance(activation, Module) and not _plain(activation))
            or not all(_attention_ok(m, E) for m in attentions) or not all(_norm_ok(m, E) for m in norms)
            or not all(_dropout_off(modules.get(n)) for n in dropout_names)
            or not (_linear_ok(linear1) and _linear_ok(linear2))
            or len({m.batch_first for m in attentions}) != 1):
        return None
    return op, attentions, linear1, linear2, norms, code


def _layer_parameters(attentions: list, linear1: Module, linear2: Module, norms: list) -> tuple:
    """The op's (weights, biases, norm_weights, norm_biases) lists of a layer's parts."""
    weights, biases = [], []
    for m in attentions:
        in_weight, in_bias, out_weight, out_bias = _attention_parameters(m)
        weights += (in_weight, out_weight)
        biases += (in_bias, out_bias)
    one, two = linear1._parameters, linear2._parameters
    weights += (one["weight"], two["weight"])
    biases += (one["bias"], two["bias"])
    norm_parameters = [n._parameters for n in norms]
    return weights, biases, [p["weight"] for p in norm_parameters], [p["bias"] for p in norm_parameters]


def _op_masks(attention, query: Tensor, key: Tensor, key_padding_mask, attn_mask, is_causal):
    """MultiheadAttention.forward's checks on (query, key, key, masks), then its masks in the op
    contract; also returns whether the input was batched."""
    query, key, _, key_padding_mask, batched, seq_first = attention._batched_inputs(
        query, key, key, key_padding_mask, attn_mask, False, is_causal)
    n_dim, l_dim = (1, 0) if seq_first else (0, 1)
    masks = mask_translation.translate(
        attn_mask, key_padding_mask, is_causal=bool(is_causal), need_weights=False, batch=query.shape[n_dim],
        heads=attention.num_heads, tgt_len=query.shape[l_dim], src_len=key.shape[l_dim],
    )
    return masks, batched


def _layer(layer, x: Tensor, memory: Tensor | None, self_args: tuple, cross_args: tuple | None) -> Tensor | None:
    """An encoder (memory None) or decoder layer's forward in one fused call, or None where it
    does not apply. self_args, cross_args: (attn_mask, key_padding_mask, is_causal) of each
    attention, in torch.nn's conventions."""
    parts = _layer_parts(layer, x, _ENCODER_PARTS if memory is None else _DECODER_PARTS)
    if parts is None:
        return None
    op, attentions, linear1, linear2, norms, activation = parts
    weights, biases, norm_weights, norm_biases = _layer_parameters(attentions, linear1, linear2, norms)
    sources = [] if memory is None else [memory]
    if (not all(_input_ok(t) and t.dim() == x.dim() for t in sources)
            or not _no_grad_same_dtype([*weights, *biases, *norm_weights, *norm_biases, *sources], x)
            or _masks_need_grad(*self_args[:2], *(cross_args or ())[:2])):
        return None
    self_masks, batched = _op_masks(attentions[0], x, x, self_args[1], self_args[0], self_args[2])
    cross_masks = None
    if memory is not None:
        cross_masks, _ = _op_masks(attentions[1], x, memory, cross_args[1], cross_args[0], cross_args[2])
        memory = memory if batched else memory.unsqueeze(1)
    out = op(x if batched else x.unsqueeze(1), memory, weights, biases, norm_weights, norm_biases,
             [float(n.eps) for n in norms], self_masks.attn_mask, self_masks.key_lengths, self_masks.is_causal,
             *((cross_masks.attn_mask, cross_masks.key_lengths, cross_masks.is_causal) if cross_masks else
               (None, None, False)),
             attentions[0].num_heads, activation, layer.norm_first, not (attentions[0].batch_first and batched))
    return out if batched else out.squeeze(1)


def encoder_layer(layer, src: Tensor, src_mask, src_key_padding_mask, is_causal) -> Tensor | None:
    """TransformerEncoderLayer.forward in one fused call, or None where it does not apply."""
    return _layer(layer, src, None, (src_mask, src_key_padding_mask, is_causal), None)


def decoder_layer(layer, tgt: Tensor, memory: Tensor, tgt_mask, memory_mask, tgt_key_padding_mask,
                  memory_key_padding_mask, tgt_is_causal, memory_is_causal) -> Tensor | None:
    """TransformerDecoderLayer.forward in one fused call, or None where it does not apply."""
    return _layer(layer, tgt, memory, (tgt_mask, tgt_key_padding_mask, tgt_is_causal),
                  (memory_mask, memory_key_padding_mask, memory_is_causal))


def decoder_layer_step(layer, x: Tensor, self_k: Tensor, self_v: Tensor, start: int, cross_k: Tensor,
                       cross_v: Tensor, memory_mask: Tensor | None, memory_lengths: Tensor | None) -> Tensor | None:
    """One decoder layer's step of incremental decoding (fasttrans.models.decoding._layer_step:
    x (B, n, E) the new positions, their keys and values written to self_k / self_v (B, H,
    capacity, D) at start .., cross_k / cross_v the projected memory, memory_mask (B, 1, 1, S)
    bool or memory_lengths (B,) its padding) in one fused call, or None where the call does not
    apply (as for :func:`decoder_layer`, and caches that are not in x's dtype or need a gradient)."""
    if x.dim() != 3:
        return None
    parts = _layer_parts(layer, x, _DECODER_PARTS, "decoder_step")
    if parts is None:
        return None
    op, attentions, linear1, linear2, norms, activation = parts
    weights, biases, norm_weights, norm_biases = _layer_parameters(attentions, linear1, linear2, norms)
    if not _no_grad_same_dtype([*weights, *biases, *norm_weights, *norm_biases, self_k, self_v, cross_k, cross_v], x):
        return None
    return op(x, self_k, self_v, start, cross_k, cross_v, memory_mask, memory_lengths, weights, biases, norm_weights,
              norm_biases, [float(n.eps) for n in norms], attentions[0].num_heads, activation, layer.norm_first)


def multihead_attention(mha, query: Tensor, key: Tensor, key_padding_mask, attn_mask, need_weights: bool,
                        average_attn_weights: bool, is_causal: bool, qkv_same: bool, kv_same: bool,
                        seq_first: bool, batch: int, tgt_len: int, src_len: int):
    """(output, weights or None) of MultiheadAttention.forward in one fused call, for inputs
    it has checked and given a batch dim; or None where the call does not apply: a module the
    ops do not compute (:func:`_attention_supported`), a key that is not the value, gradients,
    autocast (and what functional.inference_op refuses). Hooks and a backend pin
    on the module itself are served by its __call__ and forward already."""
    if type(mha) is not MultiheadAttention or not kv_same or not _attention_supported(mha):
        return None
    op = FT.inference_op("attention", query)
    if op is None or torch.is_autocast_enabled("cpu"):
        return None
    parameters = _attention_parameters(mha)
    if (not (_input_ok(query) and _input_ok(key) and _no_grad_same_dtype([*parameters, key], query))
            or _masks_need_grad(attn_mask, key_padding_mask)):
        return None
    masks = mask_translation.translate(
        attn_mask, key_padding_mask, is_causal=bool(is_causal), need_weights=need_weights, batch=batch,
        heads=mha.num_heads, tgt_len=tgt_len, src_len=src_len,
    )
    output, weights = op(query, None if qkv_same else key, *parameters, masks.attn_mask, masks.key_lengths,
                         masks.is_causal, mha.num_heads, seq_first, need_weights, average_attn_weights)
    return output, (weights if need_weights else None)


def install() -> None:
    """Give the modules their fused inference: they reach this module only through these class
    attributes, so that they need not import it (fasttrans.nn calls this on import)."""
    TransformerEncoderLayer._fused_inference = encoder_layer
    TransformerDecoderLayer._fused_inference = decoder_layer
    MultiheadAttention._fused_inference = multihead_attention
