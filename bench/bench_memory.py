"""Where the smoke recipe's memory goes: resident memory by component, and the whole process tree's peak.

    python bench/bench_memory.py [--preset smoke] [--steps 1] [--set key=value ...] [--out FILE.json] [--log FILE]
    python bench/bench_memory.py --demo [--preset smoke] [--set key=value ...] [--out FILE.json]

Runs the preset's phase as the product does (a ``Runtime``, ``open_session`` with the learner and the configured
generation engine, env servers, then per step ``rollout_batch`` -> ``compute_advantages`` -> ``policy_update``,
then ``evaluate_ids`` on ``eval.n`` held-out tasks), one stage at a time, while a thread samples the resident
memory (RSS) of this process and of its whole tree (env servers, engine processes) every 20 ms. Prints per stage:
the tree's RSS when the stage ends, its peak during the stage, and what the stage added; beside them, the sizes
that explain them, computed from the model and the config: the policy's weights, gradients and AdamW state (all in
fp32, and the gradients and optimizer state as ``algo.grad_dtype`` and ``algo.optimizer`` hold them), the reference
model, the vLLM engine's KV cache (its plan) and the vocabulary-wide tensors of one micro-batch. The libraries' log
(vLLM's engine lines) goes to a file, as in the product (``--log`` keeps a copy); the run's files are removed.
RSS is not a timing: it holds on a busy machine too. Run it once per change, before and after, on one machine.

``--demo`` runs the whole recipe instead, as a user does (``scalinginter run ENV --preset NAME``, every phase and
evaluation, in a child process), sampling the child's process tree every 20 ms and reading its console: it prints
the tree's RSS over time against the console line that was last printed (so each peak has a stage), the whole
tree's peak and the largest single process's (what ``/usr/bin/time -v`` reports as maximum resident set size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 2**30


def tree_rss(root, labelled: bool = False) -> list:
    """RSS of ``root`` (a psutil.Process) and of each process under it, root first; processes that end while read
    are left out ([] when the root itself is gone). ``labelled``: ``(label, rss)`` pairs, the label naming the
    process (``name:pid`` and what it runs)."""
    import psutil

    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return []
    rss = []
    for q in procs:
        try:
            r = q.memory_info().rss
            rss.append((_label(q), r) if labelled else r)
        except psutil.Error:
            pass
    return rss


def _label(q) -> str:
    """``name:pid`` and the first arguments that say what a process runs (a module, a script)."""
    try:
        args = q.cmdline()[1:]
    except Exception:  # noqa: BLE001 - the process may be gone or a zombie
        args = []
    what = " ".join(Path(x).name if "/" in x else x for x in args[:3])[:60]
    return f"{q.name()}:{q.pid}" + (f" ({what})" if what else "")


class TreeSampler:
    """RSS of this process and of the tree under it, sampled every ``every_s``; ``mark`` starts a stage."""

    def __init__(self, every_s: float = 0.02):
        import psutil

        self.me = psutil.Process()
        self.every_s = every_s
        self.stage = "start"
        self.peaks: dict[str, tuple[int, int]] = {}  # stage -> (own peak, tree peak)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> tuple[int, int]:
        rss = tree_rss(self.me)
        return rss[0], sum(rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            own, tree = self.now()
            p = self.peaks.get(self.stage, (0, 0))
            self.peaks[self.stage] = (max(p[0], own), max(p[1], tree))
            time.sleep(self.every_s)

    def mark(self, stage: str) -> None:
        own, tree = self.now()
        self.stage = stage
        self.peaks[stage] = (own, tree)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run_demo(a) -> None:
    """``--demo``: the recipe end to end in a child process, its tree's RSS against its console (module docstring)."""
    import resource
    import subprocess

    import psutil

    out_dir = tempfile.mkdtemp(prefix="bench-memory-demo-")
    cmd = [sys.executable, "-m", "flows.cli", "run", a.env, "--preset", a.preset, "--run-name", "bench-memory",
           "--set", f"output_dir={out_dir}"]
    for kv in a.sets:
        cmd += ["--set", kv]
    repo = Path(a.repo).resolve() if a.repo else ROOT
    env = dict(os.environ, PREFECT_HOME=os.path.join(out_dir, "prefect"), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(repo))
    log = open(a.log, "w") if a.log else None
    t0 = time.time()
    child = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = psutil.Process(child.pid)
    lines: list[tuple[float, str]] = [(0.0, "(start)")]
    samples: list[tuple[float, int, int]] = []  # (t, tree rss, largest process rss)
    done = threading.Event()

    at_peak: list = []  # the processes' RSS when the tree's was highest

    def sample() -> None:
        top = 0
        while not done.is_set():
            rss = tree_rss(proc, labelled=True)
            if not rss:
                break
            total = sum(r for _, r in rss)
            samples.append((time.time() - t0, total, max(r for _, r in rss)))
            if total > top:
                top, at_peak[:] = total, rss
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    for line in child.stdout:
        line = line.rstrip()
        if log is not None:
            log.write(line + "\n")
            log.flush()
        if line.strip():
            lines.append((time.time() - t0, line))
            if a.echo:
                print(line, flush=True)
    rc = child.wait()
    if log is not None:
        log.close()
    done.set()
    th.join()
    wall = time.time() - t0
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    # each console line's stage: from when it was printed to the next line
    stages = []
    j = 0
    for i, (t, line) in enumerate(lines):
        t_end = lines[i + 1][0] if i + 1 < len(lines) else wall
        peak = 0
        while j < len(samples) and samples[j][0] < t_end:
            peak = max(peak, samples[j][1])
            j += 1
        stages.append({"t_s": round(t, 1), "line": line[:140], "peak_tree_rss_gib": round(peak / GiB, 3)})
    whole = max((s[1] for s in samples), default=0) / GiB
    flags = sorted(set(f for f in open("/proc/cpuinfo").read().split() if f in ("avx512_bf16", "amx_bf16")))
    print(f"\n{'t (s)':>7}  {'tree peak':>9}  console line (the stage until the next one)")
    shown = 0.0
    for st in stages:  # the lines where the tree's peak moved by >= 0.1 GiB, and the top ones
        if abs(st["peak_tree_rss_gib"] - shown) >= 0.1 or st["peak_tree_rss_gib"] >= whole - 0.05:
            print(f"{st['t_s']:7.1f}  {st['peak_tree_rss_gib']:7.2f} G  {st['line'][:100]}")
            shown = st["peak_tree_rss_gib"]
    print(f"\nexit {rc}; wall {wall:.0f} s; whole tree's peak {whole:.2f} GiB; largest process's max RSS "
          f"{largest / GiB:.2f} GiB ({a.env} {a.preset}{' ' + ' '.join(a.sets) if a.sets else ''}; cpu flags "
          f"{' '.join(flags) or 'none'})")
    peak_t = max(samples, key=lambda x: x[1])[0] if samples else 0.0
    print(f"at the tree's peak ({peak_t:.1f} s): " + ", ".join(f"{lab} {r / GiB:.2f}" for lab, r in at_peak))
    if a.out:
        Path(a.out).write_text(json.dumps({"mode": "demo", "repo": str(repo), "commit": _commit(repo),
                                           "env": a.env, "preset": a.preset, "sets": a.sets,
                                           "cpu_flags": flags, "exit": rc, "wall_s": round(wall, 1),
                                           "peak_tree_rss_gib": round(whole, 3),
                                           "largest_process_max_rss_gib": round(largest / GiB, 3),
                                           "peak_t_s": round(peak_t, 2),
                                           "rss_at_peak_gib": {lab: round(r / GiB, 3) for lab, r in at_peak},
                                           "stages": stages,
                                           "samples": [(round(t, 2), round(tr / GiB, 3)) for t, tr, _ in
                                                       samples[::25]]}, indent=1))

    shutil.rmtree(out_dir, ignore_errors=True)
    if rc != 0:
        sys.exit(rc)


