"""fasttrans: the textbook Transformer on fused kernels, as a drop-in for torch.nn.

Public API (re-exports only; the layers below are described in docs/design.md):

    fasttrans.attention, fasttrans.layer_norm, fasttrans.add_layer_norm, fasttrans.rms_norm
    fasttrans.use_backend            force a backend for a block of code
    fasttrans.nn                     drop-in modules (same API and state_dict as torch.nn)
    fasttrans.models                 Seq2SeqTransformer and decoding
"""

from .version import __version__

from .backends import BackendUnavailableError, available_backends, use_backend
from .functional import add_layer_norm, attention, layer_norm, rms_norm
from . import functional, reference, nn, models  # noqa: E402  (subpackages after the ops they use)
from .conversion import convert  # noqa: E402

__all__ = [
    "__version__",
    "attention",
    "layer_norm",
    "add_layer_norm",
    "rms_norm",
    "use_backend",
    "convert",
    "available_backends",
    "BackendUnavailableError",
    "functional",
    "reference",
    "nn",
    "models",
]
