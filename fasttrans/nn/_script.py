"""The modules' answer to ``torch.jit.script``: one clear error naming the supported routes.

The modules dispatch to a backend in Python (``fasttrans.backends``), which TorchScript
cannot compile; ``torch.compile`` and ``torch.export`` trace through that dispatch to the
registered ``torch.library`` ops instead. See docs/semantics.md ("TorchScript").
"""

from __future__ import annotations


class NotScriptable:
    """Mixin: ``torch.jit.script`` calls ``__prepare_scriptable__`` on a module and each of
    its submodules before compiling, so a model holding any fasttrans module gets this error
    instead of a TorchScript frontend error deep inside fasttrans."""

    def __prepare_scriptable__(self):
        name = type(self).__name__
        raise RuntimeError(
            f"fasttrans.nn.{name} cannot be compiled by torch.jit.script: fasttrans chooses its kernels in "
            f"Python, which TorchScript cannot compile (and TorchScript is deprecated in PyTorch). Use "
            f"torch.compile(model) to compile it, or torch.export.export(model, args) to deploy it."
        )
