"""Hand freed heap memory back to the operating system.

A burst of work (thousands of objects created at once, each watch event a parsed JSON
body) leaves the C heap with free pages that glibc keeps for reuse, so the resident size
stays at the burst's peak long after it. malloc_trim returns them; it is cheap when there
is little to return.

glibc also gives threads arenas of their own, up to eight per core, each keeping its own
free pages: with the operator's dozens of threads (kopf's workers, the expiry and poll
workers, the client's connections) a burst leaves freed memory spread over many arenas.
limit_arenas() caps them, as MALLOC_ARENA_MAX would, if called before those threads start.

A release is not free: its full collection walks every object the operator keeps
(about 0.1 s with 500 Sessions and 1,000 Checkpoints), so Releases asks for one only
where there can be something to give back: after a spell of work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

_libc = None
try:
    _name = ctypes.util.find_library("c")
    if _name:
        _libc = ctypes.CDLL(_name)
        if not hasattr(_libc, "malloc_trim"):  # not glibc (musl, macOS)
            _libc = None
except OSError:
    _libc = None


# mallopt's parameter number for the arena cap (glibc's malloc.h).
_M_ARENA_MAX = -8
ARENAS = 2


def limit_arenas(count: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas; False where the C library has no such setting."""
    if _libc is None:
        return False
    return bool(_libc.mallopt(_M_ARENA_MAX, count))


def freeze_startup() -> None:
    """Keep everything allocated so far (the modules, the API client, its schemas) out of
    every later garbage collection: none of it becomes garbage, and scanning it was most of
    each full collection's time (about 0.3 s in a running operator, one in each
    release() and in Python's own full collections under load)."""
    gc.collect()
    gc.freeze()


def release() -> bool:
    """Collect garbage, then trim the heap; False where the C library cannot trim."""
    gc.collect()
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


class Releases:
    """When the periodic release is worth its cost: at the end of a window in which the
    process worked (at least `busy_cpu` seconds of CPU, all threads), and at the end of
    the first quiet window after one, which holds that work's tail. Not in the quiet
    windows after that: at rest there is nothing new to give back, and a release every
    window was most of an idle operator's CPU. The first window after start-up counts
    as worked. `clock` is the process's CPU time."""

    def __init__(self, busy_cpu: float, clock: Callable[[], float] = time.process_time) -> None:
        self._busy_cpu = busy_cpu
        self._clock = clock
        self._since = clock()
        self._worked = True

    def due(self) -> bool:
        """At the end of a window: release now?"""
        now = self._clock()
        worked, self._since = now - self._since >= self._busy_cpu, now
        due, self._worked = worked or self._worked, worked
        return due

    def released(self) -> None:
        """A release has run: its own CPU is not the next window's work."""
        self._since = self._clock()
