"""The history window (``rollout.history_turns``): each turn's prompt holds the instruction, the last k turns and
the current observation; every turn is its own training sample, token-exact. Scripted generation (the fake engine
of the async-rollout tests: replies are a pure function of prompt and seed), the toy env in-process, the real
SmolLM2 tokenizer and chat template; no model forward except in the learner test (a tiny random Llama)."""

import asyncio

import pytest

from core.chat import ChatFormat
from core.trajectory import Trajectory, join_rows, segment_bounds, split_rows, turn_samples
from envs.toy import ToyEnv
from runtime.backends.generation import SamplingParams
from envs.sessions import LocalEpisode
from runtime.rollout import EpisodeSpec, RolloutRequest, RolloutRuntime, episode_seed, rollout
from tests.test_async_rollout import FakeEngine


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from runtime.backends.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


# replies that never open the right door quickly: episodes run to the turn limit (the toy env with many attempts)
WRONG = ("Action: look around", "I am not sure. Action: wait", "Action: open door 9")


def _run(tok, k, *, async_episodes=False, turn_limit=5, budget=4096, n=3, replies=WRONG, max_new=24):
    backend = FakeEngine(tok, replies=replies)
    chat = ChatFormat.from_tokenizer(tok)
    specs = [EpisodeSpec(task_id=i, group_id=0) for i in range(n)]
    req = RolloutRequest(specs, turn_limit, SamplingParams(max_new, 1.0), budget, seed=5, history_turns=k)
    rt = RolloutRuntime(backend, chat, lambda i: LocalEpisode(ToyEnv(attempts=20)), async_episodes=async_episodes)
    trajs, stats = asyncio.run(rollout(req, rt))
    return trajs, chat


def _actions(t: Trajectory) -> list[list[int]]:
    out, start = [], None
    for p, m in enumerate(t.loss_mask):
        if m and start is None:
            start = p
        if start is not None and p in t.action_ends:
            out.append(t.token_ids[start:p + 1])
            start = None
    return out


