"""Accelerate an existing torch.nn model in one call.

    model, skipped = fasttrans.convert(model)

walks the module tree and swaps every torch.nn MultiheadAttention, LayerNorm, RMSNorm,
TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder, TransformerDecoder
and Transformer for its fasttrans.nn twin. The twin takes over the *same* Parameter and
buffer objects (so optimizers, tied weights and checkpoints keep working and no memory is
copied), its training mode and hooks, and the module's own children: those of the kinds
above are converted in turn (a layer's nn.Dropout becomes the fused fasttrans.nn.Dropout
with the same p), any other child (a Linear subclass, a parametrized Linear, an Identity
put in place of a dropout) is kept as it is, so per-sublayer settings and replacements
survive; ``convert(model, dropout=True)`` moves every other plain nn.Dropout too. State-dict
keys do not change. A module held at several paths gets one twin.
A replaced module is not modified (a container of its that holds converted modules is
copied for the twin), so code that still holds it computes what it did.

Subclasses of those torch classes run code of their own, which a fasttrans module cannot
reproduce: they are left untouched (their children are still converted) and reported, as
are torch.compile'd modules (their compiled code would keep calling the old modules), and
so are Hugging Face transformers attention and norm modules, with the way to move them
(fasttrans.integrations.transformers).
"""

from __future__ import annotations

import copy
import warnings

from torch import nn

from . import backends
from . import nn as ftnn

__all__ = ["convert", "is_transformers_norm"]

_HOOK_ATTRS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def _dtype(m: nn.Module) -> dict:
    p = next(m.parameters(), None)
    if p is None:
        p = next(m.buffers(), None)
    return {} if p is None else {"dtype": p.dtype}


def _shell(m: nn.Module) -> nn.Module:
    """A fasttrans module configured as torch module ``m``, its own tensors on the meta device
    (they are replaced by ``m``'s) and its children placeholders (replaced by ``m``'s, converted)."""
    t = type(m)
    meta = {"device": "meta", **_dtype(m)}
    if t is nn.MultiheadAttention:
        return ftnn.MultiheadAttention(
            m.embed_dim, m.num_heads, dropout=m.dropout, bias=m.in_proj_bias is not None,
            add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn, kdim=m.kdim, vdim=m.vdim,
            batch_first=m.batch_first, **meta,
        )
    if t is nn.LayerNorm:
        return ftnn.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine,
                              bias=m.bias is not None if m.elementwise_affine else True, **meta)
    if t is nn.RMSNorm:
        return ftnn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine, **meta)
    if t in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer):
        # only the settings that are not children matter: every child is m's own, converted
        cls = ftnn.TransformerEncoderLayer if t is nn.TransformerEncoderLayer else ftnn.TransformerDecoderLayer
        return cls(
            m.self_attn.embed_dim, m.self_attn.num_heads, dim_feedforward=1, activation=m.activation,
            batch_first=m.self_attn.batch_first, norm_first=m.norm_first, **meta,
        )
    if t is nn.TransformerEncoder:
        enc = ftnn.TransformerEncoder(nn.Identity(), 0, enable_nested_tensor=m.enable_nested_tensor,
                                      mask_check=m.mask_check)
        enc.num_layers = m.num_layers
        return enc
    if t is nn.TransformerDecoder:
        dec = ftnn.TransformerDecoder(nn.Identity(), 0)
        dec.num_layers = m.num_layers
        return dec
    if t is nn.Transformer:
        return ftnn.Transformer(m.d_model, m.nhead, custom_encoder=nn.Identity(), custom_decoder=nn.Identity(),
                                batch_first=m.batch_first)
    raise AssertionError(f"no fasttrans twin for {t.__name__}")  # guarded by _SUPPORTED


_SUPPORTED = (
    nn.MultiheadAttention, nn.LayerNorm, nn.RMSNorm, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
    nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer,
)


def _adopt(new: nn.Module, old: nn.Module) -> None:
    """``new`` takes over ``old``'s own Parameter and buffer objects, training mode and hooks."""
    for name, param in old._parameters.items():
        new.register_parameter(name, param)
    for name, buf in old._buffers.items():
        new.register_buffer(name, buf, persistent=name not in old._non_persistent_buffers_set)
    new.training = old.training  # its own mode only: train() would reset every child's
    for attr in _HOOK_ATTRS:  # the twin takes over the hooks (and their handles)
        if attr in old.__dict__:
            setattr(new, attr, old.__dict__[attr])


