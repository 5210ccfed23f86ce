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


def load_plain(path: Path | str) -> Any:
    """``torch.load`` restricted to tensors and plain values."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointFile(
            f"{path} holds objects other than tensors and plain values, so it is not loaded (weights_only); "
            f"it was not written by this version of ScalingInter, or was tampered with: resume from another "
            f"checkpoint or delete this one. ({str(exc).splitlines()[0][:200]})"
        ) from exc
