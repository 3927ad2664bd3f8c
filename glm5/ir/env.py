"""Environment variables read on every op call (``GLM5_STRICT``, ``GLM5_BACKEND``,
``GLM5_PLUGINS``), read cheaply.

``os.environ.get`` encodes the name and decodes the value on every call (~1.3 µs on the
2-core test machines, three reads per op call: more than the rest of an eager call's
dispatch); looking the encoded name up in the mapping ``os.environ`` keeps (``_data``, which
its ``__setitem__`` / ``__delitem__`` update, so reads stay coherent with every change made
through ``os.environ``) costs ~0.1 µs. Where that mapping is not there (another Python),
``os.environ.get`` is used.
"""

from __future__ import annotations

import functools
import os

_data = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_data, dict) and callable(_encode) and callable(_decode)


@functools.lru_cache(maxsize=None)
def _key(name: str):
    return _encode(name)


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, without re-encoding ``name`` on every call."""
    if not _FAST:
        return os.environ.get(name)
    v = _data.get(_key(name))
    return None if v is None else _decode(v)
