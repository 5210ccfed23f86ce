"""Script injection into the local sites and escapes from the task's sites (issue 18).

The probe that found it: one ``goto`` whose URL held ``../`` and a quote put markup into the episode key, which
the shop wrote into ``href='...'`` unescaped; Chromium ran the injected script, which fetched a host outside the
task and sent ``POST /create`` to the env server. Here the same attacks (and spellings of them: backslashes,
``%2e%2e``, upper-case schemes, ``user@`` hosts, relative paths) go through the real env server and the real
browser, next to an "outsider" HTTP server that counts every request it gets. Nothing may reach it, the env
server may see no ``/create`` but ours, and the page may not leave the task's site.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import pytest

import envs  # noqa: F401
from envs.client import EnvClient
from envs.spawn import EnvServerProcess


class Outsider:
    """A loopback HTTP server outside every task; counts the requests that reach it."""

    def __init__(self):
        hits = self.hits = []

        class H(BaseHTTPRequestHandler):
            def _any(self):
                hits.append((self.command, self.path))
                self.send_response(200)
                self.send_header("Access-Control-Allow-Origin", "*")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_GET = do_POST = do_OPTIONS = do_HEAD = do_PUT = _any

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()


@pytest.fixture(scope="module")
def outsider():
    o = Outsider()
    yield o
    o.close()


@pytest.fixture(scope="module")
def web_server():
    with EnvServerProcess("webarena", env_options={"max_contexts": 2}, startup_timeout_s=180) as srv:
        yield srv


def _url_of(obs: str) -> str:
    return next(ln[5:] for ln in obs.splitlines() if ln.startswith("URL: "))


def test_goto_with_dot_segments_and_quotes_runs_no_script_and_stays_on_site(web_server, outsider):
    with EnvClient(web_server.url, timeout_s=120) as client:
        env_id = client.create()
        r = client.reset(env_id, 0)
        start = _url_of(r.observation)
        parts = urlsplit(start)
        origin = f"{parts.scheme}://{parts.netloc}"
        key, site = parts.path.split("/")[2], parts.path.split("/")[3]
        base = f"{origin}/e/{key}/{site}"
        created = httpx.get(web_server.url + "/health").json()["created_total"]
        env_create = f"{web_server.url}/create"
        o = outsider.url
        script = f"<script>fetch('{env_create}',{{method:'POST'}});fetch('{o}/s')</script>"
        attacks = [
            f"{base}/../../e/x'>{script}/{site}/",  # the probe's shape
            f"{base}/..\\..\\e\\x'><img src=x onerror=fetch('{o}/b')>\\{site}\\",
            f"{base}/%2e%2e/%2E%2e/e/x%27%3E%3Cscript%3Efetch(%27{o}/c%27)%3C/script%3E/{site}/",
            f"{origin}/e/{key}'onmouseover='fetch(`{o}/d`)'/{site}/",
            f"{origin}/e/0123456789ab/{site}/",  # a well-formed key the env never issued
            f"{base}/../../../miniwob/",
            f"HTTP://127.0.0.1:{parts.port}@{urlsplit(o).netloc}/e",
            f"{o}/direct",
            o.replace("http://", "http:\\\\") + "/backslashes",
            o.replace("http://", "http:////") + "/slashes",
            f"../../e/x'>{script}/{site}/",  # relative to the page
            f"javascript:fetch('{o}/js')",
        ]
        outcomes = []
        for a in attacks:
            s = client.step(env_id, f"Action: goto [{a}]")
            assert not s.done
            url = _url_of(s.observation)
            outcomes.append((a, url, s.info.get("action_error")))
            assert url == base or url.startswith(base + "/") or url.startswith(base + "?"), (a, url)
            page_text = s.observation.split("OBSERVATION:", 1)[1]  # the page (the NOTE quotes the action)
            assert "script" not in page_text.lower() and "onerror" not in page_text and o not in page_text
        # the page's links still work after all that: the episode goes on
        s = client.step(env_id, f"Action: goto [{base}/]")
        assert _url_of(s.observation).startswith(base) and not s.info.get("action_error")
        assert httpx.get(web_server.url + "/health").json()["created_total"] == created, "the page called /create"
        assert outsider.hits == [], outsider.hits
        refused = sum(1 for _, _, err in outcomes if err and "outside the allowed sites" in err)
        print(f"\n{len(attacks)} injection gotos: {refused} refused as outside the task, the rest stayed on "
              f"{base}; outsider hits {len(outsider.hits)}, extra /create 0")
        assert refused >= len(attacks) - 1

        # the site server itself: keys that are not the issued form, or were never issued, are 404
        with httpx.Client(timeout=10) as h:
            assert h.get(f"{base}/").status_code == 200
            assert h.get(f"{origin}/e/x'><script>alert(1)</script>/{site}/").status_code == 404
            assert h.get(f"{origin}/e/0123456789ab/{site}/").status_code == 404
            if key.upper() != key:  # an all-digit key (p ~ 0.4 %) has no other case to try
                assert h.get(f"{origin}/e/{key.upper()}/{site}/").status_code == 404
        client.close(env_id)


def test_every_browser_request_off_site_is_aborted(outsider):
    """Sub-resources and fetches made by a page go through the context's filter (context.route)."""
    from envs.base import make_env

    env = make_env("webarena", max_contexts=1)
    try:
        obs, info = env.reset(0)
        base = info["url"].rsplit("/", 1)[0] if not info["url"].endswith("/") else info["url"].rstrip("/")
        before = len(outsider.hits)

        async def probe():
            page = await env.page()
            return await page.evaluate(
                """async ([o, same]) => {
                    const out = {};
                    try { await fetch(o + '/fetch'); out.off = 'loaded'; } catch (e) { out.off = 'blocked'; }
                    try { const r = await fetch(same); out.same = r.status; } catch (e) { out.same = 'blocked'; }
                    await new Promise(done => { const i = new Image(); i.onload = i.onerror = done;
                                                i.src = o + '/img.png'; });
                    return out;
                }""",
                [outsider.url, base + "/"],
            )

        res = env._run(probe())
        assert res == {"off": "blocked", "same": 200}, res
        assert len(outsider.hits) == before, outsider.hits
        assert env._lease.blocked_requests >= 2
    finally:
        env.close()


