"""Evaluation report: per-episode outcomes in, the evaluation document out (pure; the schema is documented in
``flows/evaluate.py`` and docs/reference/eval-json.md).

An evaluation scores every task at every turn budget ``K`` times (greedy when K = 1). This module turns the
outcomes into, per turn budget: the overall and per-category Avg@K (mean success over the samples), Pass@k for
every power of two k <= K and K itself (unbiased estimator), mean reward and turns, each rate with a confidence
interval (Wilson over tasks when K = 1, a bootstrap over tasks otherwise), and the per-task successes, so a paired
test can be recomputed later (``compare_models``: McNemar on greedy results, a paired bootstrap otherwise).

Masked episodes (infrastructure failures) are counted apart and never scored; a task whose samples were all
masked is left out of the rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from core.evalinput import check_sweep
from core.stats import bootstrap_ci, mcnemar_exact, paired_bootstrap, pass_at_k, pass_ks, wilson_interval

SCHEMA = "scalinginter.eval/1"
UNCATEGORIZED = "-"
BUCKETS = ("1", "2-3", "4-6", "7+")  # required-turns buckets (the fewest turns an expert needs)


def required_turns_bucket(n: int) -> str:
    """The bucket of a task that needs ``n`` turns: 1, 2-3, 4-6 or 7+."""
    if n < 1:
        raise ValueError(f"required turns must be >= 1, got {n}")
    return "1" if n == 1 else "2-3" if n <= 3 else "4-6" if n <= 6 else "7+"


@dataclass(frozen=True)
class Outcome:
    """One episode of an evaluation."""

    task_id: int
    turn_limit: int
    sample: int  # 0..K-1
    success: bool | None  # None: masked (an env failure), not scored
    reward: float = 0.0
    turns: int = 0
    category: str | None = None
    required_turns: int | None = None  # the fewest turns an expert needs (None: the env does not label it)


def _rate(value: float, ci: tuple[float, float], method: str) -> dict[str, Any]:
    """A rate and its interval; undefined (no task to score) is None, so the JSON stays strict."""
    if math.isnan(value):
        return {"value": None, "ci": None, "method": method}
    return {"value": value, "ci": [ci[0], ci[1]], "method": method}


def _task_interval(value: float, per_task: list[float], confidence: float, seed: int) -> dict[str, Any]:
    """The bootstrap interval over tasks of a K-sample rate, except when every task scored the same 0 or 1: the
    bootstrap then collapses to a point ([0, 0] after 0 successes in 128 episodes says more than the data do),
    and the Wilson interval over tasks (each task a 0/1 unit) is given instead."""
    if per_task and all(v == per_task[0] for v in per_task) and per_task[0] in (0.0, 1.0):
        wins = len(per_task) if per_task[0] == 1.0 else 0
        return _rate(value, wilson_interval(wins, len(per_task), confidence), "wilson")
    return _rate(value, bootstrap_ci(per_task, confidence, seed=seed), "bootstrap")


def _cell(tasks: list[dict[str, Any]], samples: int, confidence: float, seed: int) -> dict[str, Any]:
    """Metrics of a group of tasks (all, or one category) at one budget. ``tasks``: per-task records."""
    valid = [t for t in tasks if any(s is not None for s in t["successes"])]
    episodes = sum(s is not None for t in tasks for s in t["successes"])
    masked = sum(s is None for t in tasks for s in t["successes"])
    rewards = [r for t in tasks for s, r in zip(t["successes"], t["rewards"]) if s is not None]
    turns = [n for t in tasks for s, n in zip(t["successes"], t["turns"]) if s is not None]
    out: dict[str, Any] = {"tasks": len(valid), "episodes": episodes, "masked_episodes": masked,
                           "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                           "mean_turns": sum(turns) / len(turns) if turns else None}
    per_task_avg = []
    for t in valid:
        ok = [s for s in t["successes"] if s is not None]
        per_task_avg.append(sum(ok) / len(ok))
    avg = sum(per_task_avg) / len(per_task_avg) if per_task_avg else math.nan
    if samples == 1:  # one greedy episode per task: a proportion over tasks
        wins = sum(1 for v in per_task_avg if v > 0)
        out["avg"] = _rate(avg, wilson_interval(wins, len(valid), confidence), "wilson")
    else:
        out["avg"] = _task_interval(avg, per_task_avg, confidence, seed)
    out["pass"] = {}
    for k in pass_ks(samples):
        vals = []
        for t in valid:
            ok = [s for s in t["successes"] if s is not None]
            if len(ok) >= k:
                vals.append(pass_at_k(len(ok), sum(ok), k))
        v = sum(vals) / len(vals) if vals else math.nan
        if samples == 1:
            ci = wilson_interval(sum(1 for x in vals if x > 0), len(vals), confidence)
            out["pass"][str(k)] = {**_rate(v, ci, "wilson"), "tasks": len(vals)}
        else:
            out["pass"][str(k)] = {**_task_interval(v, vals, confidence, seed), "tasks": len(vals)}
    return out


def model_report(outcomes: Iterable[Outcome], task_ids: list[int], turn_limits: list[int], samples: int,
                 confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """``{"budgets": {"<T>": {"turn_limit", "overall", "categories": {name: cell}, "per_task": [...]}}}`` for one
    model. Every (task, budget, sample) must appear exactly once in ``outcomes``."""
    check_sweep(samples, turn_limits)
    grid: dict[tuple[int, int], list[Outcome | None]] = {(t, b): [None] * samples for t in task_ids for b in turn_limits}
    for o in outcomes:
        key = (o.task_id, o.turn_limit)
        if key not in grid or not 0 <= o.sample < samples:
            raise ValueError(f"outcome for task {o.task_id}, budget {o.turn_limit}, sample {o.sample} is outside "
                             f"the evaluation ({len(task_ids)} tasks, budgets {turn_limits}, {samples} samples)")
        if grid[key][o.sample] is not None:
            raise ValueError(f"two outcomes for task {o.task_id}, budget {o.turn_limit}, sample {o.sample}")
        grid[key][o.sample] = o
    missing = [k for k, row in grid.items() if any(x is None for x in row)]
    if missing:
        raise ValueError(f"{len(missing)} (task, budget) cells lack samples, e.g. {missing[0]}")
    budgets: dict[str, Any] = {}
    for b in turn_limits:
        per_task = []
        for t in task_ids:
            row = grid[(t, b)]
            cat = next((o.category for o in row if o.category is not None), None)  # type: ignore[union-attr]
            per_task.append({"task_id": t, "category": str(cat) if cat is not None else UNCATEGORIZED,
                             "successes": [None if o.success is None else int(o.success) for o in row],  # type: ignore[union-attr]
                             "rewards": [float(o.reward) for o in row],  # type: ignore[union-attr]
                             "turns": [int(o.turns) for o in row]})  # type: ignore[union-attr]
            need = next((o.required_turns for o in row if o.required_turns is not None), None)  # type: ignore[union-attr]
            if need is not None:
                per_task[-1]["required_turns"] = int(need)
        cats: dict[str, list[dict[str, Any]]] = {}
        for r in per_task:
            cats.setdefault(r["category"], []).append(r)
        budgets[str(b)] = {"turn_limit": b, "overall": _cell(per_task, samples, confidence, seed),
                           "categories": {c: _cell(rs, samples, confidence, seed) for c, rs in sorted(cats.items())}}
        buckets = _by_bucket(per_task)
        if buckets:  # envs that label no task leave the key out
            budgets[str(b)]["required_turns"] = {k: _cell(rs, samples, confidence, seed) for k, rs in buckets.items()}
        budgets[str(b)]["per_task"] = per_task
    return {"budgets": budgets}


def _by_bucket(per_task: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The labelled tasks by required-turns bucket, in bucket order (unlabelled tasks are in no bucket)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in per_task:
        if r.get("required_turns") is not None:
            out.setdefault(required_turns_bucket(r["required_turns"]), []).append(r)
    return {k: out[k] for k in BUCKETS if k in out}


def _task_scores(per_task: list[dict[str, Any]]) -> dict[int, tuple[float, bool]]:
    """task id -> (mean success over its unmasked samples, whether it was greedy-solved); masked tasks left out."""
    out = {}
    for r in per_task:
        ok = [s for s in r["successes"] if s is not None]
        if ok:
            out[r["task_id"]] = (sum(ok) / len(ok), ok[0] == 1)
    return out


def paired_test(a_tasks: list[dict[str, Any]], b_tasks: list[dict[str, Any]], greedy: bool,
                confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """A (first model) vs B (second) on the tasks both scored: the difference of mean success A - B with a paired
    bootstrap interval, and the p-value of "no difference" (exact McNemar when both are greedy, the paired
    bootstrap otherwise). ``a_better``/``b_better``: tasks where only one side succeeded (greedy)."""
    sa, sb = _task_scores(a_tasks), _task_scores(b_tasks)
    common = [t for t in sa if t in sb]
    out: dict[str, Any] = {"tasks": len(common)}
    if not common:
        return {**out, "a": None, "b": None, "diff": None, "ci": None, "p_value": None, "test": "none"}
    xa, xb = [sa[t][0] for t in common], [sb[t][0] for t in common]
    pb = paired_bootstrap(xa, xb, confidence, seed=seed)
    out.update(a=sum(xa) / len(xa), b=sum(xb) / len(xb), diff=pb.diff, ci=[pb.ci[0], pb.ci[1]])
    if greedy:
        a_only = sum(1 for t in common if sa[t][1] and not sb[t][1])
        b_only = sum(1 for t in common if sb[t][1] and not sa[t][1])
        out.update(test="mcnemar_exact", p_value=mcnemar_exact(a_only, b_only), a_better=a_only, b_better=b_only,
                   p_a_worse=mcnemar_exact(a_only, b_only, alternative="less"))
    else:
        out.update(test="paired_bootstrap", p_value=pb.p_value)
    return out


def compare_models(a: dict[str, Any], b: dict[str, Any], samples: int, confidence: float = 0.95,
                   seed: int = 0) -> dict[str, Any]:
    """Per budget (those both reports have): overall and per-category ``paired_test`` of model report ``a`` vs
    ``b``."""
    out: dict[str, Any] = {}
    for key, ba in a["budgets"].items():
        bb = b["budgets"].get(key)
        if bb is None:
            continue
        cats = sorted({r["category"] for r in ba["per_task"]})
        out[key] = {"turn_limit": ba["turn_limit"],
                    "overall": paired_test(ba["per_task"], bb["per_task"], samples == 1, confidence, seed),
                    "categories": {c: paired_test([r for r in ba["per_task"] if r["category"] == c],
                                                  [r for r in bb["per_task"] if r["category"] == c],
                                                  samples == 1, confidence, seed) for c in cats}}
        buckets = _by_bucket(ba["per_task"])
        if buckets:  # the same tasks of model b, bucketed by a's labels (the same tasks, the same env)
            out[key]["required_turns"] = {
                k: paired_test(rs, [r for r in bb["per_task"] if r["task_id"] in {x["task_id"] for x in rs}],
                               samples == 1, confidence, seed) for k, rs in buckets.items()}
    return out


def flat_metrics(report: dict[str, Any], model: str = "model", turn_limit: int | None = None) -> dict[str, float]:
    """MLflow-style flat numbers of one model at one budget (default: the largest): success_rate (= Avg@K) and its
    interval, pass@k, mean reward and turns, episode counts."""
    budgets = report["models"][model]["budgets"]
    key = str(turn_limit) if turn_limit is not None else max(budgets, key=int)
    c = budgets[key]["overall"]
    ci = c["avg"]["ci"] or [None, None]
    out = {"success_rate": c["avg"]["value"], "success_rate_ci_low": ci[0], "success_rate_ci_high": ci[1],
           "mean_reward": c["mean_reward"], "mean_turns": c["mean_turns"], "episodes": float(c["episodes"]),
           "masked_episodes": float(c["masked_episodes"]), "tasks": float(c["tasks"])}
    for k, v in c["pass"].items():
        out[f"pass_at_{k}"] = v["value"]
    return {k: float(v) for k, v in out.items() if v is not None}  # undefined numbers are left out


def bucket_rates(report: dict[str, Any] | None, model: str = "model") -> dict[str, dict[str, Any]]:
    """Success per required-turns bucket of one model at its largest budget: ``{bucket: {"tasks", "value", "ci"}}``
    (empty when the env labels no task or there is no report)."""
    if not report:
        return {}
    budgets = report["models"][model]["budgets"]
    b = budgets[max(budgets, key=int)]
    return {k: {"tasks": c["tasks"], "value": c["avg"]["value"], "ci": c["avg"]["ci"]}
            for k, c in b.get("required_turns", {}).items()}


def _fmt_rate(r: dict[str, Any]) -> str:
    if r["value"] is None:
        return "-"
    return f"{r['value']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_p(p: float | None) -> str:
    return "-" if p is None or math.isnan(p) else (f"{p:.3g}" if p >= 0.001 else f"{p:.1e}")


def report_text(doc: dict[str, Any]) -> str:
    """The evaluation as text: a header, then per model one line per budget (and per category), then the paired
    comparison per budget."""
    K = doc["samples"]
    ks = pass_ks(K)
    conf = int(round(doc["confidence"] * 100))
    lines = [doc.get("header", "")]
    metric = "success" if K == 1 else f"Avg@{K}"
    for name, m in doc["models"].items():
        lines.append(f"\n{name}: {m['ref']}")
        cols = [metric] + ([f"Pass@{k}" for k in ks if k > 1])
        lines.append(f"  {'budget':<8}{'category':<22}{'tasks':>6}  " + "  ".join(f"{c + f' ({conf}% CI)':<26}" for c in cols)
                     + f"{'reward':>8}{'turns':>7}")
        for key, b in m["budgets"].items():
            rows = [("all", b["overall"])] + (list(b["categories"].items()) if len(b["categories"]) > 1 else [])
            rows += [(f"needs {k} turn{'s' if k != '1' else ''}", c) for k, c in b.get("required_turns", {}).items()]
            for cat, c in rows:
                rates = [c["avg"]] + [c["pass"][str(k)] for k in ks if k > 1]
                lines.append(f"  {key:<8}{cat[:21]:<22}{c['tasks']:>6}  " + "  ".join(f"{_fmt_rate(r):<26}" for r in rates)
                             + f"{_f(c['mean_reward'], '.3f'):>8}{_f(c['mean_turns'], '.2f'):>7}")
    cmp = doc.get("comparison")
    if cmp:
        lines.append(f"\n{cmp['a']} - {cmp['b']} on the same tasks and seeds ({cmp['budgets'] and next(iter(cmp['budgets'].values()))['overall'].get('test', '')}):")
        for key, b in cmp["budgets"].items():
            o = b["overall"]
            if o["diff"] is None:
                lines.append(f"  budget {key}: no task scored by both")
                continue
            extra = (f", {o['a_better']} tasks only {cmp['a']}, {o['b_better']} only {cmp['b']}"
                     if "a_better" in o else "")
            lines.append(f"  budget {key}: {o['a']:.3f} vs {o['b']:.3f}, diff {o['diff']:+.3f} "
                         f"[{o['ci'][0]:+.3f}, {o['ci'][1]:+.3f}], p = {format_p(o['p_value'])} ({o['tasks']} tasks{extra})")
            for k, q in b.get("required_turns", {}).items():
                if q["diff"] is not None:
                    lines.append(f"    needs {k} turn{'s' if k != '1' else ''}: {q['a']:.3f} vs {q['b']:.3f}, diff "
                                 f"{q['diff']:+.3f} [{q['ci'][0]:+.3f}, {q['ci'][1]:+.3f}], p = {format_p(q['p_value'])} "
                                 f"({q['tasks']} tasks)")
    return "\n".join(lines)


def build_document(meta: dict[str, Any], models: dict[str, tuple[str, dict[str, Any]]], samples: int,
                   turn_limits: list[int], confidence: float = 0.95, seed: int = 0,
                   compare: tuple[str, str] | None = None) -> dict[str, Any]:
    """The evaluation document: ``meta`` (env, split, header, ...) plus ``models`` ({name: (ref, model_report)}) and,
    with ``compare=(a, b)``, the paired comparison of model a vs model b."""
    doc = {"schema": SCHEMA, **meta, "samples": samples, "turn_limits": list(turn_limits), "confidence": confidence,
           "seed": seed, "models": {name: {"ref": ref, **rep} for name, (ref, rep) in models.items()}}
    if compare is not None:
        a, b = compare
        doc["comparison"] = {"a": a, "b": b, "budgets": compare_models(models[a][1], models[b][1], samples,
                                                                        confidence, seed)}
    return doc


def paired_regression(current: list[int | None], previous: list[int | None], alpha: float = 0.05,
                      tolerance: float = 0.0, against: str = "the previous night", metric: str = "success_rate"):
    """Nightly verdict from per-task greedy outcomes of tonight and the reference, task by task (None = masked,
    left out): a regression when tonight solves significantly fewer of the same tasks — one-sided exact McNemar
    p < ``alpha`` — and the rate fell by more than ``tolerance``. Returns ``core.compare.Verdict``."""
    from core.compare import Verdict

    if len(current) != len(previous):
        raise ValueError(f"paired outcomes need the same tasks: {len(current)} vs {len(previous)}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    pairs = [(c, p) for c, p in zip(current, previous) if c is not None and p is not None]
    if not pairs:
        return Verdict(False, f"{metric}: no task scored both tonight and by {against}; no verdict", None)
    cur = sum(c for c, _ in pairs) / len(pairs)
    prev = sum(p for _, p in pairs) / len(pairs)
    lost = sum(1 for c, p in pairs if p and not c)
    gained = sum(1 for c, p in pairs if c and not p)
    pval = mcnemar_exact(gained, lost, alternative="less")  # small when tonight gained few of the discordant tasks
    delta = cur - prev
    detail = (f"({delta:+.3f}; paired on {len(pairs)} tasks: {lost} lost, {gained} gained, one-sided McNemar "
              f"p = {format_p(pval)}, alpha {alpha:g}, tolerance {tolerance:.3f})")
    if pval < alpha and -delta > tolerance:
        return Verdict(True, f"REGRESSION: {metric} {cur:.3f} vs {prev:.3f} {against} {detail}", delta)
    return Verdict(False, f"OK: {metric} {cur:.3f} vs {prev:.3f} {against} {detail}", delta)
