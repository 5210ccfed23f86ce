import pytest

from core.buckets import bucket_floor, bucket_length


@pytest.mark.parametrize("n,k,up,down", [
    (139, 8, 144, 128),   # 128-255: steps of 16
    (75, 8, 80, 72),      # 64-127: steps of 8
    (775, 8, 832, 768),   # 512-1023: steps of 64
    (443, 8, 448, 416),   # 256-511: steps of 32
    (128, 8, 128, 128),   # a power of two is a bucket
    (250, 8, 256, 240),   # rounding up may reach the next power of two
    (9, 8, 9, 9),         # steps of 1 below 2 * per_octave: exact
    (5, 8, 5, 5),
    (139, 0, 139, 139),   # 0: exact lengths
    (139, 4, 160, 128),   # 4 per doubling: steps of 32 in 128-255
])
def test_bucket_length_and_floor(n, k, up, down):
    assert bucket_length(n, k) == up and bucket_floor(n, k) == down


def test_buckets_bound_padding_and_the_number_of_lengths():
    for k in (4, 8, 16):
        ups = {bucket_length(n, k) for n in range(1, 4097)}
        for n in range(1, 4097):
            b = bucket_length(n, k)
            assert n <= b < n * (1 + 1 / k) and bucket_length(b, k) == b  # bounded padding; a bucket is its own
            f = bucket_floor(n, k)
            assert f <= n and bucket_length(f, k) == f and (f == n or bucket_length(f + 1, k) > n)
        assert len(ups) <= 2 * k + k * 12  # exact below 2k, then k per doubling up to 2^12
