"""``scalinginter view``: the trajectory viewer, a local web page over a runs directory and its MLflow store.

Pages (each a bookmarkable URL, server-rendered HTML, a little vanilla JS, no CDN)::

    /                                        runs (MLflow parent runs and run directories)
    /runs/<run>                              charts per step with phase boundaries, phases, steps, evals
    /runs/<run>/steps/<n>                    the step's episodes: sortable, filterable, paged
    /runs/<run>/steps/<n>/episodes/<i>       one episode as a conversation (+ token view: loss mask, advantage)
    /runs/<run>/tasks/<task_id>              the same task in each phase, side by side
    /evals, /evals/<name>                    evaluation results (eval JSONs; episodes when a Parquet sits beside)

Step files are read column by column (the episode table reads the small columns only) and an episode by its
row group. Rollout files written before the viewer's columns existed still open: what they lack shows as '-'.
Pure logic (turn splitting, filters, the SVG chart) is in ``core.trajview``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pyarrow.parquet as pq
from fastapi import Request

from core import trajview as V
from core.metrics import DIAGNOSTICS

STATIC = Path(__file__).with_name("static")
STEP_FILE = re.compile(r"^step-(\d+)\.parquet$")
LIST_COLUMNS = ("task_id", "group_id", "category", "reward", "turn_rewards", "success", "turns", "finish_reason",
                "masked", "env_truncated")
EPISODE_COLUMNS = ("task_id", "group_id", "category", "reward", "turn_rewards", "success", "turns", "finish_reason",
                   "masked", "env_truncated", "phase", "step", "turn_limit", "error", "first_observation",
                   "replies", "observations", "actions", "invalid_actions")
TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "advantages", "action_ends")
PER_PAGE = 50
MLFLOW_TTL_S = 10.0


class NotFound(Exception):
    """A page that does not exist: ``body`` (HTML) says what does."""

    def __init__(self, title: str, body: str):
        super().__init__(title)
        self.title, self.body = title, body


def q(s: Any) -> str:
    return quote(str(s), safe="")


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return escape(str(v))


# --- data -------------------------------------------------------------------------------------------------
@dataclass
class RunInfo:
    name: str
    dir: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    mlflow: dict[str, Any] | None = None  # {"run_id", "experiment_id", "status", "params", "metrics", "phases"}

    def cfg(self, dotted: str, default: Any = None) -> Any:
        cur: Any = self.config
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                cur = None
                break
            cur = cur[part]
        if cur is None and self.mlflow:
            raw = self.mlflow["params"].get(dotted)
            if raw is not None:
                try:
                    return json.loads(raw)
                except ValueError:
                    return raw
        return default if cur is None else cur

    def phases(self) -> list[tuple[int, int]]:
        ph = self.cfg("curriculum.phases") or []
        return [(int(p["turn_limit"]), int(p["steps"])) for p in ph if isinstance(p, dict)]


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def eval_flat(doc: Any) -> dict[str, Any]:
    """Flat numbers (success_rate, mean_reward, mean_turns, episodes) of an eval JSON, old or new format."""
    if not isinstance(doc, dict):
        return {}
    if "success_rate" in doc:
        return doc
    if doc.get("schema", "").startswith("scalinginter.eval/"):
        try:
            from core.evalreport import flat_metrics

            return flat_metrics(doc)
        except Exception:  # noqa: BLE001 - a document of another version: show what we can
            return {}
    return {}


class Store:
    """What the pages read: run directories under ``runs_dir`` and the MLflow store (cached a few seconds)."""

    def __init__(self, runs_dir: str | Path, tracking_uri: str | None = None, mlflow_ui: str | None = None):
        self.runs_dir = Path(runs_dir).resolve()
        if tracking_uri is None:
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None and (self.runs_dir / "mlflow.db").exists():
            tracking_uri = f"sqlite:///{self.runs_dir / 'mlflow.db'}"
        self.tracking_uri = tracking_uri
        if mlflow_ui is None:
            mlflow_ui = tracking_uri if tracking_uri and tracking_uri.startswith("http") else "http://127.0.0.1:5000"
        self.mlflow_ui = mlflow_ui.rstrip("/")
        self._lock = threading.Lock()
        self._mlflow: tuple[float, dict[str, dict[str, Any]], str | None] | None = None
        self._tables: dict[tuple[str, float, tuple[str, ...]], list[dict[str, Any]]] = {}
        self._task_cache: dict[tuple[str, float, tuple[str, ...]], list[dict[str, Any]]] = {}
        self._tokenizers: dict[str, Any] = {}

    # -- runs ------------------------------------------------------------------------------------------
    def run_dirs(self) -> dict[str, Path]:
        if not self.runs_dir.is_dir():
            return {}
        out = {}
        for d in sorted(self.runs_dir.iterdir()):
            if d.is_dir() and any((d / f).exists() for f in ("config.json", "metrics.jsonl", "rollouts", "summary.json")):
                out[d.name] = d
        return out

    def mlflow_runs(self) -> tuple[dict[str, dict[str, Any]], str | None]:
        """Parent runs of the ``scalinginter`` experiment by run name, each with its phase (child) runs."""
        if not self.tracking_uri:
            return {}, None
        with self._lock:
            if self._mlflow and time.time() - self._mlflow[0] < MLFLOW_TTL_S:
                return self._mlflow[1], self._mlflow[2]
        runs, err = {}, None
        try:
            import logging

            from mlflow.tracking import MlflowClient

            logging.getLogger("alembic").setLevel(logging.WARNING)
            logging.getLogger("mlflow").setLevel(logging.WARNING)
            client = MlflowClient(tracking_uri=self.tracking_uri)
            exp = client.get_experiment_by_name("scalinginter")
            if exp is not None:
                found = client.search_runs([exp.experiment_id], max_results=5000)
                for r in found:
                    if "mlflow.parentRunId" not in r.data.tags:
                        runs[r.info.run_name] = {
                            "run_id": r.info.run_id, "experiment_id": exp.experiment_id, "status": r.info.status,
                            "start_time": r.info.start_time, "params": dict(r.data.params),
                            "metrics": dict(r.data.metrics), "tags": dict(r.data.tags), "phases": {}}
                by_id = {v["run_id"]: v for v in runs.values()}
                for r in found:
                    parent = by_id.get(r.data.tags.get("mlflow.parentRunId", ""))
                    if parent is not None and "scalinginter.phase" in r.data.tags:
                        parent["phases"][int(r.data.tags["scalinginter.phase"])] = {
                            "run_id": r.info.run_id, "status": r.info.status, "params": dict(r.data.params),
                            "final_checkpoint": r.data.tags.get("scalinginter.final_checkpoint"),
                            "metrics": dict(r.data.metrics)}
        except Exception as e:  # noqa: BLE001 - the page still shows the run directories
            err = f"MLflow store {self.tracking_uri} could not be read: {type(e).__name__}: {e}"
        with self._lock:
            self._mlflow = (time.time(), runs, err)
        return runs, err

    def mlflow_history(self, run_id: str, keys: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        return {k: sorted((m.step + 1, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}

    def run_names(self) -> list[str]:
        return sorted(set(self.run_dirs()) | set(self.mlflow_runs()[0]))

    def run(self, name: str) -> RunInfo:
        dirs, (ml, _) = self.run_dirs(), self.mlflow_runs()
        if name not in dirs and name not in ml:
            raise NotFound(f"No run named {name!r}", self._exists_runs())
        d = dirs.get(name)
        info = RunInfo(name, d, mlflow=ml.get(name))
        if d is not None:
            info.config = _read_json(d / "config.json") or {}
            info.summary = _read_json(d / "summary.json") or {}
        return info

    def metrics(self, run: RunInfo) -> list[dict[str, Any]]:
        if run.dir is None or not (run.dir / "metrics.jsonl").exists():
            return []
        rows = {}
        for line in (run.dir / "metrics.jsonl").read_text().splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if isinstance(m, dict) and "global_step" in m:
                rows[int(m["global_step"])] = m  # a resumed run may log a step again: the last one counts
        return [rows[k] for k in sorted(rows)]

    def steps(self, run: RunInfo) -> dict[int, Path]:
        if run.dir is None or not (run.dir / "rollouts").is_dir():
            return {}
        out = {}
        for p in (run.dir / "rollouts").iterdir():
            m = STEP_FILE.match(p.name)
            if m:
                out[int(m.group(1))] = p
        return dict(sorted(out.items()))

    def evals(self) -> dict[str, Path]:
        """Eval JSONs: each run's eval_before/after (named ``<run>.eval_before``), and runs_dir/evals/*.json."""
        out = {}
        for name, d in self.run_dirs().items():
            for p in sorted(d.glob("eval*.json")):
                out[f"{name}.{p.stem}"] = p
        ev = self.runs_dir / "evals"
        if ev.is_dir():
            for p in sorted(ev.glob("*.json")):
                out[p.stem] = p
        return out

    # -- parquet ---------------------------------------------------------------------------------------
    def columns(self, path: Path) -> set[str]:
        return set(pq.read_schema(path).names)

    def step_rows(self, path: Path) -> list[dict[str, Any]]:
        """The episode table of a step: the small columns only (cached by file and mtime)."""
        key = (str(path), path.stat().st_mtime, LIST_COLUMNS)
        with self._lock:
            if key in self._tables:
                return self._tables[key]
        have = self.columns(path)
        cols = [c for c in LIST_COLUMNS if c in have]
        if "reward" in have:
            cols.remove("turn_rewards")  # the episode return is stored: no need for the per-turn list
        t = pq.read_table(path, columns=cols)
        data = {c: t.column(c).to_pylist() for c in cols}
        rows = []
        for i in range(t.num_rows):
            r = {c: data[c][i] for c in cols}
            if "reward" not in r:
                r["reward"] = float(sum(r.get("turn_rewards") or []))
            r.pop("turn_rewards", None)
            r["index"] = i
            r["finish"] = V.finish_label(r.get("finish_reason"), bool(r.get("masked")), bool(r.get("env_truncated")))
            rows.append(r)
        with self._lock:
            if len(self._tables) > 16:
                self._tables.clear()
            self._tables[key] = rows
        return rows

    def episode(self, path: Path, i: int, columns: tuple[str, ...] = EPISODE_COLUMNS) -> dict[str, Any] | None:
        """Row ``i`` of a rollout file, reading only the row group that holds it."""
        pf = pq.ParquetFile(path)
        if not 0 <= i < pf.metadata.num_rows:
            return None
        have = set(pf.schema_arrow.names)
        cols = [c for c in columns if c in have]
        first = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if i < first + n:
                t = pf.read_row_group(g, columns=cols)
                row = t.slice(i - first, 1).to_pylist()[0]
                break
            first += n
        for c in columns:
            row.setdefault(c, None)
        if row.get("reward") is None and row.get("turn_rewards") is not None:
            row["reward"] = float(sum(row["turn_rewards"]))
        row["finish"] = V.finish_label(row.get("finish_reason"), bool(row.get("masked")),
                                       bool(row.get("env_truncated")))
        row["index"] = i
        return row

    def task_phases(self, run: RunInfo) -> dict[int, set[int]]:
        """Task id -> the phases it ran in (the task_id and phase columns of every step; cached per file)."""
        out: dict[int, set[int]] = {}
        for p in self.steps(run).values():
            key = (str(p), p.stat().st_mtime, ("task_id", "phase"))
            with self._lock:
                rows = self._task_cache.get(key)
            if rows is None:
                t = pq.read_table(p, columns=["task_id", "phase"])
                rows = [{"task_id": a, "phase": b} for a, b in zip(t.column("task_id").to_pylist(),
                                                                   t.column("phase").to_pylist())]
                with self._lock:
                    self._task_cache[key] = rows
            for r in rows:
                out.setdefault(int(r["task_id"]), set()).add(int(r["phase"]))
        return out

    def task_rows(self, path: Path, task_id: int) -> list[int]:
        ids = pq.read_table(path, columns=["task_id"]).column("task_id").to_pylist()
        return [i for i, t in enumerate(ids) if t == task_id]

    # -- tokenizer -------------------------------------------------------------------------------------
    def tokenizer(self, run: RunInfo) -> Any:
        """The run's tokenizer (its base model's; checkpoints keep the same one). Raises with the reason."""
        ref = run.cfg("model.path") or "smollm2-135m"
        with self._lock:
            if ref in self._tokenizers:
                return self._tokenizers[ref]
        if ref.startswith(("/", ".", "~")) and not Path(ref).expanduser().exists():
            raise FileNotFoundError(f"the model folder {ref} no longer exists")
        from transformers import AutoTokenizer

        from runtime.backends.model import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(ref))
        with self._lock:
            self._tokenizers[ref] = tok
        return tok

    def _exists_runs(self) -> str:
        names = self.run_names()
        if not names:
            return (f"<p>There are no runs in <code>{escape(str(self.runs_dir))}</code>"
                    + (f" nor in the MLflow store <code>{escape(self.tracking_uri)}</code>" if self.tracking_uri else "")
                    + ". Train one with <code>scalinginter run babyai --preset smoke</code>, or point the viewer at "
                      "another directory with <code>--runs-dir</code>.</p>")
        return "<p>Runs that exist:</p><ul>" + "".join(
            f'<li><a href="/runs/{q(n)}">{escape(n)}</a></li>' for n in names) + "</ul>"


