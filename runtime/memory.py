"""Giving freed memory back to the operating system.

glibc's allocator keeps what a process frees in its heaps for reuse: torch tensors between 128 KiB and 32 MiB (a
135M model's weight matrices, their gradients and AdamW moments, the update's activations) come from there once
its mmap threshold has risen, and after a phase's learner is closed, or an update's activations are freed, those
pages stay resident. Measured on a multistep study arm in its third phase: 11.8 GB resident before
``malloc_trim(0)``, 7.5 GB after, the same live tensors (4.3 GB of free heap pages held). ``trim_heap`` hands the
free pages back; the pipeline calls it after each update and each closed session (every evaluation closes its
session). A no-op where the C library is not glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _libc_fn(name: str, argtypes: list, restype):
    """The C library's function ``name`` with its signature set, or None where the library has none."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    return _libc_fn("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def trim_heap() -> bool:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``: every arena, the pages inside it too, not
    only its top). Live memory is untouched. Returns True when some memory was released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise``, or None where there is none."""
    return _libc_fn("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


MADV_DONTNEED = 4  # Linux
PAGE = mmap.PAGESIZE


def zero_pages(ptr: int, nbytes: int) -> int:
    """Zero ``nbytes`` at address ``ptr`` of private anonymous memory (the heap's, an anonymous mapping's) without
    making them resident: the whole pages inside the range are dropped (``madvise(MADV_DONTNEED)``: the next touch
    maps a fresh zero page), the partial pages at its ends are written with zeros. Where madvise is missing or
    refuses (not Linux), every byte is written. Returns the bytes dropped rather than written."""
    if nbytes <= 0:
        return 0
    lo = (ptr + PAGE - 1) // PAGE * PAGE
    hi = (ptr + nbytes) // PAGE * PAGE
    fn = _madvise()
    if fn is None or hi <= lo or fn(lo, hi - lo, MADV_DONTNEED) != 0:
        ctypes.memset(ptr, 0, nbytes)
        return 0
    ctypes.memset(ptr, 0, lo - ptr)
    ctypes.memset(hi, 0, ptr + nbytes - hi)
    return hi - lo
