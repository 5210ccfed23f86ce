"""Env servers as Docker containers, through the Docker SDK (``pip install docker``), behind the same handle as
a local process (``envs.spawn.EnvServerHandle``): a free host port published on 127.0.0.1, the same
``/health`` check with a per-launch instance token, restart on the same port, stop + remove on teardown.

Images (``infra/docker/``, built by ``infra/docker/build.sh`` without a registry), one per dependency set:

    scalinginter/env-web        Chromium + Playwright: webarena, miniwob
    scalinginter/env-sciworld   a Java 17 runtime: sciworld
    scalinginter/env-light      everything else: babyai, textcraft, searchqa, toy

Each container gets CPU and memory limits (``cpus`` / ``mem_limit``; defaults by image, capped at the host's
cores, or ``$SCALINGINTER_ENV_CPUS`` / ``$SCALINGINTER_ENV_MEMORY``) and labels that say whose it is:

    org.scalinginter.env-server   the env name (every container this module starts has it)
    org.scalinginter.run          the run's name (``run=``, ``$SCALINGINTER_RUN``, or the Prefect flow run's config)
    org.scalinginter.owner        host:pid:start-time:boot-id of the process that started it

so ``docker ps -a --filter label=org.scalinginter.run=NAME`` lists a run's servers. None outlives its owner:
teardown and interpreter exit remove them; a SIGKILLed owner's are removed within about a second by a watchdog
process (``python -m envs.containers watch``, started with the first container, in its own session); and any left
by an owner that is gone (a watchdog killed too, a reboot) are removed when this host next starts one.

``unavailable_reason(image)`` says why containers cannot be used here (no SDK, no daemon, image not built), and
``stale_reason(image)`` why an image would not run this checkout's env code; ``spawn_env_server(runtime="auto")``
then falls back to local processes (``docker`` refuses the first and warns of the second).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from envs.client import TOKEN_ENV
from envs.errors import EnvServerStartError
from envs.spawn import REPO_ROOT, EnvServerHandle

IMAGE_TAG = os.environ.get("SCALINGINTER_IMAGE_TAG", "latest")
IMAGE_OF_ENV = {"webarena": "env-web", "miniwob": "env-web", "sciworld": "env-sciworld"}
CONTAINER_PORT = 8000
LABEL = "org.scalinginter.env-server"
RUN_LABEL = "org.scalinginter.run"
OWNER_LABEL = "org.scalinginter.owner"
HOST_LABEL = "org.scalinginter.host"
SOURCES_LABEL = "org.scalinginter.sources"  # set by infra/docker/build.sh: source_hash() of what the image holds
# (cpus, memory) by image: env-light servers are light; sciworld keeps a pool of JVMs (max_jvms x ~400 MB + 300 MB);
# Chromium wants room for its renderers
LIMITS = {"env-light": (2.0, "2g"), "env-sciworld": (4.0, "6g"), "env-web": (4.0, "4g")}
SOURCE_DIRS = ("core", "envs")  # what an env image copies of the repository


def image_for(env_name: str, tag: str = IMAGE_TAG, repo: str = "scalinginter") -> str:
    """The image that serves ``env_name`` (``repo/env-light:tag`` unless the env has heavy dependencies)."""
    return f"{repo}/{IMAGE_OF_ENV.get(env_name, 'env-light')}:{tag}"


def default_limits(image: str) -> tuple[float, str]:
    """(CPUs, memory) for a container of ``image``: ``$SCALINGINTER_ENV_CPUS`` / ``$SCALINGINTER_ENV_MEMORY``, else
    the image's defaults (``LIMITS``); CPUs never above the host's."""
    name = image.rsplit("/", 1)[-1].split(":")[0]
    cpus, mem = LIMITS.get(name, LIMITS["env-light"])
    cpus = float(os.environ.get("SCALINGINTER_ENV_CPUS") or cpus)
    return min(cpus, float(os.cpu_count() or 1)), os.environ.get("SCALINGINTER_ENV_MEMORY") or mem


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files an env image copies (``core/``, ``envs/``), without bytecode, sorted."""
    out = []
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                out.append(p)
    return out


