"""LayerNorm and RMSNorm: torch.nn's modules on fasttrans's fused normalisation ops.

Same constructor, parameters (``weight``, ``bias``), initialisation, ``extra_repr`` and
state_dict as ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``; ``forward`` calls
``fasttrans.layer_norm`` / ``fasttrans.rms_norm``, which accumulate statistics in fp32.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter, init

from .. import functional as FT
from ._pinning import pinnable
from ._script import NotScriptable

__all__ = ["LayerNorm", "RMSNorm"]


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


class LayerNorm(NotScriptable, Module):
    r"""Layer normalisation over the trailing ``normalized_shape`` dims, as ``torch.nn.LayerNorm``.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Args:
        normalized_shape: int or sequence of ints: the trailing dims to normalise over.
        eps: added to the variance. Default: 1e-5.
        elementwise_affine: learn ``weight`` (ones) and, if ``bias``, ``bias`` (zeros).
        bias: learn an additive bias (only with ``elementwise_affine``). Default: True.
        device, dtype: factory kwargs for the parameters.

    Shape: input (*, *normalized_shape), output the same.
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int, ...]
    eps: float
    elementwise_affine: bool

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            if bias:
                self.bias = Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    @pinnable
    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Tensor) and not input.is_floating_point():
            # torch's kernel dispatch raises NotImplementedError for integer inputs
            raise NotImplementedError(f"input: LayerNorm expects a floating-point tensor, got {input.dtype}")
        return FT.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        # the installed torch's own text, which differs between versions (bias= is newer)
        return torch.nn.LayerNorm.extra_repr(self)


class RMSNorm(NotScriptable, Module):
    r"""Root-mean-square normalisation, as ``torch.nn.RMSNorm``.

    .. math:: y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} \cdot \gamma

    Args:
        normalized_shape: int or sequence of ints: the trailing dims to normalise over.
        eps: added to the mean square; None (default) means the machine epsilon of the
            statistics' dtype, as in torch: ``torch.finfo(x.dtype).eps``, float32's for fp16/bf16.
        elementwise_affine: learn ``weight`` (ones). Default: True.
        device, dtype: factory kwargs for the parameters.

    Shape: input (*, *normalized_shape), output the same.

    Difference from torch.nn: complex inputs raise NotImplementedError naming ``x``
    (torch computes ``x * rsqrt(mean(x * x) + eps)`` for them, which is not the RMS of
    their magnitudes); the kernels take floating-point inputs only.
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int, ...]
    eps: float | None
    elementwise_affine: bool

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    @pinnable
    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, Tensor) and not x.is_floating_point():
            # torch's kernel dispatch raises NotImplementedError for integer inputs
            raise NotImplementedError(f"x: RMSNorm expects a floating-point tensor, got {x.dtype}")
        return FT.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return torch.nn.RMSNorm.extra_repr(self)
