"""The textbook Transformer as drop-ins for torch.nn's Transformer modules, on fused ops.

``TransformerEncoderLayer``, ``TransformerDecoderLayer``, ``TransformerEncoder``,
``TransformerDecoder`` and ``Transformer`` have torch 2.13's constructors, defaults,
submodule and parameter names (``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``,
``norm1..3``, ``dropout*``, ``encoder.layers.N``, ``encoder.norm``, ...), initialisation
(same RNG draws in the same order) and forward signatures, so state_dicts load both ways.

What differs is underneath: attention runs through ``fasttrans.nn.MultiheadAttention``
(the fused ``fasttrans.attention`` op, no score matrix) and every "Add & Norm" through
``fasttrans.add_layer_norm``, one pass for the residual add and the LayerNorm:

    post-norm (norm_first=False)          pre-norm (norm_first=True)
    x = LN1(x + SA(x))                    a = LN1(x)
    x = LN2(x + FF(x))                    a, h = LN2(x + SA(a)), x + SA(a)    <- one call
                                          x = h + FF(a)

(the decoder has a cross-attention sublayer between the two, with LN2 -> LN3.)

In eval mode with nothing to differentiate, each encoder and decoder layer runs as one
call of the extension's whole-layer op (``fasttrans/nn/fused_inference.py``): the same kernels
in the same order, bit for bit the output of the path above, without its Python work
between the ops. torch's inference fast paths (``torch._transformer_encoder_layer_fwd`` and
nested tensors in TransformerEncoder) are not used: ``enable_nested_tensor`` is accepted and stored but
has no effect, so in eval mode under no_grad the outputs at padded positions are computed
values here where torch's nested-tensor path returns zeros there.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Linear, Module, ModuleList
from torch.nn.init import xavier_uniform_

from .. import functional as FT
from . import mask_translation
from ._pinning import pinnable
from ._script import NotScriptable
from .attention import MultiheadAttention
from .dropout import Dropout
from .normalization import LayerNorm

__all__ = [
    "Transformer",
    "TransformerEncoder",
    "TransformerDecoder",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
]


def _generate_square_subsequent_mask(
    sz: int,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """(sz, sz) float mask: -inf strictly above the diagonal, 0 elsewhere."""
    return torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype, device=device), diagonal=1)


def _get_seq_len(src: Tensor, batch_first: bool) -> int | None:
    if src.is_nested:
        return None
    if src.dim() == 2:  # unbatched (S, E)
        return src.shape[0]
    return src.shape[1 if batch_first else 0]


def _get_clones(module: Module, n: int) -> ModuleList:
    return ModuleList([copy.deepcopy(module) for _ in range(n)])


def _get_activation_fn(activation: str) -> Callable[[Tensor], Tensor]:
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


def _has_hooks(module: Module) -> bool:
    """Whether calling the module would run hooks (its own or global ones) around forward."""
    g = torch.nn.modules.module
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or module._backward_pre_hooks or g._global_forward_hooks or g._global_forward_pre_hooks
        or g._global_backward_hooks or g._global_backward_pre_hooks
    )


def _add_norm(norm: Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(norm(residual + x), residual + x), in one ``fasttrans.add_layer_norm`` pass when possible.

    Fused when ``norm`` is a LayerNorm (fasttrans's or torch's) over the last dim without
    hooks and both operands share a dtype. A norm that was replaced (RMSNorm, a custom
    module) or carries hooks is called as a module after a plain add, exactly as torch's
    layers call it; so are operands of different dtypes (autocast: a bf16 sublayer output
    on an fp32 residual stream), whose sum torch promotes.
    """
    if (
        type(norm) in (LayerNorm, torch.nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and x.dtype == residual.dtype
        and not _has_hooks(norm)
    ):
        return FT.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    h = residual + x
    return norm(h), h


class TransformerEncoderLayer(NotScriptable, Module):
    r"""Self-attention and feed-forward with residual Add & Norm, as ``torch.nn.TransformerEncoderLayer``.

    Args:
        d_model: number of features (E).
        nhead: number of attention heads.
        dim_feedforward: hidden size of the feed-forward network. Default: 2048.
        dropout: dropout probability. Default: 0.1.
        activation: "relu", "gelu" or a callable. Default: ``F.relu``.
        layer_norm_eps: LayerNorm eps. Default: 1e-5.
        batch_first: (N, S, E) instead of (S, N, E). Default: False.
        norm_first: pre-norm (LayerNorm before each sublayer) instead of post-norm. Default: False.
        bias: biases in the Linear and LayerNorm layers. Default: True.
        device, dtype: factory kwargs.

    Masks follow torch.nn (see ``fasttrans.nn.MultiheadAttention``); a query row with no
    allowed key gets a zero attention output (torch: 0 as well on its SDPA path).
    """

    __constants__ = ["norm_first"]

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **factory_kwargs
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **factory_kwargs)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **factory_kwargs)

        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

        if isinstance(activation, str):
            activation = _get_activation_fn(activation)
        # kept for code that inspects it (torch uses it to pick its fused inference kernel)
        if activation is F.relu or isinstance(activation, torch.nn.ReLU):
            self.activation_relu_or_gelu = 1
        elif activation is F.gelu or isinstance(activation, torch.nn.GELU):
            self.activation_relu_or_gelu = 2
        else:
            self.activation_relu_or_gelu = 0
        self.activation = activation

    def __setstate__(self, state):
        super().__setstate__(state)
        if not hasattr(self, "activation"):
            self.activation = F.relu

    def _fused_inference(self, *args) -> Tensor | None:
        """This forward in one extension call, or None where the forward must run itself;
        importing fasttrans.nn replaces it (fasttrans/nn/fused_inference.py)."""
        return None

    @pinnable
    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """src (S, E) / (S, N, E) / (N, S, E) -> same shape.

        Args:
            src_mask: (S, S) or (N*nhead, S, S); bool True = may not attend, or float additive.
            src_key_padding_mask: (N, S) or (S,); bool True = padding, or float additive.
            is_causal: hint that ``src_mask`` is the causal mask (``src_mask`` still required).
        """
        warned = mask_translation.check_mask_pair(src_key_padding_mask, src_mask, "src_key_padding_mask", "src_mask")
        x = src
        with mask_translation.quiet_mask_warnings(warned):
            fused = self._fused_inference(src, src_mask, src_key_padding_mask, is_causal)
            if fused is not None:
                return fused
            if self.norm_first:
                a = self.norm1(x)
                a, x = _add_norm(self.norm2, self._sa_block(a, src_mask, src_key_padding_mask, is_causal=is_causal), x)
                x = x + self._ff_block(a)
            else:
                x, _ = _add_norm(self.norm1, self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal), x)
                x, _ = _add_norm(self.norm2, self._ff_block(x), x)
        return x

    def _sa_block(self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                  is_causal: bool = False) -> Tensor:
        x = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False, is_causal=is_causal,
        )[0]
        return self.dropout1(x)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerDecoderLayer(NotScriptable, Module):
    r"""Self-attention, cross-attention over ``memory`` and feed-forward, as ``torch.nn.TransformerDecoderLayer``.

    Args: as :class:`TransformerEncoderLayer`.
    """

    __constants__ = ["norm_first"]

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias, **factory_kwargs
        )
        self.multihead_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias, **factory_kwargs
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **factory_kwargs)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **factory_kwargs)

        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)

        if isinstance(activation, str):
            self.activation = _get_activation_fn(activation)
        else:
            self.activation = activation

    def __setstate__(self, state):
        if "activation" not in state:
            state["activation"] = F.relu
        super().__setstate__(state)

    def _fused_inference(self, *args) -> Tensor | None:
        """This forward in one extension call, or None where the forward must run itself;
        importing fasttrans.nn replaces it (fasttrans/nn/fused_inference.py)."""
        return None

    @pinnable
    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """tgt (T, E) / (T, N, E) / (N, T, E), memory (S, ...) -> tgt's shape.

        Args:
            tgt_mask: (T, T) or (N*nhead, T, T); memory_mask: (T, S) or (N*nhead, T, S);
                bool True = may not attend, or float additive.
            tgt_key_padding_mask: (N, T); memory_key_padding_mask: (N, S); bool True = padding.
            tgt_is_causal, memory_is_causal: hints that the masks are causal (masks still required).
        """
        fused = self._fused_inference(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                      memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        if fused is not None:
            return fused
        x = tgt
        if self.norm_first:
            a = self.norm1(x)
            a, x = _add_norm(self.norm2, self._sa_block(a, tgt_mask, tgt_key_padding_mask, tgt_is_causal), x)
            a, x = _add_norm(
                self.norm3, self._mha_block(a, memory, memory_mask, memory_key_padding_mask, memory_is_causal), x
            )
            x = x + self._ff_block(a)
        else:
            x, _ = _add_norm(self.norm1, self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal), x)
            x, _ = _add_norm(
                self.norm2, self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal), x
            )
            x, _ = _add_norm(self.norm3, self._ff_block(x), x)
        return x

    def _sa_block(self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                  is_causal: bool = False) -> Tensor:
        x = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, need_weights=False,
        )[0]
        return self.dropout1(x)

    def _mha_block(self, x: Tensor, mem: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                   is_causal: bool = False) -> Tensor:
        x = self.multihead_attn(
            x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            need_weights=False,
        )[0]
        return self.dropout2(x)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)


