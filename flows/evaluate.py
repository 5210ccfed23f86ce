"""Evaluation: score a checkpoint (and optionally a second one, paired) on K samples per task x T turn budgets.

Python API (what ``scalinginter eval``, the training run's before/after and the nightly eval call)::

    from flows.evaluate import evaluate, log_eval, plot_sweep
    doc = evaluate(cfg, "runs/checkpoints/<run>/phase-3/final", split="test", n=64, samples=4,
                   turn_limits=[2, 4, 8], temperature=None, seed=0, compare_ref="smollm2-135m")
    log_eval(doc, cfg)              # an MLflow run in the experiment "eval" (or run_id=... to log into a run)
    plot_sweep(doc, "sweep.png")    # success vs turn budget with intervals, one line per model

One engine for all models: all K x T x n episodes of a model run in one rollout call
(``tasks.steps.evaluate_sweep``), and the next model's weights are loaded into the same engine. Called from the
training run, the run's engine is reused; called alone, the evaluation starts one and shuts it down at the end.
The episodes' sampling seeds are keyed by (task, sample) only, so both models of a comparison (and every budget)
see the same tasks with the same seeds. K = 1 is greedy; K > 1 samples at ``temperature`` (default 1.0).

A checkpoint written by a training run is scored on the env options it was trained with (read from its
``trainer_state.json``) unless ``env_options`` is given; the header says which.

The document (JSON, ``schema`` = "scalinginter.eval/1")::

    {
      "schema": "scalinginter.eval/1",
      "header": "babyai test split: 64 tasks x 4 samples (temperature 1.0) x turn budgets 2,4,8; env options ...",
      "env": "babyai", "split": "test", "task_ids": [1000000, ...], "n_tasks": 64,
      "samples": 4, "temperature": 1.0, "greedy": false, "turn_limits": [2, 4, 8], "seed": 0, "confidence": 0.95,
      "max_new_tokens": 64, "token_budget": 2048, "backend": "vllm",
      "env_options": {...}, "env_options_source": "checkpoint" | "given" | "defaults",
      "models": {
        "model":   {"ref": "<CHECKPOINT>", "engine": {"rollout_time_s": ..., "generated_tokens": ...},
                    "budgets": {"<T>": BUDGET, ...}},
        "compare": {...same, for --compare...}
      },
      "comparison": {"a": "model", "b": "compare",
                     "budgets": {"<T>": {"turn_limit": T, "overall": PAIRED, "categories": {"<cat>": PAIRED},
                                         "required_turns": {"<bucket>": PAIRED}}}}
    }
    BUDGET = {"turn_limit": T, "overall": CELL, "categories": {"<category>": CELL, ...},
              "required_turns": {"1" | "2-3" | "4-6" | "7+": CELL, ...}  (only where the env labels tasks),
              "per_task": [{"task_id", "category", "successes": [1, 0, null, ...] (K entries, null = masked),
                            "rewards": [...], "turns": [...], "required_turns" (when labelled)}]}
    CELL   = {"tasks", "episodes", "masked_episodes", "mean_reward", "mean_turns",
              "avg": RATE (Avg@K; for K = 1 the greedy success rate),
              "pass": {"1": RATE, "2": RATE, ..., "<K>": RATE}  (each also with "tasks")}
    RATE   = {"value": v, "ci": [low, high], "method": "wilson" (K = 1) | "bootstrap"}   (value null: no task)
    PAIRED = {"tasks", "a", "b", "diff" (a - b), "ci": [low, high] (paired bootstrap), "p_value",
              "test": "mcnemar_exact" (greedy) | "paired_bootstrap",
              greedy only: "a_better", "b_better" (discordant tasks), "p_a_worse" (one-sided)}

Categories are what each env reports at reset (``info["category"]``: BabyAI level, TextCraft depth, ...); the
category cells' ``tasks`` sum to the overall ``tasks``. Required turns are what an env that can label its tasks
reports at reset (``info["required_turns"]``: the fewest turns its expert needs; BabyAI); the buckets 1, 2-3, 4-6
and 7+ hold the labelled tasks, and an env that labels none leaves the key out.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow

from core.config import RunConfig, stored_config
from core.evalinput import EvalInputError, check_inputs, check_sweep
from core.evalreport import Outcome, build_document, flat_metrics, model_report, report_text
from envs.base import task_index
from tasks.runs import check_ref


def trained_config(model_dir: str | Path) -> tuple[RunConfig | None, dict[str, Any]]:
    """The training run's config stored in a checkpoint's trainer_state.json (None: not a training checkpoint,
    or a config of an older version that no longer validates) and the trainer state."""
    from pydantic import ValidationError

    path = Path(model_dir) / "trainer_state.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    if state.get("config"):
        try:
            return stored_config(state["config"]), state
        except ValidationError as e:
            print(f"the checkpoint's training config does not validate any more ({e.error_count()} errors); "
                  "using the given env options")
    return None, state


def _context_length(model_dir: str) -> int | None:
    p = Path(model_dir) / "config.json"
    if not p.exists():
        return None
    c = json.loads(p.read_text())
    c = c.get("text_config", c)
    v = c.get("max_position_embeddings")
    return int(v) if v else None


def _same_tokenizer(dir_a: str, dir_b: str) -> tuple[bool, str]:
    from transformers import AutoTokenizer

    ta, tb = AutoTokenizer.from_pretrained(dir_a), AutoTokenizer.from_pretrained(dir_b)
    if ta.get_vocab() != tb.get_vocab():
        return False, f"vocabularies differ ({len(ta.get_vocab())} vs {len(tb.get_vocab())} tokens)"
    if getattr(ta, "chat_template", None) != getattr(tb, "chat_template", None):
        return False, "chat templates differ"
    return True, ""


@flow(name="evaluate", log_prints=True)
def evaluate_models(config: RunConfig, model_dirs: dict[str, str], task_ids: list[int], turn_limits: list[int],
                    samples: int, temperature: float, max_new_tokens: int, seed: int,
                    episodes_path: str | None = None) -> dict[str, Any]:
    """Score each model (one engine for all: the open Runtime's) on every task x budget x sample in one rollout
    call (the first model's episodes also written to ``episodes_path`` as a rollout Parquet when given)."""
    from tasks import steps as T

    out = {}
    for name, d in model_dirs.items():
        print(f"evaluating {name} ({d}): {len(task_ids)} tasks x {samples} samples x budgets "
              f"{','.join(map(str, turn_limits))} = {len(task_ids) * samples * len(turn_limits)} episodes")
        out[name] = T.score_sweep(config, d, task_ids, turn_limits, samples, temperature, max_new_tokens, seed,
                                  episodes_path if name == "model" else None)
        check_scored(out[name], name, episodes_path if name == "model" else None)
    return out


def check_scored(sweep: dict[str, Any], name: str, episodes_path: str | Path | None = None) -> None:
    """An evaluation in which every episode was masked (an env failure each time) scores nothing: stop with the
    reason the env gave (the episodes' errors, read from ``episodes_path`` when the sweep wrote them)."""
    outcomes = sweep.get("outcomes") or []
    if not outcomes or any(o.get("success") is not None for o in outcomes):
        return
    from flows.refusal import Refusal, masked_reason

    errors: list[str] = []
    if episodes_path is not None and Path(episodes_path).exists():
        import pyarrow.parquet as pq

        errors = [e for e in pq.read_table(episodes_path, columns=["error"]).column("error").to_pylist() if e]
    which = "the model" if name == "model" else f"the {name} model"
    raise Refusal(f"every one of the {len(outcomes)} evaluation episodes of {which} was masked by an env failure "
                  f"({masked_reason(errors)}); fix the env server (env.url, or the spawned server's log) and start "
                  "again")


def evaluate(cfg: RunConfig, checkpoint_ref: str, split: str = "test", n: int = 64, samples: int = 1,
             turn_limits: list[int] | tuple[int, ...] | None = None, temperature: float | None = None, seed: int = 0,
             compare_ref: str | None = None, env_options: dict[str, Any] | None = None,
             max_new_tokens: int | None = None, confidence: float = 0.95,
             task_ids: list[int] | None = None, episodes_path: str | Path | None = None) -> dict[str, Any]:
    """Evaluate ``checkpoint_ref`` (and ``compare_ref`` on the same tasks and seeds); returns the JSON document
    described in this module's docstring. ``turn_limits`` None: the checkpoint's trained turn limit, else
    ``cfg.eval_turn_limit``. ``env_options`` None: the checkpoint's training env options if it has
    them, else ``cfg.env.options``. ``task_ids`` overrides ``split``/``n`` (the first n indices of the split).
    Raises ``EvalInputError`` (one line, with the fix) on bad input."""
    if turn_limits is not None:
        turn_limits = [int(t) for t in turn_limits]
    temperature = check_inputs(samples, turn_limits, temperature, split, n, confidence)
    check_ref(checkpoint_ref)
    if compare_ref is not None:
        check_ref(compare_ref, "--compare checkpoint")
    from flows.envcheck import check_env_servers

    check_env_servers(cfg)  # before a model loads: the env servers named answer (refusals are one line)
    max_new = int(max_new_tokens or cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
    model_dirs = _model_dirs(cfg, checkpoint_ref, compare_ref)
    trained, state = trained_config(model_dirs["model"])
    if turn_limits is None:
        turn_limits = [int(state.get("turn_limit") or cfg.eval_turn_limit)]
        check_sweep(samples, turn_limits)
    if cfg.rollout.history_turns is None and trained is not None and trained.rollout.history_turns is not None:
        # a checkpoint trained with a history window is scored with the prompts it learned from
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
            update={"history_turns": trained.rollout.history_turns})})
        print(f"history window: {cfg.rollout.history_turns} turns (as trained)")
    _check_context(model_dirs, turn_limits, max_new, cfg.rollout.history_turns)
    options, source = _env_options(cfg, trained, env_options)
    cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"options": options})})

    ids = list(task_ids) if task_ids is not None else [task_index(split, i) for i in range(n)]
    greedy = samples == 1 and temperature == 0
    header = _header(cfg, split, ids, samples, greedy, temperature, turn_limits, max_new, source)
    print(header)
    from runtime.context import Runtime

    with tempfile.TemporaryDirectory(prefix="eval-episodes-") as tmp, Runtime.scope():
        # one engine for both models (an enclosing run's Runtime keeps it up after this); the first model's episodes
        # are written (to a temporary file unless asked for) so an evaluation masked throughout can name the reason
        sweeps = evaluate_models(cfg, model_dirs, ids, turn_limits, samples, float(temperature), max_new, seed,
                                 str(episodes_path or Path(tmp) / "episodes.parquet"))

    refs = {"model": checkpoint_ref, "compare": compare_ref}
    models = {name: (refs[name], _model_report(sw, ids, turn_limits, samples, confidence, seed))
              for name, sw in sweeps.items()}
    meta = {"header": header, "env": cfg.env.name, "split": split if task_ids is None else "given",
            "task_ids": ids, "n_tasks": len(ids), "temperature": float(temperature), "greedy": greedy,
            "max_new_tokens": max_new, "token_budget": cfg.rollout.token_budget, "backend": cfg.rollout.backend,
            "env_options": options, "env_options_source": source}
    doc = build_document(meta, models, samples, turn_limits, confidence, seed,
                         compare=("model", "compare") if compare_ref is not None else None)
    for name, sw in sweeps.items():
        doc["models"][name]["engine"] = sw["stats"]
    return doc