# --- HTML -----------------------------------------------------------------------------------------------------
def page(title: str, body: str, crumbs: list[tuple[str, str | None]] | None = None) -> str:
    nav = ""
    if crumbs:
        nav = '<nav class="crumbs">' + " / ".join(
            f'<a href="{u}">{escape(t)}</a>' if u else f"<span>{escape(t)}</span>" for t, u in crumbs) + "</nav>"
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)} · ScalingInter</title>"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="stylesheet" href="/static/viewer.css"><script defer src="/static/viewer.js"></script>'
            f'</head><body><header><a class="brand" href="/">ScalingInter trajectories</a>{nav}</header>'
            f"<main><h1>{escape(title)}</h1>{body}</main></body></html>")


def table(head: list[str], rows: list[list[str]], cls: str = "grid", attrs: list[str] | None = None) -> str:
    h = "".join(f"<th>{c}</th>" for c in head)
    body = "".join(f"<tr{(' ' + attrs[k]) if attrs else ''}>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>"
                   for k, r in enumerate(rows))
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def curriculum_text(run: RunInfo) -> str:
    ph = run.phases()
    if not ph:
        return "-"
    s = " → ".join(str(tl) for tl, _ in ph)
    steps = "+".join(str(n) for _, n in ph)
    mode = run.cfg("curriculum.mode") or "steps"
    return f"{s} turns ({steps} steps{', gated' if mode == 'gated' else ''})"


