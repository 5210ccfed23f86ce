"""Env servers as containers vs local processes: spawn time, rollout throughput, image sizes (issue 51).

    python bench/bench_containers.py [--envs babyai,toy] [--spawns 5] [--seconds 8] [--concurrency 16]
                                     [--episodes 64] [--turns 8] [--rounds 3] [--builds build.json ...] [--out FILE]

- **spawn**: ``spawn_env_server(env, runtime=...)`` until ``/health`` answers from that server, then ``stop()``
  (for a container: stop + remove), ``--spawns`` times per runtime, interleaved (process, docker, process, ...);
- **http**: the env path alone: ``--concurrency`` episodes in flight through the async client (reset, then up to 4
  contract actions, again) for ``--seconds``, per runtime and round, interleaved; env steps per second, and the
  server side's CPU milliseconds per step (the server's processes, and for a container Docker's port proxy too):
  CPU time does not depend on what else the machine runs, wall time does;
- **rollout**: the rollout loop (``runtime.rollout.run_rollout``) over HTTP against one server, ``--episodes``
  episodes at once for up to ``--turns`` turns, replies from a scripted policy (the env's contract action, no
  model: generation would hide the env path's cost), ``--rounds`` times per runtime, interleaved; env steps per
  second of the rollout's wall time and of its env time;
- **images**: the size of each built image (``scalinginter/env-*:latest``, the base) and, from the builder's
  ``--json`` files given with ``--builds``, how long each took.

Both runtimes run the same server code with the same options on the same machine; the container is published
on 127.0.0.1 through Docker's port forwarding with the default limits (``envs.containers.LIMITS``). Numbers from a
machine that is busy with other work are comparable only within one invocation (the interleaving is for that).
Writes bench/results/containers/containers-<date>.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs import containers  # noqa: E402
from envs.spawn import spawn_env_server  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "containers"
RUNTIMES = ("process", "docker")


def machine() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for key in ("model name", "cpu family", "model"):
            info[key.replace(" ", "_")] = next(l.split(":", 1)[1].strip() for l in text.splitlines()
                                               if l.split(":")[0].strip() == key)
        info["load_avg_1m_at_start"] = os.getloadavg()[0]
    except (OSError, StopIteration):
        pass
    info["docker_server"] = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                                           capture_output=True, text=True).stdout.strip()
    return info


def bench_spawn(env: str, n: int) -> dict:
    times: dict[str, dict[str, list[float]]] = {rt: {"spawn_s": [], "stop_s": []} for rt in RUNTIMES}
    for _ in range(n):
        for rt in RUNTIMES:
            t0 = time.perf_counter()
            srv = spawn_env_server(env, runtime=rt)
            t1 = time.perf_counter()
            assert srv.kind == rt, (srv, rt)
            srv.stop()
            times[rt]["spawn_s"].append(t1 - t0)
            times[rt]["stop_s"].append(time.perf_counter() - t1)
    return {rt: {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                 for k, v in d.items()} for rt, d in times.items()}


def contract_of(env: str):
    return importlib.import_module(f"envs.{env}.contract" if (ROOT / "envs" / env).is_dir() else f"envs.{env}_contract")


def server_state(srv) -> dict:
    """What a server that failed a round left: its exit code, a container's state (OOM kill), its log tail."""
    state: dict = {"kind": srv.kind, "exit_code": srv.exit_code()}
    c = getattr(srv, "container", None)
    if c is not None:
        try:
            c.reload()
            st = c.attrs.get("State", {})
            state.update({k: st.get(k) for k in ("Status", "OOMKilled", "ExitCode", "Error")})
        except Exception as e:  # noqa: BLE001
            state["container"] = f"gone: {e}"
    state["log_tail"] = srv.log_tail(15)[-1500:]
    return state


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo += children.get(q, [])
    return out


