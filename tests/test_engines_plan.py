"""Several rollout engines (``core.engines``, pure): routing, episode affinity, the weight-version check, broadcast
ranks, core splits and the engine layout over hosts, each against hand-computed answers; the config's refusals; the
worker-version bookkeeping and the request router of ``runtime.backends.engine_set`` on stand-in engines (no vLLM)."""

from __future__ import annotations

import pytest

from core.engines import (LOCAL, EngineHost, EngineRoom, NoEngineLeft, PrefixAffinity, broadcast_ranks,
                          engines_to_restart, parse_engine_host, pick_engine, plan_engines, split_cores,
                          stale_engines)


def test_pick_engine_most_free_room_then_fewest_live_then_lowest_index():
    rooms = [EngineRoom(True, 3, 100), EngineRoom(True, 1, 400), EngineRoom(True, 0, 400)]
    assert pick_engine(rooms) == 2  # 400 free on both 1 and 2; 2 has fewer live requests
    rooms = [EngineRoom(True, 0, 400), EngineRoom(True, 0, 400)]
    assert pick_engine(rooms) == 0  # a full tie: the lowest index
    rooms = [EngineRoom(False, 0, 10_000), EngineRoom(True, 5, 10)]
    assert pick_engine(rooms) == 1  # a dead engine is never picked, however empty


def test_pick_engine_keeps_an_episode_on_its_engine_while_it_has_room():
    rooms = [EngineRoom(True, 4, 300), EngineRoom(True, 0, 1000)]
    assert pick_engine(rooms, preferred=0, need=300) == 0  # exactly enough room: stays
    assert pick_engine(rooms, preferred=0, need=301) == 1  # not enough: the engine with most room
    assert pick_engine([EngineRoom(False), EngineRoom(True, 0, 5)], preferred=0, need=1) == 1  # its engine died
    with pytest.raises(NoEngineLeft):
        pick_engine([EngineRoom(False), EngineRoom(False)])


def test_prefix_affinity_finds_the_longest_remembered_prefix_once():
    a = PrefixAffinity()
    a.remember(0, [1, 2, 3])
    a.remember(1, [1, 2, 3, 4, 5])
    assert a.lookup([1, 2, 3, 4, 5, 9, 9]) == 1  # the longer of the two prefixes
    assert a.lookup([1, 2, 3, 4, 5, 9, 9]) == 0  # used up: the shorter one now
    assert a.lookup([1, 2, 3, 7]) is None and len(a) == 0
    assert a.lookup([1, 2]) is None  # a prompt shorter than every entry
    a.remember(0, [7, 8])
    a.remember(1, [7, 9])
    a.forget_engine(0)
    assert a.lookup([7, 8, 1]) is None and a.lookup([7, 9, 1]) == 1


def test_prefix_affinity_keeps_equal_sequences_once_each():
    a = PrefixAffinity()
    a.remember(0, [4, 5])  # two greedy samples of one task: the same prompt and reply on two engines
    a.remember(1, [4, 5])
    assert len(a) == 2 and a.lookup([4, 5, 6]) == 0 and a.lookup([4, 5, 6]) == 1 and a.lookup([4, 5, 6]) is None
    a.remember(0, [4, 5])
    a.remember(1, [4, 5])
    a.remember(0, [4, 5])
    a.forget_engine(0)
    assert len(a) == 1 and a.lookup([4, 5]) == 1


def test_prefix_affinity_is_bounded():
    a = PrefixAffinity(capacity=2)
    for k in range(3):
        a.remember(k, [k, k])
    assert len(a) == 2 and a.lookup([0, 0, 5]) is None and a.lookup([2, 2, 5]) == 2


