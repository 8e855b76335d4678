"""Hugging Face transformers models on fasttrans's kernels.

    import fasttrans.integrations.transformers as ftt

    ftt.register()                      # attn_implementation="fasttrans" now exists
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fasttrans")
    model, skipped = ftt.apply(model)   # norms too (and the attention, if not chosen at load)

``register()`` adds an attention function and its mask function to transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` under the name ``"fasttrans"``.
transformers builds the mask through the mask function (an unknown name gets no mask at
all, which would silently ignore padding), in the form ``scaled_dot_product_attention``
takes (bool, True = may attend), except that it is left out (None) where the attention
function can say the same with flags:

    transformers' mask                                 fasttrans.attention
    -------------------------------------------------  ------------------------------------
    causal, no padding, last query on the last key     is_causal, causal_offset = Lk - Lq
    bidirectional, no padding                          no mask
    bidirectional, 2-D padding mask                    attn_mask = the padding mask, (B, 1, 1, Lk)
                                                         expanded over the queries, plus key_lengths
    anything else (padding, caches with other          attn_mask (bool), plus key_lengths =
      offsets, sliding windows, packed sequences,        one past the last key any query may
      custom 2-D or 4-D masks)                           see (whole tiles of right padding skipped)
    float 4-D masks (added to the scores)              attn_mask (float)
    T5's position_bias (scaling=1.0)                   attn_mask = bias, with the bool mask's
                                                         False as -inf; its gradient flows

Whether a 2-D padding mask has padding at all is read only where that needs no
synchronisation (a CPU tensor, outside tracing); elsewhere the mask is built. The
attention function reads no tensor value on the host.

Packed sequences (transformers' padding-free ``cu_seq_lens_q`` / ``_k`` arguments, without
a mask) attend within each sequence. ``apply(model, unpad=True)`` runs BERT-family encoders
and the Llama, Qwen2 and GPT-2 decoders on the real tokens of a padded batch only, through
that path.

``apply(model)`` replaces transformers' RMSNorm classes that compute
``weight * x / rms(x)`` (Llama's and the families that copy it, T5's ``T5LayerNorm``) with
:class:`RMSNorm`, those that compute ``(1 + weight) * x / rms(x)`` (Gemma's) with
:class:`OffsetRMSNorm`, its layer norms with a weight alone (Cohere's) with :class:`LayerNorm`
(with a weight per head, Cohere's query and key norms, :class:`HeadLayerNorm`), parameter-free
norms that hold no size (Inkling 2's) with :class:`UnsizedRMSNorm` or
:class:`UnsizedLayerNorm`, and ``torch.nn.LayerNorm`` (through ``fasttrans.convert``), keeping
the Parameter objects and state_dict keys; norms that compute something else are reported,
not replaced.
docs/integrations.md has the details.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import warnings
from typing import Iterator

import torch
from torch import nn

from .. import conversion
from .. import functional as FT
from .. import nn as ftnn
from ..nn import mask_translation
from ..nn._pinning import pinnable

__all__ = ["NAME", "SUPPORTED_VERSIONS", "register", "attention_forward", "attention_mask", "apply", "replacing_norms",
           "RMSNorm", "OffsetRMSNorm", "LayerNorm", "HeadLayerNorm", "UnsizedRMSNorm", "UnsizedLayerNorm"]

NAME = "fasttrans"
SUPPORTED_VERSIONS = ((5, 0), (6, 0))  # [lowest, first unsupported): the range the tests run on

# keyword arguments of transformers' attention interface that the kernels cannot honour
_UNSUPPORTED = {
    "head_mask": "head masks",
}


# The submodules of transformers that code under torch.compile reads, imported by register()
# and apply() outside any trace: dynamo in torch 2.11 cannot trace an import of transformers
# (a lazy module), and a model's forward would break its graph there.
_masking_utils = None
_modeling_outputs = None


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("fasttrans.integrations.transformers needs the transformers package: "
                          "pip install 'fasttrans[transformers]'") from e
    return transformers


def _bind_submodules(transformers) -> None:
    global _masking_utils, _modeling_outputs
    _masking_utils, _modeling_outputs = transformers.masking_utils, transformers.modeling_outputs


def _check_version(version: str) -> None:
    m = re.match(r"(\d+)\.(\d+)", version)
    (lo, hi) = SUPPORTED_VERSIONS
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) < hi:
        raise RuntimeError(
            f"transformers {version} is not supported by fasttrans.integrations.transformers: expected a version "
            f">= {lo[0]}.{lo[1]} and < {hi[0]}.{hi[1]} (pip install 'fasttrans[transformers]')"
        )


def register() -> None:
    """Register the ``"fasttrans"`` attention function and its mask function with transformers.

    Raises RuntimeError when the installed transformers is outside ``SUPPORTED_VERSIONS``.
    Calling it again is harmless.
    """
    transformers = _transformers()
    _check_version(transformers.__version__)
    _bind_submodules(transformers)
    transformers.AttentionInterface.register(NAME, attention_forward)
    transformers.AttentionMaskInterface.register(NAME, attention_mask)


# ---------------------------------------------------------------------------------------
# the mask function
# ---------------------------------------------------------------------------------------
def _no_padding(padding: torch.Tensor | None, kv_length: int, kv_offset) -> bool:
    """Whether the 2-D padding mask lets every key through, answered only where reading
    its values costs no synchronisation (a CPU tensor, not traced); False otherwise."""
    if padding is None:
        return True
    if padding.device.type != "cpu" or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return bool(padding[:, kv_offset:kv_offset + kv_length].all())


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask function for ``"fasttrans"``: None where :func:`attention_forward`
    can say the mask with ``is_causal`` (bottom-right aligned) or no mask; a bidirectional
    mask with padding as the (B, 1, 1, Lk) padding mask expanded over the queries (a view);
    else transformers' own bool mask (``masking_utils.sdpa_mask``: True = may attend)."""
    mu = _masking_utils if _masking_utils is not None else _transformers().masking_utils
    if mask_function is None:
        mask_function = mu.causal_mask_function
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if mask_function is mu.causal_mask_function and allow_is_causal_skip:
        # None means "causal with causal_offset = Lk - Lq"; a static cache's prefill (queries
        # from 0, keys to the cache's end) is aligned top-left and keeps its mask
        aligned = (type(q_offset) is int and type(kv_offset) is int
                   and q_offset + q_length == kv_offset + kv_length)
        if aligned and _no_padding(padding, kv_length, kv_offset):
            return None
    if mask_function is mu.bidirectional_mask_function:
        if allow_is_bidirectional_skip and _no_padding(padding, kv_length, kv_offset):
            return None
        if (padding is not None and padding.dim() == 2 and not kwargs.get("use_vmap")
                and type(q_offset) is int and q_offset >= 0 and type(kv_offset) is int):
            # every query sees the same keys: sdpa_mask's values as a view of the padding
            # mask broadcast over the queries (the kernels map one row of tiles for it)
            keys = padding[:, kv_offset:kv_offset + kv_length].to(device=kwargs.get("device", padding.device),
                                                                  dtype=torch.bool)
            return keys[:, None, None, :].expand(batch_size, 1, q_length, kv_length)
    return mu.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs,
    )