def _model_dirs(cfg: RunConfig, checkpoint_ref: str, compare_ref: str | None) -> dict[str, str]:
    """The local folders of the model (and the one to compare with, which must share its tokenizer)."""
    from tasks.runs import local_model_dir

    model_dirs = {"model": local_model_dir(cfg, checkpoint_ref)}
    if compare_ref is not None:
        model_dirs["compare"] = local_model_dir(cfg, compare_ref)
        ok, why = _same_tokenizer(model_dirs["model"], model_dirs["compare"])
        if not ok:
            raise EvalInputError(f"--compare {compare_ref!r} uses a different tokenizer than {checkpoint_ref!r} "
                                 f"({why}): compare checkpoints of the same base model")
    return model_dirs


def _check_context(model_dirs: dict[str, str], turn_limits: list[int], max_new: int,
                   history_turns: int | None = None) -> None:
    """The new tokens of the largest turn budget (with a history window of k turns: of the k + 1 turns one turn's
    prompt and reply hold) must fit in every model's context."""
    for name, d in model_dirs.items():
        ctx = _context_length(d)
        shown = max(turn_limits) if history_turns is None else min(max(turn_limits), history_turns + 1)
        need = shown * max_new
        if ctx is not None and need > ctx:
            raise EvalInputError(f"turn budget {shown} x {max_new} new tokens per turn = {need} tokens is "
                                 f"beyond the context of {name} ({ctx} tokens): lower --turn-limits or "
                                 "--max-new-tokens, or set a history window (--set rollout.history_turns=2)")


