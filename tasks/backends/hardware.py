"""What the machine computes fast: bf16 only pays where the hardware has it natively.

On a CPU with AMX or AVX512-BF16 (or a GPU with bf16), bf16 autocast trains ~2x faster than fp32. On a CPU
without them (AVX2 only) torch emulates bf16 matmuls and they run ~40x *slower* than fp32 (measured on a
2-core AVX2 EPYC: 0.7 vs 31 GFLOPS). ``None`` in the config means "decide from the hardware".
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """True when bf16 matmuls are native here: a CUDA GPU with bf16, or a CPU with AMX-BF16 / AVX512-BF16."""
    try:
        import torch

        if torch.cuda.is_available():
            return bool(torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001 - no torch / broken CUDA: fall through to the CPU check
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def resolve_bf16(setting: bool | None) -> bool:
    """The learner's / generator's autocast choice: an explicit setting wins, ``None`` follows the hardware."""
    return native_bf16() if setting is None else bool(setting)


def resolve_vllm_dtype(setting: str | None) -> str:
    """vLLM's weights dtype: an explicit setting wins, ``None`` is bfloat16 with native bf16, else float32."""
    if setting is not None:
        return setting
    return "bfloat16" if native_bf16() else "float32"
