"""Env servers as Docker containers, through the Docker SDK (``pip install docker``), behind the same handle as
a local process (``envs.spawn.EnvServerHandle``): a free host port published on 127.0.0.1, the same
``/health`` check with a per-launch instance token, restart on the same port, stop + remove on teardown.

Images (``infra/docker/``), one per heavy dependency set:

    scalinginter/env-web        Chromium + Playwright: webarena, miniwob
    scalinginter/env-sciworld   a Java 17 runtime: sciworld
    scalinginter/env-light      everything else: babyai, textcraft, searchqa, toy

``unavailable_reason(image)`` says why containers cannot be used here (no SDK, no daemon, image not built);
``spawn_env_server(runtime="auto")`` then falls back to local processes.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from envs.client import TOKEN_ENV
from envs.errors import EnvServerStartError
from envs.spawn import EnvServerHandle

IMAGE_TAG = os.environ.get("SCALINGINTER_IMAGE_TAG", "latest")
IMAGE_OF_ENV = {"webarena": "env-web", "miniwob": "env-web", "sciworld": "env-sciworld"}
CONTAINER_PORT = 8000
LABEL = "org.scalinginter.env-server"


def image_for(env_name: str, tag: str = IMAGE_TAG, repo: str = "scalinginter") -> str:
    """The image that serves ``env_name`` (``repo/env-light:tag`` unless the env has heavy dependencies)."""
    return f"{repo}/{IMAGE_OF_ENV.get(env_name, 'env-light')}:{tag}"


def docker_client(timeout_s: float = 3.0):
    """A Docker SDK client from the environment (``DOCKER_HOST`` or the local socket), or None."""
    try:
        import docker
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=int(max(1, timeout_s)))
        client.ping()
        return client
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
        return "no Docker daemon answers (DOCKER_HOST or /var/run/docker.sock)"
    try:
        client.images.get(image)
    except Exception as e:  # noqa: BLE001 - docker.errors.ImageNotFound and API errors
        return f"image {image} is not available ({type(e).__name__})"
    return None


class EnvServerContainer(EnvServerHandle):
    """An env server in a container; the host port is published on ``host`` (127.0.0.1 by default)."""

    kind = "docker"
    port_taken_markers = ("address already in use", "port is already allocated")

    def __init__(self, env_name: str, host: str = "127.0.0.1", port: int | None = None,
                 env_options: dict[str, Any] | None = None, *, image: str | None = None,
                 docker_client: Any = None, mem_limit: str | None = None, shm_size: str = "1g",
                 extra_env: dict[str, str] | None = None, startup_timeout_s: float = 120.0, **kw: Any):
        super().__init__(env_name, host, port, env_options, startup_timeout_s=startup_timeout_s, **kw)
        self.image = image or image_for(env_name)
        self._client = docker_client
        self.mem_limit = mem_limit
        self.shm_size = shm_size  # Chromium needs more than Docker's 64 MB /dev/shm
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

    def _launch(self) -> None:
        if self.container is not None:  # restart: a fresh container on the same host port
            self._remove()
        self.container = self.client.containers.run(
            self.image,
            command=self.command(),
            detach=True,
            ports={f"{CONTAINER_PORT}/tcp": (self.host, self.port)},
            environment={"PYTHONUNBUFFERED": "1", **self.extra_env, "SCALINGINTER_INSTANCE": self.instance_id or "",
                         TOKEN_ENV: self.token},
            labels={LABEL: self.env_name, f"{LABEL}.owner-pid": str(os.getpid())},
            mem_limit=self.mem_limit,
            shm_size=self.shm_size,
            init=True,  # SIGTERM reaches the server, zombies are reaped
        )

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