def _commit(repo: Path) -> str | None:
    import subprocess

    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or None


def sizes(cfg, learner, model_dir: str) -> dict[str, float]:
    """What the components should take, from the model and the config (GiB)."""
    from runtime.backends.vllm_backend import kv_plan_for, resolve_vllm_dtype

    n = sum(p.numel() for p in learner.model.parameters())
    out = {"policy_weights_fp32": n * 4 / GiB, "policy_grads_fp32": n * 4 / GiB, "adamw_state_fp32": 2 * n * 4 / GiB,
           "reference_weights_fp32": (n * 4 / GiB) if learner.ref is not None else 0.0}
    # as this config holds them: gradients in algo.grad_dtype, the moments of algo.optimizer (8-bit: 2 bytes per
    # parameter, the block scales left out); the keys above are the all-fp32 sizes
    from core.preflight import OPTIMIZER_STATE_BYTES

    out["policy_grads_as_configured"] = n * (2 if cfg.algo.grad_dtype == "bf16" else 4) / GiB
    out["optimizer_state_as_configured"] = n * OPTIMIZER_STATE_BYTES[cfg.algo.optimizer] / GiB
    vocab = learner.model.config.vocab_size
    out["vocab_tensor_per_1k_policy_tokens_fp32"] = 1000 * vocab * 4 / GiB
    if cfg.rollout.backend == "vllm":
        plan = kv_plan_for(cfg, model_dir, resolve_vllm_dtype(cfg.rollout.vllm_dtype))
        out["vllm_kv_cache"] = plan.cache_bytes / GiB
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="babyai")
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", default=None)
    ap.add_argument("--demo", action="store_true", help="the whole recipe as `scalinginter run` (module docstring)")
    ap.add_argument("--echo", action="store_true", help="--demo: show the run's console as it goes")
    ap.add_argument("--log", default=None, help="write the libraries' log (--demo: the run's whole console) to this "
                                                "file")
    ap.add_argument("--repo", default=None, help="--demo: run the code of this checkout (another commit, "
                                                 "for a before/after pair); default this one")
    a = ap.parse_args()
    if a.demo:
        return run_demo(a)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sampler = TreeSampler()
    sampler.mark("imports (torch, transformers, Prefect, vLLM)")
    import torch  # noqa: F401

    from flows.config import build_config
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime
    from tasks import steps as T
    from tasks.runs import resolve_run

    from runtime.backends.vllm_backend import vllm_available

    if vllm_available():
        import vllm  # noqa: F401
    from runtime.console import quiet_console, restore_console

    out_dir = tempfile.mkdtemp(prefix="bench-memory-")  # the run's files and the engines' chatter; removed at the end
    cfg = resolve_run(build_config(a.env, a.preset, [f"output_dir={out_dir}"] + a.sets))
    model_dir = resolve_model(cfg.model.path)
    chatter = quiet_console(Path(out_dir))  # library logging to a file, as the product's console does
    rows = []

    def record(stage: str) -> None:
        own, tree = sampler.now()
        peak_own, peak_tree = sampler.peaks.get(stage, (own, tree))
        prev = rows[-1]["tree_rss_gib"] if rows else 0.0
        rows.append({"stage": stage, "rss_gib": round(own / GiB, 3), "tree_rss_gib": round(tree / GiB, 3),
                     "peak_rss_gib": round(peak_own / GiB, 3), "peak_tree_rss_gib": round(peak_tree / GiB, 3),
                     "added_gib": round(tree / GiB - prev, 3)})
        r = rows[-1]
        print(f"{stage:<58} tree {r['tree_rss_gib']:6.2f} GiB (peak {r['peak_tree_rss_gib']:6.2f}; "
              f"added {r['added_gib']:+6.2f}); this process {r['rss_gib']:6.2f} (peak {r['peak_rss_gib']:6.2f})",
              flush=True)

    record("imports (torch, transformers, Prefect, vLLM)")
    with Runtime():
        sampler.mark("learner (policy + reference) and generation engine")
        key = T.open_session(cfg, model_dir, train=True)
        record("learner (policy + reference) and generation engine")
        s = T.get_session(key)
        expect = sizes(cfg, s.learner, model_dir)
        sampler.mark("env servers")
        urls = T.spawn_env_servers.fn(key)
        record("env servers")
        limit = cfg.curriculum.as_phases()[0].turn_limit
        for step in range(a.steps):
            sampler.mark(f"step {step + 1}: rollout")
            batch = T.rollout_batch.fn(key, urls, step, limit)
            record(f"step {step + 1}: rollout")
            sampler.mark(f"step {step + 1}: prepare + advantages")
            adv = T.compute_advantages.fn(key, batch)
            record(f"step {step + 1}: prepare + advantages")
            sampler.mark(f"step {step + 1}: update (+ weight sync)")
            T.policy_update.fn(key, batch, adv)
            del batch, adv
            record(f"step {step + 1}: update (+ weight sync)")
        from envs.base import task_index

        sampler.mark(f"evaluation ({cfg.eval.n} held-out tasks, greedy)")
        T.evaluate_ids.fn(key, urls, [task_index("test", i) for i in range(cfg.eval.n)], cfg.eval_turn_limit,
                          cfg.rollout.max_new_tokens)
        record(f"evaluation ({cfg.eval.n} held-out tasks, greedy)")
        T.close_session(key)
    sampler.close()
    restore_console()
    if chatter is not None and a.log and chatter.exists():
        shutil.copyfile(chatter, a.log)
    shutil.rmtree(out_dir, ignore_errors=True)
    whole = max(r["peak_tree_rss_gib"] for r in rows)
    flags = sorted(set(f for f in open("/proc/cpuinfo").read().split() if f in ("avx512_bf16", "amx_bf16")))
    print(f"\nwhole process tree's peak: {whole:.2f} GiB ({a.env} {a.preset}, backend {cfg.rollout.backend}, "
          f"cpu flags {' '.join(flags) or 'none'})")
    print("sizes from the model and config (GiB): " + ", ".join(f"{k} {v}" for k, v in expect.items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"env": a.env, "preset": a.preset, "sets": a.sets, "cpu_flags": flags,
                                           "backend": cfg.rollout.backend, "stages": rows, "peak_tree_rss_gib": whole,
                                           "expected_gib": expect}, indent=2))


if __name__ == "__main__":
    main()