class TransformerEncoder(NotScriptable, Module):
    r"""A stack of ``num_layers`` deep copies of ``encoder_layer``, as ``torch.nn.TransformerEncoder``.

    Args:
        encoder_layer: the layer to copy (``copy.deepcopy``, so the copies start identical).
        num_layers: number of layers.
        norm: optional final normalisation module.
        enable_nested_tensor: accepted for compatibility and stored; nested tensors are never
            used (``use_nested_tensor`` is always False), so no warning about it is emitted.
        mask_check: accepted and stored (it only governs torch's nested-tensor path).
    """

    __constants__ = ["norm"]

    def __init__(
        self,
        encoder_layer: Module,
        num_layers: int,
        norm: Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = False
        self.mask_check = mask_check

    @pinnable
    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """src (S, E) / (S, N, E) / (N, S, E) -> same shape.

        Args:
            mask: (S, S) or (N*nhead, S, S) attention mask.
            src_key_padding_mask: (N, S) padding mask.
            is_causal: True/False hint that ``mask`` is causal; None (default) compares
                ``mask`` with the causal mask (as torch does).
        """
        warned = mask_translation.check_mask_pair(src_key_padding_mask, mask, "src_key_padding_mask", "mask")
        batch_first = self.layers[0].self_attn.batch_first
        is_causal = mask_translation.detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))

        output = src
        with mask_translation.quiet_mask_warnings(warned):
            for mod in self.layers:
                output = mod(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            output = self.norm(output)
        return output


class TransformerDecoder(NotScriptable, Module):
    r"""A stack of ``num_layers`` deep copies of ``decoder_layer``, as ``torch.nn.TransformerDecoder``.

    Args:
        decoder_layer: the layer to copy.
        num_layers: number of layers.
        norm: optional final normalisation module.
    """

    __constants__ = ["norm"]

    def __init__(self, decoder_layer: Module, num_layers: int, norm: Module | None = None) -> None:
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    @pinnable
    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """tgt (T, ...) attending to memory (S, ...) -> tgt's shape.

        ``tgt_is_causal=None`` (default) compares ``tgt_mask`` with the causal mask, as torch.
        """
        seq_len = _get_seq_len(tgt, self.layers[0].self_attn.batch_first)
        tgt_is_causal = mask_translation.detect_is_causal_mask(tgt_mask, tgt_is_causal, seq_len)

        output = tgt
        for mod in self.layers:
            output = mod(
                output,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=tgt_is_causal,
                memory_is_causal=memory_is_causal,
            )
        if self.norm is not None:
            output = self.norm(output)
        return output


class Transformer(NotScriptable, Module):
    r"""Encoder-decoder Transformer ("Attention Is All You Need"), as ``torch.nn.Transformer``.

    Args:
        d_model: features. Default: 512.
        nhead: attention heads. Default: 8.
        num_encoder_layers, num_decoder_layers: stack depths. Default: 6 each.
        dim_feedforward: feed-forward hidden size. Default: 2048.
        dropout: dropout probability. Default: 0.1.
        activation: "relu", "gelu" or a callable. Default: ``F.relu``.
        custom_encoder, custom_decoder: modules used instead of the default stacks.
        layer_norm_eps: LayerNorm eps. Default: 1e-5.
        batch_first: (N, S, E) instead of (S, N, E). Default: False.
        norm_first: pre-norm layers. Default: False.
        bias: biases in Linear and LayerNorm layers. Default: True.
        device, dtype: factory kwargs.

    Every parameter with more than one dim is re-initialised with ``xavier_uniform_``, in
    ``parameters()`` order, as torch does; a seeded construction gives torch's weights.
    """

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        custom_encoder: Any | None = None,
        custom_decoder: Any | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()

        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            encoder_layer = TransformerEncoderLayer(
                d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias,
                **factory_kwargs,
            )
            encoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
            self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, encoder_norm)

        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            decoder_layer = TransformerDecoderLayer(
                d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias,
                **factory_kwargs,
            )
            decoder_norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory_kwargs)
            self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, decoder_norm)

        self._reset_parameters()

        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    @pinnable
    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """src (S, N, E) and tgt (T, N, E) (or batch first, or unbatched) -> (T, N, E).

        Masks: src_mask (S, S), tgt_mask (T, T), memory_mask (T, S), each also
        (N*nhead, ., .); key padding masks (N, S), (N, T), (N, S). ``*_is_causal`` are hints
        as in torch (None: detected by comparing the mask with the causal mask).
        """
        is_batched = src.dim() == 3
        if not self.batch_first and src.size(1) != tgt.size(1) and is_batched:
            raise RuntimeError(f"the batch number of src and tgt must be equal (src {tuple(src.shape)}, "
                               f"tgt {tuple(tgt.shape)})")
        if self.batch_first and src.size(0) != tgt.size(0) and is_batched:
            raise RuntimeError(f"the batch number of src and tgt must be equal (src {tuple(src.shape)}, "
                               f"tgt {tuple(tgt.shape)})")
        if src.size(-1) != self.d_model or tgt.size(-1) != self.d_model:
            raise RuntimeError(
                f"the feature number of src and tgt must be equal to d_model ({self.d_model}); got src "
                f"{tuple(src.shape)}, tgt {tuple(tgt.shape)}"
            )

        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
        return self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """The causal mask for a sequence of length ``sz``: (sz, sz) float, -inf above the diagonal, 0 elsewhere."""
        return _generate_square_subsequent_mask(sz, dtype=dtype, device=device)

    def _reset_parameters(self) -> None:
        """xavier_uniform_ on every parameter with more than one dim (torch's order of draws)."""
        for p in self.parameters():
            if p.dim() > 1:
                xavier_uniform_(p)