def held_out(run: RunInfo, which: str) -> dict[str, Any]:
    v = run.summary.get(f"eval_{which}")
    if not v and run.dir is not None:
        v = _read_json(run.dir / f"eval_{which}.json")
    v = eval_flat(v)
    if not v and run.mlflow:
        m = run.mlflow["metrics"]
        if f"eval_{which}/success_rate" in m:
            v = {"success_rate": m[f"eval_{which}/success_rate"]}
    return v


def status_of(run: RunInfo) -> str:
    if run.mlflow:
        return run.mlflow["status"]
    return "FINISHED (no MLflow run)" if run.summary else "no MLflow run"


def mlflow_link(store: Store, exp_id: str | None, run_id: str | None) -> str:
    if not run_id:
        return "-"
    return (f'<a class="ext" href="{escape(store.mlflow_ui)}/#/experiments/{q(exp_id)}/runs/{q(run_id)}" '
            f'title="MLflow UI ({escape(store.mlflow_ui)})">{escape(run_id[:12])}</a>')


def render_index(store: Store) -> str:
    ml, err = store.mlflow_runs()
    rows = []
    for name in store.run_names():
        run = store.run(name)
        b, a = held_out(run, "before"), held_out(run, "after")
        rows.append([f'<a class="run-link" href="/runs/{q(name)}">{escape(name)}</a>',
                     fmt(run.cfg("env.name")), fmt(run.cfg("model.path")), fmt(run.cfg("algo.estimator")),
                     escape(curriculum_text(run)), fmt(status_of(run)),
                     f"{fmt(b.get('success_rate'))} → {fmt(a.get('success_rate'))}",
                     str(len(store.steps(run)))])
    body = ""
    if err:
        body += f'<p class="warn">{escape(err)}</p>'
    if rows:
        body += table(["run", "env", "model", "estimator", "curriculum (turn limits)", "status",
                       "held-out success before → after", "steps with episodes"], rows, attrs=None)
    else:
        body += store._exists_runs()
    evs = store.evals()
    if evs:
        body += f'<p><a href="/evals">Evaluation results</a> ({len(evs)})</p>'
    src = f"run directories in <code>{escape(str(store.runs_dir))}</code>"
    if store.tracking_uri:
        src += f" and MLflow <code>{escape(store.tracking_uri)}</code>"
    body += f'<p class="muted">Sources: {src}.</p>'
    return page("Runs", body)


def _series(metrics: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(float(m["global_step"]), float(m[key])) for m in metrics if m.get(key) is not None]


