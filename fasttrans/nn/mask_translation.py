"""Translation of torch.nn's attention masks into the ``fasttrans.attention`` contract.

torch.nn speaks in *blocking* masks: a bool ``attn_mask`` of shape (L, S) or (N*H, L, S)
is True where a query may **not** attend, a float one is added to the scores, and a bool
``key_padding_mask`` (N, S) is True at padding keys (a float one is additive too).
``fasttrans.attention`` wants *allowing* masks and cheaper forms where they exist:

    torch.nn                                         fasttrans.attention
    -----------------------------------------------  ---------------------------------------
    attn_mask equal to the causal mask (or the        is_causal=True (tiles above the
      is_causal hint where torch trusts it)             diagonal are skipped)
    other bool attn_mask                             attn_mask = ~mask, (1|N, 1|H, L, S)
    float attn_mask                                  attn_mask = mask,  (1|N, 1|H, L, S)
    right-padded bool key_padding_mask               key_lengths (N,) (padded tiles skipped)
    other bool key_padding_mask                      attn_mask = ~kpm,  (N, 1, 1, S)
    float key_padding_mask                           attn_mask = kpm,   (N, 1, 1, S)

Broadcast dims stay size-1 dims (never expanded here); two dense masks are combined into
one (a bool with a bool by ``&``, anything with a float by adding, bool as 0/-inf), which
is what torch computes when it adds its canonical float masks.

Everything that inspects mask *values* (causal detection, the right-padding check) needs a
host synchronisation and a data-dependent branch; under ``torch.compiler.is_compiling()``
it is skipped and the general dense-mask path is used, so compiled graphs have no breaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Iterator

import torch
from torch import Tensor

from .. import functional as FT

__all__ = [
    "OpMasks",
    "check_mask_dtype",
    "check_mask_pair",
    "quiet_mask_warnings",
    "causal_pattern",
    "is_causal_mask",
    "detect_is_causal_mask",
    "right_padded_lengths",
    "translate",
]


@dataclasses.dataclass
class OpMasks:
    """Masks in the ``fasttrans.attention`` contract (see the module docstring)."""

    attn_mask: Tensor | None = None  # bool (True = may attend) or float, 4-D broadcastable
    key_lengths: Tensor | None = None  # (N,) int
    is_causal: bool = False


def check_mask_dtype(mask: Tensor | None, name: str) -> None:
    """torch.nn accepts bool and floating-point masks only (AssertionError otherwise, as torch)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise AssertionError(f"only bool and floating types of {name} are supported (got {mask.dtype})")


