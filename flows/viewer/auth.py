"""Access control of the trajectory viewer (``scalinginter view``) when it listens beyond loopback.

Bound to a loopback address the viewer needs nothing (as the env servers). Bound anywhere else it needs a
token: ``--token``, else ``$SCALINGINTER_VIEW_TOKEN``, else one generated at start-up and printed inside the
URL to open. Every request must then carry it, as ``Authorization: Bearer <token>``, as the ``token`` query
parameter (the printed URL), or as the ``si_view`` cookie the viewer sets when a request brings a good token
(HttpOnly, SameSite=Strict), so the pages' own links and fragment requests work after the first visit. A
request without it gets 401 and a page that says how to get in; the token is compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, quote

VIEW_TOKEN_ENV = "SCALINGINTER_VIEW_TOKEN"
COOKIE = "si_view"


def is_loopback(host: str) -> bool:
    from envs.server import is_loopback as _is_loopback

    return _is_loopback(host)


def resolve_token(host: str, token: str | None, environ: dict[str, str]) -> tuple[str | None, bool]:
    """(the token the viewer needs, whether it was generated here). Loopback without one: (None, False)."""
    token = token or environ.get(VIEW_TOKEN_ENV) or None
    if token or is_loopback(host):
        return token, False
    return secrets.token_urlsafe(24), True


def login_url(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    base = f"http://{shown}:{port}/"
    return base + (f"?token={quote(token, safe='')}" if token else "")


class ViewerGuard:
    """ASGI middleware: every HTTP request needs the token (header, query parameter or cookie)."""

    def __init__(self, app: Any, *, token: str):
        self.app = app
        self.token = token.encode()

    def _presented(self, scope: dict[str, Any]) -> tuple[bytes | None, bool]:
        """(the token the request brings, whether it came in the query string)."""
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, value = auth.partition(b" ")
        if scheme.lower() == b"bearer" and value.strip():
            return value.strip(), False
        query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        if query.get("token"):
            return query["token"][-1].encode(), True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # noqa: BLE001  (a malformed cookie header is simply no token)
            return None, False
        return (cookie[COOKIE].value.encode(), False) if COOKIE in cookie else (None, False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        got, from_query = self._presented(scope)
        if got is None or not hmac.compare_digest(got, self.token):
            body = (b"<!doctype html><title>401: token needed</title><p>This viewer listens beyond loopback and "
                    b"needs its token: open the URL it printed at start-up (<code>/?token=...</code>), or send "
                    b"<code>Authorization: Bearer &lt;token&gt;</code>.</p>")
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                    (b"www-authenticate", b'Bearer realm="scalinginter view"'),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if not from_query:
            return await self.app(scope, receive, send)
        cookie = f"{COOKIE}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict".encode()

        async def send_with_cookie(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)
