"""Env servers in real containers on a real Docker engine (issue 51): the env-light image built by
``infra/docker/build.sh`` serves episodes with its limits, labels and token; a container killed mid-rollout is
replaced on its port and its episodes run again; no container outlives the process that started it (a SIGKILLed
owner's are removed by its watchdog, an owner that is gone has its leftovers removed at the next start); and, in the
slow tier, a toy run with ``env.runtime=docker`` through the CLI, finished, failed or killed and resumed, leaves no
container of the run behind.

Every test here skips, saying why and what to run, where no engine answers (``sudo infra/docker/engine.sh``
installs and starts one) or env-light is not built from this checkout (``infra/docker/build.sh env-light``, seconds
after a source change). CI (``.ci/run``) starts the engine and builds env-light before the suites, so these run
there: the quick ones in the default suite, the runs through the CLI in the slow files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from envs import containers
from envs.client import EnvClient
from envs.spawn import REPO_ROOT, spawn_env_server

IMAGE = containers.image_for("toy")


@pytest.fixture(scope="module")
def client():
    c = containers.docker_client(10)
    if c is None:
        pytest.skip("no Docker engine answers here: `sudo infra/docker/engine.sh` installs (Debian packages) and "
                    "starts one; where it cannot (no root, no cgroups) it says why")
    why = containers.unavailable_reason(IMAGE, c)
    if why is not None:
        pytest.skip(f"{why}: build it with `infra/docker/build.sh env-light`")
    stale = containers.stale_reason(IMAGE, c)
    if stale is not None:  # its servers would run other code than the one under test
        pytest.skip(stale)
    return c


def run_containers(client, run: str, all_states: bool = True) -> list:
    return client.containers.list(all=all_states, filters={"label": f"{containers.RUN_LABEL}={run}"})


def test_light_image_serves_with_limits_labels_and_token(client):
    run = f"t-{uuid.uuid4().hex[:8]}"
    srv = spawn_env_server("toy", {"n_doors": 4}, runtime="auto", docker_client=client, run=run, cpus=1,
                           mem_limit="512m")
    try:
        assert srv.kind == "docker" and srv.alive()  # auto: the engine and the image are here
        (c,) = run_containers(client, run)
        attrs = c.attrs
        assert attrs["HostConfig"]["NanoCpus"] == 10**9 and attrs["HostConfig"]["Memory"] == 512 * 2**20
        binding = attrs["HostConfig"]["PortBindings"]["8000/tcp"][0]
        assert binding["HostIp"] == "127.0.0.1" and int(binding["HostPort"]) == srv.port
        assert c.labels[containers.LABEL] == "toy" and c.labels[containers.OWNER_LABEL] == containers.owner_id()
        assert containers.owner_alive(c.labels[containers.OWNER_LABEL]) is True
        # bound to 0.0.0.0 inside, so the server insists on the token; this process's clients send it
        assert httpx.post(srv.url + "/create", json={}).status_code == 401
        env = EnvClient(srv.url)
        env_id = env.create()
        assert "door 4" in env.reset(env_id, 0).observation
        port, first = srv.port, c.id
        c.kill()  # from outside, as a crash or an OOM kill would
        deadline = time.monotonic() + 20
        while srv.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srv.alive()
        srv.restart()
        (c2,) = run_containers(client, run)  # the dead one is removed, a fresh one on the same port
        assert c2.id != first and srv.port == port and srv.alive()
    finally:
        srv.stop()
    assert run_containers(client, run) == []


def test_container_killed_mid_rollout_is_replaced_and_its_episodes_rerun(client):
    """Two env-light containers; one is killed (docker kill) after the first turn: its episodes are masked, it is
    replaced on its port, they run again to a score; the other container's episodes run on untouched."""
    from transformers import AutoTokenizer

    from runtime.backends.model import resolve_model
    from tests.test_rollout import kill_one_server_mid_rollout

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    run = f"t-{uuid.uuid4().hex[:8]}"
    a = spawn_env_server("toy", runtime="docker", docker_client=client, run=run)
    b = spawn_env_server("toy", runtime="docker", docker_client=client, run=run)
    try:
        port, first = b.port, b.container.id
        trajs, stats, killed = kill_one_server_mid_rollout(tok, a, b,
                                                           lambda: client.containers.get(b.container.id).kill())
        assert killed and b.alive() and b.port == port and b.container.id != first  # a new container, same port
        assert stats.servers_replaced == 1 and stats.retried_episodes == 3 and stats.recovered_episodes == 3
        assert not any(t.masked for t in trajs)  # retried, never scored 0
        assert [t.attempt for t in trajs] == [1, 2, 1, 2, 1, 2]
        assert all(t.turns >= 2 and t.attempt == 1 for t in trajs[0::2])  # a's episodes ran on, unaffected
        assert len(run_containers(client, run)) == 2  # the killed one was removed, not left exited
    finally:
        a.stop()
        b.stop()
    assert run_containers(client, run) == []


