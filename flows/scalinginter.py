"""The ScalingInter parent flow and its phase flow.

scalinginter (parent, MLflow parent run)
  eval before -> phase 1 -> phase 2 -> ... -> eval after
phase k (child flow, MLflow child run)
  spawn env servers -> per step: rollout batch -> advantages -> policy update -> checkpoint
  -> final checkpoint (its URI is the phase's result; the next phase starts from it)

Resume: a phase whose final checkpoint exists is skipped; a phase with step checkpoints resumes after the
last one (model, optimizer, RNG; the data position and turn limit are functions of the global step).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

from prefect import flow

from core.config import RunConfig
from core.curriculum import Gate, GateState, gate_update, phase_start, total_steps, turn_limit_at
from flows.config import build_config
from tasks import steps as T
from tasks.checkpoint_store import (
    checkpoint_exists,
    delete_checkpoint,
    is_s3_uri,
    join_uri,
    load_checkpoint,
    read_latest,
    write_latest,
)
from tasks.tracking import Tracker, default_tracking_uri


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


def checkpoint_root(cfg: RunConfig) -> str:
    root = cfg.checkpoint.root or str(Path(cfg.output_dir).resolve() / "checkpoints")
    return join_uri(root, cfg.run_name)


def cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir).resolve() / ".checkpoint-cache"


def make_tracker(cfg: RunConfig) -> Tracker:
    uri = default_tracking_uri(cfg.output_dir, cfg.tracking.uri)
    return Tracker(uri, cfg.tracking.experiment, artifact_root=Path(cfg.output_dir).resolve() / "mlartifacts")


def local_model_dir(cfg: RunConfig, ref: str) -> str:
    """A local HF folder for a model reference or a checkpoint URI."""
    from tasks.backends.model import resolve_model

    if is_s3_uri(ref) or (Path(ref) / "manifest.json").exists():
        return str(load_checkpoint(ref, cache_dir(cfg)))
    return resolve_model(ref)


def fmt(metrics: dict[str, float], keys: list[str]) -> str:
    return " | ".join(f"{k} {metrics[k]:.3g}" for k in keys if k in metrics)


# --- phase flow ------------------------------------------------------------------------------------------
@flow(name="phase", flow_run_name="phase-{phase}", log_prints=True)
def phase_flow(config: RunConfig, phase: int, init_ref: str, parent_run_id: str | None = None) -> str:
    """Train one phase (``phase`` is 1-based). Returns the URI of the phase's final checkpoint."""
    cfg = config
    phases = cfg.curriculum.as_phases()
    k = phase - 1
    ph = phases[k]
    start = phase_start(phases, k)
    root = checkpoint_root(cfg)
    phase_uri = join_uri(root, f"phase-{phase}")
    final_uri = join_uri(phase_uri, "final")
    if checkpoint_exists(final_uri):
        print(f"phase {phase}: final checkpoint exists ({final_uri}); skipping")
        tracker = make_tracker(cfg)
        run_id = tracker.find_run(f"{cfg.run_name}/phase-{phase}", parent_run_id)
        if run_id is not None:  # registration is the step after the final checkpoint: make sure it happened
            version = tracker.ensure_registered(cfg.env.name, final_uri, run_id, {
                "phase": str(phase), "turn_limit": str(ph.turn_limit), "run_name": cfg.run_name,
                "global_step": str(start + ph.steps)})
            if version is not None:
                print(f"phase {phase}: registered {final_uri} as model scalinginter-{cfg.env.name} version "
                      f"{version} (the earlier run stopped before registering it)")
        _phase_artifact(cfg, phase, ph.steps, start + ph.steps, None, final_uri, None,
                        note="Skipped: the final checkpoint of this phase exists (resumed run).")
        return final_uri

    tracker = make_tracker(cfg)
    run_id = tracker.start_run(f"{cfg.run_name}/phase-{phase}",
                               params={"phase": phase, "turn_limit": ph.turn_limit, "steps": ph.steps,
                                       "start_step": start},
                               parent_id=parent_run_id, tags={"scalinginter.phase": str(phase)})
    # resume from the last step checkpoint of this phase, else from the previous phase's result
    resume_uri = read_latest(phase_uri)
    done_steps = 0
    src = init_ref
    if resume_uri and checkpoint_exists(resume_uri):
        src = resume_uri
    model_dir = local_model_dir(cfg, src)
    ref_dir = local_model_dir(cfg, cfg.model.path)
    key = T.open_session(cfg, model_dir, train=True, reference_dir=ref_dir)
    session = T.get_session(key)
    status = "FAILED"
    metrics: dict[str, float] | None = None
    try:
        gated = cfg.curriculum.mode == "gated"
        gate = Gate(**cfg.curriculum.gate.model_dump())
        gstate = GateState()
        if src != cfg.model.path:  # a checkpoint: restore optimizer, RNG and position
            state = session.learner.load_training_state(Path(model_dir), weights=False)
            if src == resume_uri:
                done_steps = int(state.get("phase_step", 0))
                gstate = GateState.from_dict(state.get("gate"))
                print(f"phase {phase}: resuming after step {done_steps}/{ph.steps} from {resume_uri}")
            if gated:  # phases have data-dependent lengths: the position comes from the checkpoint
                start = int(state.get("global_step", 0)) - done_steps
        urls = T.spawn_env_servers(key)
        for i in range(done_steps, ph.steps):
            gstep = start + i
            # steps mode: the curriculum is a pure function of the global step; gated: of the phase
            limit = ph.turn_limit if gated else turn_limit_at(phases, gstep)
            t0 = time.time()
            T.ensure_servers_alive(key)
            roll = T.rollout_batch(key, urls, gstep, limit)
            adv = T.compute_advantages(key)
            upd = T.policy_update(key)
            metrics = {**roll, **adv, **{f"train/{k2}": v for k2, v in upd.items()},
                       "turn_limit": float(limit), "step_time_s": time.time() - t0}
            tracker.log_metrics(run_id, metrics, step=gstep)
            if parent_run_id:
                tracker.log_metrics(parent_run_id, {k2: metrics[k2] for k2 in
                                                    ("mean_reward", "success_rate", "mean_turns")}, step=gstep)
            if cfg.tracking.log_trajectories:
                tracker.log_text(run_id, T.trajectories_text(session.trajectories, cfg.tracking.log_trajectories),
                                 f"trajectories/step-{gstep + 1:06d}.json")
            with open(run_dir(cfg) / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps({"global_step": gstep + 1, "phase": phase, **metrics}) + "\n")
            T.write_rollout_parquet(session.trajectories, run_dir(cfg) / "rollouts" / f"step-{gstep + 1:06d}.parquet",
                                    phase, gstep)
            print(f"phase {phase}/{len(phases)} step {i + 1}/{ph.steps} (global {gstep + 1}/{total_steps(phases)}) "
                  f"turns<={limit} | episodes {int(roll['episodes'])} | "
                  + fmt(metrics, ["mean_reward", "success_rate", "mean_turns", "gen_tokens_per_s",
                                  "env_steps_per_s", "train/loss", "train/kl", "train/entropy"])
                  + f" | {metrics['step_time_s']:.1f}s", flush=True)
            state = {"global_step": gstep + 1, "phase": phase, "phase_step": i + 1, "turn_limit": limit,
                     "run_name": cfg.run_name, "config": cfg.model_dump(mode="json")}
            last = i + 1 == ph.steps
            if gated:
                gstate, reason = gate_update(gate, gstate, float(roll.get("success_rate", 0.0)), ph.steps)
                state["gate"] = gstate.to_dict()
                if reason is not None:
                    last = True
                    state["gate_reason"] = reason
                    _log_transition(tracker, run_id, parent_run_id, phase, gstep + 1, i + 1, reason, gstate)
            if last or (i + 1) % cfg.checkpoint.every_n_steps == 0:
                prev = read_latest(phase_uri)
                if last:
                    out = T.save_step_checkpoint(key, final_uri, state)
                    write_latest(root, out)
                else:
                    out = T.save_step_checkpoint(key, join_uri(phase_uri, f"step-{i + 1:06d}"), state,
                                                 latest_of=phase_uri)
                _prune(cfg, prev, out)
            if cfg.fail_after_step is not None and gstep + 1 == cfg.fail_after_step:
                raise RuntimeError(f"fault injection: failing after global step {gstep + 1} (fail_after_step)")
            if last:
                break
        steps_done = i + 1 if ph.steps > done_steps else done_steps
        status = "FINISHED"
        tracker.set_tag(run_id, "scalinginter.final_checkpoint", final_uri)
        version = tracker.register_checkpoint(cfg.env.name, final_uri, run_id, {
            "phase": str(phase), "turn_limit": str(ph.turn_limit), "run_name": cfg.run_name,
            "global_step": str(start + steps_done)})
        print(f"phase {phase}: registered {final_uri} as model scalinginter-{cfg.env.name} version {version}")
        _phase_artifact(cfg, phase, steps_done, start + steps_done, metrics, final_uri, run_id)
        return final_uri
    finally:
        tracker.end_run(run_id, status)
        T.close_session(key)