def test_stale_engines_and_broadcast_ranks():
    assert stale_engines([3, 3, 2, None], 3) == [2, 3]
    assert stale_engines([], 0) == []
    # learner rank 0; engine 0 has TP 2 (ranks 1, 2), engine 1 TP 1 (rank 3), engine 2 TP 4 (ranks 4..7)
    assert broadcast_ranks([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError):
        broadcast_ranks([1, 0])


def test_engines_to_restart_only_the_runs_own_within_the_limit():
    # 0 alive; 1 dead, replaced once of 2; 2 dead, its host's; 3 dead, replaced twice already
    restart, why = engines_to_restart([False, True, True, True], [False, False, True, False], [0, 1, 0, 2], 2)
    assert restart == [1] and sorted(why) == [2, 3]
    assert "another host" in why[2] and "replaced 2 times" in why[3] and "engine_restarts=2" in why[3]
    assert engines_to_restart([True], [False], [0], 0) == ([], {0: "replaced 0 times already "
                                                                  "(rollout.engine_restarts=0)"})
    restart, why = engines_to_restart([True, False], [False, False], [0, 0], 3, can_load=False)
    assert restart == [] and "no learner" in why[0]
    restart, why = engines_to_restart([True, True], [False, False], [0, 0], 3, broadcast=True)
    assert restart == [] and all("NCCL" in w for w in why.values())
    assert engines_to_restart([False, False], [False, False], [5, 5], 1) == ([], {})
    with pytest.raises(ValueError):
        engines_to_restart([True], [False, False], [0], 1)
    with pytest.raises(ValueError):
        engines_to_restart([True], [False], [0], -1)


def test_split_cores():
    assert split_cores(2, 2) == ["0", "1"]
    assert split_cores(4, 2) == ["0-1", "2-3"]
    assert split_cores(5, 2) == ["0-2", "3-4"]
    assert split_cores(7, 3) == ["0-2", "3-4", "5-6"]
    with pytest.raises(ValueError, match="3 CPU engines need at least 3 cores"):
        split_cores(2, 3)


def test_parse_engine_host():
    assert parse_engine_host("gpu-b:8") == EngineHost("gpu-b", 8)
    assert parse_engine_host("10.0.0.7") == EngineHost("10.0.0.7", 0)
    for bad in ("gpu-b:x", ":4", ""):
        with pytest.raises(ValueError, match="HOST:GPUS"):
            parse_engine_host(bad)


def test_plan_engines_on_a_cpu_machine_splits_its_cores():
    placed, errors = plan_engines(2, 1, EngineHost(LOCAL, 0, 2))
    assert errors == [] and [(p.host, p.cores, p.gpus) for p in placed] == [(LOCAL, "0", ()), (LOCAL, "1", ())]
    placed, errors = plan_engines(3, 1, EngineHost(LOCAL, 0, 2))
    assert len(errors) == 1 and "rollout.engines=3" in errors[0] and "node 0: 2 cores -> 2" in errors[0]


def test_plan_engines_fills_the_run_machine_then_the_hosts_in_order():
    local = EngineHost(LOCAL, 4, 64)
    placed, errors = plan_engines(5, 2, local, [EngineHost("b", 2), EngineHost("c", 8)])
    assert errors == []
    assert [(p.host, p.gpus) for p in placed] == [(LOCAL, (0, 1)), (LOCAL, (2, 3)), ("b", (0, 1)), ("c", (0, 1)),
                                                  ("c", (2, 3))]
    assert [p.local for p in placed] == [True, True, False, False, False]
    # a CPU run machine with GPU hosts named: every engine on the hosts
    placed, errors = plan_engines(2, 1, EngineHost(LOCAL, 0, 2), [EngineHost("b", 1), EngineHost("c", 1)])
    assert errors == [] and [p.host for p in placed] == ["b", "c"]


def test_plan_engines_refuses_an_impossible_layout_in_one_line():
    _, errors = plan_engines(2, 8, EngineHost(LOCAL, 4, 64), [EngineHost("b", 2)])
    assert errors == ["rollout.tensor_parallel_size=8 needs 8 GPUs on one host for each engine, but the largest host "
                      "(node 0) has 4: lower rollout.tensor_parallel_size or add a larger host to rollout.engine_hosts "
                      "(HOST:GPUS)"]
    _, errors = plan_engines(1, 2, EngineHost(LOCAL, 0, 2))
    assert len(errors) == 1 and "no engine host has a GPU" in errors[0]
    _, errors = plan_engines(4, 2, EngineHost(LOCAL, 4, 64), [EngineHost("b", 3)])
    assert errors == ["rollout.engines=4: 4 engines of 2 GPUs do not fit the hosts (node 0: 4 GPUs -> 2; b: 3 GPUs "
                      "-> 1 engines): lower rollout.engines or add hosts to rollout.engine_hosts (HOST:GPUS)"]


def test_config_engines_settings_and_refusals():
    from flows.config import ConfigError, build_config

    cfg = build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.engines=2",
                                          'rollout.engine_hosts=["gpu-b:8"]', "rollout.engine_sync=folder"])
    assert (cfg.rollout.engines, cfg.rollout.engine_hosts, cfg.rollout.engine_sync) == (2, ["gpu-b:8"], "folder")
    assert build_config("babyai", "tiny").rollout.engines == 1
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        build_config("babyai", "tiny", ["rollout.backend=transformers", "rollout.engines=2"])
    with pytest.raises(ConfigError, match="vllm_in_process"):
        build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.engines=2", "rollout.vllm_in_process=true"])
    with pytest.raises(ConfigError, match="HOST:GPUS"):
        build_config("babyai", "tiny", ["rollout.backend=vllm", 'rollout.engine_hosts=["b:x"]'])
    with pytest.raises(ConfigError, match="rollout.engines"):
        build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.engines=0"])