OWNER_SCRIPT = """
import sys, time
from envs.spawn import spawn_env_server
srv = spawn_env_server("toy", runtime="docker", run=sys.argv[1])
print(srv.url, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_leaves_no_container(client, tmp_path):
    """The process that started a container is SIGKILLed (no atexit): its watchdog removes the container."""
    run = f"t-{uuid.uuid4().hex[:8]}"
    p = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, run], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and len(run_containers(client, run, all_states=False)) == 1
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    deadline = time.monotonic() + 30
    while run_containers(client, run) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = run_containers(client, run)
    for c in left:  # do not leave them to the machine if the check fails
        c.remove(force=True)
    assert left == [], "the watchdog did not remove the killed owner's container"


def test_leftovers_of_an_owner_that_is_gone_are_removed(client):
    """A container labelled with an owner that no longer runs (its watchdog gone too, or a reboot) is removed by
    the sweep that precedes this host's next container; a live owner's container is kept."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = containers.socket.gethostname()
    gone_owner = f"{host}:{int(dead.stdout)}:1:{containers._boot_id()}"  # start time 1: not a live process
    run = f"t-{uuid.uuid4().hex[:8]}"
    base = {containers.LABEL: "toy", containers.RUN_LABEL: run, containers.HOST_LABEL: host}
    orphan = client.containers.create(IMAGE, ["sleep", "60"], labels={**base, containers.OWNER_LABEL: gone_owner})
    mine = client.containers.create(IMAGE, ["sleep", "60"], labels={**base, containers.OWNER_LABEL: containers.owner_id()})
    try:
        assert containers.owner_alive(gone_owner) is False
        assert orphan.name in containers.remove_orphans(client)
        assert [c.id for c in run_containers(client, run)] == [mine.id]
    finally:
        for c in run_containers(client, run):
            c.remove(force=True)


# --- the slow tier: the build's skip, and runs through the CLI ---------------------------------------------------
@pytest.mark.slow
def test_an_unchanged_image_is_not_built_again(client, tmp_path):
    """The builder tags by a hash of what goes into the image: right after a build, the same build is skipped."""
    import json

    cmd = [sys.executable, str(REPO_ROOT / "infra/docker/images.py"), "env-light", "--tag", containers.IMAGE_TAG,
           "--json", str(tmp_path / "b.json")]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)  # builds only if this checkout changed since the last build
    first = json.loads((tmp_path / "b.json").read_text())[0]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    again = json.loads((tmp_path / "b.json").read_text())[0]
    assert again["skipped"] and again["ref"] == first["ref"] and time.monotonic() - t0 < 120
    assert client.images.get(IMAGE).id == client.images.get(first["ref"]).id  # :latest is that build
    assert client.images.get(IMAGE).labels[containers.SOURCES_LABEL] == containers.source_hash()


class RunWatcher(threading.Thread):
    """Polls the engine for the run's containers while a run runs: how many were seen at once, at most."""

    def __init__(self, client, run):
        super().__init__(daemon=True)
        self.client, self.label, self.most, self.stop = client, run, 0, threading.Event()

    def run(self):  # noqa: D401 - threading.Thread's hook
        while not self.stop.is_set():
            try:
                self.most = max(self.most, len(run_containers(self.client, self.label, all_states=False)))
            except Exception:  # noqa: BLE001 - the engine busy: next poll
                pass
            self.stop.wait(0.5)


def cli_run(out: Path, model: Path, name: str, extra_env: dict[str, str], client) -> tuple[int, str, int]:
    from tests.toypolicy import toy_run_cmd

    cmd = toy_run_cmd(out, model, name, ["env.runtime=docker", "rollout.samples_per_task=2"])
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for k in ("SCALINGINTER_KILL_AT", "SCALINGINTER_FAULT_AFTER_STEP", "MLFLOW_TRACKING_URI", "SCALINGINTER_RUN"):
        env.pop(k, None)
    env.update(extra_env)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"console-{time.time_ns()}.log"
    w = RunWatcher(client, name)
    w.start()
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=out, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=3600)
        finally:
            if p.poll() is None:
                p.kill()
            w.stop.set()
            w.join()
            kill_session(p.pid)
    return rc, log.read_text(), w.most


def kill_session(sid: int) -> None:
    """What a SIGKILLed trainer leaves in its session (Prefect's ephemeral API server does not watch its parent;
    tests/test_kill_resume.py). The containers' watchdog runs in its own session and is not touched."""
    import psutil

    for q in psutil.process_iter():
        try:
            if q.pid != sid and os.getsid(q.pid) == sid:
                q.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def no_container_of(client, run: str, wait_s: float = 30) -> bool:
    deadline = time.monotonic() + wait_s  # a SIGKILLed trainer's watchdog polls once a second
    while run_containers(client, run) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = run_containers(client, run)
    for c in left:
        c.remove(force=True)
    return not left


@pytest.mark.slow
def test_toy_run_in_containers_finished_failed_killed_and_resumed(client, tmp_path, toy_policy):
    """``scalinginter run toy --set env.runtime=docker`` (phases 1 x 1 turn, 2 x 2 turns): the env servers are
    containers labelled with the run's name; a run that fails after step 1, and one SIGKILLed mid-rollout at step 3
    then resumed to the end, leave no container of the run behind."""
    name = f"ctr-{uuid.uuid4().hex[:6]}"
    rc, log, most = cli_run(tmp_path / "failed", toy_policy, name, {"SCALINGINTER_FAULT_AFTER_STEP": "1"}, client)
    assert rc != 0 and "fault injection" in log, log[-3000:]
    assert "(docker)" in log and most >= 1, log[-3000:]  # its env servers were containers labelled with the run
    assert no_container_of(client, name), "a failed run left containers"

    out = tmp_path / "killed"
    rc, log, most = cli_run(out, toy_policy, name, {"SCALINGINTER_KILL_AT": "rollout:3"}, client)
    assert rc == -signal.SIGKILL, log[-3000:]
    assert most >= 1 and no_container_of(client, name), "a SIGKILLed run left containers"
    rc, log, most = cli_run(out, toy_policy, name, {}, client)
    assert rc == 0, log[-3000:]
    assert "resuming" in log and "(docker)" in log and most >= 1
    assert (out / "checkpoints" / name / "phase-2" / "final" / "trainer_state.json").exists()
    assert no_container_of(client, name, wait_s=5), "a finished run left containers"
