"""JAX's persistent compilation cache for the stage programs: a second process on the same plan loads them.

``autopp.parallelize(..., compilation_cache=...)``: a directory; ``None`` (the default) keeps the directory JAX is
configured with, else uses ``$XDG_CACHE_HOME/autopp/xla`` (``AUTOPP_COMPILATION_CACHE=0`` in the environment
turns that default off); ``False`` leaves JAX's configuration as it is. Where autopp chooses the directory it also
caches programs of any compile time (``jax_persistent_cache_min_compile_time_secs=0``; JAX's default, 1 s, leaves
most stage programs out: a stage compiles in a fraction of a second on CPU). JAX's own rules apply otherwise: the
cache is keyed by the program, its devices and compile options, and the jaxlib version; it is trusted code (see
``jax.experimental.compilation_cache``), so keep it in a directory only you can write.
"""

from __future__ import annotations

import os

import jax

ENV_SWITCH = "AUTOPP_COMPILATION_CACHE"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/autopp/xla`` (``~/.cache/autopp/xla``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "autopp", "xla")


def use_compilation_cache(setting) -> str | None:
    """Configure JAX's persistent compilation cache for ``setting`` (see the module docstring); returns the
    directory in use, or None when there is none."""
    current = jax.config.jax_compilation_cache_dir
    if setting is False:
        return current or None
    if setting is None or setting is True:
        if current:
            return current
        if setting is None and os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
            return None
        path = default_cache_dir()
    else:
        path = os.fspath(setting)
        if current == path:
            return path
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
