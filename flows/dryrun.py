"""``scalinginter run ENV --dry-run``: the run's context, KV cache and memory plan (``core.preflight``) from its
config and the model's ``config.json``, without loading a model or starting anything."""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.config import RunConfig
from core.kvcache import GiB
from core.preflight import OPTIMIZER_STATE_BYTES, ModelShape, Plan, RunShape, check_run


def _model_config(ref: str) -> dict:
    """The model's ``config.json``: an embedded default (materialised as an HF folder), a local folder, or a hub id
    (from the hub cache, or the hub when online)."""
    from runtime.backends.model import resolve_model

    path = resolve_model(ref)
    if Path(path).is_dir():
        return json.loads((Path(path) / "config.json").read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(path, "config.json")).read_text())


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def run_shape(cfg: RunConfig) -> RunShape:
    from runtime.backends.hardware import resolve_vllm_dtype

    r, a = cfg.rollout, cfg.algo
    turn_limit = max([p.turn_limit for p in cfg.curriculum.phases] + [cfg.eval.turn_limit or 0])
    episodes = max(r.tasks_per_step * r.samples_per_task, cfg.eval.n)
    if r.max_live_episodes is not None:
        episodes = min(episodes, r.max_live_episodes)
    return RunShape(turn_limit=turn_limit, max_new_tokens=r.max_new_tokens, token_budget=r.token_budget,
                    history_turns=r.history_turns, episodes=episodes,
                    kv_budget_bytes=int(r.vllm_kv_budget_gb * GiB),
                    kv_fixed_bytes=None if r.vllm_kv_cache_gb is None else int(r.vllm_kv_cache_gb * GiB),
                    engine_bytes_per_elem=4 if resolve_vllm_dtype(r.vllm_dtype) == "float32" else 2,
                    micro_batch_tokens=a.micro_batch_tokens, micro_batch_size=a.micro_batch_size,
                    reference=a.kl_coef > 0, critic=a.estimator == "ppo", vllm=r.backend == "vllm",
                    optimizer_bytes_per_param=OPTIMIZER_STATE_BYTES[a.optimizer])


def dry_run(cfg: RunConfig) -> Plan:
    """The plan of ``cfg`` (its ``errors`` empty when the run would start)."""
    try:
        shape = ModelShape.from_hf_config(_model_config(cfg.model.path))
    except Exception as e:  # noqa: BLE001 - any failure to read the model's config is the one thing to report
        p = Plan()
        p.errors.append(f"cannot read the config of model {cfg.model.path!r} ({type(e).__name__}: {e}): pass a local "
                        "HF folder or a hub id reachable from here (--set model.path=...)")
        return p
    plan = check_run(shape, run_shape(cfg), machine_memory(), model_name=cfg.model.path)
    plan.lines.insert(0, f"model {cfg.model.path}: {shape.params / 1e6:.0f} M parameters, context "
                         f"{shape.context or 'unknown'}")
    return plan