# ---------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------
def _reject_unsupported(module: nn.Module, kwargs: dict) -> None:
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: attn_implementation='fasttrans' does not support {what}; got {name} set "
                             f"by {type(module).__name__} (use attn_implementation='eager' for this model)")
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        raise ValueError("output_attentions: attn_implementation='fasttrans' never materialises the attention "
                         "weights; expected output_attentions=False (use attn_implementation='eager' to get them)")


def _key_lengths(mask: torch.Tensor, batch: int, kv_length: int) -> torch.Tensor | None:
    """(B,) one past the last key that any query of a sequence may see, from a bool mask,
    on its device (no synchronisation): with the mask, the kernels skip the tiles past it.
    Every layer of a forward gets the same mask tensor, so eager calls compute this once per
    mask (kept while the mask is unchanged)."""
    if mask.dim() != 4 or mask.shape[-1] != kv_length or mask.shape[0] not in (1, batch):
        return None
    eager = not torch.compiler.is_compiling()
    if eager:
        seen = _lengths_of.get(mask, batch)
        if seen is not None:
            return seen
    if mask.shape[1] == 1 and mask.shape[2] and mask.stride(2) == 0:
        visible = mask[:, 0, 0]  # one head, rows broadcast over the queries (an encoder's padding mask): a view
    else:
        visible = mask.any(dim=2).any(dim=1)  # (b, Lk)
    positions = torch.arange(1, kv_length + 1, device=mask.device)
    lengths = (visible * positions).amax(dim=-1).expand(batch)
    if eager:
        _lengths_of.put(mask, batch, lengths)
    return lengths


_lengths_of = mask_translation.TensorMemo()


def _max_length(given, lengths: torch.Tensor, name: str) -> int:
    """The longest sequence: ``given`` (transformers' collator passes a Python int); a tensor
    given, or none (then read from the lengths), synchronises with a GPU once."""
    if given is None:
        return int(lengths.max()) if lengths.numel() else 0
    if isinstance(given, torch.Tensor):
        given = given.item()  # a 0-d tensor (transformers' prepare_fa_kwargs_from_position_ids)
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {given!r}")
    return given


def _cumulative_lengths(cu, name: str, device: torch.device) -> torch.Tensor:
    if (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2
            or cu.dtype not in (torch.int32, torch.int64) or cu.device != device):
        got = (f"{cu.dtype} tensor of shape {tuple(cu.shape)} on {cu.device}" if isinstance(cu, torch.Tensor)
               else type(cu).__name__)
        raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor of cumulative sequence lengths "
                         f"(0, len0, len0 + len1, ...) on {device}, got a {got}")
    return cu.long()


def _padded_rows(cu: torch.Tensor, tokens: int, length: int) -> torch.Tensor:
    """(tokens,) the row of each packed token in a (sequences * length) padded layout."""
    position = torch.arange(tokens, device=cu.device)
    sequence = torch.searchsorted(cu[1:], position, right=True)
    if cu.device.type != "cpu":  # not read on the host: keep a malformed input in bounds, as key_lengths are
        sequence = sequence.clamp_(max=cu.numel() - 2)
    return sequence * length + (position - cu[sequence]).clamp_(0, max(length - 1, 0))