def render_run(store: Store, name: str) -> str:
    run = store.run(name)
    metrics = store.metrics(run)
    steps = store.steps(run)
    ranges = V.phase_ranges(metrics) or V.planned_phase_ranges(run.phases())
    series = {k: _series(metrics, k) for k in ("success_rate", "mean_reward", "mean_turns")}
    note = ""
    if not metrics and run.mlflow:
        try:
            series = store.mlflow_history(run.mlflow["run_id"], ("success_rate", "mean_reward", "mean_turns"))
            note = '<p class="muted">Per-step numbers from MLflow (the run directory has no metrics.jsonl).</p>'
        except Exception as e:  # noqa: BLE001
            note = f'<p class="warn">MLflow metrics could not be read: {escape(str(e))}</p>'
    b, a = held_out(run, "before"), held_out(run, "after")
    ml = run.mlflow or {}
    facts = [("env", fmt(run.cfg("env.name"))), ("model", fmt(run.cfg("model.path"))),
             ("estimator", fmt(run.cfg("algo.estimator"))), ("curriculum", escape(curriculum_text(run))),
             ("status", fmt(status_of(run))),
             ("MLflow run", mlflow_link(store, ml.get("experiment_id"), ml.get("run_id"))),
             ("final checkpoint", f"<code>{fmt(run.summary.get('final_checkpoint') or ml.get('tags', {}).get('scalinginter.final_checkpoint'))}</code>"),
             ("run directory", f"<code>{fmt(str(run.dir) if run.dir else None)}</code>")]
    body = '<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
    evs = {k: v for k, v in store.evals().items() if k.startswith(f"{name}.")}
    body += "<h2>Held-out evaluation</h2>" + table(
        ["", "success rate", "mean reward", "mean turns", "episodes"],
        [[f'<a href="/evals/{q(f"{name}.eval_{w}")}">{w}</a>' if f"{name}.eval_{w}" in evs else w,
          fmt(d.get("success_rate")), fmt(d.get("mean_reward")), fmt(d.get("mean_turns"), ".2f"),
          fmt(d.get("episodes"), ".0f")] for w, d in (("before", b), ("after", a))])
    body += note + '<div class="charts">' + "".join(
        V.svg_chart(title, series[k], ranges, y_range=(0.0, 1.0) if k == "success_rate" else None)
        for k, title in (("success_rate", "train success rate"), ("mean_reward", "mean reward"),
                         ("mean_turns", "mean turns"))) + "</div>"
    # stability diagnostics per step (core.metrics.step_diagnostics; the update's entropy): a long-horizon run's
    # collapse shows here (invalid or repeated actions rising, entropy falling, groups without signal) first
    diag = [(k, t) for k, t in (("train/entropy", "policy entropy"),) + DIAGNOSTICS if _series(metrics, k)]
    if diag:
        body += "<h2>Stability diagnostics</h2>" + '<div class="charts">' + "".join(
            V.svg_chart(title, _series(metrics, k), ranges) for k, title in diag) + "</div>"
    # phases
    prow = []
    phases_cfg = run.phases()
    ckpt_root = run.cfg("checkpoint.root") or (str(Path(run.cfg("output_dir", str(store.runs_dir))) / "checkpoints"))
    for k in range(max(len(phases_cfg), len(ranges), len(ml.get("phases", {})))):
        p = k + 1
        rng = next((r for r in ranges if r.phase == p), None)
        child = ml.get("phases", {}).get(p, {})
        tl = rng.turn_limit if rng and rng.turn_limit is not None else (phases_cfg[k][0] if k < len(phases_cfg) else None)
        ck = child.get("final_checkpoint")
        if not ck:
            guess = f"{ckpt_root.rstrip('/')}/{name}/phase-{p}/final"
            ck = guess if (guess.startswith("s3://") or Path(guess).exists()) else None
        last = next((m for m in reversed(metrics) if m.get("phase") == p), {})
        prow.append([str(p), fmt(tl), f"{rng.first_step}–{rng.last_step}" if rng else "-",
                     fmt(last.get("success_rate")), f"<code>{fmt(ck)}</code>",
                     mlflow_link(store, ml.get("experiment_id"), child.get("run_id"))])
    body += "<h2>Phases</h2>" + table(["phase", "turn limit", "global steps", "success (last step)",
                                        "final checkpoint", "MLflow run"], prow)
    # steps
    by_step = {int(m["global_step"]): m for m in metrics}
    srows = []
    for s in sorted(set(by_step) | set(steps)):
        m = by_step.get(s, {})
        link = (f'<a class="step-link" href="/runs/{q(name)}/steps/{s}">episodes</a>' if s in steps
                else f'<a href="/runs/{q(name)}/steps/{s}">no rollout file</a>')
        srows.append([str(s), fmt(m.get("phase")), fmt(m.get("turn_limit"), ".0f"), fmt(m.get("episodes"), ".0f"),
                      fmt(m.get("success_rate")), fmt(m.get("mean_reward")), fmt(m.get("mean_turns"), ".2f"), link])
    body += "<h2>Steps</h2>" + (table(["step", "phase", "turn limit", "episodes", "success", "reward", "turns", ""],
                                      srows) if srows else "<p>No steps recorded yet.</p>")
    if steps:
        try:
            tp = store.task_phases(run)
        except Exception:  # noqa: BLE001 - an unreadable step file shows on its own page
            tp = {}
        multi = sorted(t for t, ph in tp.items() if len(ph) > 1)
        shown = multi or sorted(tp)
        if shown:
            note = ("Tasks that ran in more than one phase:" if multi else
                    "No task ran in more than one phase of this run (each step draws its own tasks); its tasks:")
            body += (f"<h2>The same task across phases</h2><p class=\"muted\">{note}</p><p>" + " ".join(
                f'<a class="task-link" href="/runs/{q(name)}/tasks/{t}">task {t}</a>' for t in shown[:60])
                + (f" … ({len(shown)} in all)" if len(shown) > 60 else "") + "</p>")
    return page(f"Run {name}", body, [("runs", "/"), (name, None)])


def _step_path(store: Store, run: RunInfo, n: int) -> Path:
    steps = store.steps(run)
    if n in steps:
        return steps[n]
    metrics = {int(m["global_step"]) for m in store.metrics(run)}
    links = "".join(f'<li><a href="/runs/{q(run.name)}/steps/{s}">step {s}</a></li>' for s in steps)
    have = f"<p>Steps with episodes:</p><ul>{links}</ul>" if steps else "<p>This run has no rollout files.</p>"
    if n in metrics:
        where = run.dir / "rollouts" / f"step-{n:06d}.parquet" if run.dir else "its rollouts folder"
        raise NotFound(f"Step {n} of {run.name}: the rollout file is missing",
                       f"<p>The run logged step {n}, but its episodes file <code>{escape(str(where))}</code> is "
                       "missing (deleted, or the run stopped before writing it). Its numbers are on the "
                       f'<a href="/runs/{q(run.name)}">run page</a>.</p>{have}')
    raise NotFound(f"Run {run.name} has no step {n}", have)


