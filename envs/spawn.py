"""Start env servers (``python -m envs.server``) as local subprocesses.

    with EnvServerProcess("toy", env_options={"n_doors": 4}) as srv:
        client = EnvClient(srv.url)
        ...

The subprocess gets the repo root on ``PYTHONPATH`` (works from any cwd), writes its output to a log file
(``log_path``, else a temp file removed on ``stop``), exits by itself when the spawning process dies, and is
stopped at interpreter exit. ``start`` waits until ``/health`` answers from *this* process; if the server
exits or stays unhealthy past ``startup_timeout_s``, ``EnvServerStartError`` carries the log tail.
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
import weakref
from pathlib import Path
from typing import Any

import httpx

from envs.errors import EnvServerStartError

REPO_ROOT = Path(__file__).resolve().parents[1]
_LIVE: "weakref.WeakSet[EnvServerProcess]" = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EnvServerProcess:
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
        self.python = python
        self.extra_env = dict(extra_env or {})
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen | None = None

    # --- info -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        """The process exists and has not exited (it may still be starting up)."""
        return self.proc is not None and self.proc.poll() is None

    def alive(self, timeout_s: float = 2.0) -> bool:
        """The process is running and answers ``/health``."""
        return self.running() and self._healthy(timeout_s)

    def log_tail(self, n_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-n_lines:])

    # --- lifecycle --------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "envs.server",
            "--env", self.env_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-envs", str(self.max_envs),
            "--idle-ttl", str(self.idle_ttl_s),
            "--workers", str(self.workers),
            "--log-level", self.log_level,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if self.reap_interval_s is not None:
            cmd += ["--reap-interval", str(self.reap_interval_s)]
        if self.env_options:
            cmd += ["--options-json", json.dumps(self.env_options)]
        return cmd

    def start(self) -> "EnvServerProcess":
        if self.running():
            raise RuntimeError(f"env server already running (pid {self.pid})")
        tries = 3 if self._auto_port else 1
        for attempt in range(tries):
            if self._auto_port and (self.port is None or attempt > 0):
                self.port = free_port(self.host)
            self._launch()
            try:
                self._wait_healthy()
                _LIVE.add(self)
                return self
            except EnvServerStartError as exc:
                self._terminate()
                port_taken = "address already in use" in str(exc).lower()
                if not (port_taken and attempt + 1 < tries):
                    self.stop()  # removes our temp log; its tail is in the error message
                    raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"envserver-{self.env_name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
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

    def _healthy(self, timeout_s: float) -> bool:
        try:
            r = httpx.get(self.url + "/health", timeout=timeout_s)
            d = r.json()
        except (httpx.HTTPError, ValueError):
            return False
        return r.status_code == 200 and d.get("env") == self.env_name and d.get("pid") == self.pid

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.02
        while True:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                raise EnvServerStartError(
                    f"env server {self.env_name!r} exited with code {code} during startup "
                    f"(port {self.port}). {self._log_ref()}:\n{self.log_tail()}",
                    url=self.url,
                )
            if self._healthy(1.0):
                return
            if time.monotonic() > deadline:
                raise EnvServerStartError(
                    f"env server {self.env_name!r} (pid {self.pid}) not healthy after {self.startup_timeout_s:g} s "
                    f"at {self.url}. {self._log_ref()}:\n{self.log_tail()}",
                    url=self.url,
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

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

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM (graceful: envs are closed), then SIGKILL after ``timeout_s``. Returns the exit code."""
        code = self._terminate(timeout_s)
        _LIVE.discard(self)
        if self._own_log and self.log_path is not None:
            try:
                self.log_path.unlink()
            except OSError:
                pass
            self.log_path = None
        return code

    def kill(self) -> None:
        """SIGKILL now (simulates a crash; no cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5.0)

    def restart(self) -> "EnvServerProcess":
        """Stop (if running) and start again on the same port. All env ids are lost."""
        self._terminate()
        auto, self._auto_port = self._auto_port, False  # keep the port clients know
        try:
            return self.start()
        finally:
            self._auto_port = auto

    def __enter__(self) -> "EnvServerProcess":
        if not self.running():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"EnvServerProcess({self.env_name!r}, port={self.port}, pid={self.pid}, {state})"


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        try:
            srv.stop(timeout_s=2.0)
        except Exception:  # noqa: BLE001
            pass
