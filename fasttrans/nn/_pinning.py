"""Backend pins on modules: ``fasttrans.convert(model, backend=...)`` sets a module's
``_fasttrans_backend``, and its forward then runs under ``use_backend`` of that name."""

from __future__ import annotations

import functools

from .. import functional as FT


def pinnable(forward):
    """Decorates a module's forward: a module whose ``_fasttrans_backend`` attribute names a
    backend runs under ``use_backend(that name)``. An attribute, unlike a replaced bound
    forward, goes with the module into deep copies, clones and pickles."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        backend = self.__dict__.get("_fasttrans_backend")
        if backend is None:
            return forward(self, *args, **kwargs)
        with FT.use_backend(backend):
            return forward(self, *args, **kwargs)

    return run