def _env_options(cfg: RunConfig, trained: RunConfig | None,
                 env_options: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The env options to score on and where they come from: as given, else the checkpoint's training options
    (same env), else the config's."""
    if env_options is not None:
        return dict(env_options), "given"
    if trained is not None and trained.env.name == cfg.env.name:
        return dict(trained.env.options), "checkpoint"
    return dict(cfg.env.options), "defaults"


def _header(cfg: RunConfig, split: str, ids: list[int], samples: int, greedy: bool, temperature: float,
            turn_limits: list[int], max_new: int, source: str) -> str:
    """The evaluation's one-paragraph description (``cfg`` with the env options it scores on)."""
    options = cfg.env.options
    where = {"checkpoint": "as trained (from the checkpoint's config)", "given": "as given",
             "defaults": "the env's defaults"}[source]
    header = (f"{cfg.env.name} {split} split: {len(ids)} tasks x {samples} sample{'s' if samples > 1 else ''} "
              f"({'greedy' if greedy else f'temperature {temperature:g}'}) x turn budgets "
              f"{','.join(map(str, turn_limits))}, {max_new} new tokens per turn; env options "
              f"{json.dumps(options, sort_keys=True) if options else '{}'} ({where})")
    window = cfg.rollout.history_turns  # with a history window the budget bounds one turn's sample
    if (max(turn_limits) if window is None else min(max(turn_limits), window + 1)) * max_new > cfg.rollout.token_budget:
        header += (f"\nnote: episodes at the largest budgets may end at the token budget "
                   f"(rollout.token_budget={cfg.rollout.token_budget}); raise it with --set rollout.token_budget=N")
    return header


def _model_report(sweep: dict[str, Any], ids: list[int], turn_limits: list[int], samples: int, confidence: float,
                  seed: int) -> dict[str, Any]:
    """One model's budgets report from its sweep's outcomes (``core.evalreport.model_report``)."""
    outs = [Outcome(o["task_id"], o["turn_limit"], o["sample"], o["success"], o["reward"], o["turns"],
                    o["category"], o.get("required_turns")) for o in sweep["outcomes"]]
    return model_report(outs, ids, turn_limits, samples, confidence, seed)


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, allow_nan=False))
    return p


