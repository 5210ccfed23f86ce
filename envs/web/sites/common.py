"""HTML helpers shared by the local sites (plain server-rendered HTML, no JavaScript)."""

from __future__ import annotations

import re
import uuid
from html import escape

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

# The only form of episode key the site server issues (``new_key``); any other path segment is a 404, so nothing
# a URL carries in that segment (quotes, markup, dot segments) ever reaches a page.
KEY_RE = re.compile(r"[0-9a-f]{12}")


def new_key() -> str:
    return uuid.uuid4().hex[:12]


def episode_base(request: Request, site: str) -> str:
    """``/e/<key>/<site>`` for links on a page: the key checked against the issued form (404 otherwise), escaped."""
    key = request.path_params.get("key", "")
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise HTTPException(404, "no such episode")
    return f"/e/{e(key)}/{site}"


def e(x: object) -> str:
    return escape(str(x), quote=True)


def page(title: str, nav: str, body: str) -> str:
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{e(title)}</title>"
        "<style>body{font-family:sans-serif;margin:12px;max-width:900px} nav a{margin-right:10px}"
        " li{margin:3px 0} td,th{padding:2px 8px;text-align:left}</style></head><body>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>"
    )


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def state_route(path: str, handler, get_state, **kw) -> Route:
    """A starlette Route whose endpoint calls ``handler(request, state)`` with the episode's state
    (``get_state(request)`` answers 404 for a key the env did not issue)."""
    async def endpoint(request: Request):
        return await handler(request, get_state(request))

    return Route(path, endpoint, **kw)
