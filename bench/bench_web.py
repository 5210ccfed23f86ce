"""Benchmark the web envs: steps/s, episode reset time, RSS per browser context, memory over many episodes.

    python bench/bench_web.py [--episodes 200] [--contexts 1,4,8] [--concurrency 4]

Runs the ``webarena`` env (local shop + forum) in-process with the scripted expert (so every step is a real
page action), then MiniWoB with its reference solutions. RSS is the resident memory of the Chromium processes
this benchmark started (browser + renderers; the Playwright driver is reported separately). Prints a table and
writes bench/results/envs/bench_web.json. Run under the heavy lock:
``flock /tmp/si-heavy.lock python bench/bench_web.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from envs.base import make_env, task_index  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "envs"


def chromium_rss_mb() -> tuple[float, float, int]:
    """(Chromium PSS MB, Playwright driver PSS MB, number of Chromium processes) among our children.

    PSS (proportional set size) splits shared pages between processes, so summing it does not double count."""
    chrome, driver, n = 0, 0, 0
    for p in psutil.Process().children(recursive=True):
        try:
            name, rss = p.name(), p.memory_full_info().pss  # proportional: shared pages counted once
        except psutil.Error:
            continue
        if "chrom" in name:
            chrome += rss
            n += 1
        else:
            driver += rss
    return chrome / 2**20, driver / 2**20, n


def run_expert_episode(env, expert, idx: int) -> tuple[int, float, float, bool]:
    """(steps, reset seconds, step seconds, success)."""
    t = time.perf_counter()
    obs, info = env.reset(idx)
    t_reset = time.perf_counter() - t
    steps, t_steps, r = 0, 0.0, None
    for _ in range(12):
        a = expert(obs, info)
        if a is None:
            break
        t = time.perf_counter()
        r = env.step(a)
        t_steps += time.perf_counter() - t
        steps += 1
        obs, info = r.observation, r.info
        if r.done:
            break
    return steps, t_reset, t_steps, bool(r and r.info.get("success"))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_sequential(name: str, env, expert, n: int, indices) -> dict:
    resets, steps_t, steps, ok = [], 0.0, 0, 0
    mem = []
    for k in range(n):
        s, tr, ts, succ = run_expert_episode(env, expert, indices(k))
        resets.append(tr)
        steps += s
        steps_t += ts
        ok += succ
        if k % max(1, n // 4) == 0 or k == n - 1:
            mem.append((k + 1, round(chromium_rss_mb()[0], 1)))
    return {"env": name, "episodes": n, "success_rate": ok / n, "steps": steps, "steps_per_s": steps / steps_t,
            "reset_ms_mean": 1000 * statistics.mean(resets), "reset_ms_p50": 1000 * pct(resets, 0.5),
            "reset_ms_p95": 1000 * pct(resets, 0.95), "chromium_rss_mb_by_episode": mem}


def bench_concurrent(make, expert, workers: int, per_worker: int, indices) -> dict:
    envs = [make() for _ in range(workers)]
    counts = [0] * workers

    def work(w: int):
        for k in range(per_worker):
            counts[w] += run_expert_episode(envs[w], expert, indices(w * per_worker + k))[0]

    t = time.perf_counter()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    for e in envs:
        e.close()
    return {"workers": workers, "steps": sum(counts), "steps_per_s": sum(counts) / dt}


def bench_context_rss(env_cls_make, counts: list[int]) -> list[dict]:
    """Chromium RSS with k leased contexts, each showing a local site page."""
    out = []
    base = chromium_rss_mb()[0]
    for k in counts:
        envs = [env_cls_make() for _ in range(k)]
        for i, e in enumerate(envs):
            e.reset(task_index("train", i))
        time.sleep(0.5)
        rss, driver, nproc = chromium_rss_mb()
        out.append({"contexts": k, "chromium_rss_mb": round(rss, 1), "driver_rss_mb": round(driver, 1),
                    "chromium_processes": nproc})
        for e in envs:
            e.close()
    if len(out) >= 2:
        a, b = out[0], out[-1]
        slope = (b["chromium_rss_mb"] - a["chromium_rss_mb"]) / (b["contexts"] - a["contexts"])
        for row in out:
            row["rss_per_context_mb"] = round(slope, 1)
    out.insert(0, {"contexts": 0, "chromium_rss_mb_before": round(base, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--contexts", default="1,4,8")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--miniwob-episodes", type=int, default=60)
    a = ap.parse_args()
    from envs.miniwob.contract import SOLVED_TASKS
    from envs.miniwob.contract import expert_action as mw_expert
    from envs.webarena.contract import expert_action as wa_expert

    t0 = time.perf_counter()
    ctx = bench_context_rss(lambda: make_env("webarena", max_contexts=16), [int(x) for x in a.contexts.split(",")])
    wa = make_env("webarena", max_contexts=16)
    n_train = wa.num_tasks("train")
    seq = bench_sequential("webarena (local)", wa, wa_expert, a.episodes, lambda k: task_index("train", k % n_train))
    conc = bench_concurrent(lambda: make_env("webarena", max_contexts=16), wa_expert, a.concurrency, 10,
                            lambda k: task_index("train", k % n_train))
    wa.close()
    mw = make_env("miniwob", tasks=",".join(SOLVED_TASKS), max_contexts=16)
    mw_seq = bench_sequential("miniwob (12 tasks)", mw, mw_expert, a.miniwob_episodes, lambda k: task_index("train", k))
    mw.close()
    res = {"webarena_sequential": seq, "webarena_concurrent": conc, "context_rss": ctx, "miniwob_sequential": mw_seq,
           "wall_s": time.perf_counter() - t0, "pool": wa.pool.stats()}

    print(f"\n{'what':58s} number")
    for r in (seq, mw_seq):
        print(f"{r['env'] + ': expert steps/s (1 episode at a time)':58s} {r['steps_per_s']:.1f}")
        print(f"{r['env'] + ': reset ms mean / p50 / p95':58s} {r['reset_ms_mean']:.0f} / {r['reset_ms_p50']:.0f} / "
              f"{r['reset_ms_p95']:.0f}")
        print(f"{r['env'] + ': expert success':58s} {r['success_rate']:.2f} over {r['episodes']} episodes")
        print(f"{r['env'] + ': Chromium PSS MB after episode n':58s} "
              + ", ".join(f"{n}: {m:.0f}" for n, m in r["chromium_rss_mb_by_episode"]))
    print(f"{'webarena: steps/s with %d concurrent episodes' % conc['workers']:58s} {conc['steps_per_s']:.1f}")
    for row in ctx[1:]:
        print(f"{'Chromium PSS MB with %d context(s) (processes)' % row['contexts']:58s} {row['chromium_rss_mb']:.0f}"
              f" ({row['chromium_processes']}); driver {row['driver_rss_mb']:.0f}")
    if len(ctx) > 2:
        print(f"{'PSS per browser context (MB, slope)':58s} {ctx[-1]['rss_per_context_mb']:.1f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_web.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