def server_cpu_s(srv) -> float:
    """CPU seconds (user + system) used so far by the server's processes: the server and its children; for a
    container, the processes in it (seen from the host) and Docker's port proxy for its host port. CPU time, unlike
    wall time, does not depend on what else the machine runs."""
    if srv.kind == "docker":
        srv.container.reload()
        pids = _tree(int(srv.container.attrs["State"]["Pid"]))
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if cmd and cmd[0].endswith(b"docker-proxy") and str(srv.port).encode() in cmd:
                    pids.append(int(d))
    else:
        pids = _tree(srv.pid)
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for q in pids:
        try:
            f = Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def bench_http(env: str, seconds: float, concurrency: int, rounds: int) -> dict:
    from envs.base import task_index
    from envs.client import AsyncEnvClient

    contract = contract_of(env)
    out: dict[str, list[float]] = {rt: [] for rt in RUNTIMES}
    errors: dict[str, list[dict]] = {rt: [] for rt in RUNTIMES}
    cpu: dict[str, list[float]] = {rt: [] for rt in RUNTIMES}
    for r in range(rounds):
        for rt in RUNTIMES:
            srv = spawn_env_server(env, runtime=rt)
            try:
                async def go():
                    ac = AsyncEnvClient(srv.url, timeout_s=120)
                    ids = [await ac.create() for _ in range(concurrency)]
                    await asyncio.gather(*[ac.reset(e, task_index("train", k)) for k, e in enumerate(ids)])  # warm
                    steps = [0]

                    async def worker(k, env_id, deadline):
                        i = k
                        while time.perf_counter() < deadline:
                            obs = (await ac.reset(env_id, task_index("train", i % 1000))).observation
                            for _ in range(4):
                                s = await ac.step(env_id, contract.valid_action(obs, {}))
                                steps[0] += 1
                                if s.done:
                                    break
                                obs = s.observation
                            i += concurrency

                    t0, c0 = time.perf_counter(), server_cpu_s(srv)
                    await asyncio.gather(*[worker(k, e, t0 + seconds) for k, e in enumerate(ids)])
                    dt, dc = time.perf_counter() - t0, server_cpu_s(srv) - c0
                    await ac.aclose()
                    return steps[0] / dt, 1000 * dc / max(1, steps[0])

                rate, cpu_ms = asyncio.run(go())
                out[rt].append(round(rate, 1))
                cpu[rt].append(round(cpu_ms, 3))
            except Exception as e:  # noqa: BLE001 - recorded with what the server left, the bench goes on
                errors[rt].append({"round": r + 1, "error": f"{type(e).__name__}: {str(e)[:300]}",
                                   "server": server_state(srv)})
                print(f"  {env} {rt:7s} http round {r + 1}: FAILED {errors[rt][-1]}", flush=True)
                continue
            finally:
                srv.stop()
            print(f"  {env} {rt:7s} http round {r + 1}: {out[rt][-1]:.0f} env steps/s, server CPU "
                  f"{cpu[rt][-1]:.2f} ms per step", flush=True)
    summary = {rt: {"steps_per_s": v, "median": statistics.median(v) if v else None,
                    "server_cpu_ms_per_step": cpu[rt],
                    "median_cpu_ms_per_step": statistics.median(cpu[rt]) if cpu[rt] else None,
                    "failed_rounds": errors[rt]} for rt, v in out.items()}
    p, d = summary["process"]["median"], summary["docker"]["median"]
    summary["docker_vs_process"] = round(d / p, 3) if p and d else None
    p, d = summary["process"]["median_cpu_ms_per_step"], summary["docker"]["median_cpu_ms_per_step"]
    summary["cpu_per_step_docker_vs_process"] = round(d / p, 3) if p and d else None
    return summary


