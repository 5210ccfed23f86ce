"""Loading the non-HF parts of a checkpoint (optimizer, RNG, critic) without running code from the store.

``torch.load(weights_only=False)`` unpickles arbitrary objects, so whoever can write to the checkpoint store
could run code on every resume. Everything we save there is tensors and plain Python values (dicts, lists,
tuples, numbers, strings, None), which ``weights_only=True`` loads; anything else is refused with the file's
name.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpointFile(RuntimeError):
    """A checkpoint file holds objects other than tensors and plain values (refused, never unpickled)."""


def refusal_reason(exc: BaseException) -> str:
    """The line of torch's weights_only refusal that names what was refused (``Unsupported global: GLOBAL x.y``),
    without its terminal colour codes; else its first line. At most 200 characters."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it names {m.group(1)}, which is not allowed"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "Unsupported global" in ln or "GLOBAL" in ln]
    return ((named or lines or [type(exc).__name__])[0])[:200]


def load_plain(path: Path | str, map_location: Any = None) -> Any:
    """``torch.load`` restricted to tensors and plain values (``map_location`` as torch.load's)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointFile(
            f"{path} holds objects other than tensors and plain values, so it is not loaded (weights_only); "
            f"it was not written by this version of ScalingInter, or was tampered with: resume from another "
            f"checkpoint or delete this one. ({refusal_reason(exc)})"
        ) from exc
