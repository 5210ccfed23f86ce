"""The ScalingInter parent flow and its phase flow.

scalinginter (parent, MLflow parent run)
  eval before -> phase 1 -> phase 2 -> ... -> eval after
phase k (child flow, MLflow child run)
  spawn env servers -> per step: rollout batch -> advantages -> policy update -> checkpoint
  -> final checkpoint (its URI is the phase's result; the next phase starts from it)

Resume: a phase whose final checkpoint exists is skipped; a phase with step checkpoints resumes after the
last one (model, optimizer, RNG; the data position and turn limit are functions of the global step). Every
checkpoint holds the fingerprint of the training config; a resume with a different one is refused unless the
changed keys are in ``resume.allow_changes``. Step records after the resumed position are recorded once:
metrics.jsonl is cut back to the position, MLflow steps that have a value are not logged again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import flow

from core.config import RunConfig
from core.curriculum import Gate, GateState, phase_start, total_steps
from core.evalreport import SCHEMA as EVAL_SCHEMA
from core.evalreport import BUCKETS, bucket_rates, compare_models, flat_metrics, format_p
from core.redact import redact_uri
from core.walltime import format_breakdown
from flows.config import build_config
from flows.envcheck import check_env_servers
from flows.refusal import check_not_all_masked, log_refusal
from runtime.console import quiet_console, restore_console
from runtime.context import Runtime
from runtime.killpoint import kill_point
from storage.checkpoint_store import checkpoint_exists
from storage.tracking import Tracker
from tasks import steps as T
from tasks.recording import PhaseCheckpoints, StepRecorder, _phase_artifact, fmt
from tasks.resume import (
    PhasePlan,
    PhaseProgress,
    check_config,
    check_run_resume,
    checkpoint_state,
    final_position,
    inject_fault,
    resume_source,
)
from tasks.runs import local_model_dir, make_tracker, recorded_config, resolve_run, run_dir, write_run_config



# --- phase flow ------------------------------------------------------------------------------------------
@flow(name="phase", flow_run_name="phase-{phase}", log_prints=True)
def phase_flow(config: RunConfig, phase: int, init_ref: str, parent_run_id: str | None = None) -> str:
    """Train one phase (``phase`` is 1-based). Returns the URI of the phase's final checkpoint."""
    with Runtime.scope():  # the parent run's (its engine kept), or its own when the phase runs alone
        return _phase(config, phase, init_ref, parent_run_id)


def _phase(config: RunConfig, phase: int, init_ref: str, parent_run_id: str | None) -> str:
    cfg, plan = config, PhasePlan.of(config, phase)
    if checkpoint_exists(plan.final_uri):
        return finished_phase(cfg, plan, parent_run_id)
    tracker, run_id, key, status = make_tracker(cfg), None, None, "FAILED"
    try:  # the MLflow run and every resource are opened inside the try that ends them
        run_id = tracker.start_run(f"{cfg.run_name}/phase-{phase}", params=plan.params(), parent_id=parent_run_id,
                                   tags={"scalinginter.phase": str(phase)})
        key, prog = open_phase(cfg, plan, init_ref)
        urls = T.spawn_env_servers(key)
        rec = StepRecorder(cfg, plan, tracker, run_id, parent_run_id, position=prog.start + prog.done)
        ckpt = PhaseCheckpoints(cfg, plan, key)
        for i in range(prog.done, plan.steps):
            gstep, t0 = prog.start + i, time.time()
            limit = plan.limit_at(gstep)
            T.ensure_servers_alive(key)
            batch = T.rollout_batch(key, urls, gstep, limit)
            check_not_all_masked(batch.trajectories, f"step {gstep + 1}'s")
            adv = T.compute_advantages(key, batch)
            upd = T.policy_update(key, batch, adv, gstep)
            rec.step(i, gstep, limit, batch, adv, upd, time.time() - t0)
            last = prog.advance(i, batch.metrics, rec)
            del batch, adv  # spent: the next rollout runs without this step's episodes and log-probs in memory
            ckpt.save_if_due(i, last, prog.trainer_state(i, limit))
            inject_fault(gstep + 1)
            if last:
                break
        status = "FINISHED"
        return finish_phase(cfg, plan, tracker, run_id, prog, rec.last_metrics)
    finally:
        if run_id is not None:
            tracker.end_run(run_id, status)
        if key is not None:
            T.close_session(key)


