"""Env server throughput and SciWorld server memory.

    python bench/bench_envs.py [--envs babyai,textcraft,sciworld] [--seconds 5] [--concurrency 8]
                               [--rss-episodes 1000] [--no-rss]

Per env: resets/s and steps/s in-process, over HTTP with one client (sequential calls), and over HTTP with
``--concurrency`` episodes in flight (async client). Steps use the env's contract ``valid_action`` (a cheap
well-formed action; episodes that end are reset). Then the RSS of a SciWorld server (the server process plus
its JVMs) with ``--concurrency`` live envs, sampled every 100 episodes up to ``--rss-episodes`` (each episode:
create, reset, 3 steps, close, so JVMs are reused through the pool); after a warm-up it must not grow.
Prints a table and writes bench/results/envs/bench_envs.json. Run it under the heavy lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envs  # noqa: E402,F401
from envs.base import make_env, task_index  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "envs"


def contract(name: str):
    for mod in (f"envs.{name}.contract", f"envs.{name}_contract"):
        try:
            return importlib.import_module(mod)
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"no contract module for {name}")


def bench_options(name: str, concurrency: int) -> dict:
    opts = dict(getattr(contract(name), "OPTIONS", {}))
    opts.pop("expose_gold", None)  # gold paths cost a search per reset: not part of normal serving
    if name == "babyai":
        opts = {}  # the default level mix
    if name == "sciworld":
        opts["max_jvms"] = concurrency  # one JVM per episode in flight
    return opts


def _timed(fn, seconds: float, min_calls: int = 5) -> float:
    n, t0 = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - t0 < seconds:
        fn(n)
        n += 1
    return n / (time.perf_counter() - t0)


def bench_local(name: str, seconds: float) -> dict:
    c = contract(name)
    env = make_env(name, **bench_options(name, 1))
    resets = _timed(lambda i: env.reset(task_index("train", i % 100_000)), seconds)
    state = {"obs": None, "info": None}

    def step(i):
        if state["obs"] is None:
            state["obs"], state["info"] = env.reset(task_index("train", i % 100_000))
        r = env.step(c.valid_action(state["obs"], state["info"]))
        state["obs"], state["info"] = (None, None) if r.done else (r.observation, r.info)

    steps = _timed(step, seconds)
    env.close()
    return {"resets_per_s": resets, "steps_per_s": steps}


def bench_http(name: str, seconds: float, concurrency: int) -> dict:
    from envs.client import AsyncEnvClient, EnvClient
    from envs.spawn import EnvServerProcess

    c = contract(name)
    out = {}
    with EnvServerProcess(name, env_options=bench_options(name, concurrency), startup_timeout_s=120) as srv:
        client = EnvClient(srv.url, timeout_s=120)
        h = client.create()
        out["resets_per_s"] = _timed(lambda i: client.reset(h, task_index("train", i % 100_000)), seconds)
        state = {"obs": None}

        def step(i):
            if state["obs"] is None:
                state["obs"] = client.reset(h, task_index("train", i % 100_000)).observation
            r = client.step(h, c.valid_action(state["obs"], {}))
            state["obs"] = None if r.done else r.observation

        out["steps_per_s"] = _timed(step, seconds)
        client.close(h)
        client.shutdown()

        async def concurrent():
            ac = AsyncEnvClient(srv.url, timeout_s=120)
            ids = [await ac.create() for _ in range(concurrency)]
            # warm up: every env resets once untimed (SciWorld starts a JVM per env and JIT-compiles it)
            await asyncio.gather(*[ac.reset(e, task_index("train", k)) for k, e in enumerate(ids)])
            counts = {"resets": 0, "steps": 0}

            async def worker(k, env_id, deadline):
                i = k
                while time.perf_counter() < deadline:
                    r = await ac.reset(env_id, task_index("train", i % 100_000))
                    counts["resets"] += 1
                    obs = r.observation
                    for _ in range(4):
                        s = await ac.step(env_id, c.valid_action(obs, {}))
                        counts["steps"] += 1
                        if s.done:
                            break
                        obs = s.observation
                    i += concurrency

            t0 = time.perf_counter()
            await asyncio.gather(*[worker(k, e, t0 + seconds) for k, e in enumerate(ids)])
            dt = time.perf_counter() - t0
            for e in ids:
                await ac.close(e)
            await ac.aclose()
            return counts["resets"] / dt, counts["steps"] / dt

        out["concurrent_episode_resets_per_s"], out["concurrent_steps_per_s"] = asyncio.run(concurrent())
    return out


def tree_rss_mb(pid: int) -> tuple[float, int]:
    """(RSS of a process and all its descendants in MB, how many of them are JVMs), from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    total, jvms, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                jvms += b"java" in f.read().split(b"\0")[0]
        except OSError:
            pass
    return total / 1024, jvms