@pytest.mark.parametrize("raw, canon", [
    ("http://127.0.0.1:8000/e/0123456789ab/shop/../../e/x'>/shop/", "http://127.0.0.1:8000/e/e/x%27%3E/shop/"),
    ("HTTP://127.0.0.1:8000/e/k/shop/%2e%2e/%2E%2e/x", "http://127.0.0.1:8000/e/x"),
    ("http:\\\\Evil.COM\\a\\..\\b", "http://evil.com/b"),
    ("http:////evil.com", "http://evil.com/"),
    ("https://x.com:443/?q=\"<a>#f'", "https://x.com/?q=%22%3Ca%3E#f%27"),
    ("http://127.0.0.1:08000/e/k/shop?x=1", "http://127.0.0.1:8000/e/k/shop?x=1"),
    ("http://a.b:80/./c/.", "http://a.b/c/"),
    (" http://a.b/\tc\n", "http://a.b/c"),
    ("about:blank", "about:blank"),
    ("http://127.0.0.1:8000@evil.com/", None),  # the host is evil.com: refused outright
    ("javascript:alert(1)", None),
    ("file:///etc/passwd", None),
    ("http:evil.com", None),
    ("http://ev%69l.com/", None),
    ("http://a.b:99999/", None),
])
def test_normalize_url(raw, canon):
    from envs.web.urls import normalize_url

    assert normalize_url(raw) == canon


def test_relative_urls_resolve_against_the_page():
    from envs.web.urls import normalize_url

    page = "http://127.0.0.1:8000/e/0123456789ab/shop/cart"
    assert normalize_url("../forum/", page) == "http://127.0.0.1:8000/e/0123456789ab/forum/"
    assert normalize_url("\\\\evil.com/x", page) == "http://evil.com/x"
    assert normalize_url("x", "about:blank") is None