def render_step(store: Store, name: str, n: int, params: dict[str, str]) -> str:
    run = store.run(name)
    path = _step_path(store, run, n)
    rows = store.step_rows(path)
    failed, truncated = params.get("failed") == "1", params.get("truncated") == "1"
    task = int(params["task"]) if params.get("task", "").lstrip("-").isdigit() else None
    category = params.get("category") or None
    sort = params.get("sort", "index")
    sort = sort if sort in V.SORT_KEYS else "index"
    desc = params.get("desc") == "1"
    sel = V.select_episodes(rows, failed, truncated, task, category, sort, desc)
    per = int(params["per"]) if params.get("per", "").isdigit() and int(params["per"]) > 0 else PER_PAGE
    pg = int(params["page"]) if params.get("page", "").isdigit() else 1
    a, b, pages = V.page_of(len(sel), pg, per)
    pg = min(max(1, pg), pages)
    base = f"/runs/{q(name)}/steps/{n}"
    keep = {k: v for k, v in params.items() if k in ("failed", "truncated", "task", "category", "sort", "desc", "per")
            and v}

    def url(**upd: Any) -> str:
        d = {**keep, **{k: str(v) for k, v in upd.items() if v is not None}}
        d = {k: v for k, v in d.items() if v not in ("", "0") or k == "task"}
        return base + ("?" + urlencode(d) if d else "")

    head = []
    for key, label in (("index", "#"), ("task_id", "task"), ("category", "category"), ("reward", "reward"),
                       ("success", "success"), ("turns", "turns"), ("finish", "finish")):
        arrow = (" ▼" if desc else " ▲") if sort == key else ""
        head.append(f'<a class="sort" data-sort="{key}" href="{escape(url(sort=key, desc="0" if sort == key and desc else ("1" if sort == key else "0"), page=None))}">{label}{arrow}</a>')
    head.append("")
    body_rows, attrs = [], []
    for r in sel[a:b]:
        ok = "masked" if r["finish"] == "masked" else ("✓" if r.get("success") else "✗")
        task_cell = (f'<a class="task-link" href="/runs/{q(name)}/tasks/{r["task_id"]}" title="this task across phases">'
                     f'{fmt(r["task_id"])}</a>' if r.get("task_id") is not None else "-")
        body_rows.append([str(r["index"]), task_cell, fmt(r.get("category")), fmt(r.get("reward")),
                          ok, fmt(r.get("turns")), fmt(r["finish"]),
                          f'<a class="episode-link" href="{base}/episodes/{r["index"]}">open</a>'])
        attrs.append(f'class="ep {"ok" if r.get("success") else "bad"}" data-index="{r["index"]}"')
    tasks = sorted({r["task_id"] for r in rows if r.get("task_id") is not None})
    cats = sorted({r["category"] for r in rows if r.get("category")})
    form = (f'<form class="filters" method="get" action="{base}">'
            f'<label><input type="checkbox" name="failed" value="1"{" checked" if failed else ""}> failed only</label>'
            f'<label><input type="checkbox" name="truncated" value="1"{" checked" if truncated else ""}> truncated only</label>'
            '<label>task <select name="task"><option value="">all</option>' + "".join(
                f'<option value="{t}"{" selected" if t == task else ""}>{t}</option>' for t in tasks) + "</select></label>"
            + ('<label>category <select name="category"><option value="">all</option>' + "".join(
                f'<option value="{escape(c)}"{" selected" if c == category else ""}>{escape(c)}</option>' for c in cats)
               + "</select></label>" if cats else "")
            + f'<input type="hidden" name="sort" value="{escape(sort)}"><input type="hidden" name="desc" value="{int(desc)}">'
            '<button type="submit">apply</button></form>')
    succ = [r for r in rows if r["finish"] != "masked"]
    m = next((m for m in store.metrics(run) if int(m["global_step"]) == n), {})
    stats = (f'<p class="muted">phase {fmt(m.get("phase"))}, turn limit {fmt(m.get("turn_limit"), ".0f")}; '
             f'{len(rows)} episodes, {len(sel)} shown by the filters; success '
             f'{sum(1 for r in succ if r.get("success"))}/{len(succ)} (masked excluded); '
             f'file <code>{escape(str(path))}</code></p>')
    nav = ""
    if pages > 1:
        nav = ('<p class="pager">' + (f'<a href="{escape(url(page=pg - 1))}">← previous</a> ' if pg > 1 else "")
               + f"page {pg} of {pages}" + (f' <a href="{escape(url(page=pg + 1))}">next →</a>' if pg < pages else "")
               + "</p>")
    body = form + stats + (table(head, body_rows, attrs=attrs) if body_rows else "<p>No episode matches.</p>") + nav
    return page(f"{name} · step {n}", body, [("runs", "/"), (name, f"/runs/{q(name)}"), (f"step {n}", None)])


def render_reply(reply: str | None, action: str | None) -> str:
    if reply is None:
        return '<span class="muted">(no reply recorded)</span>'
    span = V.action_span(reply, action)
    if span is None:
        return escape(reply)
    i, j = span
    return f'{escape(reply[:i])}<mark class="action">{escape(reply[i:j])}</mark>{escape(reply[j:])}'


def render_conversation(ep: dict[str, Any], compact: bool = False) -> str:
    turns = V.conversation(ep.get("first_observation"), ep.get("replies"), ep.get("observations"),
                           ep.get("turn_rewards"), ep.get("actions"), ep.get("invalid_actions"), ep.get("turns"))
    if ep.get("replies") is None and ep.get("first_observation") is None:
        return ('<p class="warn">This rollout file predates the viewer\'s text columns: the turns\' text is not '
                'stored. Open the token view to read the episode from its token ids.</p>'
                + "".join(f'<div class="turn" data-turn="{t.index}"><div class="turn-head">turn {t.index} '
                          f'<span class="reward" data-reward="{t.reward!r}">reward {fmt(t.reward)}</span></div></div>'
                          for t in turns))
    out = []
    for t in turns:
        badges = f'<span class="reward" data-reward="{t.reward!r}">reward {fmt(t.reward)}</span>'
        if t.invalid:
            badges += ' <span class="badge invalid">invalid action</span>'
        elif t.action:
            badges += f' <span class="badge action-name">action: {escape(t.action)}</span>'
        seen = ("" if t.seen is None else
                f'<div class="msg obs"><div class="who">observation</div><pre class="observation">\n{escape(t.seen)}</pre></div>')
        out.append(f'<div class="turn" data-turn="{t.index}"><div class="turn-head">turn {t.index} {badges}</div>'
                   f'{seen}<div class="msg reply"><div class="who">model</div>'
                   f'<pre class="reply">\n{render_reply(t.reply, t.action)}</pre></div></div>')
    if turns and turns[-1].observation_after is not None:
        out.append('<div class="turn final"><div class="msg obs"><div class="who">last observation</div>'
                   f'<pre class="observation">\n{escape(turns[-1].observation_after)}</pre></div></div>')
    return "".join(out) or "<p>No turns.</p>"


def episode_facts(ep: dict[str, Any], run: RunInfo | None) -> str:
    facts = [("task", fmt(ep.get("task_id"))), ("category", fmt(ep.get("category"))),
             ("group", fmt(ep.get("group_id"))), ("phase", fmt(ep.get("phase"))),
             ("turn limit", fmt(ep.get("turn_limit"))), ("reward", fmt(ep.get("reward"))),
             ("success", fmt(ep.get("success"))), ("turns", fmt(ep.get("turns"))), ("finish", fmt(ep.get("finish")))]
    if ep.get("error"):
        facts.append(("error", f'<span class="warn">{escape(ep["error"])}</span>'))
    return '<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"