# --- the router of runtime.backends.engine_set on stand-in engines ---------------------------------------------
class _Core:
    def __init__(self):
        self.resources = type("R", (), {"engine_dead": False, "engine_manager": None})()


class _LLM:
    def __init__(self):
        self.version = None
        self.llm_engine = type("E", (), {})()
        self.llm_engine.engine_core = _Core()
        self.rpcs: list[str] = []

    def collective_rpc(self, name, args=(), kwargs=None):
        self.rpcs.append(name)
        if name == "set_weight_version":
            self.version = args[0]
        if name == "weight_version":
            return [self.version]
        return [None]

    def reset_prefix_cache(self):
        pass


class _Engine:
    """A stand-in VLLMBackend: replies ``[last prompt token + 1]``; ``fail`` makes it die on its next call."""

    def __init__(self):
        self._llm = _LLM()
        self.eos_token_id, self.max_model_len, self.dtype, self.start_time_s = 0, 4096, "float32", 0.0
        self.calls: list[list[list[int]]] = []
        self.fail = False
        self.asleep = False

    def die(self):
        self._llm.llm_engine.engine_core.resources.engine_dead = True

    def generate(self, prompts, params):
        from runtime.backends.generation import Generation

        if self.fail:
            self.die()
            raise RuntimeError("EngineDeadError")
        self.calls.append([list(p) for p in prompts])
        return [Generation([p[-1] + 1], [-0.5], "stop") for p in prompts]

    def _check_prompts(self, prompts, params):
        pass

    def wake(self, tags=None):
        pass

    def _wake_for_load(self):
        pass

    def sleep(self):
        return False

    def close(self):
        self._llm = None


def _engine_set(n=2, **kw):
    from runtime.backends.engine_set import EngineSet

    engines = [_Engine() for _ in range(n)]
    return EngineSet(engines, [1000] * n, **kw), engines


