"""Where kvcompress keeps its per-user caches (exported models)."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that overrides the cache root.
CACHE_ENV_VAR = "KVCOMPRESS_CACHE"


def default_cache_root() -> Path:
    """Return the root folder of the kvcompress user cache.

    The first of these that is set wins:

    1. ``$KVCOMPRESS_CACHE``
    2. ``$XDG_CACHE_HOME/kvcompress``
    3. ``~/.cache/kvcompress``

    The folder is not created here.

    Returns
    -------
    Path
        Absolute path of the cache root.
    """
    explicit = os.environ.get(CACHE_ENV_VAR)
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return (Path(xdg).expanduser() / "kvcompress").resolve()
    return (Path.home() / ".cache" / "kvcompress").resolve()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return ``cache_dir`` (user-expanded) when given, else :func:`default_cache_root`.

    Parameters
    ----------
    cache_dir : str or PathLike, optional
        An explicit cache root.

    Returns
    -------
    Path
        The cache root to use (not created here).
    """
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