def log_eval(doc: dict[str, Any], cfg: RunConfig, run_id: str | None = None, experiment: str = "eval",
             tracking_uri: str | None = None, prefix: str | None = None) -> str:
    """Log an evaluation to MLflow: a new run in ``experiment`` (named after the env and checkpoint), or into
    ``run_id``. Metrics per model and budget at step = turn budget (``<model>/avg``, ``.../avg_ci_low|high``,
    ``.../pass_at_<k>``, ``compare/diff``, ``compare/p_value``) so MLflow draws the budget sweep; the flat numbers
    of the model at its largest budget (``success_rate``, ...); the document as ``eval/eval.json``. Returns the
    run id."""
    from storage.tracking import Tracker, default_tracking_uri

    uri = default_tracking_uri(cfg.output_dir, tracking_uri or cfg.tracking.uri)
    tracker = Tracker(uri, experiment, artifact_root=Path(cfg.output_dir).resolve() / "mlartifacts")
    own = run_id is None
    pre = prefix if prefix is not None else ("" if own else "eval/")
    if own:
        name = Path(str(doc["models"]["model"]["ref"]).rstrip("/")).name or "model"
        run_id = tracker.start_run(f"eval-{doc['env']}-{name}", resume=False, params={
            "env": doc["env"], "split": doc["split"], "n_tasks": doc["n_tasks"], "samples": doc["samples"],
            "temperature": doc["temperature"], "turn_limits": ",".join(map(str, doc["turn_limits"])),
            "seed": doc["seed"], "checkpoint": doc["models"]["model"]["ref"],
            "compare": (doc["models"].get("compare") or {}).get("ref"), "env_options_source": doc["env_options_source"]},
            tags={"env": doc["env"], "scalinginter.eval": "true"})
    for name, m in doc["models"].items():
        for key, b in m["budgets"].items():
            c = b["overall"]
            ms = {f"{pre}{name}/avg": c["avg"]["value"], f"{pre}{name}/mean_reward": c["mean_reward"],
                  f"{pre}{name}/mean_turns": c["mean_turns"]}
            if c["avg"]["ci"]:
                ms[f"{pre}{name}/avg_ci_low"], ms[f"{pre}{name}/avg_ci_high"] = c["avg"]["ci"]
            ms.update({f"{pre}{name}/pass_at_{k}": v["value"] for k, v in c["pass"].items()})
            tracker.log_metrics(run_id, ms, step=int(key))
    for key, b in (doc.get("comparison") or {}).get("budgets", {}).items():
        o = b["overall"]
        tracker.log_metrics(run_id, {f"{pre}compare/diff": o["diff"], f"{pre}compare/p_value": o["p_value"]},
                            step=int(key))
    tracker.log_metrics(run_id, {f"{pre}{k}": v for k, v in flat_metrics(doc).items()}, step=0)
    tracker.log_text(run_id, json.dumps(doc, indent=2, allow_nan=False), f"{pre or 'eval/'}eval.json")
    if own:
        tracker.end_run(run_id, "FINISHED")
    return run_id