def open_phase(cfg: RunConfig, plan: PhasePlan, init_ref: str) -> tuple[str, PhaseProgress]:
    """Load the learner from the phase's last step checkpoint (resume) or the previous phase's result, and
    restore the optimizer, RNG, position and gate state from a checkpoint. Returns the session key."""
    src, model_dir, resumed = resume_source(cfg, plan, init_ref)
    if resumed:  # before the model loads: a mismatched config fails fast
        state_file = Path(model_dir) / "trainer_state.json"
        check_config(cfg, json.loads(state_file.read_text()) if state_file.exists() else {}, src)
    key = T.open_session(cfg, model_dir, train=True, reference_dir=local_model_dir(cfg, cfg.model.path))
    prog = PhaseProgress(plan, cfg, start=plan.start, gate=Gate(**cfg.curriculum.gate.model_dump()) if plan.gated else None)
    if src != cfg.model.path:  # a checkpoint: restore optimizer, RNG and position
        try:
            state = T.get_session(key).learner.load_training_state(Path(model_dir), weights=False)
        except BaseException:
            T.close_session(key)
            raise
        if resumed:
            prog.done = int(state.get("phase_step", 0))
            prog.gstate = GateState.from_dict(state.get("gate"))
            print(f"phase {plan.phase}: resuming after step {prog.done}/{plan.steps} from {src}")
        if plan.gated:  # phases have data-dependent lengths: the position comes from the checkpoint
            prog.start = int(state.get("global_step", 0)) - prog.done
    return key, prog


def finish_phase(cfg: RunConfig, plan: PhasePlan, tracker: Tracker, run_id: str, prog: PhaseProgress,
                 metrics: dict[str, float] | None) -> str:
    """Register the phase's final checkpoint as a model version and publish the phase's artifact."""
    kill_point("register")  # test hook (runtime.killpoint): a no-op unless $SCALINGINTER_KILL_AT names it
    tracker.set_tag(run_id, "scalinginter.final_checkpoint", plan.final_uri)
    version = tracker.register_checkpoint(cfg.env.name, plan.final_uri, run_id,
                                          plan.registry_tags(cfg, prog.start + prog.done))
    print(f"phase {plan.phase}: registered {plan.final_uri} as model scalinginter-{cfg.env.name} version {version}")
    _phase_artifact(cfg, plan.phase, prog.done, prog.start + prog.done, metrics, plan.final_uri, run_id)
    return plan.final_uri


def finished_phase(cfg: RunConfig, plan: PhasePlan, parent_run_id: str | None) -> str:
    """A phase whose final checkpoint exists is skipped; if the earlier run stopped between that checkpoint and
    its registration, the registration is repaired and the phase's MLflow run finished (tagged with the final
    checkpoint), as an uninterrupted run leaves them."""
    state = checkpoint_state(cfg, plan.final_uri)
    check_config(cfg, state, plan.final_uri)
    gstep, done = final_position(plan, state)
    print(f"phase {plan.phase}: final checkpoint exists ({plan.final_uri}, global step {gstep}); skipping")
    tracker = make_tracker(cfg)
    run_id = tracker.find_run(f"{cfg.run_name}/phase-{plan.phase}", parent_run_id)
    if run_id is not None:  # registration is the step after the final checkpoint: make sure it happened
        version = tracker.ensure_registered(cfg.env.name, plan.final_uri, run_id, plan.registry_tags(cfg, gstep))
        if version is not None:
            print(f"phase {plan.phase}: registered {plan.final_uri} as model scalinginter-{cfg.env.name} version "
                  f"{version} (the earlier run stopped before registering it)")
        if tracker.client.get_run(run_id).info.status != "FINISHED":  # its process died after the final checkpoint
            tracker.set_tag(run_id, "scalinginter.final_checkpoint", plan.final_uri)
            tracker.end_run(run_id, "FINISHED")
    _phase_artifact(cfg, plan.phase, done, gstep, None, plan.final_uri, None,
                    note="Skipped: the final checkpoint of this phase exists (resumed run).")
    return plan.final_uri


