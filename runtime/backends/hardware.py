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
    return _cpu_bf16()


@functools.lru_cache(maxsize=1)
def _cpu_bf16() -> bool:
    """True when this CPU has AMX-BF16 or AVX512-BF16 (/proc/cpuinfo flags)."""
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


# --- the device the learner, critic, reference model and transformers generation run on --------------------
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def check_device_setting(setting: str) -> str:
    """``model.device`` as written by a user, validated (pure: no torch import): ``auto`` / ``cpu`` / ``cuda`` /
    ``cuda:N``. Raises ValueError saying what is accepted."""
    s = str(setting).strip().lower()
    if s in ("auto", "cpu", "cuda"):
        return s
    if s.startswith("cuda:") and s[5:].isdigit():
        return s
    raise ValueError(f"model.device must be {DEVICE_CHOICES}, got {setting!r}")


def resolve_device(setting: str | None = "auto"):
    """The ``torch.device`` for a ``model.device`` setting: ``auto`` (or None) is the current CUDA device when torch
    sees one, else the CPU; ``cuda`` / ``cuda:N`` without a usable GPU is refused with what to change."""
    import torch

    s = check_device_setting(setting or "auto")
    if s == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if s == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"model.device={s} but torch sees no CUDA GPU here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'no'}): install the CUDA build (infra/install.sh --gpu) "
                         "or set model.device=auto / cpu")
    dev = torch.device(s)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"model.device={s} but torch sees {torch.cuda.device_count()} CUDA GPU(s): use "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def device_bf16(device) -> bool:
    """Whether bf16 is native on ``device`` (a ``torch.device``): a bf16 GPU there, or the CPU's AMX / AVX512-BF16."""
    import torch

    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return _cpu_bf16()


def autocast(device, enabled: bool, cache: bool = True):
    """bf16 autocast on ``device``'s type when ``enabled``, else a null context: the one autocast of the learner,
    the critic and transformers generation (CPU and CUDA take the same code path). ``cache=False`` for training
    forwards: autocast otherwise keeps the bf16 copy of every weight it cast until the forward ends (0.27 GiB for
    SmolLM2-135M), also in layers whose activations are checkpointed; without it each weight is cast where it is
    used (once per forward; the same values, so the same results). Generation keeps it: each decoding step would
    cast every weight again."""
    import contextlib

    import torch

    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