def test_engine_set_splits_a_round_and_keeps_episodes_on_their_engine():
    from runtime.backends.generation import SamplingParams

    es, (a, b) = _engine_set()
    prompts = [[10 * k + 1, 10 * k + 2] for k in range(6)]
    gens = es.generate(prompts, SamplingParams(8, 0.0))
    assert [g.token_ids for g in gens] == [[p[-1] + 1] for p in prompts]  # in the prompts' order
    assert es.routed == [3, 3] and es.first_turns == [3, 3]
    first_a = [p[0] for p in a.calls[0]]
    # the next turn of each episode (prompt + reply + observation) goes back to the engine that served it
    nxt = [p + [g.token_ids[0], 99] for p, g in zip(prompts, gens)]
    es.generate(nxt, SamplingParams(8, 0.0))
    assert [p[0] for p in a.calls[1]] == first_a and es.first_turns == [3, 3] and es.routed == [6, 6]
    assert es.reserved == [0, 0] and es.live == [0, 0]


def test_engine_set_hands_a_dead_engines_share_to_the_others():
    from runtime.backends.generation import SamplingParams

    es, (a, b) = _engine_set()
    b.fail = True
    prompts = [[k, k + 1] for k in range(4)]
    gens = es.generate(prompts, SamplingParams(8, 1.0, seeds=(5, 6, 7, 8)))
    assert [g.token_ids for g in gens] == [[p[-1] + 1] for p in prompts]  # no prompt lost
    assert es.alive == [True, False] and es.resubmitted == 2
    assert sorted(p[0] for call in a.calls for p in call) == [0, 1, 2, 3]
    b.fail = False  # a dead engine is not used again
    es.generate([[1, 2]], SamplingParams(8, 0.0))
    assert len(b.calls) == 0 and es.stats()["alive"] == 1


def test_engine_set_checks_every_engines_weight_version_before_a_rollout():
    import torch

    from runtime.backends.generation import SamplingParams

    es, (a, b) = _engine_set()
    assert [e._llm.version for e in (a, b)] == [0, 0]  # the start weights are version 0
    b._llm.version = 7  # an engine that holds other weights (restarted, a load that did not happen)
    with pytest.raises(RuntimeError, match="mixed weights"):
        es.generate([[1, 2]], SamplingParams(4, 0.0))  # nothing to load from: refused
    assert a.calls == [] and b.calls == []
    es.named_weights = lambda: [("w", torch.ones(2, 2))]
    es.generate([[1, 2]], SamplingParams(4, 0.0))  # loaded again from the learner, then used
    assert b._llm.version == 0 and "load_shared_weights" in b._llm.rpcs and "load_shared_weights" not in a._llm.rpcs
    es.sync_weights()
    assert es.version == 1 and [e._llm.version for e in (a, b)] == [1, 1] and es.syncs == 1


def test_engine_set_replaces_a_dead_engine_with_the_runs_weights():
    import torch

    from runtime.backends.generation import SamplingParams

    started = []

    def restart(i):
        e = _Engine()
        started.append((i, e))
        return e, 990

    es, (a, b) = _engine_set(restart=restart, restart_limit=1)
    es.named_weights = lambda: [("w", torch.ones(2, 2))]
    es.sync_weights()  # version 1 in both
    b.fail = True
    es.generate([[k, k + 1] for k in range(4)], SamplingParams(8, 0.0))  # b dies: its share goes to a
    assert es.alive == [True, False] and not started
    es.sync_weights()  # b replaced first, then the new engine gets version 2 with a
    (i, c), = started
    assert i == 1 and es.engines[1] is c and b._llm is None  # the dead one closed
    assert es.alive == [True, True] and es.capacity == [1000, 990] and es.restarts == [0, 1]
    assert [e._llm.version for e in (a, c)] == [2, 2] and es.stats()["restarts"] == [0, 1]
    gens = es.generate([[10 * k, 10 * k + 1] for k in range(4)], SamplingParams(8, 0.0))
    assert len(gens) == 4 and c.calls and es.routed[1] > 0  # the new engine takes its share
    c.die()  # dies again, between rounds: the limit (1) is spent, so it stays dead and a carries on
    es.generate([[1, 2]], SamplingParams(8, 0.0))
    assert es.alive == [True, False] and len(started) == 1 and es.restarts == [0, 1]


