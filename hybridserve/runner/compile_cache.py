"""JAX's persistent compilation cache, on by default: a second engine start (or a second engine
in one process) loads its step programs from disk instead of compiling them again.

Where: `$JAX_COMPILATION_CACHE_DIR` or jax's own setting when either is given; else
`$HYBRIDSERVE_COMPILATION_CACHE` ("0" or "off": no cache); else a per-user directory,
`$XDG_CACHE_HOME/hybridserve/jax` (`~/.cache/hybridserve/jax`). Every program is stored, the
small ones between the steps too (jax's default keeps only those that compile for a second or
more; `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` still rules where it is set).

`programs()` counts the programs this process has handed to the backend so far, and how many
of them came from the cache (jax's monitoring events): a warmed-up engine that compiles while
serving met a shape its warmup did not cover.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax import monitoring

log = logging.getLogger(__name__)
ENV = "HYBRIDSERVE_COMPILATION_CACHE"
_COUNTS = {"programs": 0, "loaded": 0}
_LISTENING = False


def _on_duration(name: str, secs: float, **kw: object) -> None:
    if name == "/jax/core/compile/backend_compile_duration":  # compiled, or loaded from disk
        _COUNTS["programs"] += 1


def _on_event(name: str, **kw: object) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _COUNTS["loaded"] += 1


def programs() -> dict[str, int]:
    """{"compiled": n, "loaded": m}: the programs this process compiled, and loaded from the
    persistent cache, since the first engine started (counted from then on)."""
    return {"compiled": _COUNTS["programs"] - _COUNTS["loaded"], "loaded": _COUNTS["loaded"]}


def default_dir() -> Path | None:
    """The directory this process would use (None: the cache is off)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    chosen = os.environ.get(ENV, "")
    if chosen.lower() in ("0", "off", "none", "false"):
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridserve" / "jax"


def enable_compilation_cache() -> Path | None:
    """Point JAX's persistent cache at `default_dir()` (before the first compile); returns it.
    A directory that cannot be created leaves the cache off, with a warning. Starts the counts
    of `programs()`."""
    global _LISTENING
    if not _LISTENING:
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _LISTENING = True
    where = default_dir()
    if where is None:
        return None
    if jax.config.jax_compilation_cache_dir != str(where):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            log.warning("compilation cache off: cannot create %s (%s)", where, err)
            return None
        jax.config.update("jax_compilation_cache_dir", str(where))
    # every program, also where the directory came from $JAX_COMPILATION_CACHE_DIR
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return where
