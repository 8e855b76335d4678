"""Accelerate an existing torch.nn model in one call.

    model, skipped = fasttrans.convert(model)

walks the module tree and swaps every torch.nn MultiheadAttention, LayerNorm, RMSNorm,
TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder, TransformerDecoder
and Transformer for its fasttrans.nn twin. The twin takes over the *same* Parameter and
buffer objects (so optimizers, tied weights and checkpoints keep working and no memory is
copied), the training mode of every submodule, and the module's hooks. State-dict keys do
not change.

Subclasses of those torch classes run code of their own, which a fasttrans module cannot
reproduce: they are left untouched (their children are still converted) and reported.
"""

from __future__ import annotations

import copy
import functools
import warnings

from torch import nn

from . import backends
from . import nn as ftnn

__all__ = ["convert"]

_HOOK_ATTRS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def _factory(m: nn.Module) -> dict:
    p = next(m.parameters(), None)
    if p is None:
        p = next(m.buffers(), None)
    return {} if p is None else {"device": p.device, "dtype": p.dtype}


def _activation(layer: nn.Module):
    return layer.activation


def _build(m: nn.Module, convert_child) -> nn.Module:
    """A fasttrans twin of torch module ``m`` with freshly allocated parameters."""
    t = type(m)
    fk = _factory(m)
    if t is nn.MultiheadAttention:
        return ftnn.MultiheadAttention(
            m.embed_dim, m.num_heads, dropout=m.dropout, bias=m.in_proj_bias is not None,
            add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn, kdim=m.kdim, vdim=m.vdim,
            batch_first=m.batch_first, **fk,
        )
    if t is nn.LayerNorm:
        return ftnn.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine,
                              bias=m.bias is not None if m.elementwise_affine else True, **fk)
    if t is nn.RMSNorm:
        return ftnn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine, **fk)
    if t is nn.TransformerEncoderLayer:
        return ftnn.TransformerEncoderLayer(
            m.self_attn.embed_dim, m.self_attn.num_heads, dim_feedforward=m.linear1.out_features,
            dropout=m.dropout.p, activation=_activation(m), layer_norm_eps=m.norm1.eps,
            batch_first=m.self_attn.batch_first, norm_first=m.norm_first, bias=m.linear1.bias is not None, **fk,
        )
    if t is nn.TransformerDecoderLayer:
        return ftnn.TransformerDecoderLayer(
            m.self_attn.embed_dim, m.self_attn.num_heads, dim_feedforward=m.linear1.out_features,
            dropout=m.dropout.p, activation=_activation(m), layer_norm_eps=m.norm1.eps,
            batch_first=m.self_attn.batch_first, norm_first=m.norm_first, bias=m.linear1.bias is not None, **fk,
        )
    if t is nn.TransformerEncoder:
        first = convert_child(m.layers[0])
        enc = ftnn.TransformerEncoder(
            first, len(m.layers), norm=convert_child(m.norm) if m.norm is not None else None,
            enable_nested_tensor=m.enable_nested_tensor, mask_check=m.mask_check,
        )
        enc.layers = nn.ModuleList([first] + [convert_child(layer) for layer in m.layers[1:]])
        return enc
    if t is nn.TransformerDecoder:
        first = convert_child(m.layers[0])
        dec = ftnn.TransformerDecoder(first, len(m.layers), norm=convert_child(m.norm) if m.norm is not None else None)
        dec.layers = nn.ModuleList([first] + [convert_child(layer) for layer in m.layers[1:]])
        return dec
    if t is nn.Transformer:
        # Transformer.__init__ re-initialises every parameter in place, a custom encoder's
        # too: build the shell on the meta device and attach the converted stacks after.
        shell = ftnn.Transformer(
            m.d_model, m.nhead, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=1,
            batch_first=m.batch_first, device="meta",
        )
        shell.encoder = convert_child(m.encoder)
        shell.decoder = convert_child(m.decoder)
        return shell
    raise AssertionError(f"no fasttrans twin for {t.__name__}")  # guarded by _SUPPORTED


_SUPPORTED = (
    nn.MultiheadAttention, nn.LayerNorm, nn.RMSNorm, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
    nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer,
)


def _adopt_state(new: nn.Module, old: nn.Module) -> None:
    """Make ``new`` use ``old``'s Parameter/buffer objects, training modes and hooks."""
    new_keys, old_keys = set(new.state_dict().keys()), set(old.state_dict().keys())
    if new_keys != old_keys:
        raise AssertionError(
            f"fasttrans.convert: state_dict keys differ for {type(old).__name__}: "
            f"missing {sorted(old_keys - new_keys)}, unexpected {sorted(new_keys - old_keys)}"
        )
    new_modules = dict(new.named_modules())
    for name, old_sub in old.named_modules():
        new_sub = new_modules.get(name)
        if new_sub is None:
            continue
        for pname, param in old_sub.named_parameters(recurse=False):
            setattr(new_sub, pname, param)
        for bname, buf in old_sub.named_buffers(recurse=False):
            new_sub.register_buffer(bname, buf, persistent=bname not in old_sub._non_persistent_buffers_set)
        new_sub.train(old_sub.training)
        for attr in _HOOK_ATTRS:  # the twin at the same path takes over the hooks (and their handles)
            if attr in old_sub.__dict__:
                setattr(new_sub, attr, old_sub.__dict__[attr])


def _pin_backend(module: nn.Module, backend: str) -> None:
    """Run ``module``'s forward under ``fasttrans.use_backend(backend)``."""
    forward = module.forward

    @functools.wraps(forward)
    def pinned(*args, **kwargs):
        with backends.use_backend(backend):
            return forward(*args, **kwargs)

    module.forward = pinned


def convert(
    model: nn.Module,
    *,
    backend: str | None = None,
    inplace: bool = True,
) -> tuple[nn.Module, list[tuple[str, str]]]:
    """Swap torch.nn Transformer building blocks in ``model`` for fasttrans.nn twins.

    Args:
        model: any torch.nn.Module (or one of the supported modules itself).
        backend: pin the converted modules to one backend ("triton", "extension",
            "reference"); None selects per call, as everywhere in fasttrans.
        inplace: modify ``model`` (default) or convert a deep copy of it.

    Returns:
        (converted model, skipped) where skipped lists ``(qualified name, reason)`` for the
        modules that were left as they are. A model with nothing left to convert
        (for example an already converted one) is returned unchanged with no skips.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if backend is not None:
        backends.get_backend(backend)  # validates the name
    if not inplace:
        model = copy.deepcopy(model)
    skipped: list[tuple[str, str]] = []
    converted: list[nn.Module] = []

    def convert_module(m: nn.Module, name: str) -> nn.Module:
        if type(m) in _SUPPORTED:
            new = _build(m, lambda child: convert_module(child, name))
            _adopt_state(new, m)
            converted.append(new)
            return new
        if isinstance(m, _SUPPORTED):
            base = next(c for c in _SUPPORTED if isinstance(m, c))
            skipped.append((name or type(m).__name__,
                            f"{type(m).__name__} subclasses torch.nn.{base.__name__} with code of its own"))
        for child_name, child in list(m.named_children()):
            new_child = convert_module(child, f"{name}.{child_name}" if name else child_name)
            if new_child is not child:
                setattr(m, child_name, new_child)
        return m

    result = convert_module(model, "")
    if backend is not None:
        for m in converted:
            _pin_backend(m, backend)
    if skipped:
        warnings.warn(
            "fasttrans.convert left these modules unconverted: "
            + "; ".join(f"{n} ({why})" for n, why in skipped),
            UserWarning,
            stacklevel=2,
        )
    return result, skipped