def _log_transition(tracker: Tracker, run_id: str, parent_run_id: str | None, phase: int, global_step: int,
                    phase_steps: int, reason: str, gstate: GateState) -> None:
    """A gated phase ended: an MLflow event (metric + tags + JSON artifact) on the phase and parent runs."""
    event = {"event": "phase_transition", "phase": phase, "global_step": global_step, "phase_steps": phase_steps,
             "reason": reason, "smoothed_success": gstate.best, "history": list(gstate.history)}
    print(f"phase {phase}: gated transition after {phase_steps} steps ({reason}; "
          f"best smoothed success {gstate.best:.3f})")
    for rid in filter(None, (run_id, parent_run_id)):
        tracker.log_metrics(rid, {"curriculum/transition_phase": float(phase)}, step=global_step)
        tracker.set_tag(rid, f"scalinginter.phase_{phase}.end", f"{reason} at step {global_step}")
    tracker.log_text(run_id, json.dumps(event, indent=2), f"events/phase-{phase}-transition.json")


def _phase_artifact(cfg: RunConfig, phase: int, steps_done: int, global_step: int,
                    metrics: dict[str, float] | None, uri: str, run_id: str | None, note: str = "") -> None:
    from tasks.artifacts import artifact_key, phase_markdown, publish_markdown

    phases = cfg.curriculum.as_phases()
    md = phase_markdown(cfg.run_name, phase, len(phases), phases[phase - 1].turn_limit, steps_done,
                        phases[phase - 1].steps, global_step, metrics, uri, run_id, note)
    publish_markdown(artifact_key(cfg.run_name, f"phase-{phase}"), md,
                     f"ScalingInter {cfg.run_name} phase {phase}: steps, reward, success, turns, checkpoint")


