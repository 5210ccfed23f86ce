"""The ``miniwob`` env: MiniWoB++ HTML tasks (from the ``miniwob`` PyPI package) in the same browser env.

The package's HTML files are served on loopback by the local site server (``/miniwob/``); the page is driven
with the same accessibility-tree observation and WebArena action space as the ``webarena`` env. The
objective is MiniWoB's utterance. An episode starts the task with a seed (``Math.seedrandom``) and data mode
(train/test) like the package's own driver; MiniWoB's 10 s real-time limit is lifted (``episode_max_time_s``)
because a language model thinks slower than a person clicks.

Task index -> task: ``task = tasks[i % T]``, ``seed = i // T`` for train indices and ``TEST_SEED_BASE + i // T``
for test indices (``i`` = index within the split), so train and test episodes never share a seed.

Reward: MiniWoB's raw reward (in [-1, 1], no time penalty) when the task ends (``reward="raw"``), or
``"binary"`` (1 / -1) / ``"original"`` (time-scaled). ``info["success"]`` = raw reward >= 1 (partial-credit
tasks count as success only when fully right). ``stop [...]`` gives up: reward 0, not a success.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from envs.base import TEST_OFFSET, split_of
from envs.web.actions import Action
from envs.web.env import BrowserEpisodeEnv

TEST_SEED_BASE = 1_000_000_000

# Tasks whose goal is reachable with the accessibility tree and the WebArena action space (no dragging,
# drawing, canvas geometry or colour perception).
DEFAULT_TASKS = (
    "click-button", "click-button-sequence", "click-checkboxes", "click-checkboxes-large", "click-checkboxes-soft",
    "click-checkboxes-transfer", "click-collapsible", "click-collapsible-2", "click-dialog", "click-dialog-2",
    "click-link", "click-menu", "click-option", "click-tab", "click-tab-2", "click-tab-2-hard", "click-test",
    "click-test-2", "click-widget", "choose-list", "email-inbox", "email-inbox-forward-nl", "enter-date",
    "enter-password", "enter-text", "enter-text-2", "enter-text-dynamic", "enter-time", "find-word", "focus-text",
    "focus-text-2", "guess-number", "login-user", "login-user-popup", "multi-layouts", "multi-orderings",
    "navigate-tree", "read-table", "read-table-2", "search-engine", "simple-algebra", "simple-arithmetic",
    "social-media", "social-media-some", "terminal", "text-transform", "use-autocomplete", "use-spinner",
)

INSTRUCTION = (
    "You operate a small web page. Each turn you see the task and the page as an accessibility tree: every "
    "element has an id in [brackets]. Actions:\n"
    "click [id] | type [id] [text] [1 to press Enter, 0 not] | hover [id] | press [keys] | scroll [down] | "
    "scroll [up] | stop [] (give up)\n"
    "Think briefly, then end your reply with one line: Action: <action>, for example Action: click [5]"
)

_START_JS = """
([seed, mode, maxMs]) => {
  core.EPISODE_MAX_TIME = maxMs;
  window.__siNext = 1;  // element ids restart with every episode (the page is reused)
  document.querySelectorAll('[data-si-id]').forEach(e => e.removeAttribute('data-si-id'));
  if (core.EP_TIMER !== null) { clearTimeout(core.EP_TIMER); core.EP_TIMER = null; }
  Math.seedrandom(seed);
  core.setDataMode(mode);
  core.startEpisodeReal();
  return true;
}
"""
_META_JS = ("() => ({done: WOB_DONE_GLOBAL, env_reward: WOB_REWARD_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL, "
            "reason: WOB_REWARD_REASON === null ? null : String(WOB_REWARD_REASON)})")
_UTTERANCE_JS = "() => { const u = core.getUtterance(); return (u && typeof u === 'object') ? u.utterance : u; }"


def all_tasks() -> list[str]:
    from envs.web.sites.server import miniwob_html_dir

    d = miniwob_html_dir()
    if d is None:
        raise RuntimeError("the 'miniwob' package is not installed; run infra/install.sh")
    return sorted(p.stem for p in (d / "miniwob").glob("*.html"))


def parse_tasks(tasks: str | list[str] | tuple[str, ...] | None) -> list[str]:
    known = all_tasks()
    if tasks is None or tasks == "default":
        names = list(DEFAULT_TASKS)
    elif tasks == "all":
        return known
    elif isinstance(tasks, str):
        names = [t.strip() for t in tasks.split(",") if t.strip()]
    else:
        names = [str(t).strip() for t in tasks if str(t).strip()]
    names = [re.sub(r"^miniwob\.|\.html$", "", n) for n in names]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown MiniWoB task(s) {bad}; e.g. {', '.join(DEFAULT_TASKS[:5])} (or tasks='all')")
    if not names:
        raise ValueError("tasks must name at least one MiniWoB task")
    return names


class MiniWoBEnv(BrowserEpisodeEnv):
    name = "miniwob"

    def __init__(
        self,
        tasks: str | list[str] | None = None,
        reward: str = "raw",
        episode_max_time_s: float = 3600.0,
        n_train: int = 100_000,
        n_test: int = 1000,
        max_obs_chars: int = 2000,
        max_contexts: int = 16,
        action_timeout_s: float = 10.0,
        acquire_timeout_s: float = 120.0,
        episodes_per_context: int = 50,
    ):
        super().__init__(max_obs_chars=max_obs_chars, max_contexts=max_contexts, action_timeout_s=action_timeout_s,
                         acquire_timeout_s=acquire_timeout_s, episodes_per_context=episodes_per_context,
                         tree_root="#wrap")
        if reward not in ("raw", "binary", "original"):
            raise ValueError(f"reward must be 'raw', 'binary' or 'original', got {reward!r}")
        if not 1 <= n_train <= TEST_OFFSET or not 1 <= n_test <= TEST_OFFSET:
            raise ValueError("n_train and n_test must be in [1, 1000000]")
        self.tasks = parse_tasks(tasks)
        self.reward_kind = reward
        self.episode_max_time_ms = int(float(episode_max_time_s) * 1000)
        self.n_train, self.n_test = int(n_train), int(n_test)
        from envs.web.sites.server import SiteServer

        self.sites = SiteServer.shared()
        self._task_name = ""

    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return self.n_train if split == "train" else self.n_test

    def task(self, data_idx: int) -> tuple[str, int, str]:
        """(task name, seed, data mode) of an index."""
        if isinstance(data_idx, bool) or int(data_idx) != data_idx:
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}")
        split = split_of(int(data_idx))
        i = int(data_idx) - (TEST_OFFSET if split == "test" else 0)
        n = self.num_tasks(split)
        if not 0 <= i < n:
            base = TEST_OFFSET if split == "test" else 0
            raise ValueError(f"data_idx {data_idx} out of range for the miniwob {split} split [{base}, {base + n})")
        name = self.tasks[i % len(self.tasks)]
        seed = i // len(self.tasks) + (TEST_SEED_BASE if split == "test" else 0)
        return name, seed, split

    def allowed(self, url: str) -> bool:
        return url == "about:blank" or url.startswith(self.sites.origin + "/miniwob/")

    def allowed_description(self) -> str:
        return self.sites.origin + "/miniwob/"

    async def _start_episode(self, data_idx: int) -> dict[str, Any]:
        name, seed, mode = self.task(data_idx)
        url = f"{self.sites.origin}/miniwob/miniwob/{name}.html"
        page = await self.page()
        if page.url != url:
            await page.goto(url, wait_until="load")
            await page.wait_for_selector("#sync-task-cover", state="attached")
        await page.evaluate(_START_JS, [str(seed), mode, self.episode_max_time_ms])
        await page.wait_for_function("() => WOB_TASK_READY !== false", timeout=self.action_timeout_s * 1000)
        self._task_name = name
        self._objective = " ".join(str(await page.evaluate(_UTTERANCE_JS) or "").split())
        return {"task": name, "seed": seed, "data_idx": data_idx, "split": split_of(data_idx), "success": False,
                "category": name}  # per-category eval scores: the MiniWoB task

    def _reward(self, meta: dict[str, Any]) -> float:
        raw = float(meta.get("raw_reward") or 0.0)
        if self.reward_kind == "binary":
            return 1.0 if raw >= 1.0 else -1.0
        if self.reward_kind == "original":
            return float(meta.get("env_reward") or 0.0)
        return raw

    async def _after_action(self, action: Action) -> tuple[float, bool, bool, dict[str, Any]]:
        page = await self.page()
        try:
            meta = await page.evaluate(_META_JS)
        except Exception:  # noqa: BLE001  (the agent navigated away from the task page)
            return 0.0, False, False, {}
        if not meta.get("done"):
            return 0.0, False, False, {}
        raw = float(meta.get("raw_reward") or 0.0)
        return self._reward(meta), True, raw >= 1.0, {"raw_reward": raw, "reason": meta.get("reason")}

    async def _do_step(self, act: Action):
        res = await super()._do_step(act)
        if res.terminated and act.kind != "stop":
            raw = float(res.info.get("raw_reward", 0.0))
            verdict = "Task complete" if res.info.get("success") else "The task ended without success"
            res.observation = self._obs = f"{verdict} (MiniWoB reward {raw:g}).\nPREVIOUS ACTION: {act.render()}"
        return res

    async def _finish(self, answer: str) -> tuple[float, bool, str, dict[str, Any]]:
        return 0.0, False, "You gave up; the task was not completed (reward 0).", {"raw_reward": 0.0}