def source_hash(root: Path = REPO_ROOT) -> str:
    """sha256 over the relative paths and contents of ``source_files``: equal for an image built from this
    checkout (its ``org.scalinginter.sources`` label)."""
    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def docker_client(timeout_s: float = 3.0, op_timeout_s: float = 120.0):
    """A Docker SDK client from the environment (``DOCKER_HOST`` or the local socket), or None when no engine
    answers a ping within ``timeout_s``. The client returned waits up to ``op_timeout_s`` per call: a busy engine can
    take seconds to create and start a container."""
    try:
        import docker
    except ImportError:
        return None
    try:
        docker.from_env(timeout=int(max(1, timeout_s))).ping()
        return docker.from_env(timeout=int(max(1, op_timeout_s)))
    except Exception:  # noqa: BLE001 - no daemon, no permission, bad DOCKER_HOST: all mean "not here"
        return None


def unavailable_reason(image: str, client: Any = None) -> str | None:
    """None if containers of ``image`` can be started here, else why not (one line)."""
    try:
        import docker  # noqa: F401
    except ImportError:
        return "the Docker SDK is not installed (pip install docker)"
    client = client or docker_client()
    if client is None:
        return ("no Docker daemon answers (DOCKER_HOST or /var/run/docker.sock; "
                "`sudo infra/docker/engine.sh` installs and starts one)")
    try:
        client.images.get(image)
    except Exception as e:  # noqa: BLE001 - docker.errors.ImageNotFound and API errors
        return f"image {image} is not available ({type(e).__name__})"
    return None


def outside_images(env_name: str) -> str | None:
    """Why no env image can serve ``env_name`` (registered from a module outside ``envs/``, which the images do not
    copy: an env a script or a test registers), or None."""
    import envs  # noqa: F401  (registers the built-in envs)
    from envs.base import _REGISTRY

    target = _REGISTRY.get(env_name)
    if target is None or target.split(":")[0].split(".")[0] == "envs":
        return None
    return f"env {env_name!r} comes from {target.split(':')[0]}, outside envs/, which the images do not hold"


def stale_reason(image: str, client: Any) -> str | None:
    """Why ``image`` does not hold this checkout's ``core/`` + ``envs/`` (its servers may behave unlike the code
    here), or None when it does or when it is unknown (an image not built by infra/docker/build.sh)."""
    try:
        labels = client.images.get(image).labels or {}
    except Exception:  # noqa: BLE001
        return None
    built = labels.get(SOURCES_LABEL)
    if not built or built == source_hash():
        return None
    name = image.rsplit("/", 1)[-1].split(":")[0]
    return (f"{image} was built from other core/ + envs/ sources than this checkout's "
            f"(rebuild it: infra/docker/build.sh {name})")


# --- who owns a container ------------------------------------------------------------------------------------
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "?"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_id(pid: int | None = None) -> str:
    """``host:pid:start:boot``: a process, unique on this host across pid reuse and reboots."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or '?'}:{_boot_id()}"


def owner_alive(owner: str) -> bool | None:
    """Whether the owner process still runs; None when it is another host's (not ours to judge)."""
    try:
        host, pid, start, boot = owner.rsplit(":", 3)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    if boot != _boot_id():
        return False
    return _start_time(int(pid)) == start


def run_label(run: str | None = None) -> str:
    """The run a container belongs to: ``run``, ``$SCALINGINTER_RUN``, the run name in the current Prefect flow
    run's ``config`` parameter (a phase flow's), that flow run's name, else ``pid-<pid>``."""
    if run:
        return run
    if os.environ.get("SCALINGINTER_RUN"):
        return os.environ["SCALINGINTER_RUN"]
    try:  # the trainer's process only: an env image has no Prefect, and this is never called there
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx is not None:
            cfg = (ctx.parameters or {}).get("config")
            name = getattr(cfg, "run_name", None) or (cfg.get("run_name") if isinstance(cfg, dict) else None)
            if name:
                return str(name)
            if ctx.flow_run is not None and ctx.flow_run.name:
                return str(ctx.flow_run.name)
    except Exception:  # noqa: BLE001 - no Prefect, no flow run: fall through
        pass
    return f"pid-{os.getpid()}"


