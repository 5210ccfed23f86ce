"""Run presets of BabyAI (``scalinginter run babyai --preset NAME``): partial ``RunConfig`` dicts."""

from typing import Any

# the multi-step levels (the `multistep` preset's comment says why these): multistep, multistep-rl, multistep-study
MULTISTEP_LEVELS = "GoToLocal,PickupLoc,OpenTwoDoors,UnlockLocal,PutNextS4N1,UnlockPickup,KeyCorridorS3R1"
# the RL-from-a-warm-start recipe of multistep-rl and multistep-study (without its task filter: each preset says)
_RL_ROLLOUT = {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 3072,
               "temperature": 1.0, "dynamic_sampling_rounds": 1}
_RL_ALGO = {"lr": 1e-5, "kl_coef": 0.05, "micro_batch_size": 4, "skip_no_signal": True, "expert_groups": True,
            "expert_coef": 0.6, "expert_decay": "linear"}

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU demo: three phases with growing turn limits, 4 steps each, on three go-to levels. Its levers: lr 3e-5
    # and no KL reference (a 135M policy must move far from its chatty prior; no reference forward), temperature 1.0
    # for exploration, and 24-token replies (an answer is "Action: go to red ball 1"; longer replies are rambling
    # the turn limit punishes anyway). What it measures: docs/results/smoke-demo.md.
    "smoke": {
        "env": {"options": {"levels": "GoToObj,GoToRedBallGrey,GoToLocal"}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 4}, {"turn_limit": 3, "steps": 4},
                                  {"turn_limit": 4, "steps": 4}]},
        "rollout": {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 1536,
                    "temperature": 1.0},
        # memory: bitsandbytes' 8-bit AdamW, a pair of sequences per forward only while each is <= 512 tokens,
        # forwards of >= 400 padded tokens (the later phases' episodes, whose activations set the update's peak)
        # recompute their activations in the backward pass (the same gradients: tests/test_learning.py), gradients
        # held in bf16. Their figures: docs/results/memory.md and docs/results/smoke-demo.md.
        "algo": {"lr": 3e-5, "kl_coef": 0.0, "micro_batch_size": 2, "micro_batch_tokens": 1024,
                 "optimizer": "adamw8bit", "activation_checkpointing_min_tokens": 400, "grad_dtype": "bf16"},
        "eval": {"n": 96},
    },
    # The longer CPU run: the smoke recipe on five go-to levels, twice the episodes per step and 2.5 times the
    # steps, turn limits 2 -> 4 -> 6, scored on 128 held-out tasks at 6 turns (greedy). What it measures:
    # docs/results/cpu-preset.md.
    "cpu": {
        "env": {"options": {"levels": "GoToObj,GoToRedBallGrey,GoToRedBall,GoToLocal,GoToDoor"}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 10}, {"turn_limit": 4, "steps": 10},
                                  {"turn_limit": 6, "steps": 10}]},
        "rollout": {"tasks_per_step": 8, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 2048,
                    "temperature": 1.0},
        "algo": {"lr": 3e-5, "kl_coef": 0.0, "micro_batch_size": 4},
        "eval": {"n": 128},
    },
    # Multi-step tasks whose horizons matter: levels chosen by the turns the expert (envs/babyai/expert.py:
    # minigrid's BabyAIBot phrased as this env's macro and primitive actions) needs, info["required_turns"].
    # Counted on the preset's own train indices 0..699 (100 per level; every task labelled, the expert solves all):
    #   GoToLocal       1: 59, 2-3: 37, 4-6: 3, 7: 1      (walk to a seen object; turn first when it is not in view)
    #   PickupLoc       1: 39, 2-3: 57, 4-6: 3, 10: 1
    #   OpenTwoDoors    2-3: 59, 4-6: 41                  (open one door, cross the room, open the other)
    #   UnlockLocal     2-3: 21, 4-6: 69, 7-10: 8, 11-12: 2 (fetch the key, open the locked door)
    #   PutNextS4N1     2-3: 5, 4-6: 79, 7-8: 16          (pick up, carry, drop next to: the carrying is primitive)
    #   UnlockPickup    4-6: 19, 7-8: 81                  (key, unlock, drop the key, pick up the box)
    #   KeyCorridorS3R1 9: 100
    #   all             1: 14 %, 2-3: 26 %, 4-6: 31 %, 7-10: 30 %, 11+: 0.3 %
    # so each bucket of the 3 -> 6 -> 10 turn limits has tasks that just fit and tasks that need the next phase.
    # Left out: PutNextLocal (13 % need 11-16 turns, 8 objects per observation), Open, Unlock, SynthLoc,
    # GoToObjMaze, UnblockPickup (medians 11-36 turns: exploration of several rooms runs on primitives).
    # Observations along the expert's path: 277 characters median, 789 at most; a 10-turn episode of random play
    # (instruction, observations, 24-token replies, chat framing) is 1,399 SmolLM2 tokens median, 2,655 at most
    # (140 tasks), within the 3,072-token budget. Eval: 140 held-out tasks (20 per level).
    "multistep": {
        "env": {"options": {"levels": MULTISTEP_LEVELS}},
        "curriculum": {"phases": [{"turn_limit": 3, "steps": 10}, {"turn_limit": 6, "steps": 10},
                                  {"turn_limit": 10, "steps": 10}]},
        "rollout": {"tasks_per_step": 8, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 3072,
                    "temperature": 1.0},
        "algo": {"lr": 3e-5, "kl_coef": 0.0, "micro_batch_size": 4},
        "eval": {"n": 140},
    },
    # RL that improves a behaviour-cloning warm start of the multistep levels (scalinginter warmstart ... --out DIR;
    # run with --set model.path=DIR): the rl-vs-warmstart `groups@10+expert0.6` arm's settings, 12 steps of 4 tasks x
    # 4 samples at the evaluation's 10 turns, lr 1e-5, a KL of 0.05 to the warm start, no update without signal,
    # tasks whose expert fits the turn limit, one dynamic-sampling round, the expert's episode in each group whose
    # samples all failed, and the expert's reply at the state where each episode left its path (weight 0.6, decaying
    # to 0 over the run). What it measured: docs/results/rl-vs-warmstart.md.
    "multistep-rl": {
        "env": {"options": {"levels": MULTISTEP_LEVELS}},
        "curriculum": {"phases": [{"turn_limit": 10, "steps": 12}]},
        "rollout": {**_RL_ROLLOUT, "task_filter": "fits_turns"},
        "algo": _RL_ALGO,
        "eval": {"n": 140, "turn_limit": 10},
    },
    # The curriculum study on the multistep-rl recipe (scalinginter study --preset multistep-study --set
    # model.path=DIR): its levers (lr 1e-5, KL 0.05 to the starting model, no update without signal, one
    # dynamic-sampling round, the expert's episode in each all-fail group, the expert's relabels at weight 0.6
    # decaying over the run) on the 3 -> 6 -> 10 schedule, 12 steps a phase (36), tasks drawn from all levels: the
    # study's `scalinginter-fit` arm adds the fits-turns filter, so the preset leaves it out. The fixed arms take the
    # same 36 steps at 3 or at 10 turns.
    "multistep-study": {
        "env": {"options": {"levels": MULTISTEP_LEVELS}},
        "curriculum": {"phases": [{"turn_limit": 3, "steps": 12}, {"turn_limit": 6, "steps": 12},
                                  {"turn_limit": 10, "steps": 12}]},
        "rollout": _RL_ROLLOUT,
        "algo": _RL_ALGO,
        "eval": {"n": 140, "turn_limit": 10},
    },
    # The smallest real run, for end-to-end tests: 1 step per phase, few short episodes.
    "tiny": {
        "env": {"options": {"levels": "GoToObj"}},
        "curriculum": {"phases": [{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 1}]},
        # transformers: a vLLM engine's start would dominate a run this short
        "rollout": {"tasks_per_step": 2, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 768,
                    "backend": "transformers"},
        "algo": {"lr": 1e-5, "micro_batch_size": 2},
        "eval": {"n": 2},
        "tracking": {"log_trajectories": 2},
    },
    # The paper's BabyAI schedule (GPU scale): 6 -> 13 -> 20 turns, 100 steps each.
    "paper": {
        "curriculum": {"phases": [{"turn_limit": 6, "steps": 100}, {"turn_limit": 13, "steps": 100},
                                  {"turn_limit": 20, "steps": 100}]},
        # 20 turns x 512 reply tokens overflow SmolLM2's 8,192-token context: each turn's prompt holds the last 2
        # turns (history window), and the token budget bounds one turn's sample (prompt + reply)
        "rollout": {"tasks_per_step": 32, "samples_per_task": 8, "max_new_tokens": 512, "token_budget": 4096,
                    "history_turns": 2},
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 90},
    },
}