class ContractPolicy:
    """A generation backend that answers every prompt with the env contract's valid action (no model)."""

    def __init__(self, tok, action: str):
        self.ids = tok(action, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.eos_token_id = tok.eos_token_id

    def sync_weights(self):
        pass

    def generate(self, prompts, params):
        from runtime.backends.generation import Generation

        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


def bench_rollout(env: str, episodes: int, turns: int, rounds: int) -> dict:
    from transformers import AutoTokenizer

    from core.chat import ChatFormat
    from envs.client import AsyncEnvClient
    from envs.sessions import HttpEpisode
    from runtime.backends.generation import SamplingParams
    from runtime.backends.model import resolve_model
    from runtime.rollout import EpisodeSpec, run_rollout

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    chat = ChatFormat.from_tokenizer(tok)
    contract = contract_of(env)
    policy = ContractPolicy(tok, contract.valid_action("", {}))
    out: dict[str, list[dict]] = {rt: [] for rt in RUNTIMES}
    for r in range(rounds):
        for rt in RUNTIMES:
            srv = spawn_env_server(env, runtime=rt)
            try:
                async def go():
                    client = AsyncEnvClient(srv.url, timeout_s=120)
                    try:
                        specs = [EpisodeSpec(task_id=(100 * r + i) % 1000, group_id=i) for i in range(episodes)]
                        return await run_rollout(specs, lambda i: HttpEpisode(client), policy, chat,
                                                 SamplingParams(32, 1.0), turns, 100_000)
                    finally:
                        await client.aclose()

                t0 = time.perf_counter()
                trajs, stats = asyncio.run(go())
                wall = time.perf_counter() - t0
            finally:
                srv.stop()
            masked = sum(t.masked for t in trajs)
            out[rt].append({"env_steps": stats.env_steps, "wall_s": round(wall, 3),
                            "env_time_s": round(stats.env_time_s, 3), "masked": masked,
                            "steps_per_wall_s": round(stats.env_steps / wall, 1)})
            print(f"  {env} {rt:7s} round {r + 1}: {stats.env_steps} env steps in {wall:.2f} s "
                  f"({stats.env_steps / wall:.0f}/s), masked {masked}", flush=True)
    summary = {}
    for rt, runs in out.items():
        summary[rt] = {"rounds": runs, "median_steps_per_wall_s": statistics.median(x["steps_per_wall_s"] for x in runs)}
    p, d = summary["process"]["median_steps_per_wall_s"], summary["docker"]["median_steps_per_wall_s"]
    summary["docker_vs_process"] = round(d / p, 3) if p else None
    return summary


def image_sizes(builds: list[str]) -> dict:
    """Size of each env image (the tag runs use: ``$SCALINGINTER_IMAGE_TAG``, default latest) and of the base it
    was built on; the builder's record of each build from ``builds`` (infra/docker/build.sh --json files)."""
    out: dict[str, dict] = {}
    for name in ("env-light", "env-sciworld", "env-web"):
        ref = f"scalinginter/{name}:{containers.IMAGE_TAG}"
        r = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}} {{.Id}}", ref], capture_output=True,
                           text=True)
        if r.returncode == 0:
            size, iid = r.stdout.split()
            out[name] = {"ref": ref, "size_mb": round(int(size) / 1e6), "id": iid[:19], "builds": []}
    for path in builds:
        for b in json.loads(Path(path).read_text()):
            base = b.get("base")
            if base and "base_size_mb" not in out.get(b["image"], {"base_size_mb": 0}):
                size = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", base],
                                      capture_output=True, text=True).stdout.strip()
                out[b["image"]]["base"] = base
                out[b["image"]]["base_size_mb"] = round(int(size or 0) / 1e6)
            out.setdefault(b["image"], {"builds": []})["builds"].append(
                {k: b.get(k) for k in ("ref", "skipped", "wheels", "wheelhouse_s", "total_s")} | {"file": Path(path).name})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", default="babyai,toy")
    p.add_argument("--spawns", type=int, default=5)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--builds", nargs="*", default=[], help="infra/docker/build.sh --json files")
    p.add_argument("--out")
    a = p.parse_args()
    client = containers.docker_client(10)
    if client is None:
        raise SystemExit("no Docker engine answers: sudo infra/docker/engine.sh")
    result = {"machine": machine(), "args": vars(a), "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "envs": {}}
    for env in a.envs.split(","):
        why = containers.unavailable_reason(containers.image_for(env), client)
        if why:
            raise SystemExit(f"{why}: infra/docker/build.sh")
        print(f"{env}: spawn x {a.spawns} per runtime", flush=True)
        spawn = bench_spawn(env, a.spawns)
        for rt in RUNTIMES:
            print(f"  {env} {rt:7s} spawn median {spawn[rt]['spawn_s']['median']:.2f} s, "
                  f"stop median {spawn[rt]['stop_s']['median']:.2f} s", flush=True)
        print(f"{env}: http, {a.concurrency} episodes in flight for {a.seconds:g} s, {a.rounds} rounds per runtime",
              flush=True)
        http = bench_http(env, a.seconds, a.concurrency, a.rounds)
        print(f"{env}: rollout, {a.episodes} episodes x up to {a.turns} turns, {a.rounds} rounds per runtime",
              flush=True)
        result["envs"][env] = {"spawn": spawn, "http": http, "rollout": bench_rollout(env, a.episodes, a.turns, a.rounds)}
        print(f"  {env}: docker/process env steps/s: http {http['docker_vs_process']}, rollout "
              f"{result['envs'][env]['rollout']['docker_vs_process']}; server CPU per step "
              f"{http['cpu_per_step_docker_vs_process']}", flush=True)
    result["images"] = image_sizes(a.builds)
    for name, d in result["images"].items():
        print(f"{name}: {d.get('size_mb')} MB (base {d.get('base_size_mb')} MB); builds: "
              + ", ".join(f"{b['total_s']} s{' (skipped)' if b['skipped'] else ''}" for b in d.get("builds", [])))
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    out = Path(a.out) if a.out else RESULTS / f"containers-{datetime.date.today():%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
