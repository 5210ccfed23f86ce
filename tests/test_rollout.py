"""The rollout loop on hand-checkable cases: a scripted generation backend, the toy env in-process, and
the real SmolLM2 tokenizer/chat template (no model forward passes)."""

import asyncio

import pytest

from core.chat import ChatFormat
from envs.toy import ToyEnv
from runtime.backends.generation import Generation, SamplingParams
from envs.sessions import LocalEpisode
from runtime.rollout import EpisodeSpec, run_rollout


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from runtime.backends.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


class Scripted:
    """Replies from a script per episode (keyed by call order within each generate call)."""

    def __init__(self, tok, replies, eos=True):
        self.tok, self.replies, self.eos = tok, replies, eos
        self.eos_token_id = tok.eos_token_id
        self.calls = []
        self.turn = 0

    def sync_weights(self):
        pass

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((len(prompts), params.max_new_tokens))
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        out = []
        for i, _ in enumerate(prompts):
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            if self.eos and len(ids) < params.max_new_tokens:
                ids = ids + [self.eos_token_id]
            out.append(Generation(ids, [-0.5 - 0.01 * j for j in range(len(ids))], "stop" if self.eos else "length"))
        return out


class Crashing(LocalEpisode):
    async def step(self, reply_text):
        raise ConnectionError("server went away")


def run(tok, replies, specs, turn_limit=3, budget=2048, env_kwargs=None, make=None, eos=True):
    chat = ChatFormat.from_tokenizer(tok)
    backend = Scripted(tok, replies, eos)
    make = make or (lambda i: LocalEpisode(ToyEnv(**(env_kwargs or {}))))
    trajs, stats = asyncio.run(run_rollout(specs, make, backend, chat, SamplingParams(16, 1.0), turn_limit, budget))
    return trajs, stats, backend, chat


