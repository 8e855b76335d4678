"""Environment reads on the hot path, shared by every layer.

Each call reads FASTTRANS_BACKEND (and TRITON_INTERPRET where it matters): ``os.environ``
decodes its key and value on every read, while a lookup in its byte-keyed store (POSIX) sees
the same updates at a fraction of the cost.
"""

from __future__ import annotations

import os

__all__ = ["getenv"]

_data = getattr(os.environ, "_data", None) if os.name == "posix" else None  # bytes keys there
if not isinstance(_data, dict):
    _data = None


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, through the byte-keyed store where there is one."""
    if _data is None:
        return os.environ.get(name)
    value = _data.get(name.encode())
    return None if value is None else os.fsdecode(value)