def _packed_attention(query, key, value, kwargs: dict, causal: bool, dropout: float, scaling,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention within each of the sequences packed along the tokens of a batch of one
    (transformers' padding-free arguments ``cu_seq_lens_q`` / ``_k`` and ``max_length_q`` /
    ``_k``): the sequences are laid out padded, (sequences, H, longest, D), and run with
    ``key_lengths``; returns (1, tokens, H, D). Causal packing is self-attention: queries and
    keys have the same lengths. The lengths are checked where that costs no synchronisation
    (CPU tensors, outside torch.compile); on a GPU malformed ones are kept in bounds."""
    if query.shape[0] != 1:
        raise ValueError(f"query: packed sequences (cu_seq_lens_q) come as a batch of one, got batch "
                         f"{query.shape[0]}")
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("cu_seq_lens_k") is None:
        missing = "cu_seq_lens_k" if kwargs.get("cu_seq_lens_k") is None else "cu_seq_lens_q"
        raise ValueError(f"{missing}: packed sequences need both cu_seq_lens_q and cu_seq_lens_k")
    cu_q = _cumulative_lengths(kwargs["cu_seq_lens_q"], "cu_seq_lens_q", query.device)
    cu_k = _cumulative_lengths(kwargs["cu_seq_lens_k"], "cu_seq_lens_k", query.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seq_lens_k: expected as many sequences as cu_seq_lens_q ({cu_q.numel() - 1}), got "
                         f"{cu_k.numel() - 1}")
    Nq, Nk = query.shape[2], key.shape[2]
    len_q, len_k = cu_q.diff(), cu_k.diff()
    Lq = _max_length(kwargs.get("max_length_q"), len_q, "max_length_q")
    Lk = _max_length(kwargs.get("max_length_k"), len_k, "max_length_k")
    if cu_q.device.type == "cpu" and not torch.compiler.is_compiling():  # free here; a GPU would synchronise
        for name, cu, lengths, n, longest in (("cu_seq_lens_q", cu_q, len_q, Nq, Lq),
                                              ("cu_seq_lens_k", cu_k, len_k, Nk, Lk)):
            if cu[0] != 0 or cu[-1] != n or bool((lengths < 0).any()) or lengths.max() > longest:
                raise ValueError(f"{name}: expected cumulative lengths from 0 to the {n} packed tokens, none "
                                 f"longer than max_length ({longest}), got {cu.tolist()}")
        if causal and kwargs["cu_seq_lens_q"] is not kwargs["cu_seq_lens_k"] and not torch.equal(cu_q, cu_k):
            raise ValueError("cu_seq_lens_k: causal packed sequences need the same lengths for queries and keys")
    B, H, Hkv = cu_q.numel() - 1, query.shape[1], key.shape[1]
    rows_q, rows_k = _padded_rows(cu_q, Nq, Lq), _padded_rows(cu_k, Nk, Lk)

    def padded(x, rows, heads, length):  # (1, heads, N, d) -> (B, heads, length, d)
        d = x.shape[3]  # the values' head dim may differ (multi-head latent attention)
        out = x.new_zeros(B * length, heads, d).index_copy(0, rows, x[0].transpose(0, 1))
        return out.view(B, length, heads, d).transpose(1, 2)

    if sinks is not None and sinks.dim() == 3:  # one per query row: laid out as the queries are
        sinks = padded(sinks.expand(1, H, Nq).unsqueeze(-1), rows_q, H, Lq).squeeze(-1)
    out = FT.attention(
        padded(query, rows_q, H, Lq), padded(key, rows_k, Hkv, Lk), padded(value, rows_k, Hkv, Lk),
        key_lengths=len_k, is_causal=causal, dropout_p=dropout, scale=None if scaling is None else float(scaling),
        sinks=sinks, softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).reshape(B * Lq, H, out.shape[3]).index_select(0, rows_q).unsqueeze(0)


def _sinks(kwargs: dict, query: torch.Tensor) -> torch.Tensor | None:
    """The attention sinks a model passes, as ``fasttrans.attention`` takes them: ``s_aux``,
    one logit per query head (gpt-oss), or ``sinks``, one per query row, (B, H, Lq, 1)
    (Inkling 2); checked under the name the model passes them by."""
    B, H, Lq, _ = query.shape
    for name, rows in (("s_aux", False), ("sinks", True)):
        given = kwargs.get(name)
        if given is None:
            continue
        if kwargs.get("sinks" if name == "s_aux" else "s_aux") is not None:
            raise ValueError("s_aux, sinks: expected one kind of attention sinks, got both")
        want = f"(B, H, Lq, 1) = {(B, H, Lq, 1)}, one sink logit per query row" if rows else \
            f"({H},), one sink logit per query head"
        ok = isinstance(given, torch.Tensor) and given.is_floating_point() and (
            given.dim() == 4 and given.shape[3] == 1 and all(s in (1, t) for s, t in zip(given.shape, (B, H, Lq)))
            if rows else given.shape == (H,))
        if not ok:
            got = (f"a {given.dtype} tensor of shape {tuple(given.shape)}" if isinstance(given, torch.Tensor)
                   else type(given).__name__)
            raise ValueError(f"{name}: expected a floating-point tensor of shape {want}, got {got}")
        if given.device != query.device:
            raise ValueError(f"{name}: expected a tensor on {query.device}, like the queries, got one on "
                             f"{given.device}")
        return given.squeeze(-1) if rows else given
    return None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface on ``fasttrans.attention``.

    query (B, H, Lq, D), key (B, Hkv, Lk, D) and value (B, Hkv, Lk, Dv) (grouped-query heads
    go through as they are; Dv may differ from D); returns ((B, Lq, H, Dv), None). Attention
    sinks (``s_aux``, one logit per query head; ``sinks``, one per query row) go to
    ``fasttrans.attention``'s ``sinks``, logit soft-capping (``softcap``: Gemma 2's) to its
    ``softcap``. Arguments the kernels cannot honour raise ValueError naming them.
    """
    _reject_unsupported(module, kwargs)
    sinks = _sinks(kwargs, query)
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    position_bias = kwargs.get("position_bias")
    if attention_mask is None:
        window = kwargs.get("sliding_window")
        if window is not None and Lk > window:
            raise ValueError(f"sliding_window: got {window} with {Lk} keys and no attention mask, which is where "
                             "transformers' mask function puts the window; build the model with "
                             "attn_implementation='fasttrans' after fasttrans.integrations.transformers.register()")
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            if position_bias is not None:
                raise ValueError("position_bias: packed sequences (cu_seq_lens_q) with a position bias are not "
                                 "supported; pad the batch instead")
            return _packed_attention(query, key, value, kwargs, bool(causal), float(dropout), scaling, sinks), None
    attn_mask, key_lengths, flag = None, None, False
    if attention_mask is None:
        flag = bool(causal)
    elif not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a torch.Tensor or None, got {type(attention_mask).__name__} "
                        "(a mask built for another attn_implementation?)")
    elif attention_mask.dtype == torch.bool:
        attn_mask = attention_mask
        key_lengths = _key_lengths(attention_mask, B, Lk)
    else:
        attn_mask = attention_mask  # additive, as in eager attention
    if position_bias is not None:
        if attn_mask is None:
            attn_mask = position_bias
        elif attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, position_bias, float("-inf"))
        else:
            attn_mask = position_bias + attn_mask
    out = FT.attention(
        query, key, value, attn_mask=attn_mask, key_lengths=key_lengths, is_causal=flag,
        causal_offset=Lk - Lq if flag else 0, dropout_p=float(dropout),
        scale=None if scaling is None else float(scaling), sinks=sinks, softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)