def test_engine_set_replaces_a_dead_engine_before_a_round_with_the_current_weights():
    import torch

    from runtime.backends.generation import SamplingParams

    es, (a, b) = _engine_set(restart=lambda i: (_Engine(), 1000), restart_limit=2)
    es.named_weights = lambda: [("w", torch.ones(2, 2))]
    es.sync_weights()
    b.die()  # died while nothing ran on it (e.g. during the update)
    es.generate([[1, 2], [3, 4]], SamplingParams(8, 0.0))  # replaced and loaded before the round
    c = es.engines[1]
    assert c is not b and c._llm.version == 1 and "load_shared_weights" in c._llm.rpcs and len(c.calls) == 1
    # a start that fails leaves the slot dead and the round runs on the rest
    es2, (d, e) = _engine_set(restart=lambda i: (_ for _ in ()).throw(RuntimeError("no memory")), restart_limit=2)
    e.die()
    gens = es2.generate([[1, 2], [3, 4]], SamplingParams(8, 0.0))
    assert len(gens) == 2 and es2.alive == [True, False] and es2.restarts == [0, 1] and len(d.calls) == 1
    # without a restart hook (engines on other hosts only, tests) dead engines stay dead, as before
    es3, (f, g) = _engine_set()
    g.die()
    es3.generate([[1, 2], [3, 4]], SamplingParams(8, 0.0))
    assert es3.engines[1] is g and g.calls == [] and len(f.calls) == 1 and es3.restarts == [0, 0]


def test_routed_requests_resubmit_a_dead_engines_turns(monkeypatch):
    from runtime.backends import engine_set as m
    from runtime.backends.generation import Generation, SamplingParams

    class Requests:  # a stand-in VLLMRequests: a request finishes at the step after it was added
        def __init__(self, engine):
            self.engine, self.live = engine, []

        def add(self, key, prompt, params):
            self.live.append((key, prompt))

        def step(self):
            if self.engine.fail:
                self.engine.die()
                raise RuntimeError("EngineDeadError")
            done, self.live = self.live, []
            return [(k, Generation([p[-1] + 1], [-0.1], "stop")) for k, p in done]

        def abort(self, keys):
            self.live = [x for x in self.live if x[0] not in keys]

    monkeypatch.setattr(m, "VLLMRequests", Requests)
    es, (a, b) = _engine_set()
    b.fail = True
    rr = es.request_engine()
    for k in range(4):
        rr.add(f"r{k}", [k, k + 1], SamplingParams(8, 1.0, seeds=(k,)))
    got = {}
    for _ in range(200):
        got.update(dict(rr.step()))
        if len(got) == 4:
            break
    assert sorted(got) == ["r0", "r1", "r2", "r3"] and all(got[f"r{k}"].token_ids == [k + 2] for k in range(4))
    assert es.alive == [True, False] and es.resubmitted == 2 and es.reserved[0] == 0
    rr.close()


# --- --dry-run (flows.dryrun) -----------------------------------------------------------------------------------
def test_dry_run_plans_two_cpu_engines_on_this_machine():
    from flows.config import build_config
    from flows.dryrun import dry_run

    cfg = build_config("babyai", "smoke", ["rollout.engines=2"])
    plan = dry_run(cfg, local_host=EngineHost(LOCAL, 0, 2))
    assert not plan.errors, plan.errors
    line = [x for x in plan.lines if x.startswith("rollout engines")]
    assert line == ["rollout engines (2 on CPUs; weights synced by memory): 0: node 0 cores 0; 1: node 0 cores 1"]
    assert any(x.startswith("memory: + ") and "1 more engine(s)" in x for x in plan.lines)
    assert not any(x.startswith("rollout engines") for x in dry_run(build_config("babyai", "smoke")).lines)