def plot_sweep(doc: dict[str, Any], path: str | Path, categories: bool = False, buckets: bool = False) -> Path:
    """Success (Avg@K) vs turn budget with confidence-interval error bars: one line per model (and, with
    ``categories``, a dashed line per model and category; with ``buckets``, a dotted line per model and
    required-turns bucket)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    K = doc["samples"]
    span = (max(doc["turn_limits"]) - min(doc["turn_limits"])) or 1
    for i, (name, m) in enumerate(doc["models"].items()):
        dodge = (i - (len(doc["models"]) - 1) / 2) * 0.015 * span  # models side by side, bars not on top
        rows = [("", lambda b: b["overall"], "-o")]
        if categories:
            cats = sorted({c for b in m["budgets"].values() for c in b["categories"]})
            rows += [(f" {c}", (lambda c: lambda b: b["categories"].get(c))(c), "--.") for c in cats]
        if buckets:
            keys = [k for k in ("1", "2-3", "4-6", "7+") if any(k in b.get("required_turns", {})
                                                                 for b in m["budgets"].values())]
            rows += [(f" needs {k}", (lambda k: lambda b: b.get("required_turns", {}).get(k))(k), ":s") for k in keys]
        for suffix, get, style in rows:
            xs, ys, lo, hi = [], [], [], []
            for b in m["budgets"].values():
                c = get(b)
                if c is None or c["avg"]["value"] is None:
                    continue
                v, (l, h) = c["avg"]["value"], c["avg"]["ci"]
                xs.append(b["turn_limit"] + dodge), ys.append(v), lo.append(v - l), hi.append(h - v)
            if xs:
                ref = "/".join(Path(str(m["ref"]).rstrip("/")).parts[-2:])
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=f"{name} ({ref}){suffix}")
    ax.set_xlabel("turn budget")
    ax.set_ylabel("success (greedy)" if K == 1 else f"Avg@{K}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(doc["turn_limits"])
    ax.set_title(f"{doc['env']} {doc['split']}: {doc['n_tasks']} tasks, {int(doc['confidence'] * 100)}% CI",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_eval(cfg: RunConfig, checkpoint: str, split: str = "test", n: int = 16, turn_limit: int = 20) -> dict:
    """The old single-budget greedy entry point: flat metrics (success_rate, ...) of ``evaluate``."""
    try:
        doc = evaluate(cfg, checkpoint, split=split, n=n, turn_limits=[turn_limit])
    except EvalInputError as e:
        if "not found" in str(e):
            raise FileNotFoundError(str(e)) from None
        raise
    return flat_metrics(doc)


__all__ = ["EvalInputError", "evaluate", "evaluate_models", "log_eval", "plot_sweep", "report_text", "run_eval",
           "trained_config", "write_json"]
