"""The Prefect flows and the command line."""

import os

# oneDNN (torch's CPU matmuls, and vLLM's CPU GEMMs, which link their own copy) keeps a compiled primitive for every
# matmul shape it meets, up to 1,024 by default, with its buffers; a run meets new shapes at every step (sequence
# lengths, engine batch sizes), so its resident memory grew ~0.05 GiB per step (smoke recipe cut to 5 steps: RSS
# before the update 1.69 -> 2.27 GiB; with 32: 1.66 -> 2.07, same step times). Read once, when oneDNN starts:
# set ONEDNN_PRIMITIVE_CACHE_CAPACITY yourself to override.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
