"""Dropout on fasttrans's fused kernel, as a drop-in for ``torch.nn.Dropout``."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as FT
from ._pinning import pinnable
from ._script import NotScriptable

__all__ = ["Dropout"]


class Dropout(NotScriptable, torch.nn.Dropout):
    r"""``torch.nn.Dropout`` computed by :func:`fasttrans.functional.dropout`.

    Same constructor (``p``, ``inplace``), ``repr`` and ``state_dict`` (none) as torch's, and
    a subclass of it, so code that checks ``isinstance(m, torch.nn.Dropout)`` or reads ``m.p``
    keeps working. Training mode zeroes each element with probability ``p`` and scales the
    rest by 1 / (1 - p) in one pass; backward reuses the saved one-byte keep mask instead of
    torch's full-size float mask. The masks come from fasttrans's counter-based generator
    (seeded from torch's default generator), so they differ from torch.nn.Dropout's.
    """

    @pinnable
    def forward(self, input: Tensor) -> Tensor:
        return FT.dropout(input, self.p, self.training, self.inplace)