class _VarianceEpsilon:
    """``variance_epsilon``, the name transformers' norms give their eps, for ``eps``."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value


class RMSNorm(_VarianceEpsilon, ftnn.RMSNorm):
    """``fasttrans.nn.RMSNorm`` in the place of a transformers RMSNorm (``LlamaRMSNorm``,
    ``T5LayerNorm``, ...): the same ``weight`` Parameter and state_dict, the eps also as
    ``variance_epsilon``, and the output dtype those modules return (the promotion of the
    input's and the weight's dtypes); the statistics accumulate in fp32, as theirs do."""

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or w.dtype == x.dtype or (w.dtype == torch.float32 and x.dtype in _HALF):
            out = super().forward(x)
        else:  # a weight the kernels do not pair with x's dtype: compute in the promoted one
            dtype = torch.promote_types(x.dtype, w.dtype)
            out = FT.rms_norm(x.to(dtype), self.normalized_shape, w.to(dtype), self.eps)
        return out if w is None else out.to(torch.promote_types(x.dtype, w.dtype))


class OffsetRMSNorm(_VarianceEpsilon, ftnn.RMSNorm):
    """``fasttrans.nn.RMSNorm`` scaled by ``offset + weight`` in the place of a transformers
    RMS norm that stores its scale minus one (Gemma's ``GemmaRMSNorm``, ``offset`` 1, weight
    initialised to zeros): the same ``weight`` Parameter and state_dict, the eps also as
    ``variance_epsilon``, and what those modules compute: the statistics and the product
    with ``offset + weight`` in fp32, one rounding to the input's dtype at the end."""

    def __init__(self, normalized_shape, eps: float = 1e-6, offset: float = 1.0, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.offset = float(offset)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # a scale of offset, as a fresh Gemma norm has

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the sum in fp32, as Gemma's: a bf16 weight plus one would round to 8 bits
        scale = self.weight.float() + self.offset
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:  # Gemma's computes in fp32 whatever x is
            return FT.rms_norm(x.float(), self.normalized_shape, scale, self.eps).to(x.dtype)
        return FT.rms_norm(x, self.normalized_shape, scale, self.eps)  # half x, fp32 scale: fp32 products

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, offset={self.offset}"


class LayerNorm(_VarianceEpsilon, ftnn.LayerNorm):
    """``fasttrans.nn.LayerNorm`` without a bias in the place of a transformers layer norm that
    has a weight alone (``CohereLayerNorm``), or, with ``elementwise_affine=False``, nothing
    (``OlmoLayerNorm``): the same ``weight`` Parameter and state_dict, the eps also as
    ``variance_epsilon``, and the output in the input's dtype, as those modules return it;
    the statistics accumulate in fp32, as theirs do."""

    def __init__(self, hidden: int, eps: float, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__(hidden, eps=eps, elementwise_affine=elementwise_affine, bias=False, device=device,
                         dtype=dtype)

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or w.dtype == x.dtype or (w.dtype == torch.float32 and x.dtype in _HALF):
            return super().forward(x).to(x.dtype)
        dtype = torch.promote_types(x.dtype, w.dtype)  # a weight the kernels do not pair with x's dtype
        return FT.layer_norm(x.to(dtype), self.normalized_shape, w.to(dtype), None, self.eps).to(x.dtype)


class _UnsizedNorm(_VarianceEpsilon, nn.Module):
    """A norm without parameters over the input's last dimension, whatever its size: only an eps."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class UnsizedRMSNorm(_UnsizedNorm):
    """An RMS norm without parameters over the input's last dimension, whatever its size, in
    the place of a transformers norm that holds no size (``Inkling2UnweightedRMSNorm``, Gemma
    3n's unscaled ``Gemma3nRMSNorm``): ``x / sqrt(mean(x²) + eps)`` on fasttrans's kernels, the
    statistics in fp32, the output in the input's dtype, as those modules return it."""

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FT.rms_norm(x, x.shape[-1:], None, self.eps)


class UnsizedLayerNorm(_UnsizedNorm):
    """A layer norm without parameters over the input's last dimension, whatever its size:
    ``(x - mean) / sqrt(var + eps)``, as :class:`UnsizedRMSNorm` is an RMS norm."""

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FT.layer_norm(x, x.shape[-1:], None, None, self.eps)


class HeadLayerNorm(_VarianceEpsilon, nn.Module):
    """A layer norm over the last dimension with a weight per head, ``(heads, head_dim)``, in
    the place of Cohere's query and key norms (``CohereLayerNorm`` built with a 2-D size):
    ``weight * (x - mean) / sqrt(var + eps)`` over each head's ``head_dim`` features of x
    (..., heads, head_dim). fasttrans's layer_norm kernel normalises in fp32, the weight
    multiplies in fp32 (one torch op: the kernels take one weight for every row), and the
    result rounds once to the input's dtype, as Cohere's does. Same ``weight`` Parameter and
    state_dict key; the eps also as ``variance_epsilon``."""

    def __init__(self, normalized_shape: tuple[int, int], eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(tuple(normalized_shape), device=device, dtype=dtype))
        self.eps = float(eps)

    @pinnable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = FT.layer_norm(x.float(), x.shape[-1:], None, None, self.eps)
        return (self.weight.float() * normed).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# The feature count a norm that holds no size is probed with (any size would do).
_UNSIZED_PROBE = 64


def _norm_eps(m: nn.Module) -> tuple[float | None, tuple | None, str | None]:
    """(eps, feature shape, None) for a transformers norm that may compute one of _FORMULAS
    over its last dimension (with a 1-D weight, a 2-D one per head, or without parameters),
    else (None, None, why). The shape is the weight's, (hidden,) without one, and None for a
    norm without parameters that holds no size (it normalises any size)."""
    own_params = {n for n, p in m._parameters.items() if p is not None}
    if own_params not in ({"weight"}, set()):
        return None, None, f"its parameters are {sorted(own_params)}, not a weight alone or none"
    if any(b is not None for b in m._buffers.values()) or any(c is not None for c in m._modules.values()):
        return None, None, "it holds buffers or submodules, which these norms do not"
    if own_params:
        if m.weight.dim() not in (1, 2):
            return None, None, f"its weight has shape {tuple(m.weight.shape)}, not (hidden,) or (heads, head_dim)"
        hidden = tuple(m.weight.shape)
    else:
        shape = getattr(m, "normalized_shape", getattr(m, "hidden_size", None))
        shape = (shape,) if isinstance(shape, int) else shape
        if shape is None:
            hidden = None
        elif not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1 and isinstance(shape[0], int)
                  and not isinstance(shape[0], bool) and shape[0] >= 1):
            return None, None, "it has no weight, and its normalized_shape is not one positive size"
        else:
            hidden = (int(shape[0]),)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if eps is None and not own_params:
        eps = 1e-5  # torch.nn.functional.layer_norm's default, which OLMo's norm uses: the probe checks it
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None, None, "it has no float variance_epsilon or eps attribute"
    if m._forward_hooks or m._forward_pre_hooks or getattr(m, "_hf_hook", None) is not None:
        return None, None, "it has forward hooks (apply fasttrans before adding hooks or dispatching the model)"
    if own_params and m.weight.device.type == "meta":
        return None, None, "its weight is on the meta device (load the weights first)"
    return float(eps), hidden, None


# What a transformers norm with a 1-D weight may compute, as the probe checks it: formula
# name -> its text in reasons (a norm without a weight: weight = 1). Each has a fasttrans
# replacement (_norm_replacement).
_FORMULAS = {
    "rms": "weight * x / sqrt(mean(x^2) + eps)",
    "offset": "(1 + weight) * x / sqrt(mean(x^2) + eps)",
    "centred": "weight * (x - mean) / sqrt(var + eps)",
}


def _probe_error(m: nn.Module, eps: float, shape: tuple, formula: str) -> float | str:
    """How far m's forward is from ``formula`` (a key of _FORMULAS) on a probe of features of
    ``shape`` (normalised over the last dimension), as a multiple of the tolerance (at most 1:
    it computes that formula), or why the probe could not run. The probe has a row whose mean
    square is near eps (where eps is added shows) and one far from zero mean (a mean
    subtraction shows)."""
    w = m.weight if "weight" in m._parameters and m.weight is not None else torch.ones(shape)
    g = torch.Generator().manual_seed(0)  # leaves torch's global generator alone
    x = torch.randn(4, *shape, generator=g, dtype=torch.float64)
    x[1] *= max(eps, 1e-12) ** 0.5
    x[2] += 3.0
    xd = x.to(device=w.device, dtype=torch.float32)
    with torch.no_grad():
        try:
            got = m(xd).double()
        except Exception as e:  # a forward that cannot take this probe is not the one assumed
            return f"its forward failed on a probe ({type(e).__name__}: {e})"
        x64 = xd.double()
        if formula == "centred":
            x64 = x64 - x64.mean(-1, keepdim=True)
        offset = 1.0 if formula == "offset" else 0.0
        normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        want = normed * (w.double() + offset)
        # the scale of each element, against which its rounding is measured: offset + weight
        # may cancel to nearly zero, after the weight was rounded at the offset's scale
        size = normed.abs() * (w.double().abs() + offset)
    # fp32 arithmetic, rounded once more to the weight's dtype where the module does that
    tol = 8 * max(torch.finfo(torch.float32).eps, torch.finfo(w.dtype).eps if w.dtype.is_floating_point else 0)
    if got.shape != want.shape:
        return float("inf")
    if formula == "centred":  # x - mean rounds to eps * |x|: measured against each row's largest value, 4x the bound
        return ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item() / (4 * tol)
    return ((got - want).abs() / (size + tol)).max().item() / tol


def _norm_replacement(m: nn.Module) -> tuple[type | None, float | None, str | None]:
    """(the fasttrans class computing what the transformers norm m computes, its eps, None),
    or (None, None, why m cannot be replaced)."""
    eps, features, why = _norm_eps(m)
    if why is not None:
        return None, None, why
    errors = {}
    weighted = "weight" in m._parameters and m.weight is not None
    kinds = ((RMSNorm, "rms"), (OffsetRMSNorm, "offset"), (LayerNorm, "centred"))
    if features is not None and len(features) == 2:  # a weight per head: Cohere's layer norms alone
        kinds = ((HeadLayerNorm, "centred"),)
    for kind, formula in kinds:
        if formula == "offset" and not weighted:
            continue
        err = _probe_error(m, eps, (_UNSIZED_PROBE,) if features is None else features, formula)
        if isinstance(err, str):
            return None, None, err
        if err <= 1:
            if features is None:
                kind = UnsizedRMSNorm if kind is RMSNorm else UnsizedLayerNorm
            return kind, eps, None
        errors[formula] = err
    return None, None, ("its output differs on a probe from " + ", ".join(
        f"{_FORMULAS[f]} ({e:.2g}x the tolerance)" for f, e in errors.items())
        + ": a formula none of fasttrans's norms computes")


def _replace_norms(model: nn.Module) -> list[tuple[str, str]]:
    skipped: list[tuple[str, str]] = []
    done: dict[int, nn.Module] = {}  # a module held at several paths gets one replacement

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in done:
                parent._modules[child_name] = done[id(child)]
                continue
            new = child
            if conversion.is_transformers_norm(child):
                kind, eps, why = _norm_replacement(child)
                if why:
                    skipped.append((path, f"{type(child).__name__}: {why}"))
                else:
                    if "weight" in child._parameters and child.weight is not None:
                        size = tuple(child.weight.shape) if kind is HeadLayerNorm else child.weight.shape[0]
                        new = kind(size, eps=eps, device="meta", dtype=child.weight.dtype)
                        new.register_parameter("weight", child.weight)  # the same Parameter object
                    elif issubclass(kind, _UnsizedNorm):
                        new = kind(eps=eps)
                    else:
                        new = kind(_norm_eps(child)[1][0], eps=eps, elementwise_affine=False)
                    new.training = child.training
            done[id(child)] = new
            if new is child:
                visit(child, path)
            else:
                parent._modules[child_name] = new

    visit(model, "")
    return skipped


def apply(model: nn.Module, *, attention: bool = True, unpad: bool = False,
          dropout: bool = True) -> tuple[nn.Module, list[tuple[str, str]]]:
    """Move an existing transformers model onto fasttrans, in place.

    Replaces its norms that compute ``weight * x / rms(x)`` with :class:`RMSNorm`, ``(1 +
    weight) * x / rms(x)`` (Gemma's) with :class:`OffsetRMSNorm` and ``weight * (x - mean) /
    sqrt(var + eps)`` (Cohere's) with :class:`LayerNorm` (with a weight per head,
    :class:`HeadLayerNorm`; those without parameters that hold no size, :class:`UnsizedRMSNorm`
    and :class:`UnsizedLayerNorm`), each checked on a probe first, and its
    ``torch.nn.LayerNorm`` modules with ``fasttrans.nn.LayerNorm`` (``fasttrans.convert``),
    keeping their Parameter objects and state_dict keys, so ``save_pretrained`` and
    ``from_pretrained`` round trips and optimizers keep working; and, with ``attention``,
    calls :func:`register` and ``model.set_attn_implementation("fasttrans")``. With
    ``dropout``, its ``torch.nn.Dropout`` modules become ``fasttrans.nn.Dropout`` (same ``p``,
    fasttrans's random masks instead of torch's); the dropout a model applies through
    ``torch.nn.functional`` (most of BART's and Marian's) stays torch's.

    With ``unpad`` (and ``attention``), BERT-family encoders (BERT, RoBERTa, XLM-R,
    CamemBERT, ELECTRA) and Llama, Qwen2 and GPT-2 models (when they fill no cache: in training,
    or with ``use_cache=False``; their LM heads and losses too) run on the real tokens of a
    padded batch only, packed, so their matrix products skip the padding: their outputs at
    padded positions become zeros (elsewhere they are unchanged) and each forward
    synchronises with a GPU once to count the real tokens. A model without such a part is
    reported in ``skipped``.

    Returns ``(model, skipped)``: skipped lists ``(qualified name, reason)`` for the
    attention and norm modules left as they were (warned about once per call).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    transformers = _transformers()
    _check_version(transformers.__version__)
    _bind_submodules(transformers)
    skipped: list[tuple[str, str]] = []
    if attention:
        register()
        config = getattr(model, "config", None)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(NAME)
        if getattr(config, "_attn_implementation", None) != NAME:
            skipped.append((type(model).__name__, "its attention implementation could not be set to 'fasttrans' "
                            "(load it with attn_implementation='fasttrans' after register())"))
    if unpad:
        if not attention:
            raise ValueError("unpad: the unpadded models need fasttrans's attention; expected attention=True")
        if not _unpad_encoders(model):
            skipped.append((type(model).__name__, "unpad=True found no model part it can run unpadded (one of "
                            f"{', '.join(sorted(_UNPADDABLE_ENCODERS | _UNPADDABLE_DECODERS))}, the decoders "
                            "without sliding-window layers)"))
    skipped += _replace_norms(model)
    with warnings.catch_warnings():  # one warning, below, for everything left
        warnings.simplefilter("ignore", UserWarning)
        model, more = conversion.convert(model, dropout=dropout)
    named = {n for n, _ in skipped}
    skipped += [(n, why) for n, why in more if n not in named]
    if skipped:
        warnings.warn("fasttrans.integrations.transformers.apply left these modules as they were: "
                      + "; ".join(f"{n} ({why})" for n, why in skipped), UserWarning, stacklevel=2)
    return model, skipped


# ---------------------------------------------------------------------------------------
# unpadded encoders
# ---------------------------------------------------------------------------------------
# Encoders whose layers work token by token except through the attention interface (to
# which they pass their keyword arguments), after absolute positions were added: their
# layers may run on the real tokens alone, packed.
_UNPADDABLE_ENCODERS = frozenset({
    "BertEncoder", "RobertaEncoder", "XLMRobertaEncoder", "CamembertEncoder", "ElectraEncoder",
})


def _capturing_hidden_states() -> bool:
    """Whether transformers is collecting every layer's hidden states (output_hidden_states),
    which would collect the packed ones."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return bool(collected) and "hidden_states" in collected


def _packing_ok(model: nn.Module, kwargs: dict) -> bool:
    """Whether nothing in the call or the model's state rules out running it packed: its
    attention must take the packed arguments (another implementation would attend across
    the packed sequences), nothing may collect the packed states, and nothing is traced."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != NAME:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _capturing_hidden_states():
        return False
    return not any(kwargs.get(k) or getattr(config, k, False) for k in ("output_hidden_states",
                                                                       "output_attentions"))


def _real_rows(real: torch.Tensor, ok: torch.Tensor):
    """(rows, cu_seq_lens, longest) that pack the real tokens of ``real`` (B, L) bool: the
    real rows of the flattened batch in order, and transformers' padding-free lengths; or
    None where the bool tensor ``ok`` is False or there is no padding to skip. Reads the
    counts to the host: the one synchronisation of a packed forward."""
    B, L = real.shape
    lengths = real.sum(dim=1)
    ok, total, longest = torch.stack([ok.long(), lengths.sum(), lengths.max()]).tolist()
    if not ok or total in (0, B * L):
        return None
    rows = torch.argsort((~real).flatten().to(torch.uint8), stable=True)[:total]
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return rows, cu, longest


def _scatter(packed: torch.Tensor, rows: torch.Tensor, shape: tuple) -> torch.Tensor:
    """(1, T, C) values of the real rows -> (B, L, C), zeros at the pads."""
    values = packed[0]
    return values.new_zeros(shape[0] * shape[1], values.shape[-1]).index_copy(0, rows, values).view(*shape, -1)


class _UnpaddedEncoderForward:
    """The ``forward`` of an encoder that runs its layers on the real tokens only.

    Given transformers' bool mask of a padded batch that says padding alone (every query
    row the same, True on the real keys), the real tokens are packed into a batch of one,
    the layers run on them with transformers' padding-free arguments (``cu_seq_lens_q`` ...,
    which :func:`attention_forward` takes), and the result is scattered back with zeros at
    the pads. Otherwise (no or another mask, cross-attention, a cache, hidden states being
    collected, torch.compile or tracing, an attention implementation other than
    ``"fasttrans"``) it is the encoder's own forward. Reading the number of real
    tokens synchronises with a GPU once per forward."""

    def __init__(self, encoder: nn.Module):
        self.encoder = encoder

    def _real_tokens(self, hidden, mask, args, kwargs) -> torch.Tensor | None:
        if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or hidden.dim() != 3 or args
                or mask.shape != (hidden.shape[0], 1, hidden.shape[1], hidden.shape[1])):
            return None
        if any(kwargs.get(k) is not None for k in ("encoder_hidden_states", "encoder_attention_mask", "cache",
                                                   "past_key_values", "cu_seq_lens_q", "cu_seq_lens_k")):
            return None
        if kwargs.get("use_cache") or not _packing_ok(self.encoder, kwargs):
            return None
        return mask[:, 0, 0, :]

    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        encoder = self.encoder
        forward = type(encoder).forward
        real = self._real_tokens(hidden_states, attention_mask, args, kwargs)
        if real is None:
            return forward(encoder, hidden_states, attention_mask, *args, **kwargs)
        plan = _real_rows(real, (attention_mask == real[:, None, None, :]).all())  # padding alone
        if plan is None:
            return forward(encoder, hidden_states, attention_mask, *args, **kwargs)
        rows, cu, longest = plan
        B, L, E = hidden_states.shape
        packed = hidden_states.reshape(B * L, E).index_select(0, rows).unsqueeze(0)
        out = forward(encoder, packed, None, *args, **kwargs, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=longest, max_length_k=longest)
        last = _scatter(out[0] if isinstance(out, tuple) else out.last_hidden_state, rows, (B, L))
        if isinstance(out, tuple):
            return (last, *out[1:])
        out.last_hidden_state = last
        return out


# Decoder-only base models whose layers work token by token except through the attention
# interface and the positions of position_ids (rotary, or GPT-2's learned embedding), both of
# which take packed sequences.
_UNPADDABLE_DECODERS = frozenset({"LlamaModel", "Qwen2Model", "GPT2Model"})
# Their causal LMs: forward = base model, LM head, loss (ForCausalLMLoss), nothing else.
_UNPADDABLE_CAUSAL_LMS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"})


def _decoder_packing(model: nn.Module, args: tuple, kwargs: dict, checks: tuple = ()):
    """(packed keyword arguments, real rows (T,) of the flattened (B·L) batch, (B, L)) to run
    a decoder-only base model (``LlamaModel`` ...) on the real tokens of a padded batch, or
    None where its own forward must run. ``checks``: bool tensors that must all be True
    too, read in the same synchronisation."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    tokens = ids if ids is not None else embeds
    use_cache = kwargs.get("use_cache")
    if (args or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None
            or tuple(tokens.shape[:2]) != tuple(mask.shape) or (ids is not None and embeds is not None)
            or (positions is not None and (positions.dim() != 2 or positions.shape[1] != mask.shape[1]
                                           or positions.shape[0] not in (1, mask.shape[0])))
            or any(kwargs.get(k) is not None for k in ("cache", "past_key_values", "cu_seq_lens_q",
                                                       "cu_seq_lens_k", "token_type_ids", "encoder_hidden_states"))
            or not (use_cache is False or (use_cache is None and model.training))
            or not _packing_ok(model, kwargs)):
        return None
    B, L = mask.shape
    ok = ((mask == 0) | (mask == 1)).all()  # a padding mask
    for check in checks:
        ok = ok & check
    plan = _real_rows(mask != 0, ok)
    if plan is None:
        return None
    rows, cu, longest = plan
    if positions is None:
        positions = torch.arange(L, device=mask.device)
    positions = positions.expand(B, L).reshape(B * L).index_select(0, rows).unsqueeze(0)
    packed = dict(kwargs, attention_mask=None, position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if ids is not None:
        packed["input_ids"] = ids.reshape(B * L).index_select(0, rows).unsqueeze(0)
    else:
        packed["inputs_embeds"] = embeds.reshape(B * L, -1).index_select(0, rows).unsqueeze(0)
    return packed, rows, (B, L)


class _UnpaddedDecoderForward:
    """The ``forward`` of a decoder-only base model (``LlamaModel`` ...) that runs on the real
    tokens only.

    Given a 2-D padding mask (1 on real tokens) and no cache to fill (``use_cache=False``,
    or left unset in training mode), the real tokens are packed into a batch of one, each
    keeping the position id it has in the padded batch (``position_ids``, else its column),
    the model runs with transformers' padding-free arguments, and its last hidden state is
    scattered back with zeros at the pads. Otherwise it is the model's own forward. Reading
    the number of real tokens synchronises with a GPU once per forward."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        forward = type(model).forward
        plan = _decoder_packing(model, args, kwargs)
        if plan is None:
            return forward(model, *args, **kwargs)
        packed, rows, shape = plan
        out = forward(model, **packed)
        out.last_hidden_state = _scatter(out.last_hidden_state, rows, shape)
        return out


class _UnpaddedCausalLMForward:
    """The ``forward`` of a causal LM (``LlamaForCausalLM`` ...) whose base model and LM head
    run on the real tokens only.

    Where the base model would run packed (:func:`_decoder_packing`), the LM head and the
    loss do too: logits are scattered back with zeros at the pads, and the loss is taken over
    the real tokens' shifted labels, which is the padded model's loss when every pad's
    shifted label is ignored (-100). Otherwise (that label is not ignored, as before the
    first token of a left-padded sequence; ``logits_to_keep``; tuple outputs) it is the
    model's own forward, over a base model that may still run packed."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        forward = type(model).forward
        base = model.base_model
        keep = kwargs.get("logits_to_keep", 0)
        if (not isinstance(keep, int) or keep != 0 or kwargs.get("return_dict") is False
                or not isinstance(base.forward, _UnpaddedDecoderForward)):
            return forward(model, *args, **kwargs)
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        ignore = kwargs.get("ignore_index", -100)
        if shift is None and labels is not None:
            shift = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
        checks = ()
        if shift is not None:
            mask = kwargs.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or shift.shape != mask.shape:
                return forward(model, *args, **kwargs)
            checks = (((mask != 0) | (shift == ignore)).all(),)  # no pad's label counts
        own = {k: v for k, v in kwargs.items() if k not in ("labels", "shift_labels", "logits_to_keep")}
        plan = _decoder_packing(base, args, own, checks)
        if plan is None:
            return forward(model, *args, **kwargs)
        packed, rows, shape = plan
        out = type(base).forward(base, **packed)
        logits = model.lm_head(out.last_hidden_state)  # (1, T, V): the real tokens' only
        loss = None
        if shift is not None:
            extra = {k: v for k, v in own.items() if k in ("num_items_in_batch", "ignore_index")}
            loss = model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                                       shift_labels=shift.reshape(-1).index_select(0, rows).unsqueeze(0), **extra)
        outputs = _modeling_outputs if _modeling_outputs is not None else _transformers().modeling_outputs
        return outputs.CausalLMOutputWithPast(loss=loss, logits=_scatter(logits, rows, shape))