def _unshadow_children(new: nn.Module, old: nn.Module) -> None:
    """Undo what copying adds to ``new``, a copy (copy.copy, copy.deepcopy) of ``old``: the
    ``__setstate__`` of torch.nn.TransformerDecoderLayer looks for ``activation`` among the
    plain attributes only, misses a module activation (a child) and sets ``activation =
    F.relu`` beside it, which then shadows the child. An attribute cannot otherwise sit
    beside a child of the same name (``Module.__setattr__`` keeps one), so each one that
    ``old`` does not have goes."""
    for name in new._modules.keys() & new.__dict__.keys() - old.__dict__.keys():
        del new.__dict__[name]


def _shallow_copy(m: nn.Module) -> nn.Module:
    """A copy of ``m`` with the same tensors, children, hooks and attributes in registries
    of its own: setting a child of the copy leaves ``m`` as it is."""
    new = copy.copy(m)
    for attr in ("_parameters", "_buffers", "_modules", *_HOOK_ATTRS):
        if isinstance(m.__dict__.get(attr), dict):
            new.__dict__[attr] = m.__dict__[attr].copy()
    new._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
    _unshadow_children(new, m)
    return new


def is_transformers_norm(m: nn.Module) -> bool:
    """Whether ``m`` is a Hugging Face transformers norm module (``*RMSNorm``, ``*LayerNorm``
    classes of transformers' own, not ``torch.nn.LayerNorm``), by class name and module
    only: never imports transformers."""
    cls = type(m)
    return (cls.__module__.startswith("transformers.") and cls.__name__.endswith(("RMSNorm", "LayerNorm"))
            and not isinstance(m, nn.LayerNorm))


def _transformers_part(m: nn.Module) -> str | None:
    """Why ``m``, a Hugging Face transformers attention or norm module, is left as it is (its
    code is transformers', not torch.nn's); None for any other module. Reads class names only,
    so converting never imports transformers."""
    cls = type(m)
    if not cls.__module__.startswith("transformers."):
        return None
    if cls.__name__.endswith("Attention") and hasattr(m, "is_causal"):
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if impl == "fasttrans":
            return None
        return (f"a transformers attention module (attn_implementation={impl!r}): use "
                "fasttrans.integrations.transformers.register() and attn_implementation='fasttrans'")
    if is_transformers_norm(m):
        return ("a transformers norm: fasttrans.integrations.transformers.apply(model) replaces those that "
                "compute weight * x / rms(x)")
    return None


def _compiled_module_type():
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # a torch without dynamo
        return ()
    return OptimizedModule


