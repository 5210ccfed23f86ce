"""The generic env contract, run over every registered env that has a contract module, in-process and over HTTP.

Contract modules: ``envs/<name>/contract.py`` (or ``envs/<name>_contract.py`` for single-module envs such
as ``envs/toy.py``) with

* ``OPTIONS: dict`` -- small, fast constructor options for these tests;
* ``valid_action(observation, info) -> str`` -- a well-formed reply (not necessarily a good one);
* optional ``expert_action(observation, info) -> str | None`` -- the reply an expert sends (None = give up);
* optional ``two_actions(observation, info) -> str`` -- a reply naming two *different* well-formed actions
  (without it the two-actions check is skipped, e.g. for envs whose replies are not ``Action:`` lines);
* optional ``comparable(observation) -> str`` -- the observation without parts that legitimately differ
  between two runs of the same task (e.g. a random per-episode URL); used by the no-state-change checks;
* optional ``EXPERT_TASKS: list[int]`` (data_idx sample for the expert check; default the first 3 test
  tasks), ``EXPERT_MAX_STEPS: int`` (default 60), ``MAX_STEPS: int`` (cap when stepping to the end,
  default 60).

An env whose module (or optional dependency) cannot be imported is skipped with the reason. Checks:
create / reset / step to the end / close, unknown ids, malformed action, two actions in one reply
(both: explanatory observation, reward 0, not done, ``info["invalid_action"]``, no state change), reset of
every split's first and last task (and a rejected index past the end of a finite test split), and the
expert reaching success on its sample through a real spawned server process.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient

import envs  # noqa: F401  (registers the built-in envs)
from envs.base import TEST_OFFSET, env_names, make_env, task_index
from envs.client import EnvClient
from envs.errors import EnvBadRequest, UnknownEnvId
from envs.server import create_app

NAMES = env_names()


def contract_of(name: str):
    """The env's contract module, or pytest.skip with the reason."""
    for mod in (f"envs.{name}.contract", f"envs.{name}_contract"):
        try:
            return importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name is not None and (mod == e.name or mod.startswith(e.name + ".")) and e.name.startswith("envs"):
                continue  # this candidate does not exist; try the next one
            pytest.skip(f"{name}: optional dependency {e.name!r} is not installed ({e})")
    pytest.skip(f"{name}: no contract module (envs/{name}/contract.py)")


def _make(name: str, options: dict):
    try:
        return make_env(name, **options)
    except ModuleNotFoundError as e:
        pytest.skip(f"{name}: optional dependency {e.name!r} is not installed ({e})")


# --- two transports behind one small interface -------------------------------------------------------------
class Local:
    kind = "local"

    def __init__(self, name: str, options: dict):
        self.name, self.options = name, options
        self.probe = _make(name, options)  # also answers num_tasks
        self.envs: list[Any] = []

    def new(self):
        env = _make(self.name, self.options)
        self.envs.append(env)
        return env

    def reset(self, h, idx):
        return h.reset(idx)

    def step(self, h, reply):
        r = h.step(reply)
        return r.observation, r.reward, r.terminated, r.truncated, r.info

    def observation(self, h):
        return h.observation()

    def close(self, h):
        h.close()

    def shutdown(self):
        for e in self.envs + [self.probe]:
            try:
                e.close()
            except Exception:  # noqa: BLE001
                pass


class Http:
    kind = "http"

    def __init__(self, name: str, options: dict):
        self.probe = _make(name, options)
        self._tc = TestClient(create_app(name, options, max_envs=16, idle_ttl_s=600))
        self._tc.__enter__()
        self.client = EnvClient(http_client=self._tc)

    def new(self):
        return self.client.create()

    def reset(self, h, idx):
        r = self.client.reset(h, idx)
        assert isinstance(r.instruction, str) and r.instruction
        return r.observation, r.info

    def step(self, h, reply):
        r = self.client.step(h, reply)
        return r.observation, r.reward, r.terminated, r.truncated, r.info

    def observation(self, h):
        return self.client.observation(h)

    def close(self, h):
        assert self.client.close(h) is True

    def shutdown(self):
        self._tc.__exit__(None, None, None)
        self.probe.close()


@pytest.fixture(scope="module", params=[(n, t) for n in NAMES for t in ("local", "http")],
                ids=[f"{n}-{t}" for n in NAMES for t in ("local", "http")])
def setup(request):
    name, kind = request.param
    contract = contract_of(name)
    drv = (Local if kind == "local" else Http)(name, dict(getattr(contract, "OPTIONS", {})))
    yield name, contract, drv
    drv.shutdown()


def _check_step(obs, reward, terminated, truncated, info):
    assert isinstance(obs, str) and obs.strip()
    assert isinstance(reward, float) and math.isfinite(reward)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert isinstance(info, dict) and isinstance(info.get("success"), bool), info


def _first(drv) -> int:
    return task_index("train", 0)  # (drv kept for envs that may one day need a transport-specific first task)


# --- the checks ---------------------------------------------------------------------------------------------
def test_instruction_and_num_tasks(setup):
    name, contract, drv = setup
    text = drv.probe.instruction()
    assert isinstance(text, str) and "action" in text.lower()
    for split in ("train", "test"):
        n = drv.probe.num_tasks(split)
        assert isinstance(n, int) and 1 <= n <= TEST_OFFSET, (split, n)
    with pytest.raises(ValueError):
        drv.probe.num_tasks("validation")


