"""The browser episode shared by the ``webarena`` and ``miniwob`` envs: actions, observation, allowed sites.

A ``BrowserEpisodeEnv`` leases a browser context from the process-wide ``BrowserPool`` at reset, executes
parsed WebArena actions on the active tab, and renders the observation::

    URL: http://127.0.0.1:PORT/e/<key>/shop/product/1
    OBJECTIVE: What is the price of the Blue Ceramic Mug?
    PREVIOUS ACTION: click [8]
    NOTE: <only when the last action could not be done, or was blocked>
    OBSERVATION:
    [1] link 'Home'
    ...

Rules every subclass inherits: a malformed reply changes nothing and sets ``info["invalid_action"]``; an action
on an element id that is not on the page, a failed click/type, and a navigation outside the allowed sites
each give a NOTE (``info["action_error"]``) instead of an exception. Browser crashes and timeouts of the
browser itself raise (the server reports them as env errors, the rollout masks the episode).
Subclasses implement ``_start_episode`` (open the task), ``_after_action`` (task reward/termination),
``_finish`` (the ``stop`` action) and ``allowed(url)``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from envs.base import StepResult
from envs.web.a11y import ID_ATTR, SNAPSHOT_JS, Snapshot, format_tree
from envs.web.actions import USAGE, Action, parse_action
from envs.web.browser import BrowserPool, Lease
from envs.web.urls import normalize_url

log = logging.getLogger("envs.web")

_KEY_NAMES = {"ctrl": "Control", "control": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
              "enter": "Enter", "return": "Enter", "tab": "Tab", "esc": "Escape", "escape": "Escape",
              "backspace": "Backspace", "delete": "Delete", "del": "Delete", "space": "Space", "up": "ArrowUp",
              "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight", "pageup": "PageUp",
              "pagedown": "PageDown", "home": "Home", "end": "End"}


def normalize_keys(keys: str) -> str:
    """'ctrl+a' -> 'Control+a', 'enter' -> 'Enter' (Playwright key names)."""
    parts = [p.strip() for p in keys.replace(" ", "+").split("+") if p.strip()]
    return "+".join(_KEY_NAMES.get(p.lower(), p if len(p) == 1 else p[:1].upper() + p[1:]) for p in parts)


class ActionFailed(Exception):
    """An action that could not be done (shown to the agent as a NOTE)."""


class BrowserEpisodeEnv:
    name = "web"

    def __init__(self, max_obs_chars: int = 2400, max_contexts: int = 16, action_timeout_s: float = 10.0,
                 acquire_timeout_s: float = 120.0, episodes_per_context: int = 50, tree_root: str | None = None):
        if max_obs_chars < 200:
            raise ValueError(f"max_obs_chars must be >= 200, got {max_obs_chars}")
        self.max_obs_chars = int(max_obs_chars)
        self.action_timeout_s = float(action_timeout_s)
        self.pool = BrowserPool.shared(max_contexts=int(max_contexts), action_timeout_s=float(action_timeout_s),
                                       acquire_timeout_s=float(acquire_timeout_s),
                                       episodes_per_context=int(episodes_per_context))
        self.tree_root = tree_root
        self._lease: Optional[Lease] = None
        self._active = 0
        self._objective = ""
        self._prev = "None"
        self._obs = ""
        self._done = True
        self._started = False
        self._turn = 0
        self._url = ""
        self._snapshot: Optional[Snapshot] = None
        self._episode_info: dict[str, Any] = {}  # task id, site, ... repeated in every step's info

    # --- subclass hooks ----------------------------------------------------------------------------------------
    async def _start_episode(self, data_idx: int) -> dict[str, Any]:
        raise NotImplementedError

    async def _after_action(self, action: Action) -> tuple[float, bool, bool, dict[str, Any]]:
        """(reward, terminated, success, extra info) after a non-stop action."""
        return 0.0, False, False, {}

    async def _finish(self, answer: str) -> tuple[float, bool, str, dict[str, Any]]:
        """The ``stop`` action: (reward, success, message, extra info)."""
        raise NotImplementedError

    def allowed(self, url: str) -> bool:
        """Whether a canonical URL (``envs.web.urls.normalize_url``) is inside the task's sites."""
        return True

    def url_allowed(self, url: str) -> bool:
        """The allow check on any URL: normalised first (dot segments, backslashes, scheme, host, port), so
        ``allowed`` only ever sees canonical URLs. The browser's request filter calls this for every request."""
        canon = normalize_url(url)
        return canon is not None and self.allowed(canon)

    def allowed_description(self) -> str:
        return "the task's sites"

    def _end_episode(self) -> None:
        """Forget per-episode state (called when the lease goes back)."""

    # --- TextEnv --------------------------------------------------------------------------------------------------
    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        self._release()
        self._lease = self.pool.acquire()
        self._lease.data["allow"] = self.url_allowed  # every request of the context passes this check
        self._active = 0
        self._prev, self._turn, self._done, self._started = "None", 0, False, True
        try:
            self._episode_info = {}
            info = self._run(self._start_episode(int(data_idx)), long=True)
            self._episode_info = {k: v for k, v in info.items() if k != "success"}
            self._obs = self._run(self._render(None))
        except BaseException:
            self._release(broken=True)
            self._done = True
            raise
        info.setdefault("success", False)
        info.update(self._base_info())
        return self._obs, info

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise RuntimeError(f"{self.name} env: step() before reset()")
        if self._done:
            raise RuntimeError(f"{self.name} env: step() after the episode ended; call reset()")
        parsed = parse_action(action)
        if not parsed.ok:
            note = f"Invalid action: {parsed.error}. Actions: {USAGE}. End your reply with 'Action: <action>'."
            self._obs = self._replace_note(note)
            info = {"success": False, "invalid_action": True, "action_error": parsed.error, **self._base_info()}
            return StepResult(self._obs, 0.0, False, False, info)
        act = parsed.action
        assert act is not None
        self._turn += 1
        try:
            result = self._run(self._do_step(act))
        except BaseException:
            self._release(broken=True)
            self._done = True
            raise
        if result.terminated:
            self._done = True
            self._release()
        return result

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._release()
        self._done, self._started = True, False

    # --- internals --------------------------------------------------------------------------------------------------
    def _run(self, coro, long: bool = False):
        return self.pool.run(coro, self.action_timeout_s * (6 if long else 3) + 10)

    def _release(self, broken: bool = False) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._end_episode()
            finally:
                self.pool.release(lease, broken=broken)

    def _base_info(self) -> dict[str, Any]:
        return {**self._episode_info, "url": self._url, "turn": self._turn}

    def _replace_note(self, note: str) -> str:
        lines = [ln for ln in self._obs.split("\n") if not ln.startswith("NOTE: ")]
        for i, ln in enumerate(lines):
            if ln.startswith("OBSERVATION:"):
                lines.insert(i, f"NOTE: {note}")
                break
        else:
            lines.insert(0, f"NOTE: {note}")
        return "\n".join(lines)

    # pages
    @property
    def context(self):
        assert self._lease is not None, "no browser context (reset first)"
        return self._lease.context

    async def page(self):
        ctx = self.context
        pages = ctx.pages
        if not pages:
            p = await ctx.new_page()
            self._active = 0
            return p
        self._active = min(self._active, len(pages) - 1)
        return pages[self._active]

    async def goto(self, url: str) -> None:
        p = await self.page()
        await p.goto(url, wait_until="load")

    async def _settle(self, page) -> None:
        try:
            await page.wait_for_load_state("load", timeout=min(5000, self.action_timeout_s * 1000))
        except Exception:  # noqa: BLE001  (slow page: observe what is there)
            pass

    async def _element(self, page, eid: int):
        loc = page.locator(f'[{ID_ATTR}="{eid}"]')
        if await loc.count() == 0:
            raise ActionFailed(f"there is no element with id [{eid}] on the current page; use an id shown in the "
                               "observation")
        return loc.first

    async def _do_step(self, act: Action) -> StepResult:
        note: Optional[str] = None
        if act.kind == "stop":
            reward, success, message, extra = await self._finish(act.text or "")
            self._prev = act.render()
            self._obs = f"{message}\nPREVIOUS ACTION: {self._prev}"
            info = {"success": success, "answer": act.text or "", **extra, **self._base_info()}
            return StepResult(self._obs, reward, True, False, info)
        ctx = self.context
        n_pages = len(ctx.pages)
        before = (await self.page()).url
        try:
            await self._execute(act)
        except ActionFailed as exc:
            note = f"{act.render()} was not done: {exc}"
        except Exception as exc:  # noqa: BLE001  (Playwright errors of one action: timeouts, detached, not editable)
            if _is_crash(exc):
                raise
            msg = str(exc).split("\n")[0][:200]
            note = f"{act.render()} failed: {msg}"
        # a click may open a tab (target=_blank / window.open): follow it
        if len(ctx.pages) > n_pages and act.kind not in ("new_tab",):
            self._active = len(ctx.pages) - 1
        page = await self.page()
        await self._settle(page)
        if not self.url_allowed(page.url):
            blocked = page.url
            try:
                if before and before != "about:blank" and self.url_allowed(before):
                    await page.goto(before, wait_until="load")
                else:
                    await page.goto("about:blank")
            except Exception as exc:  # noqa: BLE001
                if _is_crash(exc):
                    raise
            note = (f"{blocked} is outside the allowed sites ({self.allowed_description()}); "
                    "you were sent back to the previous page")
        self._prev = act.render()
        reward, terminated, success, extra = await self._after_action(act)
        self._obs = await self._render(note)
        info = {"success": success, **extra, **self._base_info()}
        if note:
            info["action_error"] = note
        return StepResult(self._obs, reward, terminated, False, info)

    async def _execute(self, act: Action) -> None:
        ctx = self.context
        page = await self.page()
        k = act.kind
        if k in ("click", "hover", "type"):
            el = await self._element(page, act.element_id)  # type: ignore[arg-type]
            tag = (await el.evaluate("e => e.tagName")).upper()
            if k == "click":
                if tag == "OPTION":
                    sel = el.locator("xpath=ancestor::select[1]")
                    await sel.select_option(label=(await el.inner_text()).strip())
                else:
                    await el.click()
            elif k == "hover":
                await el.hover()
            else:
                if tag == "SELECT":
                    await el.select_option(label=act.text or "")
                else:
                    editable = await el.evaluate(
                        "e => e.isContentEditable || ((e.tagName === 'INPUT' || e.tagName === 'TEXTAREA') && "
                        "!e.disabled && !e.readOnly && !['button','submit','reset','checkbox','radio','hidden']"
                        ".includes((e.type||'').toLowerCase()))")
                    if not editable:
                        raise ActionFailed(f"element [{act.element_id}] is not a text field")
                    await el.click()
                    await el.fill(act.text or "")
                    if act.press_enter:
                        await el.press("Enter")
        elif k == "press":
            await page.keyboard.press(normalize_keys(act.text or ""))
        elif k == "scroll":
            await page.evaluate("d => window.scrollBy(0, d * window.innerHeight * 0.8)", -1 if act.text == "up" else 1)
        elif k == "goto":
            url = normalize_url(act.text or "", base=page.url)  # what is checked is what the browser loads
            if url is None or not self.allowed(url):
                raise ActionFailed(f"{(act.text or '')[:200]} is outside the allowed sites "
                                   f"({self.allowed_description()})")
            await page.goto(url, wait_until="load")
        elif k == "go_back":
            await page.go_back(wait_until="load")
        elif k == "go_forward":
            await page.go_forward(wait_until="load")
        elif k == "new_tab":
            await ctx.new_page()
            self._active = len(ctx.pages) - 1
        elif k == "tab_focus":
            n = act.number or 0
            if not 0 <= n < len(ctx.pages):
                raise ActionFailed(f"there is no tab {n}; open tabs are 0 to {len(ctx.pages) - 1}")
            self._active = n
            await ctx.pages[n].bring_to_front()
        elif k == "close_tab":
            await page.close()
            if not ctx.pages:
                await ctx.new_page()
            self._active = len(ctx.pages) - 1
        else:  # pragma: no cover (parser only produces known kinds)
            raise ActionFailed(f"unsupported action {k}")

    async def snapshot(self) -> Snapshot:
        page = await self.page()
        try:
            d = await page.evaluate(SNAPSHOT_JS, self.tree_root)
        except Exception as exc:  # noqa: BLE001  (a navigation raced the snapshot: once more after load)
            if _is_crash(exc):
                raise
            await self._settle(page)
            d = await page.evaluate(SNAPSHOT_JS, self.tree_root)
        return Snapshot.from_js(d)

    async def _render(self, note: Optional[str]) -> str:
        page = await self.page()
        self._url = page.url
        snap = await self.snapshot()
        self._snapshot = snap
        head = [f"URL: {self._url}", f"OBJECTIVE: {self._objective}", f"PREVIOUS ACTION: {self._prev}"]
        pages = self.context.pages
        if len(pages) > 1:
            tabs = []
            for i, p in enumerate(pages):
                try:
                    title = await p.title()
                except Exception:  # noqa: BLE001
                    title = p.url
                tabs.append(f"[{i}] {title or p.url}" + (" (active)" if i == self._active else ""))
            head.append("TABS: " + " | ".join(tabs))
        if note:
            head.append(f"NOTE: {note}")
        budget = max(200, self.max_obs_chars - sum(len(h) + 1 for h in head) - 13)
        return "\n".join(head) + "\nOBSERVATION:\n" + format_tree(snap, budget)


def _is_crash(exc: BaseException) -> bool:
    """Errors that mean the page/context/browser is gone (not a failed action)."""
    text = str(exc).lower()
    return any(s in text for s in ("target page, context or browser has been closed", "target closed",
                                   "browser has been closed", "page crashed", "connection closed"))