def bench_sciworld_rss(episodes: int, concurrency: int) -> dict:
    from envs.client import AsyncEnvClient
    from envs.spawn import EnvServerProcess

    opts = {"max_jvms": concurrency}
    samples = []
    with EnvServerProcess("sciworld", env_options=opts, startup_timeout_s=120) as srv:

        async def run():
            ac = AsyncEnvClient(srv.url, timeout_s=120)
            done = {"n": 0}
            next_mark = [100]
            t0 = time.perf_counter()

            async def worker(k):
                i = k
                while done["n"] < episodes:
                    env_id = await ac.create()
                    obs = (await ac.reset(env_id, task_index("train", i % 100_000))).observation
                    for a in ("look around", "inventory", "open door"):
                        r = await ac.step(env_id, f"Action: {a}")
                        if r.done:
                            break
                    await ac.close(env_id)
                    done["n"] += 1
                    i += concurrency
                    if done["n"] >= next_mark[0]:
                        next_mark[0] += 100
                        h = await ac.health()
                        rss, jvms = tree_rss_mb(srv.pid)
                        samples.append({"episodes": done["n"], "rss_mb": round(rss, 1), "jvms": jvms,
                                        "live_envs": h["live_envs"], "elapsed_s": round(time.perf_counter() - t0, 1)})
                        print(f"  sciworld: {samples[-1]}", flush=True)
                    del obs

            await asyncio.gather(*[worker(k) for k in range(concurrency)])
            # 8 live envs at the end, as in a rollout in flight
            ids = [await ac.create() for _ in range(concurrency)]
            for k, e in enumerate(ids):
                await ac.reset(e, task_index("train", k % 100_000))
            rss, jvms = tree_rss_mb(srv.pid)
            samples.append({"episodes": done["n"], "rss_mb": round(rss, 1), "jvms": jvms,
                            "live_envs": (await ac.health())["live_envs"], "note": "all envs live and reset"})
            for e in ids:
                await ac.close(e)
            await ac.aclose()

        asyncio.run(run())
    return {"samples": samples, "jvms": concurrency}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--envs", default="babyai,textcraft,sciworld")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rss-episodes", type=int, default=1000)
    p.add_argument("--no-rss", action="store_true")
    a = p.parse_args()
    results: dict = {"envs": {}, "cpu_count": os.cpu_count()}
    for name in [n.strip() for n in a.envs.split(",") if n.strip()]:
        print(f"{name}: in-process ...", flush=True)
        local = bench_local(name, a.seconds)
        print(f"{name}: over HTTP ...", flush=True)
        http = bench_http(name, a.seconds, a.concurrency)
        results["envs"][name] = {"local": local, "http": http}
    if not a.no_rss:
        print("sciworld server RSS ...", flush=True)
        results["sciworld_rss"] = bench_sciworld_rss(a.rss_episodes, a.concurrency)

    print()
    print(f"{'env':<10} {'transport':<22} {'resets/s':>10} {'steps/s':>10}")
    for name, r in results["envs"].items():
        print(f"{name:<10} {'in-process':<22} {r['local']['resets_per_s']:>10.1f} {r['local']['steps_per_s']:>10.1f}")
        print(f"{name:<10} {'HTTP, 1 client':<22} {r['http']['resets_per_s']:>10.1f} {r['http']['steps_per_s']:>10.1f}")
        print(f"{name:<10} {f'HTTP, {a.concurrency} in flight':<22} "
              f"{r['http']['concurrent_episode_resets_per_s']:>10.1f} {r['http']['concurrent_steps_per_s']:>10.1f}")
    if "sciworld_rss" in results:
        print("\nSciWorld server RSS (server + JVMs), max_jvms =", a.concurrency)
        for s in results["sciworld_rss"]["samples"]:
            print(f"  after {s['episodes']:>4} episodes: {s['rss_mb']:>8.1f} MB  ({s['jvms']} JVMs, "
                  f"{s['live_envs']} live envs)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_envs.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
