"""The run-scoped Runtime (runtime.context): who finds it, what it closes, and that nothing outlives it."""

import pytest

from core.config import build_config
from runtime.context import Runtime, Session
from runtime.timing import timed


class Part:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def stop(self):
        self.log.append(f"stop {self.name}")
        if self.fail:
            raise OSError(f"{self.name} would not stop")

    def close(self):
        self.log.append(f"close {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} would not close")

    def __repr__(self):
        return self.name


def _session(log, fail_server=False, fail_learner=False):
    cfg = build_config("toy", None, ["rollout.backend=transformers"])
    return Session(cfg=cfg, learner=Part(log, "learner", fail_learner), backend=Part(log, "backend"),
                   servers=[Part(log, "srv-a", fail_server), Part(log, "srv-b")])


def test_no_runtime_open_is_a_clear_error():
    assert Runtime.current_or_none() is None
    with pytest.raises(RuntimeError, match="no Runtime is open"):
        Runtime.current()


def test_scopes_join_the_open_runtime_and_the_outermost_closes_it():
    log = []
    with Runtime.scope() as outer:
        key = outer.add_session(_session(log))
        with Runtime.scope() as inner:  # an evaluation inside a run
            assert inner is outer and Runtime.current() is outer
            assert inner.session(key).servers[0].name == "srv-a"
        assert log == [] and key in outer.sessions  # the inner scope closed nothing
    assert Runtime.current_or_none() is None
    # the session left open was closed with the Runtime: servers, then the backend and the learner
    assert log == ["stop srv-a", "stop srv-b", "close backend", "close learner"]
    assert outer.sessions == {}


def test_close_session_closes_every_part_and_reports_each_failure(capsys):
    log = []
    with Runtime() as rt:
        key = rt.add_session(_session(log, fail_server=True, fail_learner=True))
        failures = rt.close_session(key)
        assert log == ["stop srv-a", "stop srv-b", "close backend", "close learner"]  # none skipped
        assert len(failures) == 2 and "srv-a would not stop" in failures[0] and "learner would not close" in failures[1]
        assert "warning: closing a session: env server srv-a: OSError: srv-a would not stop" in capsys.readouterr().out
        assert rt.close_session(key) == []  # closing twice is harmless
        with pytest.raises(KeyError, match="no live session"):
            rt.session(key)


def test_a_runtime_left_by_an_exception_is_closed_and_gone():
    log = []
    with pytest.raises(ValueError):
        with Runtime() as rt:
            rt.add_session(_session(log))
            raise ValueError("a phase failed")
    assert log[-1] == "close learner" and Runtime.current_or_none() is None


def test_timed_charges_the_open_runtimes_ledger_only():
    with timed("rollout"):  # outside any Runtime: charged nowhere, and no error
        pass
    with Runtime() as rt:
        first = rt.ledger
        with timed("rollout"):
            with timed("weight_sync"):
                pass
        assert set(first.totals) == {"rollout", "weight_sync"}
        fresh = rt.new_ledger()  # a run starts its own breakdown
        with timed("update"):
            pass
        assert set(fresh.totals) == {"update"} and "update" not in first.totals
