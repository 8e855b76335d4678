"""Drop-in replacements for torch.nn's Transformer modules, plus the seed building blocks."""

from .attention import MultiheadAttention
from .dropout import Dropout
from .normalization import LayerNorm, RMSNorm
from .transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from .embedding import PositionalEncoding, TokenEmbedding
from . import fused_inference

fused_inference.install()

__all__ = [
    "MultiheadAttention",
    "Dropout",
    "LayerNorm",
    "RMSNorm",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "TokenEmbedding",
    "PositionalEncoding",
]
