"""A real SIGKILL at any point of a step, then a resume, ends where an uninterrupted run ends (issue 18).

The toy env (an env server process like every env's) and a tiny Llama that writes its actions
(``tests/toypolicy.py``; GRPO groups get signal, so updates move the weights), transformers backend, phases
1 x turn limit 1, then 2 x turn limit 2 (global steps 1, 2, 3), run in a subprocess that kills itself
(``runtime.killpoint``: ``$SCALINGINTER_KILL_AT``, a real SIGKILL, no cleanup code runs) at a point inside a step;
the same command then resumes it. The env and the model are not the point here (the flows, checkpoints, MLflow
records and kill points are), so the smallest of each keeps every run near process start-up (~30 s) and the
test in CI. Compared with one uninterrupted run of the same config (module fixture):

- the final weights of both phases are bit-exact (tests/test_resume.py: on this backend the resumed step samples
  the same tokens and the update is deterministic), as are the trainer states (global step, phase, phase step,
  turn limit) and the ``latest`` pointer: the same curriculum position;
- every global step is in metrics.jsonl once, with the same values (timings aside); the rollout Parquet files
  are the same files with the same episodes; no temporary files are left;
- MLflow: the same runs, all FINISHED, every metric of every run at the same steps, each once, with the same
  values (timings aside); the same trajectory artifacts; one registered model version per phase final;
- the checkpoint folders hold what the uninterrupted run's hold (no leftover step or half-written checkpoint);
- the killed trainer leaves no env server behind (they watch their parent and stop); other leftovers are killed
  and printed (Prefect's ephemeral API server outlives a SIGKILLed trainer).

Kill points run one after another on their own output dirs. Wall time (printed with ``-s``): see the report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from runtime.killpoint import KILL_ENV
from tests.toypolicy import toy_run_cmd

ROOT = Path(__file__).resolve().parents[1]
NAME = "run"
SETS = ["rollout.samples_per_task=4", "algo.lr=1e-3", "checkpoint.every_n_steps=1", "tracking.log_trajectories=2"]
TIMED = ("time", "idle")  # in a key, or a "_s" ending: it measures wall time, the only values allowed to differ

# kill point -> global steps recorded in metrics.jsonl when the process died (proves where it died)
KILLS = {
    "register:2": [1, 2, 3],  # phase 2's final written, not registered: the resume only registers it
    "checkpoint:2": [1, 2],  # step 2 recorded, its checkpoint half written: step 2 runs (and is recorded) again
    "rollout:3": [1, 2],  # phase 2's second step, mid-rollout: resumes from phase 2's step checkpoint
    "update:2": [1],  # phase 2's first step, optimizer stepped in memory: resumes from phase 1's final
}


def _descendants(pid: int) -> list[psutil.Process]:
    """Processes the trainer ``pid`` started: its session (it leads one) and env servers spawned with its pid."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid == pid:
                continue
            cmd = p.info["cmdline"] or []
            if os.getsid(p.pid) == pid or any(a == "--parent-pid" and b == str(pid) for a, b in zip(cmd, cmd[1:])):
                found.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return found