def test_dry_run_plans_a_multi_host_layout_and_refuses_an_impossible_one():
    from flows.config import build_config
    from flows.dryrun import dry_run

    gpu_node = EngineHost(LOCAL, 4, 32)
    ok = dry_run(build_config("babyai", "paper", ["rollout.engines=3", "rollout.tensor_parallel_size=2",
                                                  'rollout.engine_hosts=["gpu-b:2"]']), local_host=gpu_node)
    line = [x for x in ok.lines if x.startswith("rollout engines")][0]
    assert line == ("rollout engines (3 of 2 GPU(s) each; weights synced by memory): 0: node 0 GPUs 0,1; 1: node 0 "
                    "GPUs 2,3; 2: gpu-b GPUs 0,1")
    # a layout on other hosts is planned, and the run (which starts engines on its own machine) would refuse it
    assert ok.errors and ok.errors[0].startswith("rollout.engine_hosts: the layout puts engines on gpu-b")
    bad = dry_run(build_config("babyai", "paper", ["rollout.engines=2", "rollout.tensor_parallel_size=8",
                                                   'rollout.engine_hosts=["gpu-b:2"]']), local_host=gpu_node)
    assert bad.errors == ["rollout.tensor_parallel_size=8 needs 8 GPUs on one host for each engine, but the largest "
                          "host (node 0) has 4: lower rollout.tensor_parallel_size or add a larger host to "
                          "rollout.engine_hosts (HOST:GPUS)"]
    cpu = dry_run(build_config("babyai", "smoke", ["rollout.engines=3"]), local_host=EngineHost(LOCAL, 0, 2))
    assert len(cpu.errors) == 1 and cpu.errors[0].startswith("rollout.engines=3: 3 CPU engines do not fit the hosts")


def test_one_dead_engine_is_replaced_and_its_rollout_runs_again():
    """``tasks.steps._run_rollout`` with a stand-in single engine: a dead one is replaced before the rollout; one
    that dies during it is replaced and the rollout runs again (the learner's weights synced to the new one);
    past ``rollout.engine_restarts``, or with an engine that is alive (another error), the error goes up."""
    from types import SimpleNamespace

    from tasks.steps import _run_rollout

    class Engine:
        def __init__(self, limit, dead=False):
            self.restart_limit, self.is_dead, self.restarts, self.synced = limit, dead, [0], 0

        def dead(self):
            return self.is_dead

        def why_not_restarted(self):
            return None if self.restarts[0] < self.restart_limit else "limit"

        def restart(self, sync=True):
            if self.why_not_restarted():
                raise RuntimeError("not replaced")
            self.is_dead, self.restarts = False, [self.restarts[0] + 1]
            self.synced += sync

        def replace_if_dead(self, sync=True):
            if self.is_dead:
                self.restart(sync)
                return True
            return False

    def rollout_killing(engine, kills):
        calls = []

        async def go():
            calls.append(1)
            if len(calls) <= kills:
                engine.is_dead = True
                raise RuntimeError("EngineDeadError")
            return ["trajs"], "stats"
        return go, calls

    e = Engine(2, dead=True)  # died since its last use: replaced first
    go, calls = rollout_killing(e, 0)
    assert _run_rollout(SimpleNamespace(backend=e), go, "t") == (["trajs"], "stats")
    assert (e.restarts, e.synced, len(calls)) == ([1], 1, 1)
    e = Engine(2)  # dies during the rollout, twice: replaced each time, the rollout run three times
    go, calls = rollout_killing(e, 2)
    assert _run_rollout(SimpleNamespace(backend=e), go, "t") == (["trajs"], "stats")
    assert (e.restarts, e.synced, len(calls)) == ([2], 2, 3)
    e = Engine(2)  # a third death: past the limit, the engine's error goes up
    go, calls = rollout_killing(e, 3)
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        _run_rollout(SimpleNamespace(backend=e), go, "t")
    assert e.restarts == [2]
    e = Engine(0)  # rollout.engine_restarts=0: never replaced
    go, calls = rollout_killing(e, 1)
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        _run_rollout(SimpleNamespace(backend=e), go, "t")

    async def other_error():
        raise ValueError("a bad prompt")
    e = Engine(2)
    with pytest.raises(ValueError):  # the engine is alive: not its death
        _run_rollout(SimpleNamespace(backend=e), other_error, "t")
    assert e.restarts == [0]