def evaluate_model(cfg: RunConfig, ref: str, n: int | None = None, turn_limit: int | None = None,
                   episodes_path: Path | None = None) -> dict[str, Any]:
    """The held-out evaluation document (flows.evaluate; greedy, the run's env options) of a model. Before and
    after training it is the same tasks and seeds, so the two can be paired."""
    from flows.evaluate import evaluate

    return evaluate(cfg, ref, split="test", n=n or cfg.eval.n, samples=1, turn_limits=[turn_limit or cfg.eval_turn_limit],
                    seed=cfg.seed, env_options=cfg.env.options,
                    max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, episodes_path=episodes_path)


# --- parent flow -----------------------------------------------------------------------------------------
def _cached_eval(cfg: RunConfig, path: Path, ref: str) -> dict[str, Any]:
    """The evaluation document of ``ref`` (written to ``path``; a resumed run reads it back)."""
    if path.exists():
        doc = json.loads(path.read_text())
        # an older run's flat metrics, or a document without a scored episode, are evaluated again
        if doc.get("schema") == EVAL_SCHEMA and "success_rate" in flat_metrics(doc):
            return doc
    doc = evaluate_model(cfg, ref, episodes_path=path.with_suffix(".parquet"))  # the viewer lists its episodes
    path.write_text(json.dumps(doc, indent=2))
    return doc


def _phase_end_step(cfg: RunConfig, phase: int, ref: str) -> int:
    """The global step at which ``phase`` ended: its checkpoint's own (gated phases end early), else the plan's."""
    state = Path(ref) / "trainer_state.json"
    if state.exists():
        try:
            return int(json.loads(state.read_text())["global_step"])
        except (ValueError, KeyError):
            pass
    phases = cfg.curriculum.as_phases()
    return phase_start(phases, phase - 1) + phases[phase - 1].steps


def _phase_eval(cfg: RunConfig, tracker: Tracker, parent: str, phase: int, ref: str) -> None:
    """eval.each_phase: the phase's final on the run's held-out tasks, a point of the held-out learning curve."""
    step = _phase_end_step(cfg, phase, ref)
    print(f"evaluating phase {phase}'s final model on {cfg.eval.n} held-out tasks ({cfg.eval_turn_limit} turns)")
    doc = _cached_eval(cfg, run_dir(cfg) / f"eval_phase-{phase}.json", ref)
    doc["global_step"] = step
    (run_dir(cfg) / f"eval_phase-{phase}.json").write_text(json.dumps(doc, indent=2))
    m = flat_metrics(doc)
    tracker.log_metrics_once(parent, {"heldout/success_rate": m["success_rate"]}, step=step)
    print(f"phase {phase} held-out: " + fmt(m, ["success_rate", "success_rate_ci_low", "success_rate_ci_high"]))