def render_episode(store: Store, name: str, n: int, i: int, show_tokens: bool) -> str:
    run = store.run(name)
    path = _step_path(store, run, n)
    ep = store.episode(path, i)
    base = f"/runs/{q(name)}/steps/{n}"
    if ep is None:
        count = len(store.step_rows(path))
        raise NotFound(f"Step {n} of {name} has no episode {i}",
                       f'<p>Step {n} has episodes 0 to {count - 1}: <a href="{base}">the list</a>.</p>')
    count = len(store.step_rows(path))
    nav = ('<p class="pager">' + (f'<a href="{base}/episodes/{i - 1}">← episode {i - 1}</a> ' if i > 0 else "")
           + f'<a href="{base}">all episodes of step {n}</a>'
           + (f' <a href="{base}/episodes/{i + 1}">episode {i + 1} →</a>' if i + 1 < count else "")
           + f' · <a href="/runs/{q(name)}/tasks/{ep.get("task_id")}">task {ep.get("task_id")} across phases</a></p>')
    tok_url = f"{base}/episodes/{i}/tokens"
    toggle = (f'<p><a id="token-toggle" class="button" data-src="{tok_url}" '
              f'href="{base}/episodes/{i}{"" if show_tokens else "?tokens=1"}">'
              f'{"hide tokens" if show_tokens else "show tokens"}</a> '
              '<span class="muted">the ids the model was trained on: loss mask and per-token advantage</span></p>')
    tokens = f'<div id="tokens"{"" if show_tokens else " hidden"}>' + (
        render_tokens(store, run, path, i) if show_tokens else "") + "</div>"
    body = (nav + episode_facts(ep, run) + toggle + tokens
            + f'<div id="conversation" class="conversation">{render_conversation(ep)}</div>')
    return page(f"{name} · step {n} · episode {i}", body,
                [("runs", "/"), (name, f"/runs/{q(name)}"), (f"step {n}", base), (f"episode {i}", None)])


def render_tokens(store: Store, run: RunInfo, path: Path, i: int) -> str:
    ep = store.episode(path, i, TOKEN_COLUMNS)
    if ep is None or not ep.get("token_ids"):
        return '<p class="warn">No token ids stored for this episode.</p>'
    ids, mask = ep["token_ids"], ep.get("loss_mask") or [0] * len(ep["token_ids"])
    adv, lps = ep.get("advantages"), ep.get("logprobs")
    try:
        tok = store.tokenizer(run)
        texts = [tok.decode([t]) for t in ids]
        tok_note = ""
    except Exception as e:  # noqa: BLE001 - still show ids and the mask
        texts = [f"[{t}]" for t in ids]
        tok_note = (f'<p class="warn">The run\'s tokenizer ({escape(str(run.cfg("model.path")))}) could not be '
                    f"loaded ({escape(type(e).__name__)}: {escape(str(e))}); showing token ids.</p>")
    pol = [abs(a) for a, m in zip(adv or [], mask) if m]
    scale = max(pol) if pol else 0.0
    segs = V.token_segments(mask, ep.get("action_ends"))
    out = []
    for s in segs:
        label = {"prompt": "prompt", "action": f"turn {s.turn + 1}: model (trained)",
                 "env": f"turn {s.turn + 1}: env reply (not trained)"}[s.kind]
        spans = []
        for k in range(s.start, s.end):
            a = adv[k] if adv is not None and k < len(adv) else None
            tip = f"id {ids[k]}"
            if mask[k]:
                tip += f" · loss mask 1 · advantage {fmt(a, '.4f')} · logprob {fmt(lps[k] if lps else None, '.3f')}"
                style = f' style="background:{V.advantage_color(a, scale)}"'
                cls = "tok pol"
            else:
                tip += " · loss mask 0"
                style, cls = "", "tok ctx"
            t = texts[k].replace("\n", "↵\n")
            spans.append(f'<span class="{cls}" title="{escape(tip)}"{style}>{escape(t)}</span>')
        out.append(f'<div class="seg seg-{s.kind}" data-kind="{s.kind}"><div class="seg-label">{label} '
                   f'({s.end - s.start} tokens)</div><div class="seg-body">{"".join(spans)}</div></div>')
    n_pol = sum(1 for m in mask if m)
    legend = (f'<p class="legend">{len(ids)} tokens, {n_pol} trained (loss mask 1, outlined); colour = per-token '
              f'advantage, <span class="sw pos">green &gt; 0</span> <span class="sw neg">red &lt; 0</span>, '
              f'full colour at |advantage| = {scale:.4g}; grey = context (loss mask 0). Hover a token for its id, '
              "advantage and log-prob.</p>")
    if adv is None:
        legend += '<p class="warn">This file stores no advantages (written before they were kept): mask only.</p>'
    return f'<div class="token-view">{tok_note}{legend}{"".join(out)}</div>'


def render_task(store: Store, name: str, task_id: int, params: dict[str, str]) -> str:
    run = store.run(name)
    steps = store.steps(run)
    metrics = {int(m["global_step"]): m for m in store.metrics(run)}
    found: dict[int, tuple[int, Path, list[int]]] = {}  # phase -> (step, file, rows of the task), last step wins
    for s, p in steps.items():
        rows = store.task_rows(p, task_id)
        if not rows:
            continue
        ph = metrics.get(s, {}).get("phase")
        if ph is None:
            e = store.episode(p, rows[0], ("phase",))
            ph = e.get("phase") if e else None
        found[int(ph or 0)] = (s, p, rows)
    if not found:
        raise NotFound(f"Task {task_id} does not occur in {name}",
                       f'<p>No step of this run has task {task_id}. See the tasks listed on the '
                       f'<a href="/runs/{q(name)}">run page</a>.</p>')
    phases = sorted(found)
    if params.get("phases") != "all" and len(phases) > 2:
        phases = [phases[0], phases[-1]]
    sample = int(params["sample"]) if params.get("sample", "").isdigit() else 0
    cols = []
    for ph in phases:
        s, p, rows = found[ph]
        i = rows[min(sample, len(rows) - 1)]
        ep = store.episode(p, i)
        cols.append(f'<section class="col"><h2>phase {ph} · step {s}</h2>{episode_facts(ep, run)}'
                    f'<p><a href="/runs/{q(name)}/steps/{s}/episodes/{i}">open episode {i}</a></p>'
                    f'<div class="conversation">{render_conversation(ep)}</div></section>')
    nsamp = max(len(v[2]) for v in found.values())
    opts = " ".join(f'<a href="?{urlencode({**params, "sample": k})}">{"<b>" if k == sample else ""}sample {k}'
                    f'{"</b>" if k == sample else ""}</a>' for k in range(nsamp))
    more = (f' · <a href="?{urlencode({**params, "phases": "all"})}">all phases</a>'
            if params.get("phases") != "all" and len(found) > 2 else "")
    body = (f'<p class="muted">Each phase\'s last step that has task {task_id}; {opts}{more}</p>'
            f'<div class="side-by-side">{"".join(cols)}</div>')
    return page(f"{name} · task {task_id} across phases", body,
                [("runs", "/"), (name, f"/runs/{q(name)}"), (f"task {task_id}", None)])


