"""Run presets of TextCraft (``scalinginter run textcraft --preset NAME``): partial ``RunConfig`` dicts."""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # A few minutes on 2 CPU cores with SmolLM2-135M: three short phases with growing turn limits. The
    # prompt (crafting commands) is ~500 tokens, so episodes are few and short.
    "smoke": {
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 1}, {"turn_limit": 3, "steps": 1},
                                  {"turn_limit": 4, "steps": 1}]},
        "rollout": {"tasks_per_step": 2, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 1536,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 2},
        "eval": {"n": 8},
    },
    # The easiest honest slice (built for the learning study's second environment): goals of recipe depth 1 only
    # ("get" the base items, then one "craft"; 125 goals, 61 train / 64 held-out), with the action menu in the
    # first observation (show_actions). The base model solves none of these goals, so an outcome reward gives GRPO
    # nothing to learn from: start it from a warm start (behaviour cloning on the expert, docs/guides/warm-start.md:
    # `scalinginter warmstart textcraft --preset easy --demos 61 --epochs E --lr LR --out DIR`, then
    # `--set model.path=DIR`). What it measured: docs/results/learning-study-textcraft.md.
    "easy": {
        "env": {"options": {"depth": 1, "n_test": 64, "show_actions": True}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 4}, {"turn_limit": 3, "steps": 4},
                                  {"turn_limit": 4, "steps": 4}]},
        "rollout": {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 2048,
                    "temperature": 1.0},
        "algo": {"lr": 3e-5, "kl_coef": 0.0, "micro_batch_size": 2},
        "eval": {"n": 64},
    },
    # The paper's TextCraft schedule (GPU scale): 10 -> 20 -> 30 turns, 100 steps each; 100 test goals.
    "paper": {
        "curriculum": {"phases": [{"turn_limit": 10, "steps": 100}, {"turn_limit": 20, "steps": 100},
                                  {"turn_limit": 30, "steps": 100}]},
        # 30 turns x 512 reply tokens overflow the default model's 8,192-token context: a 2-turn history window,
        # the token budget per turn's sample (prompt + reply)
        "rollout": {"tasks_per_step": 32, "samples_per_task": 8, "max_new_tokens": 512, "token_budget": 4096,
                    "history_turns": 2},
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 100},
    },
}
