"""Start env servers (``python -m envs.server``) as local subprocesses or, where a Docker daemon answers, as
containers (``envs.containers``), behind one handle interface:

    with EnvServerProcess("toy", env_options={"n_doors": 4}) as srv:
        client = EnvClient(srv.url)
        ...

    srv = spawn_env_server("sciworld", runtime="auto")   # a container if a daemon and the image exist

Both kinds get a free host port, are healthy only once ``/health`` answers from *this* server (a per-launch
instance token, so a stale server on a reused port never passes), restart on the same port (``restart``) and
are stopped at interpreter exit. A subprocess gets the repo root on ``PYTHONPATH`` (works from any cwd), writes
its output to a log file (``log_path``, else a temp file removed on ``stop``) and exits by itself when the
spawning process dies. If a server exits or stays unhealthy past ``startup_timeout_s``,
``EnvServerStartError`` carries its log tail.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import httpx

from core.redact import child_environ
from envs.client import TOKEN_ENV, register_token
from envs.errors import EnvServerStartError

REPO_ROOT = Path(__file__).resolve().parents[1]
_LIVE: "weakref.WeakSet[EnvServerHandle]" = weakref.WeakSet()
RUNTIMES = ("auto", "process", "docker")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EnvServerHandle:
    """What a phase needs of an env server, whatever runs it: start (free port, health check), alive,
    restart on the same port, stop, kill, log tail. Subclasses launch and terminate."""

    kind = "?"
    port_taken_markers = ("address already in use",)

    def __init__(self, env_name: str, host: str = "127.0.0.1", port: int | None = None,
                 env_options: dict[str, Any] | None = None, *, max_envs: int = 256, idle_ttl_s: float = 600.0,
                 reap_interval_s: float | None = None, workers: int = 32, startup_timeout_s: float = 60.0,
                 log_level: str = "warning"):
        self.env_name = env_name
        self.host = host
        self.port = port
        self._auto_port = port is None
        self.env_options = dict(env_options or {})
        self.max_envs = max_envs
        self.idle_ttl_s = idle_ttl_s
        self.reap_interval_s = reap_interval_s
        self.workers = workers
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self.instance_id: str | None = None
        # the server's shared token: the one configured for this process, if any (a process server inherits the
        # variable; a container, which must bind 0.0.0.0 inside, makes its own); this process's clients send it
        self.token: str | None = os.environ.get(TOKEN_ENV) or None

    # --- info -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def running(self) -> bool:
        """The server exists and has not exited (it may still be starting up)."""
        return self.exit_code() is None and self._launched()

    def alive(self, timeout_s: float = 2.0) -> bool:
        """The server is running and answers ``/health``."""
        return self.running() and self._healthy(timeout_s)

    def server_args(self, host: str, port: int) -> list[str]:
        """``python -m envs.server`` arguments (after the interpreter)."""
        args = ["-m", "envs.server", "--env", self.env_name, "--host", host, "--port", str(port),
                "--max-envs", str(self.max_envs), "--idle-ttl", str(self.idle_ttl_s),
                "--workers", str(self.workers), "--log-level", self.log_level]
        if self.reap_interval_s is not None:
            args += ["--reap-interval", str(self.reap_interval_s)]
        if self.env_options:
            args += ["--options-json", json.dumps(self.env_options)]
        return args

    # --- to implement -----------------------------------------------------------------------------------
    def _launch(self) -> None:
        raise NotImplementedError

    def _launched(self) -> bool:
        raise NotImplementedError

    def exit_code(self) -> int | None:
        """The exit code once the server has exited, else None."""
        raise NotImplementedError

    def _terminate(self, timeout_s: float = 5.0) -> int | None:
        raise NotImplementedError

    def kill(self) -> None:
        """Kill it now (simulates a crash; no cleanup)."""
        raise NotImplementedError

    def log_tail(self, n_lines: int = 40) -> str:
        raise NotImplementedError

    def _release(self) -> None:
        """Free what ``stop`` leaves behind (temp log, container)."""

    # --- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> "EnvServerHandle":
        if self.running():
            raise RuntimeError(f"env server already running ({self!r})")
        tries = 3 if self._auto_port else 1
        for attempt in range(tries):
            if self._auto_port and (self.port is None or attempt > 0):
                self.port = free_port(self.host)
            self.instance_id = uuid.uuid4().hex
            try:
                self._launch()
                self._wait_healthy()
                if self.token:
                    register_token(self.url, self.token)
                _LIVE.add(self)
                return self
            except EnvServerStartError as exc:
                self._terminate()
                port_taken = any(m in str(exc).lower() for m in self.port_taken_markers)
                if not (port_taken and attempt + 1 < tries):
                    self.stop()  # frees our temp log / container; the log tail is in the error message
                    raise
        raise AssertionError("unreachable")

    def _healthy(self, timeout_s: float) -> bool:
        try:
            r = httpx.get(self.url + "/health", timeout=timeout_s)
            d = r.json()
        except (httpx.HTTPError, ValueError):
            return False
        return r.status_code == 200 and d.get("env") == self.env_name and d.get("instance") == self.instance_id

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.02
        while True:
            code = self.exit_code()
            if code is not None:
                raise EnvServerStartError(
                    f"env server {self.env_name!r} ({self.kind}) exited with code {code} during startup "
                    f"(port {self.port}). {self._log_ref()}:\n{self.log_tail()}",
                    url=self.url,
                )
            if self._healthy(1.0):
                return
            if time.monotonic() > deadline:
                raise EnvServerStartError(
                    f"env server {self.env_name!r} ({self!r}) not healthy after {self.startup_timeout_s:g} s "
                    f"at {self.url}. {self._log_ref()}:\n{self.log_tail()}",
                    url=self.url,
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _log_ref(self) -> str:
        return "Log tail"

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Graceful stop (envs are closed), forced after ``timeout_s``. Returns the exit code."""
        code = self._terminate(timeout_s)
        _LIVE.discard(self)
        self._release()
        return code

    def restart(self) -> "EnvServerHandle":
        """Stop (if running) and start again on the same port. All env ids are lost."""
        self._terminate()
        auto, self._auto_port = self._auto_port, False  # keep the port clients know
        try:
            return self.start()
        finally:
            self._auto_port = auto

    def __enter__(self) -> "EnvServerHandle":
        if not self.running():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EnvServerProcess(EnvServerHandle):
    """An env server as a local subprocess."""

    kind = "process"

    def __init__(
        self,
        env_name: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        env_options: dict[str, Any] | None = None,
        *,
        max_envs: int = 256,
        idle_ttl_s: float = 600.0,
        reap_interval_s: float | None = None,
        workers: int = 32,
        startup_timeout_s: float = 60.0,
        log_path: str | os.PathLike | None = None,
        log_level: str = "warning",
        python: str = sys.executable,
        extra_env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ):
        super().__init__(env_name, host, port, env_options, max_envs=max_envs, idle_ttl_s=idle_ttl_s,
                         reap_interval_s=reap_interval_s, workers=workers, startup_timeout_s=startup_timeout_s,
                         log_level=log_level)
        self.python = python
        self.extra_env = dict(extra_env or {})
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _launched(self) -> bool:
        return self.proc is not None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, n_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-n_lines:])

    def command(self) -> list[str]:
        return [self.python, *self.server_args(self.host, self.port), "--parent-pid", str(os.getpid())]

    def _launch(self) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"envserver-{self.env_name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = child_environ(dict(os.environ))  # no S3 / tracking credentials for the server and its browser
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        env["SCALINGINTER_INSTANCE"] = self.instance_id or ""
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- starting: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                cwd=str(self.cwd),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it cleanly
            )

    def _log_ref(self) -> str:
        return "Log tail" if self._own_log else f"Log {self.log_path}"

    def _terminate(self, timeout_s: float = 5.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self.proc = proc  # keep for returncode / pid inspection
        return proc.returncode

    def _release(self) -> None:
        if self._own_log and self.log_path is not None:
            try:
                self.log_path.unlink()
            except OSError:
                pass
            self.log_path = None

    def kill(self) -> None:
        """SIGKILL now (simulates a crash; no cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5.0)

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"EnvServerProcess({self.env_name!r}, port={self.port}, pid={self.pid}, {state})"


CONTAINER_ONLY = ("docker_client", "cpus", "mem_limit", "shm_size", "pids_limit", "run", "watchdog")
_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, flush=True)


def spawn_env_server(env_name: str, env_options: dict[str, Any] | None = None, *, runtime: str = "auto",
                     image: str | None = None, **kw: Any) -> EnvServerHandle:
    """Start an env server: a container when ``runtime`` is ``docker`` (or ``auto`` and a daemon answers and
    has the env's image), else a local process. Same health check, port allocation, restart and teardown.
    ``auto`` also wants the image built from this checkout's ``core/`` + ``envs/`` (``containers.stale_reason``)
    and an env registered from ``envs/`` (``containers.outside_images``), and says once per process and reason why
    it runs processes. Container-only keywords (``CONTAINER_ONLY``: limits, the run label, a client) are dropped
    for a process."""
    from envs import containers

    if runtime not in RUNTIMES:
        raise ValueError(f"env.runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if runtime != "process":
        img = image or containers.image_for(env_name)
        client = kw.get("docker_client") or containers.docker_client()
        why = containers.unavailable_reason(img, client)
        stale = containers.stale_reason(img, client) if why is None else None
        if stale and runtime == "auto":  # auto never runs other env code than this checkout's
            why = stale
        elif stale:
            _say_once(f"warning: {stale}; env.runtime=docker runs it as it is")
        if why is None and image is None:  # the default images hold envs/ only
            why = containers.outside_images(env_name)
        if why is None:
            kw["docker_client"] = client
            return containers.EnvServerContainer(env_name, env_options=env_options, image=img, **kw).start()
        if runtime == "docker":
            raise EnvServerStartError(f"env.runtime=docker but {why}. Build the images with "
                                      f"`infra/docker/build.sh`, or use env.runtime=process (or auto).")
        _say_once(f"env.runtime=auto: {env_name} env servers run as local processes ({why})")
    for k in CONTAINER_ONLY:
        kw.pop(k, None)
    return EnvServerProcess(env_name, env_options=env_options, **kw).start()


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        try:
            srv.stop(timeout_s=2.0)
        except Exception:  # noqa: BLE001
            pass
