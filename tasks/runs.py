"""Where a run lives: its name, directory, recorded config, checkpoint root, tracker, and the local folder of a
model reference or checkpoint URI. Used by the parent flow, ``evaluate`` and the nightly evaluation."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from core.config import RunConfig
from core.redact import redact
from storage.checkpoint_store import is_s3_uri, join_uri, load_checkpoint
from storage.tracking import Tracker, default_tracking_uri


def resolve_run(cfg: RunConfig) -> RunConfig:
    """Give an unnamed run a name. Inside a Prefect flow run the name derives from the flow run (its name
    and id stay the same when the run is retried from the UI, so a retry finds and resumes the same run)."""
    if cfg.run_name:
        return cfg
    from prefect.runtime import flow_run

    fr_id, fr_name = flow_run.get_id(), flow_run.get_name()
    if fr_id and fr_name:
        suffix = f"{fr_name}-{str(fr_id)[:8]}"
    else:
        suffix = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cfg.model_copy(update={"run_name": f"{cfg.env.name}-{cfg.preset or 'custom'}-{suffix}"})


def run_dir(cfg: RunConfig) -> Path:
    d = Path(cfg.output_dir).resolve() / cfg.run_name
    d.mkdir(parents=True, exist_ok=True)
    return d


def recorded_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as a run records it (config.json, MLflow params, trainer_state.json): URI credentials redacted."""
    return redact(cfg.model_dump(mode="json"))


def write_run_config(rd: Path, cfg: RunConfig) -> Path:
    path = rd / "config.json"
    path.write_text(json.dumps(recorded_config(cfg), indent=2))
    return path


def checkpoint_root(cfg: RunConfig) -> str:
    root = cfg.checkpoint.root or str(Path(cfg.output_dir).resolve() / "checkpoints")
    return join_uri(root, cfg.run_name)


def cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir).resolve() / ".checkpoint-cache"


def make_tracker(cfg: RunConfig) -> Tracker:
    uri = default_tracking_uri(cfg.output_dir, cfg.tracking.uri)
    return Tracker(uri, cfg.tracking.experiment, artifact_root=Path(cfg.output_dir).resolve() / "mlartifacts")


def check_ref(ref: str, what: str = "checkpoint") -> None:
    """A model reference must be an embedded model, an s3:// URI or a local checkpoint / HF folder (checked by
    ``scalinginter eval`` before anything heavy loads, and by ``flows.evaluate.evaluate``); raises EvalInputError."""
    from core.evalinput import EvalInputError
    from runtime.backends.model import EMBEDDED

    if ref in EMBEDDED or is_s3_uri(ref):
        return
    p = Path(ref).expanduser()
    if not p.exists():
        raise EvalInputError(f"{what} {ref!r} not found: pass a checkpoint folder (runs/checkpoints/<run>/phase-<k>/"
                             f"final), an s3:// URI or one of {', '.join(EMBEDDED)}")
    if not p.is_dir() or not ((p / "manifest.json").exists() or (p / "config.json").exists()):
        raise EvalInputError(f"{what} {ref!r} is not a checkpoint (no manifest.json or config.json in it): pass a "
                             f"phase's final/ or step-*/ folder, or a Hugging Face model folder")


def local_model_dir(cfg: RunConfig, ref: str) -> str:
    """A local HF folder for a model reference or a checkpoint URI. A checkpoint (local or S3) is verified against
    its manifest — sizes and sha256 of every file — on every load: a damaged file raises CheckpointCorrupted
    naming it."""
    from runtime.backends.model import resolve_model

    if is_s3_uri(ref) or (Path(ref) / "manifest.json").exists():
        return str(load_checkpoint(ref, cache_dir(cfg), verify_sha256=True))
    return resolve_model(ref)