def _to_float(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's canonical form of a bool blocking mask: -inf where True, 0 elsewhere."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


_quiet = threading.local()  # depth of enclosing modules that already warned about the pair


def check_mask_pair(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    kpm_name: str,
    mask_name: str,
) -> bool:
    """torch's ``F._canonical_mask`` checks on a (key padding mask, attention mask) pair.

    Both must be bool or float (AssertionError otherwise); where their dtypes differ torch
    warns that mixing is deprecated, and so does this (returning True). torch then converts
    bool masks to 0/-inf floats and adds them; the masks are *not* converted here, because
    a bool mask combined later (``translate``) gives the same scores while it can still
    become key_lengths or is_causal: the common "float causal mask + bool padding mask"
    pair keeps both fast forms. Since the types stay mixed, an outer module that warned
    wraps its body in :func:`quiet_mask_warnings`, so that, as with torch's converted
    masks, the inner modules do not warn again.
    """
    check_mask_dtype(key_padding_mask, kpm_name)
    check_mask_dtype(attn_mask, mask_name)
    if key_padding_mask is None or attn_mask is None or key_padding_mask.dtype == attn_mask.dtype:
        return False
    if torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn (a graph break)
        return False
    if not getattr(_quiet, "depth", 0):
        warnings.warn(
            f"Support for mismatched {kpm_name} and {mask_name} is deprecated. Use same type for both instead.",
            stacklevel=3,
        )
    return True


@contextlib.contextmanager
def quiet_mask_warnings(active: bool = True) -> Iterator[None]:
    """Inside, check_mask_pair does not warn (an enclosing module already did)."""
    if not active:
        yield
        return
    depth = getattr(_quiet, "depth", 0)
    _quiet.depth = depth + 1
    try:
        yield
    finally:
        _quiet.depth = depth


def causal_pattern(L: int, S: int, device) -> Tensor:
    """(L, S) bool, True strictly above the diagonal: the keys a causal query may not see."""
    return torch.ones(L, S, dtype=torch.bool, device=device).triu_(1)


def is_causal_mask(mask: Tensor, L: int, S: int) -> bool:
    """Whether a torch.nn attention mask (bool or float, (L, S) or (..., L, S)) is exactly causal.

    Bool: True strictly above the diagonal, False elsewhere. Float: -inf strictly above the
    diagonal, 0 elsewhere (what ``generate_square_subsequent_mask`` builds). Reads the mask
    values: never call it while compiling.
    """
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (L, S):
        return False
    helpers = _cpu_helpers(mask)
    if helpers is not None:
        return helpers[1](mask)
    if mask.device.type == "cpu" or mask.requires_grad:
        return _compare_with_causal(mask, L, S)
    # On a GPU the comparison's answer costs a host-device synchronisation: it is taken once
    # per mask and kept while the mask is unchanged (a model's layers and steps share one).
    answer = _causal_answers.get(mask, (L, S))
    if answer is None:
        answer = _compare_with_causal(mask, L, S)
        _causal_answers.put(mask, (L, S), answer)
    return answer


class TensorMemo:
    """Values computed from a tensor, kept while it lives and is not changed in place.

    Keyed by identity: tensors compare elementwise, so a WeakKeyDictionary, which compares
    its keys with ==, cannot hold them. ``get(t, extra)`` returns what ``put(t, extra,
    value)`` stored (``extra``: the other arguments the value depends on), or None when t
    changed (its version counter moved), was never seen or is an inference tensor (which has
    no version counter)."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, t: Tensor, extra=None):
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t or t.is_inference() or entry[1] != t._version or entry[2] != extra:
            return None
        return entry[3]

    def put(self, t: Tensor, extra, value) -> None:
        if t.is_inference():
            return
        key, entries = id(t), self._entries
        entries[key] = (weakref.ref(t, lambda _, key=key: entries.pop(key, None)), t._version, extra, value)


_causal_answers = TensorMemo()  # GPU masks: (L, S) -> whether the mask is causal
# a torch.nn mask -> its op-contract dense mask, so that the layers of a stack given one mask
# pass one tensor on (translated once; the Triton kernels' tile map is cached with it)
_dense_masks = TensorMemo()


def _dense_once(mask: Tensor, extra, make) -> Tensor:
    """make(), the op mask of the torch.nn ``mask``, remembered with it under ``extra`` while
    it lives unchanged; made afresh for a mask that requires grad (its graph is per call)."""
    if mask.requires_grad:
        return make()
    dense = _dense_masks.get(mask, extra)
    if dense is None:
        dense = make()
        _dense_masks.put(mask, extra, dense)
    return dense


def _compare_with_causal(mask: Tensor, L: int, S: int) -> bool:
    upper = causal_pattern(L, S, mask.device)
    if mask.dtype == torch.bool:
        return torch.equal(mask, upper.expand_as(mask))
    return torch.equal(mask, _to_float(upper, mask.dtype).expand_as(mask))


def detect_is_causal_mask(mask: Tensor | None, is_causal: bool | None, size: int | None) -> bool:
    """torch.nn.modules.transformer._detect_is_causal_mask for bool and float masks.

    An explicit ``is_causal`` wins; ``None`` means "compare the mask with the causal mask of
    ``size`` (the sequence length)". While compiling nothing is compared (False), so the
    mask takes the general path instead of a data-dependent branch.
    """
    if is_causal is not None or mask is None:
        return is_causal is True
    if torch.compiler.is_compiling():
        return False
    sz = size if size is not None else mask.size(-2)
    return tuple(mask.shape) == (sz, sz) and is_causal_mask(mask, sz, sz)


def _cpu_helpers(mask: Tensor) -> tuple | None:
    """The extension's one-pass answers for a plain CPU tensor in eager mode, when the
    extension is loaded (functional.mask_helpers); None where the PyTorch ops below must
    answer: other devices, tensors under a torch.func transform or that need a gradient,
    and processes that have not loaded the extension."""
    helpers = FT.mask_helpers()
    if (helpers is None or type(mask) is not torch.Tensor or mask.device.type != "cpu" or mask.requires_grad
            or torch._C._functorch.maybe_current_level() is not None):
        return None
    return helpers


def right_padded_lengths(key_padding_mask: Tensor) -> Tensor | None:
    """Key lengths (N,) int32 if every row of a bool (N, S) padding mask is F..F T..T, else None.

    Only CPU masks are read: on a GPU the answer would synchronise every call (padding masks
    change with every batch), so GPU masks stay dense masks (None)."""
    if key_padding_mask.device.type != "cpu":
        return None
    helpers = _cpu_helpers(key_padding_mask)
    if helpers is not None:
        lengths = helpers[0](key_padding_mask)  # empty when some row is not right-padded
        return lengths if lengths.shape[0] == key_padding_mask.shape[0] else None
    S = key_padding_mask.shape[-1]
    lengths = (~key_padding_mask).sum(-1, dtype=torch.int32)  # (N,), the dtype the ops take
    positions = torch.arange(S, device=key_padding_mask.device)
    if torch.equal(positions >= lengths[:, None], key_padding_mask):
        return lengths
    return None


def _pad_keys(mask: Tensor, extra: int) -> Tensor:
    """Append ``extra`` always-allowed key columns (bias_k / add_zero_attn) to an op mask."""
    if extra == 0:
        return mask
    shape = (*mask.shape[:-1], extra)
    fill = torch.ones(shape, dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool else \
        torch.zeros(shape, dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, fill], dim=-1)


def _combine(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """One op mask from two (each bool-allowing or float-additive), broadcasting, never expanding."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a = _to_float(~a, b.dtype)
    if b.dtype == torch.bool:
        b = _to_float(~b, a.dtype)
    return a + b


def translate(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    *,
    is_causal: bool,
    need_weights: bool,
    batch: int,
    heads: int,
    tgt_len: int,
    src_len: int,
    extra_keys: int = 0,
) -> OpMasks:
    """Masks of torch.nn's MultiheadAttention (already shape-checked, batched) -> OpMasks.

    Args:
        attn_mask: None, or bool/float (L, S) or (N*H, L, S).
        key_padding_mask: None, or bool/float (N, S).
        is_causal: torch's hint that ``attn_mask`` is the causal mask. torch trusts it (and
            ignores ``attn_mask``) only when there is no key padding mask and no weights are
            asked for; elsewhere it applies ``attn_mask`` as given. Both are reproduced.
        extra_keys: keys appended after the S source keys (bias_k, add_zero_attn); torch
            lets every query attend them, except under the trusted causal hint, where they are
            simply the last columns of the causal mask.

    Returns OpMasks for keys of length S + extra_keys.
    """
    compiling = torch.compiler.is_compiling()
    N, H, L, S = batch, heads, tgt_len, src_len
    out = OpMasks()

    if is_causal and key_padding_mask is None and not need_weights:
        out.is_causal = True  # torch drops attn_mask here and runs causal attention over all keys
        return out

    dense: Tensor | None = None
    if attn_mask is not None:
        # a mask that requires grad stays a tensor: its gradient is asked for
        if extra_keys == 0 and not compiling and not attn_mask.requires_grad and is_causal_mask(attn_mask, L, S):
            out.is_causal = True
        else:
            def make(m=attn_mask):
                # views whatever the strides: (1, 1, L, S) or (N, H, L, S)
                m = m[None, None] if m.dim() == 2 else m.unflatten(0, (N, H))
                return _pad_keys(~m if m.dtype == torch.bool else m, extra_keys)

            dense = make() if compiling else _dense_once(attn_mask, ("attn_mask", N, H, extra_keys), make)

    if key_padding_mask is not None:
        kpm = key_padding_mask
        lengths = None
        if kpm.dtype == torch.bool and extra_keys == 0 and not compiling:
            lengths = right_padded_lengths(kpm)
        if lengths is not None:
            out.key_lengths = lengths
        else:
            def make(kpm=kpm):  # (N, 1, 1, S)
                return _pad_keys((~kpm if kpm.dtype == torch.bool else kpm)[:, None, None, :], extra_keys)

            k = make() if compiling else _dense_once(kpm, ("key_padding_mask", extra_keys), make)
            dense = _combine(dense, k)

    out.attn_mask = dense
    return out