def _prune(cfg: RunConfig, prev: str | None, current: str) -> None:
    """Delete the superseded step checkpoint ``prev`` (local or S3) once ``current`` is complete.

    Called only after ``current`` and the pointer to it are written, so a crash at any point leaves a
    complete checkpoint to resume from. Phase finals are never pruned (they are registered models).
    """
    if cfg.checkpoint.keep_step_checkpoints or not prev or prev == current:
        return
    if not prev.rstrip("/").rsplit("/", 1)[-1].startswith("step-"):
        return
    try:
        delete_checkpoint(prev)
    except Exception as exc:  # noqa: BLE001 - disk space is not worth failing a finished step over
        print(f"warning: could not delete the superseded checkpoint {prev}: {exc}")


# --- evaluation ------------------------------------------------------------------------------------------
def evaluate_model(cfg: RunConfig, ref: str, n: int | None = None, turn_limit: int | None = None) -> dict[str, float]:
    return T.score_model(cfg, local_model_dir(cfg, ref), T.eval_tasks(n or cfg.eval.n),
                         turn_limit or cfg.eval_turn_limit, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)


# --- parent flow -----------------------------------------------------------------------------------------
def _cached_eval(cfg: RunConfig, path: Path, ref: str) -> dict[str, float]:
    if path.exists():
        return json.loads(path.read_text())
    m = evaluate_model(cfg, ref)
    path.write_text(json.dumps(m))
    return m