def remove_orphans(client: Any) -> list[str]:
    """Remove this host's env server containers whose owner process is gone; returns their names."""
    gone = []
    try:
        found = client.containers.list(all=True, filters={"label": [LABEL, f"{HOST_LABEL}={socket.gethostname()}"]})
    except Exception:  # noqa: BLE001
        return gone
    for c in found:
        if owner_alive((c.labels or {}).get(OWNER_LABEL, "")) is False:
            try:
                c.remove(force=True)
                gone.append(c.name)
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass
    return gone


def remove_owned(client: Any, owner: str) -> int:
    """Remove every container labelled with ``owner``; returns how many."""
    n = 0
    for c in client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner}"}):
        try:
            c.remove(force=True)
            n += 1
        except Exception:  # noqa: BLE001
            pass
    return n


_WATCH_LOCK = threading.Lock()
_WATCHDOG: subprocess.Popen | None = None
_SWEPT = False


def _ensure_watchdog(client: Any) -> None:
    """Once per process, before its first container: remove orphans, start the watchdog."""
    global _WATCHDOG, _SWEPT
    with _WATCH_LOCK:
        if not _SWEPT:
            _SWEPT = True
            gone = remove_orphans(client)
            if gone:
                print(f"removed {len(gone)} env server container(s) left by a process that is gone: {', '.join(gone)}")
        if _WATCHDOG is not None and _WATCHDOG.poll() is None:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        _WATCHDOG = subprocess.Popen(
            [sys.executable, "-m", "envs.containers", "watch", "--owner", owner_id()], env=env, cwd=str(REPO_ROOT),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in the owner's process group: a kill of the group leaves it to clean up


def watch(owner: str, poll_s: float = 1.0) -> int:
    """Wait for the ``owner`` process to end, then remove its containers (what atexit would have done had it run).
    Returns how many were removed."""
    if owner_alive(owner) is None:
        raise SystemExit(f"owner {owner!r} is not a process of this host")
    while owner_alive(owner):
        time.sleep(poll_s)
    client = None
    for _ in range(10):  # the daemon may be restarting
        client = docker_client(10)
        if client is not None:
            break
        time.sleep(1)
    return remove_owned(client, owner) if client is not None else 0


# --- the handle ----------------------------------------------------------------------------------------------
class EnvServerContainer(EnvServerHandle):
    """An env server in a container; the host port is published on ``host`` (127.0.0.1 by default)."""

    kind = "docker"
    port_taken_markers = ("address already in use", "port is already allocated")

    def __init__(self, env_name: str, host: str = "127.0.0.1", port: int | None = None,
                 env_options: dict[str, Any] | None = None, *, image: str | None = None,
                 docker_client: Any = None, cpus: float | None = None, mem_limit: str | None = None,
                 shm_size: str = "1g", pids_limit: int = 4096, run: str | None = None,
                 extra_env: dict[str, str] | None = None, startup_timeout_s: float = 120.0,
                 watchdog: bool = True, **kw: Any):
        super().__init__(env_name, host, port, env_options, startup_timeout_s=startup_timeout_s, **kw)
        self.image = image or image_for(env_name)
        self._client = docker_client
        d_cpus, d_mem = default_limits(self.image)
        self.cpus = float(cpus) if cpus is not None else d_cpus
        self.mem_limit = mem_limit or d_mem
        self.shm_size = shm_size  # Chromium needs more than Docker's 64 MB /dev/shm
        self.pids_limit = pids_limit
        self.run = run_label(run)
        self.watchdog = watchdog
        self.extra_env = dict(extra_env or {})
        self.container: Any = None
        # inside the container the server binds 0.0.0.0, which it refuses without a token
        self.token = self.token or secrets.token_urlsafe(24)

    @property
    def client(self):
        if self._client is None:
            self._client = docker_client()
            if self._client is None:
                raise EnvServerStartError(f"cannot start {self.env_name!r} in a container: "
                                          "no Docker daemon answers", url=None)
        return self._client

    @property
    def pid(self) -> None:  # the process lives in the container's namespace
        return None

    def command(self) -> list[str]:
        return ["python", *self.server_args("0.0.0.0", CONTAINER_PORT)]

    def labels(self) -> dict[str, str]:
        return {LABEL: self.env_name, RUN_LABEL: self.run, OWNER_LABEL: owner_id(), HOST_LABEL: socket.gethostname()}

    def _launch(self) -> None:
        if self.container is not None:  # restart: a fresh container on the same host port
            self._remove()
        if self.watchdog:
            _ensure_watchdog(self.client)
        try:  # create, then start: a start that fails still leaves a handle to remove
            self.container = self.client.containers.create(
                self.image,
                command=self.command(),
                ports={f"{CONTAINER_PORT}/tcp": (self.host, self.port)},
                environment={"PYTHONUNBUFFERED": "1", **self.extra_env,
                             "SCALINGINTER_INSTANCE": self.instance_id or "", TOKEN_ENV: self.token},
                labels=self.labels(),
                mem_limit=self.mem_limit,
                nano_cpus=int(self.cpus * 1e9),
                pids_limit=self.pids_limit,
                shm_size=self.shm_size,
                init=True,  # SIGTERM reaches the server, zombies are reaped
            )
            self.container.start()
        except EnvServerStartError:
            raise
        except Exception as e:  # noqa: BLE001 - docker.errors.APIError, a timeout: the caller's start() cleans up
            raise EnvServerStartError(f"the Docker engine could not start {self.env_name!r} from {self.image}: "
                                      f"{type(e).__name__}: {e}", url=None) from e

    def _launched(self) -> bool:
        return self.container is not None

    def exit_code(self) -> int | None:
        if self.container is None:
            return None
        try:
            self.container.reload()
        except Exception:  # noqa: BLE001 - removed behind our back: it is gone
            return -1
        if self.container.status in ("created", "running", "restarting"):
            return None
        return int(self.container.attrs.get("State", {}).get("ExitCode", -1))

    def log_tail(self, n_lines: int = 40) -> str:
        if self.container is None:
            return ""
        try:
            return self.container.logs(tail=n_lines).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            return ""

    def _terminate(self, timeout_s: float = 5.0) -> int | None:
        if self.container is None:
            return None
        if self.exit_code() is None:
            try:
                self.container.stop(timeout=int(max(1, timeout_s)))
            except Exception:  # noqa: BLE001 - already gone
                pass
        return self.exit_code()

    def kill(self) -> None:
        if self.container is not None and self.exit_code() is None:
            self.container.kill()
            self.container.wait(timeout=10)

    def _remove(self) -> None:
        c, self.container = self.container, None
        if c is not None:
            try:
                c.remove(force=True)
            except Exception:  # noqa: BLE001
                pass

    def _release(self) -> None:
        self._remove()

    def __repr__(self) -> str:
        cid = getattr(self.container, "short_id", None)
        state = "running" if self.running() else "stopped"
        return f"EnvServerContainer({self.env_name!r}, image={self.image!r}, port={self.port}, id={cid}, {state})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.containers", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="remove OWNER's containers once that process has ended")
    w.add_argument("--owner", required=True, help="host:pid:start:boot (envs.containers.owner_id)")
    w.add_argument("--poll", type=float, default=1.0)
    sub.add_parser("orphans", help="remove this host's env server containers whose owner is gone")
    sub.add_parser("source-hash", help="print the hash of core/ + envs/ that an image built from here is labelled with")
    a = p.parse_args(argv)
    if a.cmd == "watch":
        watch(a.owner, a.poll)
    elif a.cmd == "orphans":
        client = docker_client()
        if client is None:
            raise SystemExit("no Docker daemon answers")
        for name in remove_orphans(client):
            print(f"removed {name}")
    else:
        print(source_hash())
    return 0


if __name__ == "__main__":
    sys.exit(main())