def _alive(q: psutil.Process) -> bool:
    try:
        return q.is_running() and q.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_cli(out: Path, model: Path, kill_at: str | None = None, sets: list[str] | None = None
            ) -> tuple[int, str, list[str]]:
    """(return code, console output, env servers it left behind after 20 s) of one run (``sets``: SETS by default).
    Whatever it left is killed here; other leftovers are printed: Prefect's ephemeral API server (a uvicorn child of
    the trainer) does not watch its parent, so a SIGKILLed trainer leaves it running (flows/cli.py would have to stop
    it)."""
    cmd = toy_run_cmd(out, model, NAME, SETS if sets is None else sets)
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **os.environ, "PYTHONPATH": str(ROOT)}
    for k in (KILL_ENV, "SCALINGINTER_FAULT_AFTER_STEP", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    if kill_at:
        env[KILL_ENV] = kill_at
    log = out / f"console-{kill_at or 'run'}-{time.time_ns()}.log"
    with open(log, "w") as fh:  # a file, not a pipe: a leftover child holding the pipe cannot hang the test
        p = subprocess.Popen(cmd, cwd=out, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=3600)  # a loaded 2-core machine: ~15 min per run seen
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise

    def env_server(q: psutil.Process) -> bool:
        try:
            return "envs.server" in " ".join(q.cmdline())
        except psutil.Error:
            return False

    # env servers poll their parent every second and must stop by themselves: wait up to 20 s for them (not for
    # the other leftovers, which nothing stops)
    left, deadline = _descendants(p.pid), time.monotonic() + 20
    while any(env_server(q) and _alive(q) for q in left) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [q for q in left if _alive(q)]
    names = []
    for q in left:  # ours: do not leave them to the machine
        try:
            names.append(" ".join(q.cmdline()[:4]))
            q.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    if names:
        print(f"\n{kill_at or 'run'}: left behind (killed now): {names}")
    return rc, log.read_text(), [n for n in names if "envs.server" in n]


# --- what a finished run left behind, in comparable form -----------------------------------------------------
def _is_timed(key: str) -> bool:
    return key.endswith("_s") or any(t in key for t in TIMED)


def metric_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / NAME / "metrics.jsonl").read_text().splitlines()]


def recorded_steps(out: Path) -> list[int]:
    path = out / NAME / "metrics.jsonl"
    return [json.loads(line)["global_step"] for line in path.read_text().splitlines()] if path.exists() else []


def untimed(d: dict) -> dict:
    return {k: v for k, v in d.items() if not _is_timed(k)}


def rollouts(out: Path) -> dict[str, list[tuple]]:
    cols = ("task_id", "group_id", "token_ids", "loss_mask", "logprobs", "turn_rewards", "reward", "turn_limit",
            "finish_reason", "advantages")
    files = sorted((out / NAME / "rollouts").iterdir())
    return {f.name: [tuple(r[c] for c in cols) for r in pq.read_table(f).to_pylist()] for f in files}


def checkpoint_tree(out: Path) -> dict[str, list[str]]:
    """Every entry (hidden ones too) of the run's checkpoint folder and its phase folders."""
    root = out / "checkpoints" / NAME
    tree = {".": sorted(p.name for p in root.iterdir())}
    for ph in sorted(p for p in root.iterdir() if p.is_dir()):
        tree[ph.name] = sorted(p.name for p in ph.iterdir())
    return tree


def trainer_state(out: Path, phase: int) -> dict:
    s = json.loads((out / "checkpoints" / NAME / f"phase-{phase}" / "final" / "trainer_state.json").read_text())
    return {k: s[k] for k in ("global_step", "phase", "phase_step", "turn_limit", "fingerprint")}


