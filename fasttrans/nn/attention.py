"""MultiheadAttention: torch.nn's module on the fused ``fasttrans.attention`` op.

A drop-in for ``torch.nn.MultiheadAttention`` (torch 2.13): same constructor, parameters
(``in_proj_weight`` packed q;k;v, or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
when kdim/vdim differ from embed_dim; ``in_proj_bias``, ``out_proj``, ``bias_k``,
``bias_v``), initialisation order, state_dict, forward signature, mask conventions and
error types.

Data flow of one forward (shapes for batch_first=False; batch_first only moves N first):

    query (L, N, E), key (S, N, Ek), value (S, N, Ev)
      -> in-projection (one GEMM for self-attention, two for encoder-decoder attention)
      -> q (N, H, L, D), k/v (N, H, S, D): strided views of the projections, no copies
      -> masks translated once into the op contract (fasttrans/nn/mask_translation.py)
      -> fasttrans.attention (need_weights=False): no (L, S) matrix anywhere
         or fasttrans.functional.attention_weights (need_weights=True): the materialising path
      -> out_proj -> (L, N, E)

In inference (eval mode, nothing to differentiate, CPU, extension backend) a module with a
packed projection whose key tensor is also the value runs all of it as one extension call
instead (fasttrans/nn/fused_inference.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import functional as FT
from . import mask_translation
from ._pinning import pinnable
from ._script import NotScriptable

__all__ = ["MultiheadAttention"]


class MultiheadAttention(NotScriptable, Module):
    r"""Multi-head attention, as ``torch.nn.MultiheadAttention``, on fused kernels.

    .. math::
        \text{MultiHead}(Q, K, V) = \text{Concat}(\text{head}_1,\dots,\text{head}_h)W^O,
        \quad \text{head}_i = \text{softmax}\left(\frac{QW_i^Q (KW_i^K)^T}{\sqrt{d}} + M\right) VW_i^V

    Args:
        embed_dim: total dimension of the model (E); split across ``num_heads``.
        num_heads: number of heads (H); ``embed_dim`` must be divisible by it.
        dropout: dropout probability on the attention weights (training only). Default: 0.0.
        bias: add biases to the input and output projections. Default: True.
        add_bias_kv: learn ``bias_k``/``bias_v`` (1, 1, E) appended to the key and value
            sequences. Default: False.
        add_zero_attn: append a zero key and value. Default: False.
        kdim, vdim: key / value feature sizes (default ``embed_dim``); when either differs
            the projections are stored as ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``.
        batch_first: inputs and outputs are (N, L, E) instead of (L, N, E). Default: False.
        device, dtype: factory kwargs for the parameters.

    Masks follow torch.nn: a bool ``attn_mask`` (L, S) or (N*H, L, S) is True where a query
    may *not* attend, a float one is added to the scores; a bool ``key_padding_mask`` (N, S)
    is True at padding keys, a float one is additive. They are translated once per forward
    into the op's cheaper forms: the causal mask becomes ``is_causal``, a right-padded key
    padding mask becomes per-batch key lengths, anything else an allowing bool or additive
    float mask whose broadcast dims are never expanded.

    Fully masked query rows (no key allowed): with ``need_weights=False`` their attention
    output is 0 and their gradients are finite (zero), as in the ``fasttrans.attention``
    contract and torch's own SDPA path. With ``need_weights=True`` torch's softmax yields
    NaN for such rows, in the weights and in the output, and so does this module.

    Differences from torch.nn: NestedTensor inputs are not supported (torch accepts them
    only on its inference fast path). Head dims above the kernels' limit (256) run on the
    reference implementation, with a one-time warning.
    """

    __constants__ = ["batch_first"]
    bias_k: Tensor | None
    bias_v: Tensor | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim

        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise AssertionError(
                f"embed_dim must be divisible by num_heads (got embed_dim={embed_dim}, num_heads={num_heads})"
            )

        # Registration order (and therefore parameters() order and the RNG draws of
        # initialisation) is torch's, so seeded construction gives torch's weights.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)

        if bias:
            self.in_proj_bias = Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class for this Linear: dynamic quantisation must leave it alone, because
        # forward reads out_proj.weight directly (a quantised Linear has no such tensor)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)

        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None

        self.add_zero_attn = add_zero_attn

        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation of the projections (out_proj.weight keeps Linear's init)."""
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)

        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    def reset_parameters(self) -> None:
        """Re-initialise every parameter exactly as construction does (same RNG draws, same order)."""
        self.out_proj.reset_parameters()
        self._reset_parameters()

    def __setstate__(self, state):
        # checkpoints pickled by torch 1.1 have no _qkv_same_embed_dim
        if "_qkv_same_embed_dim" not in state:
            state["_qkv_same_embed_dim"] = True
        super().__setstate__(state)

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """torch.nn.MultiheadAttention.merge_masks: the two masks combined into one
        (batch, heads, L, L) mask and its type (0 attn_mask, 1 key_padding_mask, 2 both)."""
        return torch.nn.MultiheadAttention.merge_masks(self, attn_mask, key_padding_mask, query)

    # ----------------------------------------------------------------------------------
    # forward
    # ----------------------------------------------------------------------------------
    def _fused_inference(self, *args) -> tuple[Tensor, Tensor | None] | None:
        """This forward in one extension call, or None where the forward must run itself;
        importing fasttrans.nn replaces it (fasttrans/nn/fused_inference.py)."""
        return None

    @pinnable
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        r"""Attention of ``query`` over ``key``/``value``; returns (output, weights or None).

        Args:
            query: (L, E) unbatched, (L, N, E), or (N, L, E) with ``batch_first``.
            key: (S, Ek), (S, N, Ek) or (N, S, Ek).
            value: (S, Ev), (S, N, Ev) or (N, S, Ev).
            key_padding_mask: (S) unbatched or (N, S); bool True = padding key, or float
                (added to the scores).
            need_weights: also return the attention weights. This materialises the (L, S)
                weights per head (``fasttrans.functional.attention_weights``); pass False
                for the fused path.
            attn_mask: (L, S) or (N*num_heads, L, S); bool True = may not attend, or float
                (added to the scores).
            average_attn_weights: average the returned weights over heads.
            is_causal: hint that ``attn_mask`` is the causal mask (``attn_mask`` is still
                required, as in torch). Trusted, as torch does, when there is no
                key_padding_mask and need_weights=False.

        Returns:
            output (L, E) / (L, N, E) / (N, L, E); weights (N, L, S') averaged or
            (N, H, L, S') per head ((L, S') / (H, L, S') unbatched) when need_weights, where
            S' = S + add_bias_kv + add_zero_attn; else None.
        """
        # which projections can share a GEMM, decided before unsqueezing makes new tensors
        kv_same = key is value
        qkv_same = kv_same and query is key
        query, key, value, key_padding_mask, is_batched, seq_first = self._batched_inputs(
            query, key, value, key_padding_mask, attn_mask, need_weights, is_causal)
        n_dim, l_dim = (1, 0) if seq_first else (0, 1)
        N, L, E = query.shape[n_dim], query.shape[l_dim], query.shape[2]
        S = key.shape[l_dim]
        H = self.num_heads

        # inference: one extension call where it computes this path's result
        fused = self._fused_inference(
            query, key, key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal,
            qkv_same, kv_same, seq_first, N, L, S)
        if fused is not None:
            out, weights = fused
            if not is_batched:
                out = out.squeeze(1)
                weights = None if weights is None else weights.squeeze(0)
            return out, weights

        q, k, v = self._in_projection(query, key, value, qkv_same, kv_same, seq_first)  # (N, H, L|S, D)
        extra = 0
        if self.bias_k is not None or self.bias_v is not None or self.add_zero_attn:
            k, v, extra = self._append_extra_keys(k, v)  # (N, H, S', D)
        masks = mask_translation.translate(
            attn_mask, key_padding_mask, is_causal=bool(is_causal), need_weights=need_weights,
            batch=N, heads=H, tgt_len=L, src_len=S, extra_keys=extra,
        )
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p and not 0.0 <= dropout_p <= 1.0:  # torch's wording and type (F.dropout's check)
            raise FT.ShapeError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")

        weights = None
        if need_weights:
            out, weights = self._attention_with_weights(q, k, v, masks, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (N, L, S')
        else:
            # the arguments are valid by construction (the checks above, the translated masks)
            out = FT.attention_prevalidated(
                q, k, v, masks.attn_mask, masks.key_lengths, masks.is_causal, 0, dropout_p, None,
            )  # (N, H, L, D)

        # (N, H, L, D) -> rows of E features in the caller's layout, then the output projection
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)  # (L, N, H, D) | (N, L, H, D)
        out = F.linear(out.reshape(-1, E), self.out_proj.weight, self.out_proj.bias)
        out = out.view(L, N, E) if seq_first else out.view(N, L, E)
        if not is_batched:
            out = out.squeeze(1)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights

    def _batched_inputs(self, query, key, value, key_padding_mask, attn_mask, need_weights, is_causal):
        """forward's checks on its arguments (torch's errors, same types), then query, key,
        value and key_padding_mask with an explicit batch dim, whether the input was batched,
        and seq_first: where that batch dim sits ((L, N, E) when True, else (N, L, E))."""
        if query.is_nested or key.is_nested or value.is_nested:
            raise AssertionError(
                "fasttrans.nn.MultiheadAttention does not support NestedTensor inputs (query, key, value)"
            )
        mask_translation.check_mask_pair(key_padding_mask, attn_mask, "key_padding_mask", "attn_mask")
        is_batched = self._check_dims(query, key, value, key_padding_mask, attn_mask)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. "
                "You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        seq_first = not (self.batch_first and is_batched)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        n_dim, l_dim = (1, 0) if seq_first else (0, 1)
        # the float mask dtypes torch's ops take: the query's for baddbmm (weights), also
        # float32 for scaled_dot_product_attention; none when torch drops attn_mask under a
        # causal hint
        if need_weights:
            mask_dtypes = (query.dtype,)
        elif is_causal and key_padding_mask is None:
            mask_dtypes = None
        else:
            mask_dtypes = (query.dtype, torch.float32)
        self._check_shapes(query, key, value, key_padding_mask, attn_mask, n_dim, l_dim, mask_dtypes)
        return query, key, value, key_padding_mask, is_batched, seq_first

    def _check_dims(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """torch's _mha_shape_check (AssertionError, as torch); returns whether the input is batched."""
        if query.dim() not in (2, 3):
            raise AssertionError(
                f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
            )
        batched = query.dim() == 3
        kind = "batched (3-D)" if batched else "unbatched (2-D)"
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise AssertionError(
                f"For {kind} `query`, expected `key` and `value` to be {query.dim()}-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
            raise AssertionError(
                f"For {kind} `query`, expected `key_padding_mask` to be `None` or {query.dim() - 1}-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 3):
                raise AssertionError(
                    f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                    f" but found {attn_mask.dim()}-D tensor instead"
                )
            expected = (self.num_heads, query.shape[0], key.shape[0])
            if not batched and attn_mask.dim() == 3 and tuple(attn_mask.shape) != expected:
                raise AssertionError(
                    f"Expected `attn_mask` shape to be {expected} (num_heads, L, S) "
                    f"but got {tuple(attn_mask.shape)}"
                )
        return batched

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask, n_dim, l_dim, mask_dtypes) -> None:
        """The checks torch makes (or the errors torch's ops raise) on batched inputs, same types.
        ``mask_dtypes`` is None exactly where torch drops attn_mask (the trusted causal hint)."""
        N, L, E = query.shape[n_dim], query.shape[l_dim], query.shape[2]
        S = key.shape[l_dim]
        if E != self.embed_dim:
            raise AssertionError(f"query: was expecting embedding dimension of {self.embed_dim}, but got {E}")
        if self._qkv_same_embed_dim:
            if key.shape != value.shape:
                raise AssertionError(f"key shape {tuple(key.shape)} does not match value shape {tuple(value.shape)}")
            if key.shape[2] != self.kdim:
                raise RuntimeError(f"key: expected {self.kdim} features (kdim), got shape {tuple(key.shape)}")
        else:
            if key.shape[:2] != value.shape[:2]:
                raise AssertionError(
                    f"key's sequence and batch dims {tuple(key.shape[:2])} do not match value's "
                    f"{tuple(value.shape[:2])}"
                )
            # torch asserts the projection weights' shapes against the inputs' feature sizes
            if key.shape[2] != self.kdim:
                raise AssertionError(f"key: expected {self.kdim} features (kdim), got shape {tuple(key.shape)}")
            if value.shape[2] != self.vdim:
                raise AssertionError(f"value: expected {self.vdim} features (vdim), got shape {tuple(value.shape)}")
        if key.shape[n_dim] != N:
            raise RuntimeError(f"key: expected batch size {N} (from query), got shape {tuple(key.shape)}")

        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        if not torch.is_autocast_enabled():
            for name, t in (("query", query), ("key", key), ("value", value)):
                if t.dtype != weight.dtype:
                    raise RuntimeError(
                        f"{name}: expected dtype {weight.dtype} (the module's parameters), got {t.dtype}"
                    )
        for name, t in (("query", query), ("key", key), ("value", value),
                        ("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if t is not None and t.device != weight.device:
                raise RuntimeError(
                    f"{name}: expected a tensor on {weight.device} (the module's device), got {t.device}"
                )

        # a dropped attn_mask (mask_dtypes None) is never shape-checked, as in torch
        if attn_mask is not None and mask_dtypes is not None:
            expected = (L, S) if attn_mask.dim() == 2 else (N * self.num_heads, L, S)
            if tuple(attn_mask.shape) != expected:
                raise RuntimeError(
                    f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, but should be "
                    f"{expected}."
                )
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (N, S):
            raise AssertionError(
                f"key_padding_mask: expected shape {(N, S)} (batch size, source length), "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if mask_dtypes is not None:
            # torch turns bool masks into float masks of the query's dtype, adds the two masks
            # when both are given (type promotion) and adds the result to the scores
            masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
            if any(m.dtype != torch.bool for m in masks):
                dtypes = [query.dtype if m.dtype == torch.bool else m.dtype for m in masks]
                mask_dtype = dtypes[0] if len(dtypes) == 1 else torch.promote_types(*dtypes)
                if mask_dtype not in mask_dtypes:
                    raise RuntimeError(
                        f"attn_mask, key_padding_mask: expected bool masks or float masks of dtype "
                        f"{' or '.join(map(str, dict.fromkeys(mask_dtypes)))}, got {mask_dtype}"
                    )

    def _in_projection(self, query: Tensor, key: Tensor, value: Tensor, qkv_same: bool, kv_same: bool,
                       seq_first: bool):
        """q (N, H, L, D), k and v (N, H, S, D): views of the projections, split into heads.

        A packed projection's parts are taken with one unbind over its (.., parts, H, D)
        view (its backward stacks the gradients in one pass into the projection's layout),
        then each moves its head dim forward: five view ops for self-attention, where a
        split of each part into heads would take eight.
        One GEMM when query is key is value, two when key is value.
        """
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias

        def heads(x: Tensor, weight: Tensor, bias: Tensor | None, parts: int) -> tuple[Tensor, ...]:
            if bias is None or bias.dtype == weight.dtype:
                y = F.linear(x, weight, bias)  # (L, N, parts E) | (N, L, parts E)
            else:  # a bias of another dtype is added with type promotion, as torch.nn's matmul + add path does
                y = F.linear(x, weight) + bias
            y = y.view(y.shape[0], y.shape[1], parts, H, D).unbind(2)  # parts x (L, N, H, D) | (N, L, H, D)
            return tuple(t.permute(1, 2, 0, 3) if seq_first else t.transpose(1, 2) for t in y)

        if not self._qkv_same_embed_dim:
            b_q, b_k, b_v = b.chunk(3) if b is not None else (None, None, None)
            return (heads(query, self.q_proj_weight, b_q, 1)[0], heads(key, self.k_proj_weight, b_k, 1)[0],
                    heads(value, self.v_proj_weight, b_v, 1)[0])
        if qkv_same:  # self-attention: one (.., 3E) projection
            return heads(query, w, b, 3)
        if kv_same:  # encoder-decoder attention: keys and values share one (.., 2E) projection
            w_q, w_kv = w.split([E, 2 * E])
            b_q, b_kv = b.split([E, 2 * E]) if b is not None else (None, None)
            k, v = heads(key, w_kv, b_kv, 2)
            return heads(query, w_q, b_q, 1)[0], k, v
        w_q, w_k, w_v = w.chunk(3)
        b_q, b_k, b_v = b.chunk(3) if b is not None else (None, None, None)
        return heads(query, w_q, b_q, 1)[0], heads(key, w_k, b_k, 1)[0], heads(value, w_v, b_v, 1)[0]

    def _append_extra_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """k, v (N, H, S, D) with bias_k/bias_v and then the zero key and value
        (add_zero_attn) appended as keys S, S+1; also returns how many were appended."""
        if (self.bias_k is None) != (self.bias_v is None):
            raise AssertionError("bias_k and bias_v: expected both or neither to be set")
        N, H, _, D = k.shape
        extra = 0
        if self.bias_k is not None:
            def per_head(bias: Tensor) -> Tensor:  # (1, 1, E) -> (N, H, 1, D)
                return bias.view(1, H, 1, D).expand(N, H, 1, D)

            k = torch.cat([k, per_head(self.bias_k)], dim=2)
            v = torch.cat([v, per_head(self.bias_v)], dim=2)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, D)], dim=2)
            extra += 1
        return k, v, extra

    def _attention_with_weights(self, q, k, v, masks: mask_translation.OpMasks, dropout_p: float):
        """The materialising path: (N, H, L, D) output and the (N, H, L, S') weights used for it.

        As in torch, dropout is applied to the weights (F.dropout, so a seeded run drops the
        same entries as torch) and the returned weights are the dropped-out ones; rows with
        no allowed key are NaN, as torch's softmax of an all -inf row.
        """
        p = FT.attention_weights(
            q, k, attn_mask=masks.attn_mask, key_lengths=masks.key_lengths, is_causal=masks.is_causal,
        )  # (N, H, L, S')
        # a row with any allowed key sums to ~1 (its largest entry is exp(0) / sum); only a
        # fully masked row is all zeros
        p = p.masked_fill(p.sum(-1, keepdim=True) == 0, math.nan)
        if dropout_p > 0.0:
            p = F.dropout(p, p=dropout_p)
        return p @ v, p

