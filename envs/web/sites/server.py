"""Serve the local sites (and MiniWoB's HTML) on loopback from a background thread of this process.

    srv = SiteServer.shared()          # started once per process, on a free port
    key = srv.new_episode()            # fresh state for shop and forum under /e/<key>/
    srv.site_url(key, "shop")          # -> http://127.0.0.1:PORT/e/<key>/shop
    srv.drop_episode(key)              # forget the state

Only keys the env issued (``new_episode``) have state: a request for any other key is a 404, so a page cannot
mint episodes. A site's state is created on the first request of an issued key and kept in memory; at most
``max_episodes`` keys are kept (oldest dropped first), so episodes whose env vanished cannot leak memory.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from envs.web.sites import forum, shop
from envs.web.sites.common import KEY_RE, new_key

log = logging.getLogger("envs.web.sites")
SITES = {"shop": shop, "forum": forum}


class EpisodeStore:
    """Per-episode, per-site state dicts (thread-safe, bounded)."""

    def __init__(self, max_episodes: int = 1024):
        self.max_episodes = max_episodes
        self._lock = threading.Lock()
        self._states: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def issue(self, key: str) -> None:
        """Make ``key`` an episode (state for its sites is created on first use)."""
        if not KEY_RE.fullmatch(key):
            raise ValueError(f"episode keys are 12 lower-case hex digits, got {key!r}")
        with self._lock:
            self._states.setdefault(key, {})
            self._states.move_to_end(key)
            while len(self._states) > self.max_episodes:
                self._states.popitem(last=False)

    def get(self, key: str, site: str) -> dict[str, Any] | None:
        """The state of ``site`` in episode ``key``, or None when the key was never issued (or was dropped)."""
        with self._lock:
            ep = self._states.get(key)
            if ep is None:
                return None
            self._states.move_to_end(key)
            if site not in ep:
                ep[site] = SITES[site].fresh_state()
            return ep[site]

    def drop(self, key: str) -> None:
        with self._lock:
            self._states.pop(key, None)

    def __len__(self) -> int:
        return len(self._states)


def miniwob_html_dir() -> Path | None:
    try:
        import miniwob
    except ImportError:
        return None
    d = Path(miniwob.__file__).resolve().parent / "html"
    return d if d.is_dir() else None


def create_site_app(store: EpisodeStore) -> Starlette:
    routes: list[Any] = [Route("/health", lambda r: PlainTextResponse("ok"))]
    for name, mod in SITES.items():

        def getter(request: Request, _name: str = name) -> dict[str, Any]:
            state = store.get(request.path_params["key"], _name)
            if state is None:
                raise HTTPException(404, "no such episode")
            return state

        routes.append(Mount(f"/e/{{key}}/{name}", routes=mod.make_routes(getter)))
    html = miniwob_html_dir()
    if html is not None:
        from starlette.staticfiles import StaticFiles

        routes.append(Mount("/miniwob", app=StaticFiles(directory=str(html)), name="miniwob"))
    return Starlette(routes=routes)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SiteServer:
    _shared: "SiteServer | None" = None
    _shared_lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, max_episodes: int = 1024):
        import uvicorn

        self.host = host
        self.port = port or _free_port(host)
        self.store = EpisodeStore(max_episodes)
        self.app = create_site_app(self.store)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self._thread = threading.Thread(target=self._server.run, name="web-sites", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"local web sites failed to start on {host}:{self.port}")
            time.sleep(0.01)

    @classmethod
    def shared(cls) -> "SiteServer":
        with cls._shared_lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = SiteServer()
            return cls._shared

    @property
    def origin(self) -> str:
        return f"http://{self.host}:{self.port}"

    def new_episode(self) -> str:
        key = new_key()
        self.store.issue(key)
        return key

    def site_url(self, key: str, site: str) -> str:
        if site not in SITES:
            raise ValueError(f"unknown local site {site!r}; local sites: {', '.join(SITES)}")
        return f"{self.origin}/e/{key}/{site}"

    def drop_episode(self, key: str) -> None:
        self.store.drop(key)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)