def test_a_new_engine_gets_the_weights_the_session_loaded_from_folders(monkeypatch):
    """``VLLMBackend.restart`` with the pool's ``reload`` (``_hook_reload``): a session without a learner (an
    evaluation) has its dead engine replaced, the new one started with the same settings and given the session's
    folder when it is not the one the engine started on; without ``reload`` (and no learner hooked) it is not
    replaced. A LoRA training session in adapter mode gets its base back before the learner's sync."""
    from runtime.backends import vllm_backend as vb

    started = []

    def fake_init(self, **kw):  # VLLMBackend.__init__ without an engine: what restart() relies on
        started.append(kw["model_path"])
        self._init, self.model_path, self._llm, self.in_process = kw, kw["model_path"], object(), False
        self.export_weights = self.named_weights = self.adapter = self.merged = self.lora_request = None
        self.restarts, self.start_time_s = [0], 0.5
        self.transport, self.max_live_episodes, self.keep_sync_segment = "shm", None, False

    monkeypatch.setattr(vb.VLLMBackend, "__init__", fake_init)
    monkeypatch.setattr(vb.VLLMBackend, "close", lambda self: None)
    loads = []
    monkeypatch.setattr(vb.VLLMBackend, "load_folder", lambda self, d: loads.append(str(d)) or 0.1)
    monkeypatch.setattr(vb.VLLMBackend, "clear_adapter", lambda self: None)
    e = vb.VLLMBackend(model_path="/m/first", eos_token_id=2)
    e.restart_limit = 2
    assert "no learner" in e.why_not_restarted()
    with pytest.raises(RuntimeError, match="not replaced"):
        e.restart()
    vb._hook_reload(e, "/m/first", None, None)  # an evaluation of the folder the engine started on
    assert e.why_not_restarted() is None
    e.restart()
    assert started == ["/m/first", "/m/first"] and loads == [] and e.restarts == [1] and e.reload is not None
    vb._hook_reload(e, "/m/second", None, None)  # the kept engine, reused by an evaluation of another folder
    e.restart()
    assert started[-1] == "/m/first" and loads == ["/m/second"] and e.restarts == [2]
    assert "replaced 2 times" in e.why_not_restarted()
    vb._hook_reload(e, "/m/second", object(), None)  # a training session: its learner's sync gives every weight
    assert e.reload is None
    # a LoRA training session in adapter mode: the new engine gets the session's base, the learner's sync the adapter
    e.restart_limit, e.adapter = 5, "the learner's adapter"
    vb._hook_reload(e, "/m/adapter", object(), vb.LoraServing("adapter", "/m/base2", None, 8))
    e.restart(sync=False)  # as sync_weights does before it moves the adapter
    assert loads[-1] == "/m/base2" and len(loads) == 2
    vb._hook_reload(e, "/m/adapter", object(), vb.LoraServing("adapter", "/m/first", None, 8))
    e.restart(sync=False)  # the engine starts on that base: nothing to load
    assert len(loads) == 2 and started[-1] == "/m/first"
    vb._hook_reload(e, "/m/adapter", object(), vb.LoraServing("merged", "/m/base2", None, 0))
    assert e.reload is None  # merged: the learner's sync moves every weight
    vb._hook_reload("an engine set", "/m", None, None)  # replaces its own engines: left alone
