"""Trajectory viewer: time to the first page of a step with 1,000 episodes (the issue asks for < 1 s).

A synthetic run is written with the real writer (``tasks.steps.write_rollout_parquet``): 1,000 BabyAI-sized
episodes (a ~350-token prompt, 1-8 turns of ~30 policy tokens and ~90 env tokens, their text, advantages). The
viewer is served by uvicorn on a free loopback port in this process and fetched over HTTP:

- cold: the first request of a fresh server (imports done, nothing cached: the Parquet columns are read);
- warm: the same page again, a filtered + sorted page, the last page, one episode, the run page.

    .venv/bin/python bench/bench_viewer.py [--episodes 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_run(root: Path, n: int, seed: int = 0) -> Path:
    import numpy as np

    from core.trajectory import Trajectory
    from tasks.steps import write_rollout_parquet

    rng, nrng = random.Random(seed), np.random.default_rng(seed)

    def ids(k: int) -> list[int]:
        return nrng.integers(0, 49152, k).tolist()
    trajs, advantages = [], []
    for i in range(n):
        t = Trajectory(task_id=1000 + i // 8, group_id=i // 8)
        t.start(ids(350))
        replies, obs = [], []
        turns = rng.randint(1, 8)
        for k in range(turns):
            t.add_action(ids(30), (-nrng.random(30)).tolist())
            t.set_turn_reward(1.0 if k == turns - 1 and rng.random() < 0.3 else 0.0)
            replies.append(f"I see the red ball ahead. Action: go to red ball {k}")
            obs.append("You moved. Ahead: a wall. Visible: a red ball 2 steps left. " * 3)
            if k < turns - 1:
                t.add_env(ids(90))
        reason = rng.choice(["success", "failure", "turn_limit", "token_budget"])
        t.finish(reason, success=reason == "success")
        t.first_observation, t.replies, t.observations = "Your goal: go to the red ball. " * 10, replies, obs
        t.actions, t.invalid_actions = [f"go to red ball {k}" for k in range(turns)], [False] * turns
        t.category, t.turn_limit = rng.choice(["GoToObj", "GoToLocal"]), 8
        advantages.append((nrng.normal(size=len(t.loss_mask)) * np.array(t.loss_mask)).tolist())
        trajs.append(t)
    run = root / "bench"
    write_rollout_parquet(trajs, run / "rollouts" / "step-000001.parquet", phase=1, step=0, advantages=advantages)
    (run / "config.json").write_text(json.dumps({"run_name": "bench", "env": {"name": "babyai"},
                                                 "model": {"path": "smollm2-135m"}, "algo": {"estimator": "grpo"},
                                                 "curriculum": {"phases": [{"turn_limit": 8, "steps": 1}]}}))
    (run / "metrics.jsonl").write_text(json.dumps({"global_step": 1, "phase": 1, "turn_limit": 8.0, "episodes": n,
                                                   "success_rate": 0.3, "mean_reward": 0.3, "mean_turns": 4.5}) + "\n")
    return run / "rollouts" / "step-000001.parquet"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import httpx
    import uvicorn

    from flows.viewer.app import create_app

    root = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    try:
        t0 = time.perf_counter()
        f = synthetic_run(root, args.episodes)
        print(f"synthetic step: {args.episodes} episodes, {f.stat().st_size / 1e6:.1f} MB, written in "
              f"{time.perf_counter() - t0:.2f} s")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(root), host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as c:
            def get(path: str) -> float:
                t = time.perf_counter()
                r = c.get(path)
                dt = time.perf_counter() - t
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
                return dt

            cold = get("/runs/bench/steps/1")
            print(f"first page of the step, cold (fresh server): {cold * 1000:.0f} ms")
            pages = {"first page, warm": "/runs/bench/steps/1",
                     "failed only, sorted by reward desc": "/runs/bench/steps/1?failed=1&sort=reward&desc=1",
                     "last page": f"/runs/bench/steps/1?page={(args.episodes + 49) // 50}",
                     "one episode": f"/runs/bench/steps/1/episodes/{args.episodes - 1}",
                     "run page": "/runs/bench"}
            for label, path in pages.items():
                ts = sorted(get(path) for _ in range(args.repeat))
                print(f"{label}: median {ts[len(ts) // 2] * 1000:.0f} ms (min {ts[0] * 1000:.0f})")
        server.should_exit = True
        th.join(timeout=5)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