def test_window_prompt_is_the_full_history_for_the_first_k_turns_and_drops_older_turns_after(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    obs = ["o0 start", "o1 after a0", "o2 after a1", "o3 after a2"]
    acts = [chat.encode(f"Action: a{j}") + [tokenizer.eos_token_id] for j in range(3)]
    stop = [True, True, True]
    full = chat.prompt_ids("SYS", obs[0]) + acts[0] + chat.env_turn_ids(obs[1], True) + acts[1] + \
        chat.env_turn_ids(obs[2], True)
    assert chat.window_prompt_ids("SYS", obs[:3], acts[:2], stop[:2], k=2) == full  # t = 2 <= k: unchanged
    assert chat.window_prompt_ids("SYS", obs[:3], acts[:2], stop[:2], k=5) == full
    # t = 3, k = 1: the instruction, turn 2 (its observation o2 opens the user message, its reply a2), then o3
    got = chat.window_prompt_ids("SYS", obs, acts, stop, k=1)
    assert got == chat.prompt_ids("SYS", "[2 earlier turns omitted]\no2 after a1") + acts[2] + \
        chat.env_turn_ids(obs[3], True)
    # k = 0: only the current observation
    assert chat.window_prompt_ids("SYS", obs, acts, stop, k=0) == chat.prompt_ids("SYS", "[3 earlier turns omitted]\n"
                                                                                  "o3 after a2")
    with pytest.raises(ValueError, match="observations"):
        chat.window_prompt_ids("SYS", obs, acts[:1], stop[:1], k=1)


@pytest.mark.parametrize("async_episodes", [False, True])
def test_windowed_rollout_is_token_exact_per_turn_sample(tokenizer, async_episodes):
    k = 1
    trajs, chat = _run(tokenizer, k, async_episodes=async_episodes)
    instr = ToyEnv(attempts=20).instruction()
    for t in trajs:
        assert t.turns == 5 and t.finish_reason == "turn_limit"
        bounds = segment_bounds(t)
        assert len(bounds) == t.turns and bounds[0][0] == 0 and bounds[-1][1] == len(t.token_ids)
        obs = [t.first_observation] + t.observations
        acts = _actions(t)
        stopped = [a[-1] == tokenizer.eos_token_id for a in acts]
        for turn, (a, b) in enumerate(bounds):
            sample = t.token_ids[a:b]
            prompt = chat.window_prompt_ids(instr, obs[:turn + 1], acts[:turn], stopped[:turn], k)
            # each sample: its own prompt (mask 0) then exactly the reply that was sampled from it (mask 1)
            assert sample == prompt + acts[turn]
            assert t.loss_mask[a:b] == [0] * len(prompt) + [1] * len(acts[turn])
            assert t.action_ends[turn] == b - 1
            assert all(x == 0.0 for x in t.logprobs[a:a + len(prompt)])
    # what the engine drew is a function of (prompt, seed): each sample's prompt is the context it was given
    fake = FakeEngine(tokenizer, replies=WRONG)
    for i, t in enumerate(trajs):
        for turn, (a, b) in enumerate(segment_bounds(t)):
            act = _actions(t)[turn]
            g = fake.sample(t.token_ids[a:b - len(act)], 24, episode_seed(5, i, turn))
            assert g.token_ids == act and g.logprobs == t.logprobs[b - len(act):b]


def test_window_none_keeps_one_sequence_and_window_k_matches_it_while_t_le_k(tokenizer):
    full, _ = _run(tokenizer, None)
    assert all(not t.segment_starts for t in full)
    # the first k+1 turns sample from the same contexts, so with the same seeds they draw the same replies
    win, _ = _run(tokenizer, 3)
    for a, b in zip(full, win):
        assert _actions(a)[:4] == _actions(b)[:4]
        s, where = turn_samples([b])
        assert [x.token_ids for x in s][3] == a.token_ids[:a.action_ends[3] + 1]


def test_token_budget_binds_per_sample_not_per_trajectory(tokenizer):
    # a budget that two turns of full history overflow, but every windowed sample fits
    full, _ = _run(tokenizer, None, budget=400, turn_limit=6)
    win, _ = _run(tokenizer, 0, budget=400, turn_limit=6)
    assert all(t.finish_reason == "token_budget" for t in full)
    assert all(t.finish_reason == "turn_limit" and t.turns == 6 for t in win)
    assert all(b - a <= 400 for t in win for a, b in segment_bounds(t))
    assert max(len(t.token_ids) for t in win) > 400


def test_turn_samples_split_and_join_are_inverse_and_keep_rewards_on_action_ends(tokenizer):
    trajs, _ = _run(tokenizer, 1, turn_limit=4)
    trajs[1].turn_rewards[-1] = 1.0
    plain = Trajectory(task_id=9, group_id=1)
    plain.start([1, 2, 3])
    plain.add_action([4, 5], [-0.1, -0.2])
    samples, where = turn_samples(trajs + [plain])
    assert samples[-1] is plain and where[-1] == (len(trajs), 0, 5)
    assert len(samples) == sum(t.turns for t in trajs) + 1
    for s, (i, a, b) in zip(samples, where):
        src = (trajs + [plain])[i]
        assert s.token_ids == src.token_ids[a:b] and s.group_id == src.group_id and s.turns == 1
        assert s.loss_mask[s.prompt_len] == 1 and not any(s.loss_mask[:s.prompt_len])
    assert sum(s.num_policy_tokens for s in samples) == sum(t.num_policy_tokens for t in trajs + [plain])
    last_of_1 = trajs[0].turns + trajs[1].turns - 1
    assert where[last_of_1][0] == 1 and samples[last_of_1].turn_rewards == [1.0]
    assert sum(sum(s.turn_rewards) for s in samples) == sum(t.reward for t in trajs + [plain])
    lengths = [len(t.token_ids) for t in trajs + [plain]]
    rows = [[float(p) for p in range(n)] for n in lengths]
    assert join_rows(split_rows(rows, where), where, lengths) == rows
    with pytest.raises(ValueError, match="sample row"):
        join_rows([[0.0]] * len(where), where, lengths)


# --- through the learner: per-turn samples are token-exact and learnable ------------------------------------
from tests.test_learning import LR, STEPS, TASKS, SAMPLES, TwoRooms, learned, tiny_model_dir  # noqa: E402,F401


def _train_windowed(model_dir: str, estimator: str, lr: float, k: int, mismatch: list | None = None) -> list[float]:
    """tests/test_learning.py's loop with a history window of ``k`` turns: the learner sees one sample per turn
    (``turn_samples``), the estimator the episodes (``join_rows`` / ``split_rows`` between them), as the flow does."""

    from core.advantages import trajectory_advantages
    from tests.test_learning import setup

    spec, learner, backend, chat, params = setup(model_dir, estimator, lr, ppo_steps=1)
    rates = []
    for _ in range(STEPS):
        specs = [EpisodeSpec(task_id=g, group_id=g) for g in range(TASKS) for _ in range(SAMPLES)]
        req = RolloutRequest(specs, 2, SamplingParams(1, 1.0), 512, history_turns=k)
        trajs, _ = asyncio.run(rollout(req, RolloutRuntime(backend, chat, lambda i: LocalEpisode(TwoRooms()))))
        rates.append(sum(t.success for t in trajs) / len(trajs))
        samples, where = turn_samples(trajs)
        assert len(samples) == sum(max(1, t.turns) for t in trajs)  # one sample per turn
        lengths = [len(t.token_ids) for t in trajs]
        prep = learner.prepare(samples, old_for_reward=True)
        if mismatch is not None:
            mismatch.append(prep.stats["logprob_mismatch"])
        adv, ret, _ = trajectory_advantages(
            estimator, params, trajs,
            values=join_rows(learner.per_token(samples, prep, "values"), where, lengths) if spec.needs_critic else None,
            kl=join_rows(learner.per_token(samples, prep, "kl"), where, lengths) if spec.kl_in_reward else None)
        learner.update(samples, split_rows(adv, where), prepared=prep,
                       returns=None if ret is None else split_rows(ret, where))
    return rates


@pytest.mark.parametrize("estimator", ["grpo", "ppo", "gigpo"])
def test_windowed_per_turn_samples_learn_the_two_turn_task(tiny_model_dir, estimator):
    # k = 0: turn 2 sees only "Room two." (the task is Markov, so the window loses nothing it needs); every turn
    # is its own sample, and the learner's log-probs of the sampled ids are the sampler's (fp32: token-exact)
    mismatch: list[float] = []
    rates = _train_windowed(tiny_model_dir, estimator, LR[estimator], k=0, mismatch=mismatch)
    assert learned(rates), f"{estimator} with a window did not learn: success per step {rates}"
    assert max(mismatch) < 1e-4, mismatch


def test_windowed_run_with_zero_lr_does_not_learn(tiny_model_dir):
    rates = _train_windowed(tiny_model_dir, "grpo", 0.0, k=0)
    assert not learned(rates), rates


def test_agentgym_prompt_style_opens_with_the_instruction_an_ok_turn_then_the_observation(tokenizer):
    from core.chat import AGENTGYM_ACK, AGENTGYM_FORMAT

    chat = ChatFormat.from_tokenizer(tokenizer, "agentgym")
    text = tokenizer.decode(chat.prompt_ids("Play the grid game.", "You see a red ball."))
    i, j, k = (text.find("Play the grid game."), text.find(AGENTGYM_ACK + "<|im_end|>"),
               text.find("You see a red ball."))
    assert 0 <= i < j < k, text
    assert "Thought:" in text and "Action:" in text and AGENTGYM_FORMAT.split("\n")[0] in text
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2  # OK turn + the open one
    default = tokenizer.decode(ChatFormat.from_tokenizer(tokenizer).prompt_ids("Play the grid game.", "obs"))
    assert "<|im_start|>system\nPlay the grid game." in default and AGENTGYM_ACK + "<|im_end|>" not in default
    # the window keeps the style: t <= k is the full-history sequence in that style
    acts = [chat.encode("Action: go") + [tokenizer.eos_token_id]]
    assert chat.window_prompt_ids("I", ["o0", "o1"], acts, [True], k=2) == \
        chat.prompt_ids("I", "o0") + acts[0] + chat.env_turn_ids("o1", True)
    with pytest.raises(ValueError, match="prompt style"):
        ChatFormat.from_tokenizer(tokenizer, "other")
