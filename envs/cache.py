"""The one ScalingInter cache directory, shared by the env packages (task catalogs, search indexes) and the
trainer (dequantised models): ``$SCALINGINTER_CACHE`` or ``~/.cache/scalinginter``. It lives in envs/, the
lower of the two layers that need it, so an env server needs no trainer code."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SCALINGINTER_CACHE`` or ``~/.cache/scalinginter`` (not created here)."""
    root = os.environ.get("SCALINGINTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "scalinginter")
    return Path(root)
