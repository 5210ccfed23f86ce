"""The ``webarena`` env: WebArena-format tasks in a real browser, scored by WebArena's evaluators.

Task sources (one code path):

* ``tasks="local"`` (default): the shop and forum of ``envs/web/sites`` on loopback, with the task sets in
  ``envs/web/tasks/*.json``. Each episode gets its own site state under ``/e/<key>/`` (fresh seed data), so
  concurrent episodes never see each other's clicks. ``sites="shop"`` / ``"forum"`` picks one.
* ``tasks="/path/to/config_files"`` (a directory of WebArena ``<id>.json`` files, or one JSON list): real
  WebArena. Site URLs come from the variables BrowserGym uses: ``WA_SHOPPING``, ``WA_SHOPPING_ADMIN``,
  ``WA_REDDIT``, ``WA_GITLAB``, ``WA_WIKIPEDIA``, ``WA_MAP``, ``WA_HOMEPAGE`` (replacing ``__SHOPPING__``, ...).
  Tasks whose sites have no URL, or that need an LLM judge (``fuzzy_match``) when none is configured
  (``judge_url`` / ``SI_JUDGE_URL``), are left out with a logged reason (``skipped_tasks``); with
  ``judge_missing="error"`` a missing judge is an error instead. Real WebArena sites are shared, so their
  state is not reset per episode (as in WebArena).

Task index -> task: the train (test) tasks in order. Train indices wrap around the train task count (so any
``env.task_pool`` works); test indices must be below ``num_tasks("test")`` (evaluation never repeats a task
silently). Train and test never overlap. A task's
split is its ``split`` field, else ``test`` when ``task_id % 5 == 4``.

Reward: the evaluator score (0 or 1) when the agent sends ``stop [answer]``; ``info["success"]`` = score 1.
Navigation is restricted to the task's sites (the allowed-sites check).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from envs.base import TEST_OFFSET, split_of
from envs.web import evaluators as ev
from envs.web.actions import Action
from envs.web.env import BrowserEpisodeEnv

log = logging.getLogger("envs.webarena")

LOCAL_TASK_DIR = Path(__file__).resolve().parents[1] / "web" / "tasks"
LOCAL_SITES = ("shop", "forum")
LOCAL_PLACEHOLDERS = {"shop": "__SHOP__", "forum": "__FORUM__"}
# WebArena site name -> (placeholder in configs, environment variable with its URL; BrowserGym's names)
WEBARENA_SITES = {
    "shopping": ("__SHOPPING__", "WA_SHOPPING"),
    "shopping_admin": ("__SHOPPING_ADMIN__", "WA_SHOPPING_ADMIN"),
    "reddit": ("__REDDIT__", "WA_REDDIT"),
    "gitlab": ("__GITLAB__", "WA_GITLAB"),
    "wikipedia": ("__WIKIPEDIA__", "WA_WIKIPEDIA"),
    "map": ("__MAP__", "WA_MAP"),
    "homepage": ("__HOMEPAGE__", "WA_HOMEPAGE"),
}

INSTRUCTION = (
    "You are a web agent. Each turn you see the page as an accessibility tree: every element has an id in "
    "[brackets]. Reach the OBJECTIVE with these actions:\n"
    "click [id] | type [id] [text] [1 to press Enter, 0 not] | hover [id] | press [keys] | scroll [down] | "
    "scroll [up] | goto [url] | go_back | go_forward | new_tab | tab_focus [n] | close_tab | stop [answer]\n"
    "When done, send stop with the answer (stop [] if no answer is asked). "
    "Think briefly, then end your reply with one line: Action: <action>, for example Action: click [5]"
)


def local_tasks(sites: tuple[str, ...] = LOCAL_SITES) -> list[dict[str, Any]]:
    out = []
    per_site = [json.loads((LOCAL_TASK_DIR / f"{s}.json").read_text()) for s in sites]
    # interleave the sites, so the first n tasks of a split cover every site
    for i in range(max(len(t) for t in per_site)):
        for s, tasks in zip(sites, per_site):
            if i < len(tasks):
                out.append(dict(tasks[i], _site_key=s))
    return out


def _split_of_task(t: dict[str, Any]) -> str:
    s = t.get("split")
    if s in ("train", "test"):
        return s
    return "test" if int(t.get("task_id", 0)) % 5 == 4 else "train"


class WebArenaEnv(BrowserEpisodeEnv):
    name = "webarena"

    def __init__(
        self,
        tasks: str = "local",
        sites: str | list[str] | None = None,
        max_obs_chars: int = 2400,
        max_contexts: int = 16,
        action_timeout_s: float = 10.0,
        acquire_timeout_s: float = 120.0,
        episodes_per_context: int = 50,
        judge_url: str | None = None,
        judge_model: str | None = None,
        judge_missing: str = "skip",
    ):
        super().__init__(max_obs_chars=max_obs_chars, max_contexts=max_contexts, action_timeout_s=action_timeout_s,
                         acquire_timeout_s=acquire_timeout_s, episodes_per_context=episodes_per_context)
        if judge_missing not in ("skip", "error"):
            raise ValueError(f"judge_missing must be 'skip' or 'error', got {judge_missing!r}")
        self.judge = ev.Judge.from_env(judge_url, judge_model)
        self.local = tasks == "local"
        self.skipped_tasks: list[tuple[Any, str]] = []
        if isinstance(sites, str):
            sites = [s.strip() for s in sites.split(",") if s.strip()]
        if self.local:
            chosen = tuple(sites) if sites else LOCAL_SITES
            bad = [s for s in chosen if s not in LOCAL_SITES]
            if bad:
                raise ValueError(f"unknown local site(s) {bad}; local sites: {', '.join(LOCAL_SITES)}")
            from envs.web.sites.server import SiteServer

            self.sites = SiteServer.shared()
            configs = local_tasks(chosen)
            self.site_urls: dict[str, str] = {}
        else:
            self.sites = None
            configs = ev.load_configs(tasks)
            if sites:
                configs = [c for c in configs if set(c.get("sites") or []) <= set(sites)]
            self.site_urls = {name: os.environ[var].rstrip("/") for name, (_, var) in WEBARENA_SITES.items()
                              if os.environ.get(var)}
        usable = []
        for c in configs:
            try:
                ev.validate_config(c)
            except ev.EvalConfigError as e:
                if self.local:  # our own task files must always be scorable
                    raise
                self.skipped_tasks.append((c.get("task_id"), str(e)))  # e.g. WebArena's 'func:' helpers
                continue
            why = self._unusable(c)
            if why:
                self.skipped_tasks.append((c.get("task_id"), why))
                continue
            usable.append(c)
        if self.skipped_tasks:
            reasons = sorted({w for _, w in self.skipped_tasks})
            log.warning("webarena: %d task(s) left out: %s", len(self.skipped_tasks), "; ".join(reasons))
            if judge_missing == "error" and any(w == ev.NO_JUDGE_MESSAGE for _, w in self.skipped_tasks):
                raise ev.JudgeUnavailable(ev.NO_JUDGE_MESSAGE)
        self.tasks = {"train": [c for c in usable if _split_of_task(c) == "train"],
                      "test": [c for c in usable if _split_of_task(c) == "test"]}
        if not usable:
            raise ValueError(f"no usable webarena tasks in {tasks!r}: "
                             + ("; ".join(sorted({w for _, w in self.skipped_tasks})) or "the config list is empty"))
        self._task: Optional[dict[str, Any]] = None
        self._key: Optional[str] = None
        self._bases: dict[str, str] = {}

    def _unusable(self, c: dict[str, Any]) -> Optional[str]:
        if ev.needs_judge(c) and self.judge is None:
            return ev.NO_JUDGE_MESSAGE
        if not self.local:
            missing = [WEBARENA_SITES[s][1] for s in c.get("sites") or [] if s in WEBARENA_SITES
                       and s not in self.site_urls]
            unknown = [s for s in c.get("sites") or [] if s not in WEBARENA_SITES]
            if unknown:
                return f"unknown WebArena site(s) {unknown}"
            if missing:
                return f"site URL variable(s) not set: {', '.join(sorted(set(missing)))}"
        return None

    # --- TextEnv ------------------------------------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        if split not in self.tasks:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return len(self.tasks[split])

    def task(self, data_idx: int) -> dict[str, Any]:
        if isinstance(data_idx, bool) or int(data_idx) != data_idx:
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}")
        split = split_of(int(data_idx))
        local = int(data_idx) - (TEST_OFFSET if split == "test" else 0)
        if local >= TEST_OFFSET:
            raise ValueError(f"data_idx {data_idx} out of range: train is [0, {TEST_OFFSET}), "
                             f"test is [{TEST_OFFSET}, {2 * TEST_OFFSET})")
        tasks = self.tasks[split]
        if not tasks:
            raise ValueError(f"the webarena {split} split has no tasks")
        if split == "test" and local >= len(tasks):
            raise ValueError(f"data_idx {data_idx} out of range: the webarena test split has {len(tasks)} tasks "
                             f"[{TEST_OFFSET}, {TEST_OFFSET + len(tasks)})")
        return tasks[local % len(tasks)]

    # --- episode ------------------------------------------------------------------------------------------------
    def substitute(self, s: str) -> str:
        for ph, base in self._bases.items():
            s = s.replace(ph, base)
        return s

    def allowed(self, url: str) -> bool:
        if url in ("about:blank", ""):
            return True
        return any(url == b or url.startswith(b + "/") or url.startswith(b + "?") for b in self._bases.values())

    def allowed_description(self) -> str:
        return ", ".join(sorted(self._bases.values())) or "none"

    def _end_episode(self) -> None:
        if self._key is not None and self.sites is not None:
            self.sites.drop_episode(self._key)
        self._key = None

    async def _start_episode(self, data_idx: int) -> dict[str, Any]:
        task = self.task(data_idx)
        self._task = task
        if self.local:
            self._key = self.sites.new_episode()
            self._bases = {LOCAL_PLACEHOLDERS[s]: self.sites.site_url(self._key, s) for s in LOCAL_SITES}
        else:
            self._bases = {WEBARENA_SITES[s][0]: u for s, u in self.site_urls.items()}
            state = task.get("storage_state")
            if state and Path(str(state)).is_file():
                cookies = json.loads(Path(str(state)).read_text()).get("cookies") or []
                if cookies:
                    await self.context.add_cookies(cookies)
        self._objective = str(task["intent"])
        start = self.substitute(str(task["start_url"]).split(" |AND| ")[0])
        await self.goto(start)
        site = ",".join(task.get("sites") or [])
        return {"task_id": task.get("task_id"), "site": site, "data_idx": data_idx, "split": split_of(data_idx),
                "success": False, "category": site or "-"}  # per-category eval scores: the web site

    async def _fetch(self, url: str, locator: str) -> str:
        js = locator.strip() or "document.body.innerText"
        if url == "last":
            page = await self.page()
            return str(await page.evaluate(js))
        page = await self.context.new_page()
        try:
            await page.goto(url, wait_until="load")
            return str(await page.evaluate(js))
        finally:
            await page.close()

    async def _finish(self, answer: str) -> tuple[float, bool, str, dict[str, Any]]:
        assert self._task is not None
        page = await self.page()
        final_url = page.url
        fetched: dict[tuple[str, str], str] = {}
        for t in (self._task.get("eval") or {}).get("program_html") or []:  # read pages here, on the browser loop
            url = str(t.get("url", "last"))
            url = url if url == "last" else self.substitute(url)
            try:
                fetched[(url, str(t.get("locator", "")))] = await self._fetch(url, str(t.get("locator", "")))
            except Exception as exc:  # noqa: BLE001
                fetched[(url, str(t.get("locator", "")))] = f"<unreadable: {exc}>"

        def fetch(url: str, locator: str) -> str:
            return fetched[(url, locator)]

        import asyncio

        # the judge (an HTTP call) must not block the browser loop
        result = await asyncio.to_thread(ev.evaluate, self._task, answer, final_url, fetch, self.judge, self.substitute)
        success = result.success
        shown = answer if answer else "(no answer)"
        if success:
            msg = f"Task complete. Your answer: {shown}. Score: 1."
        else:
            msg = (f"Task failed: the evaluator did not accept the result. Your answer: {shown}. Score: 0. "
                   "The episode is over.")
        return float(result.score), success, msg, {"eval": result.details}
