"""Length buckets for the learner's forward passes (pure: ints in, ints out).

On the CPU every distinct matmul shape costs memory that stays: oneDNN compiles and caches a kernel (with its
buffers) per shape, and a heap that serves ever new tensor sizes fragments. Multi-turn episodes have a new set of
lengths every step, so a learner on exact lengths held more memory after every update (issue 31). Rounding each
forward's length up to a bucket bounds the shapes: ``per_octave`` evenly spaced lengths between consecutive powers
of two cost at most 1/``per_octave`` of padding (short and long sequences alike), and a run over lengths up to
2^k sees at most ``per_octave`` * k of them.
"""

from __future__ import annotations


def _step(n: int, per_octave: int) -> int:
    """The spacing of the buckets in ``n``'s doubling (1: ``n`` is exact)."""
    if per_octave <= 0 or n <= per_octave:
        return 1
    return max(1, (1 << (n.bit_length() - 1)) // per_octave)


def bucket_length(n: int, per_octave: int) -> int:
    """``n`` rounded up to the next of ``per_octave`` evenly spaced lengths between two powers of two (8: 64, 72,
    80, ..., 120, 128, 144, ...): at most 1/``per_octave`` of padding, and few distinct lengths (per_octave per
    doubling). ``per_octave`` 0: ``n`` itself."""
    step = _step(n, per_octave)
    return -(-n // step) * step


def bucket_floor(n: int, per_octave: int) -> int:
    """The largest bucketed length (``bucket_length``) <= ``n``."""
    step = _step(n, per_octave)
    return n // step * step