def convert(
    model: nn.Module,
    *,
    backend: str | None = None,
    inplace: bool = True,
    dropout: bool = False,
) -> tuple[nn.Module, list[tuple[str, str]]]:
    """Swap torch.nn Transformer building blocks in ``model`` for fasttrans.nn twins.

    Args:
        model: any torch.nn.Module (or one of the supported modules itself).
        backend: pin the converted modules to one backend ("triton", "extension",
            "reference"); None selects per call, as everywhere in fasttrans.
        inplace: modify ``model`` (default) or convert a deep copy of it.
        dropout: also swap every other ``torch.nn.Dropout`` (the class itself, not a
            subclass) for ``fasttrans.nn.Dropout`` with the same ``p``; by default only the
            converted layers' own dropouts move. Its masks come from fasttrans's generator,
            so they differ from torch's.

    Returns:
        (converted model, skipped) where skipped lists ``(qualified name, reason)`` for the
        modules that were left as they are. The converted model is ``model`` itself
        (converted in place) unless ``model`` is one of the supported modules: then it is
        ``model``'s twin, holding the same parameters, and ``model`` is left as it was. A
        model with nothing left to convert (for example an already converted one) is
        returned unchanged with no skips.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if backend is not None:
        backends.get_backend(backend)  # validates the name
    if not inplace:
        original, model = model, copy.deepcopy(model)
        for new, old in zip(model.modules(), original.modules()):  # the same walk: deepcopy keeps the structure
            _unshadow_children(new, old)
    skipped: list[tuple[str, str]] = []
    converted: list[nn.Module] = []
    done: dict[int, nn.Module] = {}  # a module reached at several paths gets one twin
    compiled = _compiled_module_type()

    def skip(m: nn.Module, name: str, why: str) -> None:
        skipped.append((name or type(m).__name__, why))

    def path(name: str, child_name: str) -> str:
        return f"{name}.{child_name}" if name else child_name

    def twin_of(m: nn.Module, name: str) -> nn.Module | None:
        """m's fasttrans twin, holding m's tensors and m's children (converted); None when
        the twin could not hold them all (m is then left as it is and reported)."""
        try:
            new = _shell(m)
        except Exception as e:  # a child replaced by something without the attributes read
            skip(m, name, f"its configuration could not be read ({type(e).__name__}: {e})")
            return None
        missing = sorted({n for n, c in new._modules.items() if c is not None}
                         - {n for n, c in m._modules.items() if c is not None})
        if missing:
            skip(m, name, f"it lacks the children {', '.join(missing)} that torch's layout has")
            return None
        if set(new._parameters) != set(m._parameters) or set(new._buffers) != set(m._buffers):
            skip(m, name, "its own parameters or buffers differ from torch's layout")
            return None
        for child_name, child in m._modules.items():
            if child is not None:
                setattr(new, child_name, convert_module(child, path(name, child_name), in_twin=True, frozen=True))
        for attr in m._modules.keys() & m.__dict__.keys():
            # an attribute that shadows a child, as torch's stacks leave in their decoder layers
            # (see _unshadow_children): m computes with the attribute, and so does the twin
            new.__dict__[attr] = m.__dict__[attr]
        _adopt(new, m)
        return new

    def convert_module(m: nn.Module, name: str, in_twin: bool = False, frozen: bool = False) -> nn.Module:
        """m converted. ``frozen``: m belongs to a module that its twin replaces, so m is
        not modified (where its children change, a copy of it holds them): the replaced
        module stays exactly as it was, for whoever still holds it."""
        if id(m) in done:
            return done[id(m)]
        result = m
        if compiled and isinstance(m, compiled):  # its compiled code would keep running the old modules
            skip(m, name, "compiled with torch.compile: convert the model before compiling it")
            done[id(m)] = m
            return m
        if type(m) in _SUPPORTED:
            result = twin_of(m, name) or m
        elif (in_twin or dropout) and type(m) is nn.Dropout:  # a converted layer's, or every one if asked
            result = ftnn.Dropout(m.p, m.inplace)
            _adopt(result, m)
        elif isinstance(m, _SUPPORTED):
            base = next(c for c in _SUPPORTED if isinstance(m, c))
            skip(m, name, f"{type(m).__name__} subclasses torch.nn.{base.__name__} with code of its own")
        elif (why := _transformers_part(m)) is not None:
            skip(m, name, why)
        if result is m:  # left as it is: its children may still be converted
            done[id(m)] = m
            # _modules, not named_children(): a module held under two names is converted at both
            changed = {}
            for child_name, child in list(m._modules.items()):
                if child is None:
                    continue
                new_child = convert_module(child, path(name, child_name), frozen=frozen)
                if new_child is not child:
                    changed[child_name] = new_child
            if changed and frozen:
                result = done[id(m)] = _shallow_copy(m)
            for child_name, new_child in changed.items():
                setattr(result, child_name, new_child)
            if (isinstance(result, nn.TransformerEncoder) and getattr(result, "use_nested_tensor", False)
                    and not all(isinstance(layer, nn.TransformerEncoderLayer) for layer in result.layers)):
                # torch's encoder would hand nested tensors to its converted layers in
                # inference; its constructor makes the same choice for layers not its own
                if frozen and result is m:
                    result = done[id(m)] = _shallow_copy(m)
                result.use_nested_tensor = False
        else:
            converted.append(result)
            done[id(m)] = result
        return result

    result = convert_module(model, "")
    if backend is not None:
        for m in converted:
            m._fasttrans_backend = backend
    if skipped:
        warnings.warn(
            "fasttrans.convert left these modules unconverted: "
            + "; ".join(f"{n} ({why})" for n, why in skipped),
            UserWarning,
            stacklevel=2,
        )
    return result, skipped
