"""A bounded pool of Chromium browser contexts shared by all web envs of a process.

One Playwright driver and one Chromium (Debian's ``/usr/bin/chromium``; never downloaded) run on a private
asyncio loop in a background thread, so env methods called from any worker thread of the env server can
drive the browser (Playwright objects are bound to the loop that made them). Envs submit coroutines with
``pool.run(coro)``, which waits at most ``action_timeout_s`` (plus a margin).

- ``acquire()`` hands out a ``Lease`` on a browser context (at most ``max_contexts`` at once; waiting up to
  ``acquire_timeout_s``, then ``PoolExhausted``). Contexts are reused across episodes: ``release`` closes the
  extra tabs, clears cookies and parks the context; a context is retired after ``episodes_per_context``
  episodes (memory stays flat), and a broken one (page crash, timeout, closed target) is closed, not reused.
- If Chromium itself dies, the next ``acquire`` launches a new one.
- Every network request of a context (navigations, sub-resources, fetches, form posts) goes through a filter:
  it continues only when the leasing env's ``lease.data["allow"](url)`` says yes, and is aborted otherwise
  (also between episodes, when no env holds the context). Playwright does not show a navigation's redirect
  hops to the filter; the env checks where the page landed after every action and sends it back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Awaitable

log = logging.getLogger("envs.web.browser")

CHROMIUM = os.environ.get("SI_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [  # no --no-sandbox: the sandbox stays on wherever the kernel allows it (see launch_chromium)
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
    "--disable-extensions",
]


class BrowserUnavailable(RuntimeError):
    """Chromium or Playwright is missing, or the browser could not be started."""


SANDBOX_ENV = "SI_CHROMIUM_SANDBOX"  # auto (default): sandbox, else a logged fallback; 1: sandbox or fail; 0: off


def sandbox_attempts(setting: str | None) -> list[bool]:
    """The sandbox settings to launch Chromium with, in order (True: sandboxed). ``auto``: sandboxed first, and
    without the sandbox only when that launch fails (a kernel without unprivileged user namespaces, root in a
    container without the setuid helper); ``1``: sandboxed only; ``0``: unsandboxed only."""
    v = (setting or "auto").strip().lower()
    if v in ("1", "true", "yes", "on", "require"):
        return [True]
    if v in ("0", "false", "no", "off"):
        return [False]
    if v != "auto":
        raise BrowserUnavailable(f"{SANDBOX_ENV}={setting!r}: expected auto, 1 or 0")
    return [True, False]


async def launch_chromium(launch: Any, executable: str, setting: str | None = None, **kw: Any) -> tuple[Any, bool]:
    """(browser, sandboxed): ``launch`` is Playwright's ``chromium.launch``, tried per ``sandbox_attempts``
    (``$SI_CHROMIUM_SANDBOX`` when ``setting`` is None). Running without the sandbox is logged as a warning."""
    setting = os.environ.get(SANDBOX_ENV) if setting is None else setting
    errors = []
    for sandboxed in sandbox_attempts(setting):
        args = CHROMIUM_ARGS if sandboxed else [*CHROMIUM_ARGS, "--no-sandbox"]
        try:
            browser = await launch(executable_path=executable, headless=True, args=args, chromium_sandbox=sandboxed,
                                   **kw)
        except Exception as exc:  # noqa: BLE001
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
            first = next((ln for ln in lines if "sandbox" in ln.lower()), lines[0])  # the reason, where it says
            errors.append(f"{'sandboxed' if sandboxed else 'without sandbox'}: {first}")
            continue
        if not sandboxed:
            log.warning("Chromium runs WITHOUT its sandbox (%s); pages it loads are not isolated from this user: "
                        "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as "
                        "a non-root user to keep it", "; ".join(errors) or f"{SANDBOX_ENV}=0")
        return browser, sandboxed
    raise BrowserUnavailable(f"could not start Chromium ({executable}): " + "; ".join(errors))


class PoolExhausted(RuntimeError):
    """All browser contexts are leased and none came back in time."""


def check_browser_installed(executable: str = CHROMIUM) -> None:
    """Raise ``BrowserUnavailable`` with the fix when Playwright or Chromium is missing."""
    try:
        import playwright  # noqa: F401
    except ImportError as exc:
        raise BrowserUnavailable(
            "the Python package 'playwright' is not installed; run infra/install.sh "
            "(never 'playwright install': we drive Debian's Chromium)"
        ) from exc
    if not (os.path.isfile(executable) and os.access(executable, os.X_OK)) and not shutil.which(executable):
        raise BrowserUnavailable(
            f"Chromium not found at {executable}; install it with 'apt-get install -y chromium' (infra/install.sh "
            "does) or point SI_CHROMIUM at a Chromium binary"
        )


@dataclass(eq=False)
class Lease:
    context: Any  # playwright BrowserContext
    pool: "BrowserPool"
    episodes: int = 0
    broken: bool = False
    released: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    blocked_requests: int = 0  # requests the filter aborted (see ``BrowserPool._guard``)


class BrowserPool:
    _shared: dict[tuple, "BrowserPool"] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self,
        max_contexts: int = 16,
        action_timeout_s: float = 10.0,
        acquire_timeout_s: float = 120.0,
        episodes_per_context: int = 50,
        executable: str = CHROMIUM,
        viewport: tuple[int, int] = (1024, 768),
    ):
        if max_contexts < 1 or action_timeout_s <= 0 or episodes_per_context < 1:
            raise ValueError("max_contexts and episodes_per_context must be >= 1, action_timeout_s > 0")
        check_browser_installed(executable)
        self.max_contexts = int(max_contexts)
        self.action_timeout_s = float(action_timeout_s)
        self.acquire_timeout_s = float(acquire_timeout_s)
        self.episodes_per_context = int(episodes_per_context)
        self.executable = executable
        self.viewport = {"width": int(viewport[0]), "height": int(viewport[1])}
        self._sem = threading.BoundedSemaphore(self.max_contexts)
        self._idle: list[Lease] = []
        self._leased: set[Lease] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="browser-pool", daemon=True)
        self._thread.start()
        self._pw: Any = None
        self._browser: Any = None
        self._browser_lock: asyncio.Lock | None = None
        self.launches = 0
        self.sandboxed: bool | None = None  # whether the running Chromium has its sandbox (None: not launched)
        self.contexts_created = 0
        self.contexts_retired = 0
        self._closed = False

    @classmethod
    def shared(cls, **kwargs: Any) -> "BrowserPool":
        """One pool per process and settings (every env of an env server shares it)."""
        key = tuple(sorted(kwargs.items()))
        with cls._shared_lock:
            pool = cls._shared.get(key)
            if pool is None or pool._closed:
                pool = cls._shared[key] = cls(**kwargs)
            return pool

    @property
    def capacity(self) -> int:
        """Episodes that can hold a context at once (an env server advertises it on ``/health``)."""
        return self.max_contexts

    # --- running coroutines on the browser loop -----------------------------------------------------------
    def run(self, coro: Awaitable[Any], timeout_s: float | None = None) -> Any:
        if self._closed:
            raise BrowserUnavailable("the browser pool is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout_s if timeout_s is not None else self.action_timeout_s * 3 + 10)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError("the browser did not answer in time") from None

    async def _ensure_browser(self) -> Any:
        if self._browser_lock is None:
            self._browser_lock = asyncio.Lock()
        async with self._browser_lock:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._pw is None:
                from playwright.async_api import async_playwright

                self._pw = await async_playwright().start()
            self._browser, self.sandboxed = await launch_chromium(self._pw.chromium.launch, self.executable,
                                                                  timeout=60_000)
            self.launches += 1
            log.info("launched Chromium (%d launch(es) so far, sandbox %s)", self.launches,
                     "on" if self.sandboxed else "off")
            return self._browser

    async def _new_context(self) -> Any:
        browser = await self._ensure_browser()
        ctx = await browser.new_context(viewport=self.viewport, service_workers="block", java_script_enabled=True)
        ctx.set_default_timeout(self.action_timeout_s * 1000)
        ctx.set_default_navigation_timeout(self.action_timeout_s * 1000)
        self.contexts_created += 1
        return ctx

    # --- leases ----------------------------------------------------------------------------------------------
    def acquire(self) -> Lease:
        if not self._sem.acquire(timeout=self.acquire_timeout_s):
            raise PoolExhausted(
                f"all {self.max_contexts} browser contexts are in use and none was released within "
                f"{self.acquire_timeout_s:g} s; run fewer concurrent episodes or raise max_contexts"
            )
        try:
            lease = None
            with self._lock:
                while self._idle:
                    cand = self._idle.pop()
                    if self._alive(cand):
                        lease = cand
                        break
                    self._discard(cand)
            if lease is None:
                lease = Lease(self.run(self._new_context(), 90), self)
                self.run(self._guard(lease), 30)
            lease.released = False
            lease.episodes += 1
            with self._lock:
                self._leased.add(lease)
            return lease
        except BaseException:
            self._sem.release()
            raise

    async def _guard(self, lease: Lease) -> None:
        async def check(route: Any) -> None:
            url = route.request.url
            allow = lease.data.get("allow")
            try:
                ok = bool(allow and allow(url))
            except Exception:  # noqa: BLE001  (a check that fails refuses)
                ok = False
            if ok:
                await route.continue_()
            else:
                lease.blocked_requests += 1
                log.info("blocked a request outside the allowed sites: %s", url[:200])
                await route.abort("blockedbyclient")

        await lease.context.route("**/*", check)

    def _alive(self, lease: Lease) -> bool:
        try:
            b = lease.context.browser
            return not lease.broken and b is not None and b.is_connected()
        except Exception:  # noqa: BLE001
            return False

    def _discard(self, lease: Lease) -> None:
        self.contexts_retired += 1
        try:
            self.run(lease.context.close(), 15)
        except Exception:  # noqa: BLE001
            pass

    def release(self, lease: Lease, broken: bool = False) -> None:
        if lease.released:
            return
        lease.released = True
        lease.data.pop("allow", None)  # parked: no request passes until the next env sets its check
        with self._lock:
            self._leased.discard(lease)
        try:
            lease.broken = lease.broken or broken
            if lease.broken or lease.episodes >= self.episodes_per_context or self._closed:
                self._discard(lease)
            else:
                try:
                    self.run(self._scrub(lease.context), 20)
                    with self._lock:
                        self._idle.append(lease)
                except Exception:  # noqa: BLE001
                    lease.broken = True
                    self._discard(lease)
        finally:
            self._sem.release()

    async def _scrub(self, ctx: Any) -> None:
        pages = list(ctx.pages)
        for p in pages[1:]:
            await p.close()
        await ctx.clear_cookies()
        if pages:
            await pages[0].goto("about:blank")

    # --- stats / shutdown --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"leased": len(self._leased), "idle": len(self._idle), "max_contexts": self.max_contexts,
                "launches": self.launches, "sandboxed": self.sandboxed, "contexts_created": self.contexts_created,
                "contexts_retired": self.contexts_retired}

    def browser_pid(self) -> int | None:
        try:
            return self._browser.process.pid if self._browser is not None else None  # not public in every version
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        if self._closed:
            return

        async def _shutdown():
            try:
                if self._browser is not None:
                    await self._browser.close()
            finally:
                if self._pw is not None:
                    await self._pw.stop()

        try:
            self.run(_shutdown(), 30)
        except Exception:  # noqa: BLE001
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
