"""The learning study's old entry point: the study is ``scalinginter study`` (``flows/study.py``) now; this file runs
it with the same arguments and, imported, is that module (so ``import learning_study`` and loading this file by
path keep working)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flows.study as _impl  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(_impl.main())
globals().update({k: v for k, v in vars(_impl).items() if not k.startswith("__")})
sys.modules[__name__] = _impl