def test_token_exact_multi_turn(tokenizer):
    # hint=False: the prize is behind the red door; task 0's door numbering is fixed by its seed
    env = ToyEnv(hint=False)
    env.reset(0)
    red = env._doors.index("red") + 1
    wrong = 1 if red != 1 else 2
    replies = [f"Action: open door {wrong}", f"Action: open door {red}"]
    trajs, stats, backend, chat = run(tokenizer, replies, [EpisodeSpec(0, 0)], env_kwargs={"hint": False})
    t = trajs[0]
    assert t.turns == 2 and t.success and t.finish_reason == "success" and t.reward == 1.0
    assert t.turn_rewards == [0.0, 1.0]
    # the sequence is exactly: prompt | reply1 ids | env ids | reply2 ids
    a1 = tokenizer(replies[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    a2 = tokenizer(replies[1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    env_ids = chat.env_turn_ids(t.observations[0], reply_ended_with_eos=True)
    p = t.prompt_len
    assert t.token_ids[p:] == a1 + env_ids + a2
    assert t.loss_mask == [0] * p + [1] * len(a1) + [0] * len(env_ids) + [1] * len(a2)
    assert t.action_ends == [p + len(a1) - 1, len(t.token_ids) - 1]
    # the rendered text is what the chat template would produce for the same conversation
    text = tokenizer.decode(t.token_ids)
    assert text.count("<|im_start|>assistant") == 2 and text.count("<|im_start|>user") == 2
    assert stats.env_steps == 2 and stats.generated_tokens == len(a1) + len(a2)


def test_turn_limit_is_enforced(tokenizer):
    trajs, *_ = run(tokenizer, ["I am not sure."], [EpisodeSpec(i, i) for i in range(3)], turn_limit=2)
    for t in trajs:
        assert t.turns == 2 and t.finish_reason == "turn_limit" and not t.success and not t.masked


def test_token_budget_is_enforced(tokenizer):
    trajs, _, backend, _ = run(tokenizer, ["I am not sure what to do here, let me think."],
                               [EpisodeSpec(0, 0)], turn_limit=50, budget=400)
    t = trajs[0]
    assert t.finish_reason == "token_budget"
    assert len(t.token_ids) <= 400
    assert all(cap <= 16 for _, cap in backend.calls)


def test_env_failure_masks_episode_not_scores_it(tokenizer):
    def make(i):
        return Crashing(ToyEnv()) if i == 1 else LocalEpisode(ToyEnv())

    trajs, *_ = run(tokenizer, ["Action: open door 1"], [EpisodeSpec(0, 0), EpisodeSpec(0, 0)], make=make)
    assert not trajs[0].masked
    assert trajs[1].masked and trajs[1].finish_reason == "env_error" and "server went away" in trajs[1].error


def test_reply_without_eos_gets_closing_delimiter(tokenizer):
    trajs, _, _, chat = run(tokenizer, ["thinking"], [EpisodeSpec(0, 0)], turn_limit=2, eos=False)
    t = trajs[0]
    a = tokenizer("thinking", add_special_tokens=False)["input_ids"]
    env_ids = chat.env_turn_ids(t.observations[0], reply_ended_with_eos=False)
    assert env_ids[0] == tokenizer.eos_token_id  # the template's turn-closing token is added for the env
    assert t.token_ids[t.prompt_len:t.prompt_len + len(a) + len(env_ids)] == a + env_ids


def test_http_rollout_masks_episodes_of_a_dead_server_then_restart_recovers(tokenizer):
    """Real env server process: killed -> episodes masked (never scored 0); restarted -> episodes run."""
    from envs.client import AsyncEnvClient
    from envs.spawn import EnvServerProcess
    from envs.sessions import HttpEpisode

    with EnvServerProcess("toy") as server:
        def run_http():
            async def go():
                client = AsyncEnvClient(server.url, timeout_s=5, retries=1)
                try:
                    return await run_rollout([EpisodeSpec(i, i) for i in range(4)], lambda i: HttpEpisode(client),
                                             Scripted(tokenizer, ["Action: open door 1"]),
                                             ChatFormat.from_tokenizer(tokenizer), SamplingParams(16, 1.0), 2, 2048)
                finally:
                    await client.aclose()
            return asyncio.run(go())[0]

        ok = run_http()
        assert not any(t.masked for t in ok) and all(t.turns >= 1 for t in ok)
        server.kill()
        assert not server.alive()
        dead = run_http()
        assert all(t.masked and t.finish_reason == "env_error" for t in dead)
        from core.metrics import episode_metrics
        m = episode_metrics(dead)
        assert m["episodes"] == 0 and m["masked_episodes"] == 4  # not counted as failures
        server.restart()
        again = run_http()
        assert not any(t.masked for t in again)
        assert [t.success for t in again] == [t.success for t in ok]  # deterministic tasks


class Counting(LocalEpisode):
    """Counts episodes holding an env at once (reset .. close), like a server's bounded pool would."""

    live = 0
    peak = 0
    closed = 0

    async def reset(self, data_idx):
        Counting.live += 1
        Counting.peak = max(Counting.peak, Counting.live)
        return await super().reset(data_idx)

    async def close(self):
        Counting.live -= 1
        Counting.closed += 1
        await super().close()


class SeedRecorder(Scripted):
    def __init__(self, tok):
        super().__init__(tok, ["Action: open door 1"])
        self.seeds = []  # every per-prompt seed the backend was given

    def generate(self, prompts, params):
        assert params.seeds is not None and len(params.seeds) == len(prompts)
        self.seeds += params.seeds
        return super().generate(prompts, params)


@pytest.mark.parametrize("max_live", [None, 1, 3])
def test_max_live_bounds_concurrent_episodes_and_seeds_do_not_depend_on_it(tokenizer, max_live):
    Counting.live = Counting.peak = Counting.closed = 0
    chat = ChatFormat.from_tokenizer(tokenizer)
    backend = SeedRecorder(tokenizer)
    specs = [EpisodeSpec(t, t) for t in range(7)]
    trajs, _ = asyncio.run(run_rollout(specs, lambda i: Counting(ToyEnv(hint=False)), backend, chat,
                                       SamplingParams(16, 1.0), 2, 2048, seed=5, max_live=max_live))
    assert Counting.peak == (7 if max_live is None else max_live)
    assert Counting.live == 0 and Counting.closed == 7  # every env given back, once
    assert all(t.finish_reason in ("success", "failure", "turn_limit") for t in trajs)
    assert [t.task_id for t in trajs] == list(range(7))
    # the seed of an episode's turn is a function of (seed, episode, turn), whatever ran beside it
    from runtime.rollout import episode_seed

    expected = [episode_seed(5, i, turn) for i, t in enumerate(trajs) for turn in range(t.turns)]
    assert sorted(backend.seeds) == sorted(expected) and len(set(expected)) == len(expected)


def test_max_live_must_be_positive(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="max_live"):
        asyncio.run(run_rollout([EpisodeSpec(0, 0)], lambda i: LocalEpisode(ToyEnv()), Scripted(tokenizer, ["x"]),
                                chat, SamplingParams(8, 1.0), 1, 512, max_live=0))


class FlakyOnce(LocalEpisode):
    """Fails its first step for the episodes in ``FlakyOnce.bad`` (a server that died), then works."""

    bad: set = set()
    failed: set = set()

    def __init__(self, env, i):
        super().__init__(env)
        self.i = i

    async def step(self, reply_text):
        if self.i in FlakyOnce.bad and self.i not in FlakyOnce.failed:
            FlakyOnce.failed.add(self.i)
            raise ConnectionError("env server died")
        return await super().step(reply_text)


def _retrying(tok, specs, make, retries, heal=None, seed=None):
    """The rollout entry point: a request (episodes, turn limit, budgets, seed) on a runtime (backend, envs, retries)."""
    from runtime.rollout import RolloutRequest, RolloutRuntime, rollout

    backend = SeedRecorder(tok) if seed is not None else Scripted(tok, ["Action: open door 1"])
    req = RolloutRequest(specs, turn_limit=2, params=SamplingParams(16, 1.0), token_budget=2048, seed=seed)
    rt = RolloutRuntime(backend, ChatFormat.from_tokenizer(tok), make, retries=retries, heal=heal)
    trajs, stats = asyncio.run(rollout(req, rt))
    return trajs, stats, backend


def test_masked_episodes_are_retried_after_heal_with_their_own_seeds(tokenizer):
    from runtime.rollout import episode_seed

    FlakyOnce.bad, FlakyOnce.failed = {1, 3}, set()
    healed = []

    async def heal():
        healed.append(1)
        return 1

    specs = [EpisodeSpec(t, t) for t in range(4)]
    trajs, stats, backend = _retrying(tokenizer, specs, lambda i: FlakyOnce(ToyEnv(hint=False), i), 1, heal, seed=9)
    assert healed == [1] and stats.servers_replaced == 1
    assert stats.retried_episodes == 2 and stats.recovered_episodes == 2
    assert not any(t.masked for t in trajs) and [t.task_id for t in trajs] == [0, 1, 2, 3]
    assert [t.attempt for t in trajs] == [1, 2, 1, 2]
    assert "env server died" in trajs[1].earlier_errors[0]
    # the retried episodes sampled with their own indices' seeds: (seed, 1, 0) twice, never (seed, 0, 0) again
    first_turn = [episode_seed(9, i, 0) for i in range(4)]
    assert sorted(s for s in backend.seeds if s in first_turn) == sorted(first_turn + [first_turn[1], first_turn[3]])
    m = stats.as_metrics()
    assert m["retried_episodes"] == 2 and m["recovered_episodes"] == 2 and m["env_servers_replaced"] == 1


def test_without_retries_or_when_failing_again_the_episode_stays_masked(tokenizer):
    FlakyOnce.bad, FlakyOnce.failed = {0}, set()
    trajs, stats, _ = _retrying(tokenizer, [EpisodeSpec(0, 0), EpisodeSpec(1, 1)],
                                lambda i: FlakyOnce(ToyEnv(), i), retries=0)
    assert trajs[0].masked and not trajs[1].masked and stats.retried_episodes == 0

    def make(i):
        return Crashing(ToyEnv()) if i == 0 else LocalEpisode(ToyEnv())

    trajs, stats, _ = _retrying(tokenizer, [EpisodeSpec(0, 0), EpisodeSpec(1, 1)], make, retries=2)
    assert trajs[0].masked and trajs[0].finish_reason == "env_error" and trajs[0].attempt == 3
    assert len(trajs[0].earlier_errors) == 2 and not trajs[1].masked
    assert stats.retried_episodes == 2 and stats.recovered_episodes == 0


def kill_one_server_mid_rollout(tokenizer, a, b, kill):
    """Six episodes over two env servers (``a``, ``b``: anything with ``url``, ``alive()`` and ``restart()``),
    alternating; ``kill()`` takes ``b`` down after the first round, once; the rollout heals (restarts the dead
    server) and retries the masked episodes once. Returns (trajectories, stats, whether ``kill`` ran)."""
    from envs.client import AsyncEnvClient
    from envs.sessions import HttpEpisode
    from runtime.rollout import run_rollout

    killed = []

    def on_round(rnd, live, stats):
        if rnd == 1 and not killed:  # once: the retry's first round passes this hook too
            killed.append(True)
            kill()

    async def heal():
        n = 0
        for srv in (a, b):
            if not srv.alive():
                await asyncio.to_thread(srv.restart)
                n += 1
        return n

    async def go():
        clients = [AsyncEnvClient(s.url, timeout_s=5, retries=1) for s in (a, b)]
        try:
            return await run_rollout(
                [EpisodeSpec(i, i) for i in range(6)], lambda i: HttpEpisode(clients[i % 2]),
                Scripted(tokenizer, ["Action: open door 9", "Action: open door 1"]),
                ChatFormat.from_tokenizer(tokenizer), SamplingParams(16, 1.0), 3, 2048, on_round, heal=heal, retries=1)
        finally:
            for c in clients:
                await c.aclose()

    trajs, stats = asyncio.run(go())
    return trajs, stats, bool(killed)


def test_http_server_killed_mid_rollout_is_replaced_and_its_episodes_rerun(tokenizer):
    """Real env server processes: one is SIGKILLed after the first turn; its episodes are masked, the server is
    replaced on its port, and they run again to a score. The other server's episodes are untouched."""
    from envs.spawn import EnvServerProcess

    with EnvServerProcess("toy") as a, EnvServerProcess("toy") as b:
        port, pid = b.port, b.pid
        trajs, stats, killed = kill_one_server_mid_rollout(tokenizer, a, b, b.kill)
        assert killed and b.alive() and b.port == port and b.pid != pid  # replaced on the same port
        assert stats.servers_replaced == 1 and stats.retried_episodes == 3 and stats.recovered_episodes == 3
        assert not any(t.masked for t in trajs)
        assert [t.attempt for t in trajs] == [1, 2, 1, 2, 1, 2]
        assert all(t.finish_reason in ("success", "failure", "turn_limit") and t.turns >= 1 for t in trajs)
        assert all(t.turns >= 2 and t.attempt == 1 for t in trajs[0::2])  # server a's ran on, unaffected


def test_a_task_index_the_env_refuses_is_a_config_error_not_a_masked_episode(tokenizer):
    """HTTP 400 bad_data_idx (e.g. env.task_pool larger than the env's split) fails the rollout with the fix."""
    from envs.client import AsyncEnvClient
    from envs.spawn import EnvServerProcess
    from envs.sessions import HttpEpisode
    from envs.errors import EnvConfigError

    with EnvServerProcess("toy") as server:
        async def go():
            client = AsyncEnvClient(server.url, timeout_s=5)
            try:
                return await run_rollout([EpisodeSpec(0, 0), EpisodeSpec(5_000, 1)], lambda i: HttpEpisode(client),
                                         Scripted(tokenizer, ["Action: open door 1"]),
                                         ChatFormat.from_tokenizer(tokenizer), SamplingParams(16, 1.0), 2, 2048)
            finally:
                await client.aclose()

        with pytest.raises(EnvConfigError, match=r"out of range(.|\n)*env.task_pool"):
            asyncio.run(go())


def test_rollout_stats_add_work_sums_the_work_and_keeps_the_episode_count():
    from runtime.rollout import RolloutStats

    a = RolloutStats(episodes=4, generated_tokens=10, env_steps=3, gen_time_s=1.0, env_time_s=0.5, wall_time_s=2.0,
                     retried_episodes=1)
    a.add_work(RolloutStats(episodes=1, generated_tokens=5, env_steps=2, gen_time_s=0.25, env_time_s=0.25,
                            wall_time_s=1.0, retried_episodes=7))
    assert (a.episodes, a.generated_tokens, a.env_steps, a.retried_episodes) == (4, 15, 5, 1)
    assert (a.gen_time_s, a.env_time_s, a.wall_time_s) == (1.25, 0.75, 3.0)
    assert a.tokens_per_s == 12.0 and a.env_steps_per_s == 5 / 0.75