# --- evals ------------------------------------------------------------------------------------------------------
def _rate(r: Any) -> str:
    if not isinstance(r, dict) or r.get("value") is None:
        return "-"
    ci = r.get("ci")
    return f"{r['value']:.3f}" + (f' <span class="muted">[{ci[0]:.2f}, {ci[1]:.2f}]</span>' if ci else "")


def render_evals(store: Store) -> str:
    evs = store.evals()
    if not evs:
        body = (f"<p>No evaluation JSONs: runs keep theirs as <code>&lt;run&gt;/eval_before.json</code> and "
                f"<code>eval_after.json</code>; put others (<code>scalinginter eval ... --json</code>) in "
                f"<code>{escape(str(store.runs_dir / 'evals'))}</code>.</p>")
    else:
        rows = []
        for n, p in evs.items():
            d = eval_flat(_read_json(p))
            rows.append([f'<a href="/evals/{q(n)}">{escape(n)}</a>', fmt(d.get("success_rate")),
                         fmt(d.get("mean_reward")), fmt(d.get("episodes"), ".0f"), f"<code>{escape(str(p))}</code>"])
        body = table(["evaluation", "success rate", "mean reward", "episodes", "file"], rows)
    return page("Evaluations", body, [("runs", "/"), ("evaluations", None)])


def _eval_parquet(p: Path) -> Path | None:
    for c in (p.with_suffix(".parquet"), p.with_name(p.stem) / "episodes.parquet"):
        if c.exists():
            return c
    return None


def render_eval(store: Store, name: str) -> str:
    evs = store.evals()
    if name not in evs:
        raise NotFound(f"No evaluation named {name!r}", "<p>Evaluations that exist:</p><ul>" + "".join(
            f'<li><a href="/evals/{q(n)}">{escape(n)}</a></li>' for n in evs) + "</ul>" if evs else
            "<p>There are no evaluation JSONs.</p>")
    path = evs[name]
    doc = _read_json(path)
    body = f'<p class="muted">file <code>{escape(str(path))}</code></p>'
    if not isinstance(doc, dict):
        body += '<p class="warn">This file is not a JSON object: it could not be read.</p>'
    elif doc.get("schema", "").startswith("scalinginter.eval/"):
        body += f'<pre class="header">{escape(str(doc.get("header", "")))}</pre>'
        K = doc.get("samples", 1)
        for mname, m in doc.get("models", {}).items():
            body += f'<h2>{escape(mname)}: <code>{escape(str(m.get("ref")))}</code></h2>'
            rows = []
            for key, bud in m.get("budgets", {}).items():
                c = bud.get("overall", {})
                passes = " ".join(f"@{k} {_rate(v)}" for k, v in c.get("pass", {}).items()) if K > 1 else ""
                rows.append([escape(str(key)), fmt(c.get("tasks")), fmt(c.get("episodes")),
                             fmt(c.get("masked_episodes")), _rate(c.get("avg")), passes,
                             fmt(c.get("mean_reward")), fmt(c.get("mean_turns"), ".2f")])
                groups = [(cat, cc) for cat, cc in sorted(bud.get("categories", {}).items())]
                groups += [(f"needs {k} turn{'s' if k != '1' else ''}", cc)  # the env's required-turns buckets
                           for k, cc in bud.get("required_turns", {}).items()]
                for cat, cc in groups:
                    rows.append([f'<span class="muted">{escape(str(key))} · {escape(cat)}</span>', fmt(cc.get("tasks")),
                                 fmt(cc.get("episodes")), fmt(cc.get("masked_episodes")), _rate(cc.get("avg")), "",
                                 fmt(cc.get("mean_reward")), fmt(cc.get("mean_turns"), ".2f")])
            body += table(["turn budget · category", "tasks", "episodes", "masked",
                           "success (greedy)" if K == 1 else f"Avg@{K}", "Pass@k" if K > 1 else "",
                           "mean reward", "mean turns"], rows)
            for key, bud in m.get("budgets", {}).items():
                pt = bud.get("per_task", [])
                if not pt:
                    continue
                trows = [[fmt(t.get("task_id")), fmt(t.get("category")),
                          " ".join("·" if s is None else ("✓" if s else "✗") for s in t.get("successes", [])),
                          " ".join(fmt(r, ".2f") for r in t.get("rewards", [])),
                          " ".join(fmt(x) for x in t.get("turns", []))] for t in pt]
                body += (f"<details><summary>per task at turn budget {escape(str(key))} ({len(pt)} tasks, "
                         f"{K} sample{'s' if K != 1 else ''} each)</summary>"
                         + table(["task", "category", "successes", "rewards", "turns"], trows) + "</details>")
        comp = doc.get("comparison")
        if comp:
            rows = [[escape(str(k)), fmt(b["overall"].get("a")), fmt(b["overall"].get("b")),
                     fmt(b["overall"].get("diff")), fmt(b["overall"].get("p_value"), ".3g"),
                     escape(str(b["overall"].get("test")))] for k, b in comp.get("budgets", {}).items()]
            body += f"<h2>{escape(comp.get('a', 'a'))} vs {escape(comp.get('b', 'b'))}</h2>" + table(
                ["turn budget", "a", "b", "a - b", "p", "test"], rows)
    else:
        body += table(["", "value"], [[escape(str(k)), fmt(v)] for k, v in doc.items()
                                      if not isinstance(v, (dict, list))])
    pq_path = _eval_parquet(path)
    if pq_path is not None:
        rows = store.step_rows(pq_path)
        body += "<h2>Episodes</h2>" + table(
            ["#", "task", "category", "reward", "success", "turns", "finish", ""],
            [[str(r["index"]), fmt(r.get("task_id")), fmt(r.get("category")), fmt(r.get("reward")),
              "✓" if r.get("success") else "✗", fmt(r.get("turns")), fmt(r["finish"]),
              f'<a class="episode-link" href="/evals/{q(name)}/episodes/{r["index"]}">open</a>'] for r in rows])
    else:
        body += ('<p class="muted">No episodes stored with this evaluation (an episodes Parquet named like the JSON '
                 "would be listed here).</p>")
    return page(f"Evaluation {name}", body, [("runs", "/"), ("evaluations", "/evals"), (name, None)])