def _unpad_encoders(model: nn.Module) -> list[str]:
    """Give every encoder of _UNPADDABLE_ENCODERS (not a decoder) and every base model of
    _UNPADDABLE_DECODERS the unpadded forward; the qualified names of those it did."""
    done = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in _UNPADDABLE_ENCODERS and not getattr(getattr(m, "config", None), "is_decoder", False):
            m.forward = _UnpaddedEncoderForward(m)
            done.append(name)
        elif kind in _UNPADDABLE_DECODERS and not getattr(m, "has_sliding_layers", False):
            m.forward = _UnpaddedDecoderForward(m)
            done.append(name)
    for name, m in model.named_modules():  # their LM heads, once the base models are set
        if type(m).__name__ in _UNPADDABLE_CAUSAL_LMS and isinstance(m.base_model.forward, _UnpaddedDecoderForward):
            m.forward = _UnpaddedCausalLMForward(m)
    return done


# The norm classes replacing_norms() may swap at construction, each probed before use:
# (module under transformers.models, class name).
_NORM_CLASSES = (
    ("llama.modeling_llama", "LlamaRMSNorm"), ("mistral.modeling_mistral", "MistralRMSNorm"),
    ("mixtral.modeling_mixtral", "MixtralRMSNorm"), ("qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3.modeling_qwen3", "Qwen3RMSNorm"),
    ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRMSNorm"), ("phi3.modeling_phi3", "Phi3RMSNorm"),
    ("granite.modeling_granite", "GraniteRMSNorm"), ("olmo2.modeling_olmo2", "Olmo2RMSNorm"),
    ("t5.modeling_t5", "T5LayerNorm"), ("mt5.modeling_mt5", "MT5LayerNorm"),
    ("gemma.modeling_gemma", "GemmaRMSNorm"), ("gemma2.modeling_gemma2", "Gemma2RMSNorm"),
    ("gemma3.modeling_gemma3", "Gemma3RMSNorm"),
)


