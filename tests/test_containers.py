"""Env servers in containers (envs.containers) behind the same handle as local processes.

Without a Docker daemon here, the adapter is checked against a stand-in daemon whose ``containers.run`` starts
the command it is given as a real server process on the published host port; the test against a real daemon
runs where one answers and has the image (``infra/docker/build.sh``), and is skipped elsewhere."""

import subprocess
import sys

import httpx
import pytest

from envs import containers
from envs.errors import EnvServerStartError
from envs.client import EnvClient
from envs.spawn import REPO_ROOT, EnvServerProcess, spawn_env_server


class FakeContainer:
    def __init__(self, command, ports, environment, labels):
        (spec,) = ports.items()
        self.container_port, (self.host, self.host_port) = spec
        args = list(command[1:])  # drop the image's "python"
        args[args.index("--host") + 1] = self.host  # "publish": the server binds the host port directly
        args[args.index("--port") + 1] = str(self.host_port)
        self.command, self.environment, self.labels = command, environment, labels
        env = {"PYTHONPATH": str(REPO_ROOT), **environment}
        self.proc = subprocess.Popen([sys.executable, *args], env={**__import__("os").environ, **env},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.short_id = f"fake{self.proc.pid}"
        self.removed = False
        self.status = "running"
        self.attrs = {"State": {"ExitCode": 0}}

    def reload(self):
        if self.removed:
            raise RuntimeError("No such container")
        code = self.proc.poll()
        self.status = "running" if code is None else "exited"
        self.attrs = {"State": {"ExitCode": code if code is not None else 0}}

    def logs(self, tail=40):
        return b"fake container log\n"

    def stop(self, timeout=10):
        self.proc.terminate()
        self.proc.wait(timeout)

    def kill(self):
        self.proc.kill()

    def wait(self, timeout=None):
        self.proc.wait(timeout)

    def remove(self, force=False):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.removed = True


class FakeDaemon:
    """The slice of docker.DockerClient the adapter uses."""

    def __init__(self, images=("scalinginter/env-light:latest",)):
        self.images = self
        self.containers = self
        self.known = set(images)
        self.started: list[FakeContainer] = []

    def ping(self):
        return True

    def get(self, image):  # images.get
        if image not in self.known:
            raise LookupError(f"ImageNotFound: {image}")
        return image

    def run(self, image, command, detach, ports, environment, labels, **kw):  # containers.run
        assert detach and image in self.known
        c = FakeContainer(command, ports, environment, labels)
        c.image, c.kw = image, kw
        self.started.append(c)
        return c


def test_images_by_dependency_set():
    assert containers.image_for("webarena").endswith("/env-web:latest")
    assert containers.image_for("miniwob").endswith("/env-web:latest")
    assert containers.image_for("sciworld").endswith("/env-sciworld:latest")
    assert containers.image_for("babyai").endswith("/env-light:latest")
    assert containers.image_for("textcraft", tag="v1") == "scalinginter/env-light:v1"


def test_container_server_health_restart_and_teardown():
    daemon = FakeDaemon()
    srv = spawn_env_server("toy", {"n_doors": 4}, runtime="docker", docker_client=daemon)
    try:
        assert srv.kind == "docker" and len(daemon.started) == 1
        c = daemon.started[0]
        # what the container is asked to run: the server on 0.0.0.0:8000 inside, published on 127.0.0.1:<port>
        assert c.command[:3] == ["python", "-m", "envs.server"] and "--parent-pid" not in c.command
        assert c.command[c.command.index("--port") + 1] == "8000" and c.container_port == "8000/tcp"
        assert (c.host, c.host_port) == ("127.0.0.1", srv.port) and c.kw["init"] and c.kw["shm_size"] == "1g"
        assert c.environment["SCALINGINTER_INSTANCE"] == srv.instance_id
        assert c.labels[containers.LABEL] == "toy"
        h = httpx.get(srv.url + "/health").json()
        assert h["env"] == "toy" and h["instance"] == srv.instance_id and srv.alive()
        # the server binds 0.0.0.0 in a container, so it has a token: refused without it, and our clients send it
        assert srv.token and c.environment["SCALINGINTER_ENV_TOKEN"] == srv.token
        assert httpx.post(srv.url + "/create", json={}).status_code == 401
        assert EnvClient(srv.url).create() >= 0
        auth = {"Authorization": f"Bearer {srv.token}"}
        env_id = httpx.post(srv.url + "/create", json={}, headers=auth).json()["id"]
        reset = httpx.post(srv.url + "/reset", json={"id": env_id, "data_idx": 0}, headers=auth)
        assert "door 4" in reset.json()["observation"]
        # a crash: the container's process dies; restart = a fresh container on the same host port
        port, first = srv.port, srv.instance_id
        c.kill()
        c.wait(5)
        assert srv.exit_code() is not None and not srv.alive()
        srv.restart()
        assert len(daemon.started) == 2 and c.removed and srv.port == port and srv.instance_id != first
        assert srv.alive()
    finally:
        srv.stop()
    assert daemon.started[-1].removed and not srv.running()


def test_container_start_failure_carries_its_log_and_removes_it():
    daemon = FakeDaemon()
    with pytest.raises(EnvServerStartError, match=r"\(docker\) exited with code 1(.|\n)*fake container log"):
        containers.EnvServerContainer("no-such-env", docker_client=daemon, image="scalinginter/env-light:latest",
                                      startup_timeout_s=30).start()
    assert daemon.started and all(c.removed for c in daemon.started)


def test_runtime_auto_falls_back_to_processes_and_docker_says_why():
    no_image = FakeDaemon(images=())
    srv = spawn_env_server("toy", runtime="auto", docker_client=no_image)
    try:
        assert isinstance(srv, EnvServerProcess) and srv.alive() and not no_image.started
    finally:
        srv.stop()
    with pytest.raises(EnvServerStartError, match="env.runtime=docker but image scalinginter/env-light:latest is not "
                                                  "available.*infra/docker/build.sh"):
        spawn_env_server("toy", runtime="docker", docker_client=no_image)
    with pytest.raises(ValueError, match="env.runtime must be one of"):
        spawn_env_server("toy", runtime="kubernetes")


def test_config_names_the_runtime():
    from core.config import RunConfig

    cfg = RunConfig.model_validate({"env": {"runtime": "docker", "image": "reg.example/env-light:1"}})
    assert cfg.env.runtime == "docker" and cfg.env.image == "reg.example/env-light:1"
    with pytest.raises(ValueError):
        RunConfig.model_validate({"env": {"runtime": "podman"}})


@pytest.mark.slow  # not in CI: needs a Docker daemon with the built image (none on the CI machine: it skips)
def test_real_daemon_serves_the_light_image():
    client = containers.docker_client()
    image = containers.image_for("babyai")
    why = containers.unavailable_reason(image, client) if client is not None else "no Docker daemon here"
    if why is not None:
        pytest.skip(why)
    srv = spawn_env_server("babyai", runtime="docker", docker_client=client)
    try:
        assert srv.kind == "docker" and srv.alive()
        auth = {"Authorization": f"Bearer {srv.token}"}
        env_id = httpx.post(srv.url + "/create", json={}, headers=auth).json()["id"]
        assert httpx.post(srv.url + "/reset", json={"id": env_id, "data_idx": 0}, headers=auth).status_code == 200
        srv.kill()
        srv.restart()
        assert srv.alive()
    finally:
        srv.stop()


def test_dockerfiles_match_the_repo():
    """No daemon to build them here: check what can go stale: every image the spawner names has a Dockerfile,
    every COPY source exists, and the env servers' pins are pyproject's."""
    import re
    import tomllib

    d = REPO_ROOT / "infra" / "docker"
    named = {containers.image_for(e).split("/")[1].split(":")[0] for e in ("babyai", "webarena", "sciworld")}
    assert named == {"env-light", "env-web", "env-sciworld"}
    for name in named | {"trainer-gpu"}:
        text = (d / f"{name}.Dockerfile").read_text()
        assert text.startswith("#") and "\nFROM " in text
        for src in re.findall(r"^COPY (\S+)", text, flags=re.M):
            assert (REPO_ROOT / src).exists(), f"{name}: COPY {src} does not exist"
        if name != "trainer-gpu":
            assert "EXPOSE 8000" in text and '"envs.server"' in text and "USER envs" in text
            copied = set(re.findall(r"^COPY (\S+)", text, flags=re.M))  # envs/ imports no trainer code
            assert {"core", "envs"} <= copied and not copied & {"tasks", "flows"}, f"{name} copies {copied}"
    pins = dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)(==[^\s#]+)", (d / "requirements-env.txt").read_text(), re.M))
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pyproject = dict(re.match(r"([A-Za-z0-9_.\[\]-]+)(==\S+)", x).groups() for x in deps if "==" in x)
    for pkg, ver in pins.items():
        assert pyproject.get(pkg) == ver, f"{pkg}{ver} in requirements-env.txt, {pyproject.get(pkg)} in pyproject"
    web = (d / "env-web.Dockerfile").read_text()
    for pkg in ("playwright", "miniwob"):
        assert f"{pkg}{pyproject[pkg]}" in web
    assert f"scienceworld{pyproject['scienceworld']}" in (d / "env-sciworld.Dockerfile").read_text()
