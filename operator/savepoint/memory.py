"""Hand freed heap memory back to the operating system.

A burst of work (thousands of objects created at once, each watch event a parsed JSON
body) leaves the C heap with free pages that glibc keeps for reuse, so the resident size
stays at the burst's peak long after it. malloc_trim returns them; it is cheap when there
is little to return.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_libc = None
try:
    _name = ctypes.util.find_library("c")
    if _name:
        _libc = ctypes.CDLL(_name)
        if not hasattr(_libc, "malloc_trim"):  # not glibc (musl, macOS)
            _libc = None
except OSError:
    _libc = None


def release() -> bool:
    """Collect garbage, then trim the heap; False where the C library cannot trim."""
    gc.collect()
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True
