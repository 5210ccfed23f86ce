"""``scalinginter view`` beyond loopback: a token is required (given, from $SCALINGINTER_VIEW_TOKEN, or generated
and printed in the URL), and every request must bring it (header, ``?token=`` or the cookie that sets)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from flows.viewer.auth import COOKIE, VIEW_TOKEN_ENV, login_url, resolve_token
from flows.viewer.app import create_app


def test_token_is_required_off_loopback_and_generated_when_missing():
    assert resolve_token("127.0.0.1", None, {}) == (None, False)
    assert resolve_token("localhost", None, {}) == (None, False)
    assert resolve_token("0.0.0.0", "s3cret", {}) == ("s3cret", False)
    assert resolve_token("10.1.2.3", None, {VIEW_TOKEN_ENV: "from-env"}) == ("from-env", False)
    tok, generated = resolve_token("0.0.0.0", None, {})
    tok2, _ = resolve_token("::", None, {})
    assert generated and len(tok) >= 24 and tok != tok2
    assert login_url("0.0.0.0", 8765, "a b") == "http://0.0.0.0:8765/?token=a%20b"
    assert login_url("::", 8765, "t") == "http://[::]:8765/?token=t"


def test_every_request_needs_the_token(tmp_path):
    app = create_app(tmp_path, token="s3cret")
    with TestClient(app) as c:
        for path in ("/", "/evals", "/static/viewer.css", "/runs/x"):
            r = c.get(path)
            assert r.status_code == 401 and "token" in r.text, path
        assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/?token=wrong").status_code == 401
        assert c.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = c.get("/?token=s3cret")  # the printed URL: sets the cookie the pages' links then carry
        assert r.status_code == 200 and COOKIE in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
        assert c.get("/evals").status_code == 200  # the client kept the cookie
    with TestClient(app) as fresh:
        fresh.cookies.set(COOKIE, "wrong")
        assert fresh.get("/").status_code == 401


def test_loopback_viewer_without_token_is_open(tmp_path):
    with TestClient(create_app(tmp_path)) as c:
        assert c.get("/").status_code == 200
