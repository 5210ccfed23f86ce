"""bitsandbytes' 8-bit AdamW, stepped a slice at a time on the CPU.

bitsandbytes' CPU kernel for the block-wise 8-bit update works on a whole tensor at once: it dequantises both
moments to fp32, casts the gradient and computes the denominator, ~16 bytes of temporaries per element. For a
135M model's tied embedding (28 M elements) that is ~0.42 GiB on top of everything the update holds, at the moment
the gradients are all still alive. The update is elementwise and the quantisation is per block of 256 elements, so
running the same kernel on consecutive slices that start on a block boundary gives bit-identical weights and state
(``tests/test_optim8bit.py``) with temporaries of one slice. On CUDA the fused kernel has no such temporaries and
the tensor goes whole.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch

QUANT_BLOCK = 256  # the CPU kernel's (and init_state's) block size for the 8-bit moments
SLICE = 1 << 20  # elements per slice (a multiple of QUANT_BLOCK): ~16 MiB of temporaries


class SlicedAdamW8bit(bnb.optim.AdamW8bit):
    """``bnb.optim.AdamW8bit`` whose CPU update of an 8-bit-state tensor runs ``slice_elems`` elements at a time.
    Same state (names, shapes, dtypes) as the stock optimizer, so checkpoints are interchangeable."""

    def __init__(self, params, *args, slice_elems: int = SLICE, **kwargs):
        if slice_elems <= 0 or slice_elems % QUANT_BLOCK:
            raise ValueError(f"slice_elems must be a positive multiple of {QUANT_BLOCK}, got {slice_elems}")
        super().__init__(params, *args, **kwargs)
        self.slice_elems = slice_elems

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        state = self.state[p]
        if p.device.type != "cpu" or state["state1"].dtype != torch.uint8 or p.numel() <= self.slice_elems:
            return super().update_step(group, p, gindex, pindex)
        p.data = p.data.contiguous()
        p.grad = p.grad.contiguous()
        config = self.get_config(gindex, pindex, group)
        state["step"] += 1
        step = state["step"]
        flat = [t.view(-1) for t in (p.grad, p.data, state["state1"], state["state2"])]
        n, b = p.numel(), self.slice_elems // QUANT_BLOCK
        for a in range(0, n, self.slice_elems):
            e = min(n, a + self.slice_elems)
            g, w, s1, s2 = (t[a:e] for t in flat)
            blocks = slice(a // QUANT_BLOCK, a // QUANT_BLOCK + b)
            F.optimizer_update_8bit_blockwise(
                self.optimizer_name, g, w, s1, s2,
                config["betas"][0], config["betas"][1],
                config["betas"][2] if len(config["betas"]) >= 3 else 0.0, config.get("alpha", 0.0),
                config["eps"], step, config["lr"], state["qmap1"], state["qmap2"],
                state["absmax1"][blocks], state["absmax2"][blocks], config["weight_decay"],
                gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