@functools.lru_cache(maxsize=1)
def _replaceable_norm_classes() -> dict[str, type]:
    """{class name: its fasttrans replacement} for the classes of _NORM_CLASSES this
    transformers has whose forward computes what one of fasttrans's norms does on a probe (a
    fresh instance with a random weight); probed once per process (importing the model
    modules is the slow part)."""
    mapping = {}
    for module_name, class_name in _NORM_CLASSES:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
        except (ImportError, AttributeError):
            continue
        probe = cls(16, eps=1e-6)
        with torch.no_grad():
            probe.weight.copy_(torch.linspace(0.5, 1.5, 16))
        kind, _, why = _norm_replacement(probe)
        if why is None:
            mapping[class_name] = kind
    return mapping


@contextlib.contextmanager
def replacing_norms() -> Iterator[list[str]]:
    """Models built inside (``from_pretrained``, ``from_config``) get :class:`RMSNorm` in the
    place of transformers' RMS norms and :class:`OffsetRMSNorm` in the place of Gemma's,
    through transformers' ``register_patch_mapping``; the mapping is removed on exit. Yields
    the class names it maps. Only classes whose forward was checked on a probe to compute
    ``weight * x / rms(x)`` or ``(1 + weight) * x / rms(x)`` are mapped;
    ``torch.nn.LayerNorm`` and models built earlier need :func:`apply`.

        with ftt.replacing_norms():
            model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fasttrans")
    """
    transformers = _transformers()
    _check_version(transformers.__version__)
    mp = importlib.import_module("transformers.monkey_patching")
    mapping = dict(_replaceable_norm_classes())
    taken = sorted(set(mapping) & set(mp.get_patch_mapping()))
    if taken:
        raise RuntimeError(f"replacing_norms: transformers already has patch mappings for {taken}; remove them "
                           "(transformers.monkey_patching.unregister_patch_mapping) or use apply(model) after loading")
    mp.register_patch_mapping(mapping)
    try:
        yield sorted(mapping)
    finally:
        mp.unregister_patch_mapping(list(mapping))