def mlflow_record(out: Path) -> dict:
    """Per run (by name): status, every metric's [(step, value)] in logged order (timings: steps only), the
    trajectory artifacts, the final-checkpoint tag; and the registered versions (phase, checkpoint under out)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = {}
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id]):
            hist = {}
            for key in r.data.metrics:
                h = sorted(client.get_metric_history(r.info.run_id, key), key=lambda m: (m.step, m.timestamp))
                hist[key] = [(m.step, None if _is_timed(key) else m.value) for m in h]
            arts = sorted(a.path for a in client.list_artifacts(r.info.run_id, "trajectories"))
            tag = r.data.tags.get("scalinginter.final_checkpoint")
            assert r.info.run_name not in runs, f"two MLflow runs named {r.info.run_name}"
            runs[r.info.run_name] = {"status": r.info.status, "metrics": hist, "artifacts": arts,
                                     "final_tag": tag and os.path.relpath(tag, out)}
    versions = sorted((v.tags.get("phase"), os.path.relpath(v.tags["scalinginter.checkpoint_uri"], out),
                       v.tags.get("global_step"))
                      for v in client.search_model_versions("name='scalinginter-toy'"))
    return {"runs": runs, "versions": versions}


def snapshot(out: Path) -> dict:
    return {"metrics": [untimed(m) for m in metric_lines(out)], "rollouts": rollouts(out),
            "checkpoints": checkpoint_tree(out), "states": [trainer_state(out, k) for k in (1, 2)],
            "latest": json.loads((out / "checkpoints" / NAME / "latest").read_text())["relative"],
            "mlflow": mlflow_record(out), "run_dir": sorted(p.name for p in (out / NAME).iterdir()
                                                            if p.name != "engine.log")}


def weights(out: Path, phase: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / NAME / f"phase-{phase}" / "final" / "model.safetensors")


# --- the test --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory, toy_policy):
    out = tmp_path_factory.mktemp("uninterrupted")
    t0 = time.monotonic()
    rc, log, left = run_cli(out, toy_policy)
    assert rc == 0, log[-3000:]
    assert not left, f"the finished run left env servers behind: {left}"
    print(f"\nuninterrupted run: {time.monotonic() - t0:.0f} s")
    snap = snapshot(out)
    assert [m["global_step"] for m in snap["metrics"]] == [1, 2, 3]
    assert [(s["global_step"], s["phase_step"], s["turn_limit"]) for s in snap["states"]] == [(1, 1, 1), (3, 2, 2)]
    assert len(snap["mlflow"]["versions"]) == 2
    assert sum(m["episodes_with_signal"] for m in snap["metrics"]) > 0, "no reward signal: the test proves nothing"
    return out, snap


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", list(KILLS))
def test_sigkill_inside_a_step_then_resume_equals_an_uninterrupted_run(tmp_path, reference, kill_at, toy_policy):
    ref_out, ref = reference
    t0 = time.monotonic()
    rc, log, left = run_cli(tmp_path, toy_policy, kill_at)
    t_killed = time.monotonic() - t0
    assert rc == -signal.SIGKILL, f"expected a SIGKILL at {kill_at}, got exit {rc}:\n{log[-3000:]}"
    assert f"{KILL_ENV}: SIGKILL at {kill_at}" in log
    assert not left, f"the killed trainer left env servers behind: {left}"
    assert recorded_steps(tmp_path) == KILLS[kill_at], "killed somewhere else than intended"
    ck = tmp_path / "checkpoints" / NAME
    if kill_at.startswith("checkpoint"):  # died with the files written and no manifest: nothing loadable
        assert not (ck / "phase-2" / "step-000001" / "manifest.json").exists()
    if kill_at.startswith("register"):
        assert (ck / "phase-2" / "final" / "manifest.json").exists()
        assert len(mlflow_record(tmp_path)["versions"]) == 1  # phase 1's only

    t1 = time.monotonic()
    rc, log, left = run_cli(tmp_path, toy_policy)  # the same command: resume
    t_resumed = time.monotonic() - t1
    assert rc == 0, log[-4000:]
    assert not left, f"the resumed run left env servers behind: {left}"
    print(f"\n{kill_at}: killed after {t_killed:.0f} s, resumed in {t_resumed:.0f} s")

    got, bad = snapshot(tmp_path), []  # every difference is listed, not only the first

    def check(ok: bool, what: str) -> None:
        if not ok:
            bad.append(what)

    for phase in (1, 2):  # bit-exact final weights
        wa, wb = weights(tmp_path, phase), weights(ref_out, phase)
        check(wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"phase {phase} final weights")
    check(got["states"] == ref["states"], f"trainer states {got['states']} vs {ref['states']}")  # curriculum position
    check(got["latest"] == ref["latest"], f"latest {got['latest']} vs {ref['latest']}")
    check([m["global_step"] for m in got["metrics"]] == [1, 2, 3], f"metrics.jsonl steps {recorded_steps(tmp_path)}")
    for a, b in zip(got["metrics"], ref["metrics"]):
        check(a == b, f"metrics.jsonl step {b['global_step']}: "
                      f"{ {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)} }")
    check(got["rollouts"].keys() == ref["rollouts"].keys(), f"rollout files {list(got['rollouts'])}")
    for name in ref["rollouts"]:
        check(got["rollouts"].get(name) == ref["rollouts"][name], f"rollout {name} episodes")
    check(got["run_dir"] == ref["run_dir"], f"run dir {got['run_dir']} vs {ref['run_dir']}")
    check(got["checkpoints"] == ref["checkpoints"], f"checkpoint folders {got['checkpoints']} vs {ref['checkpoints']}")
    check(got["mlflow"]["versions"] == ref["mlflow"]["versions"],
          f"registered versions {got['mlflow']['versions']} vs {ref['mlflow']['versions']}")
    check(got["mlflow"]["runs"].keys() == ref["mlflow"]["runs"].keys(), f"MLflow runs {list(got['mlflow']['runs'])}")
    for run, want in ref["mlflow"]["runs"].items():
        have = got["mlflow"]["runs"].get(run, {"status": None, "metrics": {}, "artifacts": [], "final_tag": None})
        check(have["status"] == want["status"] == "FINISHED", f"{run} status {have['status']}")
        check(have["metrics"].keys() == want["metrics"].keys(), f"{run} metric keys")
        for key in want["metrics"]:  # each step once, same value
            check(have["metrics"].get(key) == want["metrics"][key],
                  f"{run} {key}: {have['metrics'].get(key)} vs {want['metrics'][key]}")
        check(have["artifacts"] == want["artifacts"], f"{run} artifacts {have['artifacts']}")
        check(have["final_tag"] == want["final_tag"], f"{run} final tag {have['final_tag']}")
    assert not bad, "\n".join(bad)
    w0 = load_file(toy_policy / "model.safetensors")
    wa = weights(tmp_path, 2)
    assert any(not torch.equal(wa[k].float(), w0[k].float()) for k in wa if k in w0)  # training moved the weights: equality is not vacuous


# --- the hook's own parsing -------------------------------------------------------------------------------------
def test_kill_at_parses_points_and_counts_and_refuses_the_rest():
    from runtime.killpoint import parse_kill_at

    assert parse_kill_at("") is None and parse_kill_at("  ") is None
    assert parse_kill_at("update") == ("update", 1)
    assert parse_kill_at(" checkpoint:3 ") == ("checkpoint", 3)
    for bad, says in (("updat:1", "unknown point"), ("rollout:0", "positive"), ("rollout:x", "positive"),
                      ("rollout:", "positive")):
        with pytest.raises(ValueError, match=says):
            parse_kill_at(bad)


def test_kill_point_kills_for_real_at_the_named_arrival_only(tmp_path):
    code = ("import atexit, sys; from runtime.killpoint import kill_point\n"
            "atexit.register(lambda: open(sys.argv[1], 'w').write('cleanup ran'))\n"
            "kill_point('update'); print('first', flush=True); kill_point('update'); print('second', flush=True)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), KILL_ENV: "update:2"}
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "atexit")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stdout == "first\n" and f"{KILL_ENV}: SIGKILL at update:2" in p.stderr
    assert not (tmp_path / "atexit").exists()  # a real SIGKILL: no cleanup code ran


def test_kill_point_is_a_no_op_unless_named(monkeypatch):
    from runtime import killpoint

    monkeypatch.delenv(KILL_ENV, raising=False)
    killpoint.kill_point("update")  # unset: nothing happens
    monkeypatch.setenv(KILL_ENV, "update:1000")
    killpoint.kill_point("update")  # another arrival: nothing happens
    killpoint.kill_point("rollout")
    monkeypatch.setenv(KILL_ENV, "nowhere")
    with pytest.raises(ValueError, match="unknown point"):
        killpoint.kill_point("update")


def test_a_save_killed_mid_write_leaves_a_temp_folder_that_the_next_save_removes(tmp_path):
    from storage.checkpoint_store import checkpoint_exists, save_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    phase = tmp_path / "ck" / "phase-1"
    code = "import sys; from storage.checkpoint_store import save_checkpoint; save_checkpoint(sys.argv[1], sys.argv[2])"
    env = {**os.environ, "PYTHONPATH": str(ROOT), KILL_ENV: "checkpoint"}
    p = subprocess.run([sys.executable, "-c", code, str(src), str(phase / "step-000001")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    left = [q.name for q in phase.iterdir()]
    assert len(left) == 1 and left[0].startswith(".step-000001.tmp-"), left  # the dead save's
    assert not checkpoint_exists(str(phase / "step-000001"))
    live = phase / f".step-000009.tmp-{os.getpid()}-0123abcd"  # a live writer's temp folder is not touched
    live.mkdir()
    save_checkpoint(src, str(phase / "step-000002"))
    assert sorted(q.name for q in phase.iterdir()) == [live.name, "step-000002"]


def test_temp_owner_reads_the_pid_of_a_temp_sibling_name():
    from storage.checkpoint_store import _temp_owner

    assert _temp_owner(".step-000001.tmp-4242-0123abcd") == 4242
    assert _temp_owner(".final.old-7-deadbeef") == 7
    assert _temp_owner(".latest.tmp-12-89abcdef") == 12
    for name in ("step-000001", ".step-000001.tmp-x-0123abcd", ".final.new-7-deadbeef", ".final.tmp-7-xyz",
                 ".tmp-7-deadbeef"):
        assert _temp_owner(name) is None, name


def test_a_phase_killed_before_registration_is_finished_by_the_resume(tmp_path, monkeypatch):
    """What the resume does for a phase whose final checkpoint exists but whose run died before registering it
    (the ``register`` kill point), on a real MLflow store: one version registered, and the phase's MLflow run,
    left RUNNING by the dead process, is FINISHED with its final-checkpoint tag, as an uninterrupted run leaves it."""
    from mlflow.tracking import MlflowClient

    import tasks.artifacts
    from flows.config import build_config
    from tasks.resume import PhasePlan
    from flows.scalinginter import finished_phase
    from tasks.runs import make_tracker, recorded_config
    from core.fingerprint import fingerprint

    published = []  # the Prefect markdown artifact (a Prefect API call) is recorded, not sent
    monkeypatch.setattr(tasks.artifacts, "publish_markdown", lambda key, md, desc: published.append(key))
    cfg = build_config("babyai", "tiny", [f"output_dir={tmp_path}", "run_name=r"])
    plan = PhasePlan.of(cfg, 2)
    final = Path(plan.final_uri)
    final.mkdir(parents=True)
    (final / "trainer_state.json").write_text(json.dumps({"global_step": 2, "phase": 2, "phase_step": 1,
                                                          "fingerprint": fingerprint(recorded_config(cfg))}))
    tracker = make_tracker(cfg)
    parent = tracker.start_run("r")
    child = tracker.start_run("r/phase-2", parent_id=parent)  # the dead process's: never ended
    assert finished_phase(cfg, plan, parent) == plan.final_uri
    assert finished_phase(cfg, plan, parent) == plan.final_uri  # a second resume changes nothing
    client = MlflowClient(tracker.uri)
    run = client.get_run(child)
    assert run.info.status == "FINISHED"
    assert run.data.tags["scalinginter.final_checkpoint"] == plan.final_uri
    versions = client.search_model_versions("name='scalinginter-babyai'")
    assert [(v.tags["phase"], v.tags["scalinginter.checkpoint_uri"], v.tags["global_step"]) for v in versions] == [
        ("2", plan.final_uri, "2")]
    assert len(published) == 2