@flow(name="scalinginter", log_prints=True)
def scalinginter(config: RunConfig | None = None, env: str = "babyai", preset: str | None = "smoke",
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """A ScalingInter curriculum: phases of growing turn limits, each starting from the previous one.

    Pass a full ``config``, or ``env`` + ``preset`` + ``overrides`` (``key=value`` strings).

    Args:
        config: A full typed run config (every field has a default and a description). When given, env,
            preset and overrides are ignored.
        env: Registered environment (babyai, textcraft, sciworld, webarena, searchqa, miniwob, toy).
        preset: Preset of the env (envs/<env>/presets.py): smoke (CPU demo), paper (the paper's schedule),
            tiny (babyai: the smallest real run). Empty = the config defaults.
        overrides: Config overrides as key.path=value strings, e.g. rollout.temperature=0.7 or
            run_name=my-run (the same run name resumes a run).
    """
    cfg = resolve_run(config or build_config(env, preset, overrides))
    if cfg.checkpoint.s3_block:
        from tasks.s3_block import apply_s3_block

        print(f"S3 settings from Prefect block {cfg.checkpoint.s3_block!r}: {', '.join(apply_s3_block(cfg.checkpoint.s3_block))}")
    phases = cfg.curriculum.as_phases()
    rd = run_dir(cfg)
    (rd / "config.json").write_text(cfg.model_dump_json(indent=2))
    tracker = make_tracker(cfg)
    parent = tracker.start_run(cfg.run_name, params=cfg.model_dump(mode="json"), tags={"scalinginter.env": cfg.env.name})
    print(f"ScalingInter run {cfg.run_name}: env {cfg.env.name}, model {cfg.model.path}, "
          f"turn limits {' -> '.join(str(p.turn_limit) for p in phases)}, {total_steps(phases)} steps; "
          f"MLflow run {parent} ({tracker.uri})")
    status = "FAILED"
    try:
        before = None
        if cfg.eval.before:
            print(f"evaluating the initial model on {cfg.eval.n} held-out tasks (greedy, "
                  f"{cfg.eval_turn_limit} turns)")
            before = _cached_eval(cfg, rd / "eval_before.json", cfg.model.path)
            tracker.log_metrics(parent, {f"eval_before/{k}": v for k, v in before.items()}, step=0)
            print("before: " + fmt(before, ["success_rate", "mean_reward", "mean_turns"]))
        ref = cfg.model.path
        for k in range(len(phases)):
            ref = phase_flow(cfg, k + 1, ref, parent)
        after = None
        if cfg.eval.after:
            print(f"evaluating the final model on {cfg.eval.n} held-out tasks")
            after = _cached_eval(cfg, rd / "eval_after.json", ref)
            tracker.log_metrics(parent, {f"eval_after/{k}": v for k, v in after.items()}, step=total_steps(phases))
        tracker.set_tag(parent, "scalinginter.final_checkpoint", ref)
        summary = {"run_name": cfg.run_name, "mlflow_run_id": parent, "mlflow_uri": tracker.uri,
                   "final_checkpoint": ref, "eval_before": before, "eval_after": after}
        (rd / "summary.json").write_text(json.dumps(summary, indent=2))
        print(summary_table(summary, cfg))
        status = "FINISHED"
        return summary
    finally:
        tracker.end_run(parent, status)


def summary_table(summary: dict[str, Any], cfg: RunConfig) -> str:
    b, a = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    rows = [("success rate", "success_rate"), ("mean reward", "mean_reward"), ("mean turns", "mean_turns")]
    title = f"held-out {cfg.env.name} tasks (n={cfg.eval.n}, greedy, {cfg.eval_turn_limit} turns)"
    lines = ["", title, f"{'':<14}{'before':>10}{'after':>10}"]
    for label, key in rows:
        bv = f"{b[key]:.3f}" if key in b else "-"
        av = f"{a[key]:.3f}" if key in a else "-"
        lines.append(f"{label:<14}{bv:>10}{av:>10}")
    lines += [f"MLflow run id:    {summary['mlflow_run_id']}  ({summary['mlflow_uri']})",
              f"final checkpoint: {summary['final_checkpoint']}", ""]
    return "\n".join(lines)