def test_create_reset_step_to_end_close(setup):
    name, contract, drv = setup
    policy = getattr(contract, "expert_action", None)
    cap = getattr(contract, "MAX_STEPS", 60)
    h = drv.new()
    obs, info = drv.reset(h, _first(drv))
    assert isinstance(obs, str) and obs.strip() and isinstance(info, dict)
    assert drv.observation(h) == obs
    done = False
    for _ in range(cap):
        reply = (policy(obs, info) if policy else None) or contract.valid_action(obs, info)
        obs, reward, terminated, truncated, info = drv.step(h, reply)
        _check_step(obs, reward, terminated, truncated, info)
        assert drv.observation(h) == obs
        if terminated or truncated:
            done = True
            break
    assert done, f"{name}: episode did not end within {cap} steps"
    # a new episode on the same env works, then close
    obs2, _ = drv.reset(h, _first(drv))
    assert obs2.strip()
    drv.close(h)
    if drv.kind == "http":
        with pytest.raises(UnknownEnvId):
            drv.step(h, contract.valid_action(obs2, {}))
        drv.close(h)  # idempotent


def test_unknown_ids_and_bad_task_index(setup):
    name, contract, drv = setup
    if drv.kind == "http":
        c = drv.client
        for call in (lambda: c.reset(10_000, 0), lambda: c.step(10_000, "Action: x"), lambda: c.observation(10_000)):
            with pytest.raises(UnknownEnvId):
                call()
        h = drv.new()
        with pytest.raises(EnvBadRequest):
            c.reset(h, -1)
        drv.close(h)
    else:
        h = drv.new()
        with pytest.raises(ValueError):
            drv.reset(h, -1)


def _invalid_is_harmless(name, contract, drv, make_bad):
    """A bad reply is explained, costs nothing and changes no state (a following valid action does what it
    would have done without it)."""
    idx = _first(drv)
    h = drv.new()  # one env for both runs (observations may name per-env things such as URLs)
    obs, info = drv.reset(h, idx)
    want = drv.step(h, contract.valid_action(obs, info))

    obs, info = drv.reset(h, idx)
    bad = make_bad(obs, info)
    for reply in bad if isinstance(bad, list) else [bad]:
        o, reward, terminated, truncated, inf = drv.step(h, reply)
        _check_step(o, reward, terminated, truncated, inf)
        assert reward == 0.0 and not terminated and not truncated, (reply, o)
        assert inf.get("invalid_action") is True and inf["success"] is False, (reply, inf)
        assert o != obs, "an invalid action must be explained in the observation"
    got = drv.step(h, contract.valid_action(obs, info))
    same = getattr(contract, "comparable", lambda o: o)
    assert (same(got[0]),) + tuple(got[1:4]) == (same(want[0]),) + tuple(want[1:4]), (got, want)
    drv.close(h)


def test_malformed_action(setup):
    name, contract, drv = setup
    _invalid_is_harmless(name, contract, drv, lambda o, i: ["", "I am not sure what to do.\nLet me think more."])


def test_two_actions_in_one_reply(setup):
    name, contract, drv = setup
    if not hasattr(contract, "two_actions"):
        pytest.skip(f"{name}: contract module has no two_actions()")
    _invalid_is_harmless(name, contract, drv, contract.two_actions)


def test_reset_first_and_last_task_of_each_split(setup):
    name, contract, drv = setup
    h = drv.new()
    for split in ("train", "test"):
        n = drv.probe.num_tasks(split)
        for i in sorted({0, n - 1}):
            obs, info = drv.reset(h, task_index(split, i))
            assert isinstance(obs, str) and obs.strip(), (split, i)
            if "split" in info:
                assert info["split"] == split
        if split == "test" and n < TEST_OFFSET:
            with pytest.raises((ValueError, EnvBadRequest)):
                drv.reset(h, task_index(split, n))
    drv.close(h)


# --- expert through a real server process ------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_expert_reaches_success_through_the_server(name):
    contract = contract_of(name)
    expert = getattr(contract, "expert_action", None)
    if expert is None:
        pytest.skip(f"{name}: no expert")
    options = dict(getattr(contract, "OPTIONS", {}))
    _make(name, options).close()  # skip early when a dependency is missing
    from envs.spawn import EnvServerProcess

    tasks = list(getattr(contract, "EXPERT_TASKS", [task_index("test", i) for i in range(3)]))
    cap = getattr(contract, "EXPERT_MAX_STEPS", 60)
    with EnvServerProcess(name, env_options=options, startup_timeout_s=120) as srv:
        c = EnvClient(srv.url, timeout_s=120)
        failures = []
        for idx in tasks:
            h = c.create()
            r = c.reset(h, idx)
            obs, info, res = r.observation, r.info, None
            for _ in range(cap):
                reply = expert(obs, info)
                if reply is None:
                    break
                res = c.step(h, reply)
                obs, info = res.observation, res.info
                if res.done:
                    break
            if not (res is not None and res.info.get("success") and res.terminated):
                failures.append((idx, obs[-300:]))
            c.close(h)
        c.shutdown()
    assert not failures, f"{name}: expert failed on {failures}"