def paired_eval(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """After vs before on the same tasks and seeds (exact McNemar on the greedy outcomes, paired bootstrap interval
    of the difference) at the eval budget; None unless both exist on the same tasks."""
    if not before or not after or before["task_ids"] != after["task_ids"] or before["seed"] != after["seed"]:
        return None
    cmp = compare_models(after["models"]["model"], before["models"]["model"], after["samples"], after["confidence"],
                         after["seed"])
    return next(iter(cmp.values()))["overall"] if cmp else None


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
        from storage.s3_block import apply_s3_block

        print(f"S3 settings from Prefect block {cfg.checkpoint.s3_block!r}: {', '.join(apply_s3_block(cfg.checkpoint.s3_block))}")
    outer = Runtime.current_or_none()  # a run inside an open Runtime shares its engine; else it owns its own
    with Runtime.scope() as rt:
        return _run(cfg, rt, owns=rt is not outer)


def _run(cfg: RunConfig, rt: Runtime, owns: bool) -> dict[str, Any]:
    """The run's body, inside its Runtime (closed at the end when ``owns``, while the console is still quiet)."""
    rd = run_dir(cfg)
    try:
        return _run_body(cfg, rt, owns, rd)
    except Exception as e:  # the traceback goes to the run's log; a refusal reaches the console as one line
        log_refusal(e, rd / "engine.log")
        raise


def _run_body(cfg: RunConfig, rt: Runtime, owns: bool, rd: Path) -> dict[str, Any]:
    phases = cfg.curriculum.as_phases()
    t_run = time.time()
    ledger = rt.new_ledger()
    check_run_resume(cfg)  # a reused run name with another training config stops here, before anything is written
    log_path = quiet_console(rd)  # engine / library chatter -> the run's engine.log
    try:  # before any evaluation or training: the env servers the config names answer (and are not refused)
        check_env_servers(cfg, record_dir=rd)
    except BaseException:
        restore_console()
        raise
    write_run_config(rd, cfg)  # no URI secrets
    tracker = make_tracker(cfg)
    parent = tracker.start_run(cfg.run_name, params=recorded_config(cfg), tags={"scalinginter.env": cfg.env.name})
    print(f"ScalingInter run {cfg.run_name}: env {cfg.env.name}, model {cfg.model.path}, "
          f"turn limits {' -> '.join(str(p.turn_limit) for p in phases)}, {total_steps(phases)} steps; "
          f"MLflow run {parent} ({redact_uri(tracker.uri)})")
    if log_path is not None:
        print(f"engine, transformers, DeepSpeed, MLflow and Prefect logs: {log_path} (SCALINGINTER_VERBOSE=1 shows "
              "them here)")
    status = "FAILED"
    try:  # one vLLM engine for the run (the Runtime's): phases and evaluations reuse it
        before = before_doc = after_doc = None
        if cfg.eval.before:
            print(f"evaluating the initial model on {cfg.eval.n} held-out tasks (greedy, "
                  f"{cfg.eval_turn_limit} turns)")
            before_doc = _cached_eval(cfg, rd / "eval_before.json", cfg.model.path)
            before = flat_metrics(before_doc)
            tracker.log_metrics_once(parent, {f"eval_before/{k}": v for k, v in before.items()}, step=0)
            print("before: " + fmt(before, ["success_rate", "success_rate_ci_low", "success_rate_ci_high",
                                            "mean_reward", "mean_turns"]))
        if before is not None:
            tracker.log_metrics_once(parent, {"heldout/success_rate": before["success_rate"]}, step=0)
        ref = cfg.model.path
        for k in range(len(phases)):
            ref = phase_flow(cfg, k + 1, ref, parent)
            last = k + 1 == len(phases)
            if cfg.eval.each_phase and not (last and (cfg.eval.after or not cfg.eval.each_phase_last)):
                _phase_eval(cfg, tracker, parent, k + 1, ref)
        after = None
        if cfg.eval.after:
            print(f"evaluating the final model on {cfg.eval.n} held-out tasks")
            after_doc = _cached_eval(cfg, rd / "eval_after.json", ref)
            after = flat_metrics(after_doc)
            tracker.log_metrics_once(parent, {f"eval_after/{k}": v for k, v in after.items()},
                                     step=total_steps(phases))
            tracker.log_metrics_once(parent, {"heldout/success_rate": after["success_rate"]},
                                     step=_phase_end_step(cfg, len(phases), ref))
        paired = paired_eval(before_doc, after_doc)
        if paired is not None:
            tracker.log_metrics_once(parent, {"eval_after/diff_vs_before": paired["diff"],
                                              "eval_after/p_value_vs_before": paired["p_value"]},
                                     step=total_steps(phases))
        tracker.set_tag(parent, "scalinginter.final_checkpoint", ref)
        summary = {"run_name": cfg.run_name, "mlflow_run_id": parent, "mlflow_uri": redact_uri(tracker.uri),
                   "final_checkpoint": ref, "eval_before": before, "eval_after": after, "eval_paired": paired}
        by_turns = {"before": bucket_rates(before_doc), "after": bucket_rates(after_doc)}
        if by_turns["before"] or by_turns["after"]:  # the env labels its tasks with the turns an expert needs
            summary["eval_required_turns"] = by_turns
        wall = time.time() - t_run
        summary["wall_time_s"] = round(wall, 1)
        summary["wall_time_breakdown_s"] = ledger.breakdown(wall)  # where the time went (core.walltime)
        (rd / "summary.json").write_text(json.dumps(summary, indent=2))
        print(summary_table(summary, cfg))
        print(format_breakdown(summary["wall_time_breakdown_s"], wall))
        status = "FINISHED"
        return summary
    finally:
        try:
            if owns:
                rt.close()  # the run's engine is shut down here, its chatter still in the run's log
        finally:
            tracker.end_run(parent, status)
            restore_console()


def summary_table(summary: dict[str, Any], cfg: RunConfig) -> str:
    from core.trajview import viewer_url

    b, a = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    rows = [("success rate", "success_rate"), ("mean reward", "mean_reward"), ("mean turns", "mean_turns")]
    title = (f"held-out {cfg.env.name} tasks (n={cfg.eval.n}, greedy, {cfg.eval_turn_limit} turns; "
             "success with its 95% Wilson interval)")
    lines = ["", title, f"{'':<14}{'before':>24}{'after':>24}"]

    def cell(m: dict[str, Any], key: str) -> str:
        if key not in m:
            return "-"
        if key == "success_rate" and "success_rate_ci_low" in m:
            return f"{m[key]:.3f} [{m['success_rate_ci_low']:.3f}, {m['success_rate_ci_high']:.3f}]"
        return f"{m[key]:.3f}"

    for label, key in rows:
        lines.append(f"{label:<14}{cell(b, key):>24}{cell(a, key):>24}")
    by_turns = summary.get("eval_required_turns") or {}
    for k in BUCKETS:  # success per required-turns bucket (the fewest turns the env's expert needs)
        rb, ra = (by_turns.get(side, {}).get(k) for side in ("before", "after"))
        if rb is None and ra is None:
            continue

        def rate(r: dict[str, Any] | None) -> str:
            return "-" if r is None or r["value"] is None else f"{r['value']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"

        n = (ra or rb)["tasks"]
        lines.append(f"{f'needs {k} ({n})':<14}{rate(rb):>24}{rate(ra):>24}")
    p = summary.get("eval_paired")
    if p and p.get("diff") is not None:
        lines.append(f"after - before: {p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] on the same "
                     f"{p['tasks']} tasks and seeds; McNemar p = {format_p(p['p_value'])} ({p.get('a_better', 0)} "
                     f"tasks solved only after, {p.get('b_better', 0)} only before)")
    lines += [f"MLflow run id:    {summary['mlflow_run_id']}  ({summary['mlflow_uri']})",
              f"final checkpoint: {summary['final_checkpoint']}",
              f"trajectories:     {viewer_url(cfg.run_name)}  (scalinginter view --runs-dir {cfg.output_dir})", ""]
    return "\n".join(lines)
