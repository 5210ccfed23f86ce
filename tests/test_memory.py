"""runtime.memory.trim_heap: freed heap pages go back to the OS (glibc), live memory is untouched."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.memory import trim_heap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_trim_returns_freed_heap_pages_and_keeps_live_ones():
    """In a child process (the allocator settings below stay out of the test process): see ``_scenario``."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", "import tests.test_memory as t; t._scenario()"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _scenario() -> None:
    """Many 1 MiB blocks under the mmap threshold raised to 32 MiB (as freeing a big tensor raises it) come from the
    heap; freeing all but every 16th leaves most pages free but held (the kept blocks pin the heap's top). The trim
    returns them: resident memory falls by at least half the freed bytes, and the kept blocks still hold their
    bytes."""
    libc = ctypes.CDLL("libc.so.6")
    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
    assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 1 << 20, 256
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 7, size)  # touched: resident
    kept = blocks[15::16]
    for i, b in enumerate(blocks):
        if i % 16 != 15:
            libc.free(b)
    before = _rss()
    assert trim_heap()
    after = _rss()
    freed = (n - len(kept)) * size
    assert before - after > freed // 2, (before, after)
    assert all(ctypes.string_at(b, 8) == b"\x07" * 8 and ctypes.string_at(b + size - 8, 8) == b"\x07" * 8
               for b in kept)
    for b in kept:
        libc.free(b)


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise(MADV_DONTNEED) semantics are Linux's")
def test_zero_pages_zeroes_the_range_without_making_it_resident():
    """The released KV cache comes back through ``zero_pages``: every byte of the range reads 0 afterwards, the
    bytes around it are untouched (its ends are not page-aligned here), and the whole pages inside it stop being
    resident (they are mapped again, zeroed, on their next touch)."""
    import torch

    from runtime.memory import PAGE, zero_pages

    n = (64 << 20) + 123
    buf = torch.full((n,), 7, dtype=torch.uint8)  # written: resident
    start, length = 100, n - 100 - 77
    before = _rss()
    dropped = zero_pages(buf.data_ptr() + start, length)
    after = _rss()
    assert dropped >= length - 2 * PAGE and dropped % PAGE == 0
    assert before - after > 0.9 * dropped, (before, after, dropped)
    assert int(buf[start:start + length].count_nonzero()) == 0
    assert bool((buf[:start] == 7).all()) and bool((buf[start + length:] == 7).all())
    buf[start:start + length] = 5  # the pages work as ordinary memory again
    assert int((buf == 5).sum()) == length


def test_flows_cap_onednn_primitive_cache_unless_set():
    """``import flows`` (the CLI's and every deployment's first import, before torch) caps oneDNN's per-shape
    primitive cache at 32, and leaves a value the user set alone."""
    import os
    import subprocess
    import sys

    code = "import os, flows, torch; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    run = dict(cwd=root, capture_output=True, text=True, check=True, timeout=120)
    assert subprocess.run([sys.executable, "-c", code], env=env, **run).stdout.strip() == "32"
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "256"
    assert subprocess.run([sys.executable, "-c", code], env=env, **run).stdout.strip() == "256"
