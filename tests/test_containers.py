"""Env servers in containers (envs.containers) behind the same handle as local processes.

Everywhere, engine or not: the adapter against a stand-in daemon whose ``containers.run`` starts the command it is
given as a real server process on the published host port, the owner and run labels, the Dockerfiles against the
repository. The same paths on a real engine with the built image: ``tests/test_docker_engine.py``."""

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
        self.command, self.environment, self.labels, self.args = command, environment, labels, args
        self.proc = None
        self.short_id = f"fake{id(self)}"
        self.removed = False
        self.status = "created"
        self.attrs = {"State": {"ExitCode": 0}}

    def start(self):
        env = {"PYTHONPATH": str(REPO_ROOT), **self.environment}
        self.proc = subprocess.Popen([sys.executable, *self.args], env={**__import__("os").environ, **env},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.status = "running"

    def reload(self):
        if self.removed:
            raise RuntimeError("No such container")
        if self.proc is None:
            return
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.removed = True


class FakeImage:
    def __init__(self, labels):
        self.labels = labels


class FakeDaemon:
    """The slice of docker.DockerClient the adapter uses."""

    def __init__(self, images=("scalinginter/env-light:latest",), labels=None):
        self.images = self
        self.containers = self
        self.known = set(images)
        self.labels = labels or {}
        self.started: list[FakeContainer] = []

    def ping(self):
        return True

    def get(self, image):  # images.get
        if image not in self.known:
            raise LookupError(f"ImageNotFound: {image}")
        return FakeImage(self.labels)

    def create(self, image, command, ports, environment, labels, **kw):  # containers.create
        assert image in self.known
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
    srv = spawn_env_server("toy", {"n_doors": 4}, runtime="docker", docker_client=daemon, watchdog=False,
                           run="r1", cpus=1.5, mem_limit="1g")
    try:
        assert srv.kind == "docker" and len(daemon.started) == 1
        c = daemon.started[0]
        # what the container is asked to run: the server on 0.0.0.0:8000 inside, published on 127.0.0.1:<port>
        assert c.command[:3] == ["python", "-m", "envs.server"] and "--parent-pid" not in c.command
        assert c.command[c.command.index("--port") + 1] == "8000" and c.container_port == "8000/tcp"
        assert (c.host, c.host_port) == ("127.0.0.1", srv.port) and c.kw["init"] and c.kw["shm_size"] == "1g"
        assert c.environment["SCALINGINTER_INSTANCE"] == srv.instance_id
        assert c.labels[containers.LABEL] == "toy" and c.labels[containers.RUN_LABEL] == "r1"
        assert c.labels[containers.OWNER_LABEL] == containers.owner_id()
        assert c.kw["nano_cpus"] == 1_500_000_000 and c.kw["mem_limit"] == "1g" and c.kw["pids_limit"] > 0
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


def test_an_engine_that_fails_the_start_is_a_start_error_and_the_container_is_removed():
    class Refusing(FakeDaemon):
        def create(self, *a, **kw):
            c = super().create(*a, **kw)
            c.start = lambda: (_ for _ in ()).throw(TimeoutError("engine busy"))
            return c

    daemon = Refusing()
    with pytest.raises(EnvServerStartError, match="could not start 'toy' .*TimeoutError: engine busy"):
        spawn_env_server("toy", runtime="docker", docker_client=daemon, watchdog=False)
    assert daemon.started and all(c.removed for c in daemon.started)


def test_container_start_failure_carries_its_log_and_removes_it():
    daemon = FakeDaemon()
    with pytest.raises(EnvServerStartError, match=r"\(docker\) exited with code 1(.|\n)*fake container log"):
        containers.EnvServerContainer("no-such-env", docker_client=daemon, image="scalinginter/env-light:latest",
                                      startup_timeout_s=30, watchdog=False).start()
    assert daemon.started and all(c.removed for c in daemon.started)


def test_runtime_auto_falls_back_to_processes_and_docker_says_why():
    no_image = FakeDaemon(images=())
    srv = spawn_env_server("toy", runtime="auto", docker_client=no_image, run="r1", cpus=1)  # dropped: a process
    try:
        assert isinstance(srv, EnvServerProcess) and srv.alive() and not no_image.started
    finally:
        srv.stop()
    with pytest.raises(EnvServerStartError, match="env.runtime=docker but image scalinginter/env-light:latest is not "
                                                  "available.*infra/docker/build.sh"):
        spawn_env_server("toy", runtime="docker", docker_client=no_image)
    with pytest.raises(ValueError, match="env.runtime must be one of"):
        spawn_env_server("toy", runtime="kubernetes")


def test_an_image_of_other_sources_is_not_picked_by_auto(capsys):
    """An image labelled with another core/ + envs/ hash than this checkout's: auto runs a process (and says why),
    docker runs the container and warns; an image with this checkout's hash is picked by auto."""
    other = FakeDaemon(labels={containers.SOURCES_LABEL: "0" * 64})
    srv = spawn_env_server("toy", runtime="auto", docker_client=other)
    try:
        assert isinstance(srv, EnvServerProcess) and not other.started
    finally:
        srv.stop()
    assert "run as local processes (scalinginter/env-light:latest was built from other core/ + envs/ sources" \
        in capsys.readouterr().out
    srv = spawn_env_server("toy", runtime="docker", docker_client=other, watchdog=False)
    try:
        assert srv.kind == "docker" and "warning: scalinginter/env-light:latest was built from other" in \
            capsys.readouterr().out
    finally:
        srv.stop()
    same = FakeDaemon(labels={containers.SOURCES_LABEL: containers.source_hash()})
    srv = spawn_env_server("toy", runtime="auto", docker_client=same, watchdog=False)
    try:
        assert srv.kind == "docker" and same.started
    finally:
        srv.stop()


def test_an_env_from_outside_envs_is_not_sent_to_an_image():
    from envs.base import register_env

    register_env("outside-envs-x", "tests.somewhere:SomeEnv")
    assert "outside envs/" in containers.outside_images("outside-envs-x")
    assert containers.outside_images("toy") is None and containers.outside_images("babyai") is None


def test_config_names_the_runtime():
    from core.config import RunConfig

    cfg = RunConfig.model_validate({"env": {"runtime": "docker", "image": "reg.example/env-light:1"}})
    assert cfg.env.runtime == "docker" and cfg.env.image == "reg.example/env-light:1"
    with pytest.raises(ValueError):
        RunConfig.model_validate({"env": {"runtime": "podman"}})


def test_owner_and_run_labels():
    me = containers.owner_id()
    assert me.split(":")[1] == str(__import__("os").getpid()) and containers.owner_alive(me) is True
    host, pid, start, boot = me.rsplit(":", 3)
    assert containers.owner_alive(f"{host}:{pid}:{int(start) + 1}:{boot}") is False  # the pid, reused later
    assert containers.owner_alive(f"{host}:{pid}:{start}:another-boot") is False
    assert containers.owner_alive(f"other-host:{pid}:{start}:{boot}") is None  # not ours to judge
    assert containers.run_label("given") == "given"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCALINGINTER_RUN", "from-env")
        assert containers.run_label() == "from-env"
        mp.delenv("SCALINGINTER_RUN")
        assert containers.run_label() == f"pid-{__import__('os').getpid()}"  # no flow run here


def test_limits_by_image(monkeypatch):
    monkeypatch.delenv("SCALINGINTER_ENV_CPUS", raising=False)
    monkeypatch.delenv("SCALINGINTER_ENV_MEMORY", raising=False)
    cpus, mem = containers.default_limits("scalinginter/env-sciworld:abc")
    assert mem == "6g" and cpus == min(4.0, float(__import__("os").cpu_count()))
    monkeypatch.setenv("SCALINGINTER_ENV_CPUS", "0.5")
    monkeypatch.setenv("SCALINGINTER_ENV_MEMORY", "300m")
    assert containers.default_limits("reg.example/other:1") == (0.5, "300m")


def test_source_hash_covers_what_the_images_copy(tmp_path):
    for d in ("core", "envs/x"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "core" / "a.py").write_text("a = 1\n")
    (tmp_path / "envs" / "x" / "b.py").write_text("b = 1\n")
    (tmp_path / "envs" / "x" / "__pycache__").mkdir()
    (tmp_path / "envs" / "x" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    h = containers.source_hash(tmp_path)
    assert [p.name for p in containers.source_files(tmp_path)] == ["a.py", "b.py"]
    (tmp_path / "envs" / "x" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\1")
    assert containers.source_hash(tmp_path) == h  # bytecode is not the source
    (tmp_path / "core" / "a.py").write_text("a = 2\n")
    assert containers.source_hash(tmp_path) != h


def test_dockerfiles_match_the_repo():
    """What can go stale without an engine: every image the spawner names has a Dockerfile, every COPY source is
    in the repository or staged by the builder (build/wheels), the env images take their base as a build argument
    and install from wheels only, and the requirement files pin what pyproject pins."""
    import re
    import tomllib

    d = REPO_ROOT / "infra" / "docker"
    named = {containers.image_for(e).split("/")[1].split(":")[0] for e in ("babyai", "webarena", "sciworld")}
    assert named == {"env-light", "env-web", "env-sciworld"}
    for name in named | {"trainer-gpu"}:
        text = (d / f"{name}.Dockerfile").read_text()
        assert text.startswith("#") and "\nFROM " in text
        for src in re.findall(r"^COPY (\S+)", text, flags=re.M):
            if src.startswith("--from=") or src == "build/wheels":  # a build stage; staged by infra/docker/images.py
                continue
            found = list(REPO_ROOT.glob(src)) if "*" in src else (REPO_ROOT / src).exists()
            assert found, f"{name}: COPY {src} does not exist"
        if name != "trainer-gpu":
            assert "EXPOSE 8000" in text and '"envs.server"' in text and "USER envs" in text
            assert text.count("FROM ${BASE}") == 2 and "--no-index" in text, f"{name}: base arg + wheels only"
            copied = set(re.findall(r"^COPY (\S+)", text, flags=re.M))  # envs/ imports no trainer code
            assert {"core", "envs"} <= copied and not copied & {"tasks", "flows"}, f"{name} copies {copied}"
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pyproject = dict(re.match(r"([A-Za-z0-9_.\[\]-]+)(==\S+)", x).groups() for x in deps if "==" in x)
    for req in d.glob("requirements-*.txt"):
        pins = dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)(==[^\s#]+)", req.read_text(), re.M))
        for pkg, ver in pins.items():
            assert pyproject.get(pkg) == ver, f"{pkg}{ver} in {req.name}, {pyproject.get(pkg)} in pyproject"
    assert "scienceworld==" in (d / "requirements-sciworld.txt").read_text()
    web = (d / "requirements-web.txt").read_text()
    assert "playwright==" in web and "miniwob==" in web


def _images_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("si_images", REPO_ROOT / "infra" / "docker" / "images.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_builder_stages_what_the_dockerfiles_copy_and_hashes_it(tmp_path, monkeypatch):
    """Without an engine: each image's requirement files (with the files they include), the staged context (the
    Dockerfile's COPY sources at their paths, the wheels), and a content hash that moves with any of them."""
    images = _images_module()
    d = REPO_ROOT / "infra" / "docker"
    assert [f.name for f in images.requirement_files("env-light", False)] == ["requirements-env.txt"]
    assert [f.name for f in images.requirement_files("env-web", False)] == ["requirements-web.txt",
                                                                             "requirements-env.txt"]
    assert images.requirement_files("env-light", True)[-1].name == "requirements-dense.txt"
    monkeypatch.setattr(images, "BUILD", tmp_path / "build")
    wheels = tmp_path / "wh"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    ctx = images.stage_context("env-sciworld", images.requirement_files("env-sciworld", False), wheels)
    for src in ("core/config.py", "envs/server.py", "infra/docker/env-sciworld.Dockerfile",
                "infra/docker/requirements-sciworld.txt", "infra/docker/requirements-env.txt",
                "build/wheels/x-1.0-py3-none-any.whl"):
        assert (ctx / src).is_file(), src
    assert not list(ctx.rglob("__pycache__")) and not (ctx / "tasks").exists() and not (ctx / "flows").exists()
    args = {"BASE": "b", "REQUIREMENTS": "requirements-sciworld.txt", "EXTRA_REQUIREMENTS": ""}
    h = images.context_hash(ctx, "sha256:base", args)
    assert images.context_hash(ctx, "sha256:base", args) == h  # nothing changed: the same tag, the build skipped
    assert images.context_hash(ctx, "sha256:other", args) != h  # another base
    assert images.context_hash(ctx, "sha256:base", {**args, "EXTRA_REQUIREMENTS": "x"}) != h
    (ctx / "build" / "wheels" / "x-1.0-py3-none-any.whl").unlink()
    (ctx / "build" / "wheels" / "x-1.1-py3-none-any.whl").write_bytes(b"wheel")
    assert images.context_hash(ctx, "sha256:base", args) != h  # another dependency version
    assert (d / "build.sh").stat().st_mode & 0o111 and (d / "engine.sh").stat().st_mode & 0o111


def test_engine_script_parses_and_refuses_what_it_does_not_know():
    engine = REPO_ROOT / "infra" / "docker" / "engine.sh"
    assert subprocess.run(["bash", "-n", str(engine)]).returncode == 0
    r = subprocess.run([str(engine), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
    assert "docker.io" in subprocess.run([str(engine), "--help"], capture_output=True, text=True).stdout


def test_servers_hold_idle_connections_longer_than_clients_do():
    """A client must drop an idle keep-alive connection before the server does, or a request sent as the server
    closes it is lost (through Docker's port proxy 2 of 14 steps sent after ~5 s idle were, at uvicorn's default)."""
    from envs import server

    assert server.KEEP_ALIVE_S > httpx.Limits(max_connections=1).keepalive_expiry + 10
