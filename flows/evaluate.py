"""Evaluation flow: score a checkpoint on a split with greedy decoding."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from core.config import RunConfig
from envs.base import task_index
from tasks import steps as T


def run_eval(cfg: RunConfig, checkpoint: str, split: str = "test", n: int = 16, turn_limit: int = 20) -> dict:
    from flows.scalinginter import local_model_dir
    from tasks.backends.model import EMBEDDED
    from tasks.checkpoint_store import is_s3_uri

    if not (checkpoint in EMBEDDED or is_s3_uri(checkpoint) or Path(checkpoint).exists()):
        raise FileNotFoundError(f"checkpoint {checkpoint!r} not found (a local checkpoint dir, s3:// URI, "
                                f"or one of {', '.join(EMBEDDED)})")
    return evaluate_checkpoint(cfg, checkpoint, split, n, turn_limit, local_model_dir(cfg, checkpoint))


@flow(name="evaluate", log_prints=True)
def evaluate_checkpoint(config: RunConfig, checkpoint: str, split: str, n: int, turn_limit: int,
                        model_dir: str) -> dict:
    ids = [task_index(split, i) for i in range(n)]
    return T.score_model(config, model_dir, ids, turn_limit, config.rollout.max_new_tokens)