def render_eval_episode(store: Store, name: str, i: int) -> str:
    evs = store.evals()
    if name not in evs:
        return render_eval(store, name)  # raises NotFound listing the evaluations
    pq_path = _eval_parquet(evs[name])
    if pq_path is None:
        raise NotFound(f"Evaluation {name} stores no episodes", f'<p>See <a href="/evals/{q(name)}">its results</a>.</p>')
    ep = store.episode(pq_path, i)
    if ep is None:
        raise NotFound(f"Evaluation {name} has no episode {i}", f'<p>See <a href="/evals/{q(name)}">its episodes</a>.</p>')
    body = episode_facts(ep, None) + f'<div id="conversation" class="conversation">{render_conversation(ep)}</div>'
    return page(f"Evaluation {name} · episode {i}", body,
                [("runs", "/"), ("evaluations", "/evals"), (name, f"/evals/{q(name)}"), (f"episode {i}", None)])


# --- the app ------------------------------------------------------------------------------------------------------
def create_app(runs_dir: str | Path = "runs", tracking_uri: str | None = None, mlflow_ui: str | None = None,
               token: str | None = None):
    """The viewer app; with ``token`` every request must bring it (``flows.viewer.auth``)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException as StarletteHTTPException

    store = Store(runs_dir, tracking_uri, mlflow_ui)
    app = FastAPI(title="ScalingInter trajectory viewer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if token:
        from flows.viewer.auth import ViewerGuard

        app.add_middleware(ViewerGuard, token=token)

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound):
        return HTMLResponse(page(exc.title, exc.body, [("runs", "/")]), status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        body = ('<p>This address is not a page of the viewer. Pages: <a href="/">runs</a>, '
                "<code>/runs/&lt;run&gt;</code>, <code>/runs/&lt;run&gt;/steps/&lt;n&gt;</code>, "
                "<code>/runs/&lt;run&gt;/steps/&lt;n&gt;/episodes/&lt;i&gt;</code>, <a href=\"/evals\">/evals</a>.</p>")
        return HTMLResponse(page(f"{exc.status_code}: {exc.detail}", body, [("runs", "/")]),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_path(request: Request, exc: RequestValidationError):
        body = (f"<p><code>{escape(request.url.path)}</code>: step numbers, episode indices and task ids are "
                'integers, e.g. <code>/runs/&lt;run&gt;/steps/3/episodes/0</code>. <a href="/">The runs</a>.</p>')
        return HTMLResponse(page("Not a page of the viewer", body, [("runs", "/")]), status_code=404)

    @app.exception_handler(Exception)
    async def _error(_: Request, exc: Exception):
        body = (f'<p class="warn">{escape(type(exc).__name__)}: {escape(str(exc))}</p>'
                "<p>The file behind this page could not be read. Check it (a run still writing, a truncated copy) "
                'and reload, or go back to <a href="/">the runs</a>.</p>')
        return HTMLResponse(page("This page could not be built", body, [("runs", "/")]), status_code=500)

    def html(s: str) -> HTMLResponse:
        return HTMLResponse(s)

    @app.get("/", response_class=HTMLResponse)
    def index():
        return html(render_index(store))

    @app.get("/runs/{name}", response_class=HTMLResponse)
    def run_page(name: str):
        return html(render_run(store, name))

    @app.get("/runs/{name}/steps/{n}", response_class=HTMLResponse)
    def step_page(name: str, n: int, request: Request):
        return html(render_step(store, name, n, dict(request.query_params)))

    @app.get("/runs/{name}/steps/{n}/episodes/{i}", response_class=HTMLResponse)
    def episode_page(name: str, n: int, i: int, tokens: int = 0):
        return html(render_episode(store, name, n, i, bool(tokens)))

    @app.get("/runs/{name}/steps/{n}/episodes/{i}/tokens", response_class=HTMLResponse)
    def tokens_fragment(name: str, n: int, i: int):
        run = store.run(name)
        path = _step_path(store, run, n)
        if store.episode(path, i, ("task_id",)) is None:
            raise NotFound(f"Step {n} of {name} has no episode {i}", f'<p><a href="/runs/{q(name)}/steps/{n}">'
                           "The episodes of the step</a>.</p>")
        return html(render_tokens(store, run, path, i))

    @app.get("/runs/{name}/tasks/{task_id}", response_class=HTMLResponse)
    def task_page(name: str, task_id: int, request: Request):
        return html(render_task(store, name, task_id, dict(request.query_params)))

    @app.get("/evals", response_class=HTMLResponse)
    def evals_page():
        return html(render_evals(store))

    @app.get("/evals/{name}", response_class=HTMLResponse)
    def eval_page(name: str):
        return html(render_eval(store, name))

    @app.get("/evals/{name}/episodes/{i}", response_class=HTMLResponse)
    def eval_episode_page(name: str, i: int):
        return html(render_eval_episode(store, name, i))

    return app


def serve(runs_dir: str | Path = "runs", tracking_uri: str | None = None, host: str = V.DEFAULT_HOST,
          port: int = V.DEFAULT_PORT, mlflow_ui: str | None = None, token: str | None = None) -> None:
    """Off loopback a token is required (``token``, ``$SCALINGINTER_VIEW_TOKEN``, else one generated and printed
    in the URL to open)."""
    import uvicorn

    from flows.viewer.auth import login_url, resolve_token

    token, generated = resolve_token(host, token, dict(os.environ))
    app = create_app(runs_dir, tracking_uri, mlflow_ui, token=token)
    # the first token view needs transformers (seconds to import): import it now, off the request path
    threading.Thread(target=lambda: __import__("transformers.models.auto.tokenization_auto"), daemon=True).start()
    if token:
        print(f"viewer token {'generated' if generated else 'set'}: every request needs it; open "
              f"{login_url(host, port, token)}", flush=True)
    print(f"trajectory viewer: http://{host}:{port}/  (runs from {Path(runs_dir).resolve()}"
          + (f", MLflow {app.state.store.tracking_uri}" if app.state.store.tracking_uri else "") + ")", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
