"""A new preset: the BabyAI smoke recipe with a fourth, longer phase (docs/extending/add-preset.md).

A preset is a partial RunConfig dict. In the repository it is one more entry of ``PRESETS`` in
``envs/babyai/presets.py``; here it is merged into a copy of that table so that nothing global changes.
tests/test_docs_examples.py runs ``demo()``.
"""

from __future__ import annotations

import copy
from typing import Any

from core.config import build_config, deep_merge
from envs.base import env_presets

SMOKE_LONG: dict[str, Any] = deep_merge(copy.deepcopy(env_presets("babyai")["smoke"]), {
    # one phase more, at 6 turns; lists are replaced whole, dicts merged key by key
    "curriculum": {"phases": [{"turn_limit": 2, "steps": 4}, {"turn_limit": 3, "steps": 4},
                              {"turn_limit": 4, "steps": 4}, {"turn_limit": 6, "steps": 4}]},
    "eval": {"turn_limit": 6},
})


def demo() -> dict[str, Any]:
    from flows.dryrun import dry_run

    presets = {**env_presets("babyai"), "smoke-long": SMOKE_LONG}
    # what `scalinginter run babyai --preset smoke-long --set algo.lr=2e-5` builds once the entry is in PRESETS
    cfg = build_config("babyai", "smoke-long", ["algo.lr=2e-5"], presets=presets)
    assert cfg.preset == "smoke-long" and cfg.algo.lr == 2e-5
    assert [p.turn_limit for p in cfg.curriculum.phases] == [2, 3, 4, 6] and cfg.eval_turn_limit == 6
    assert cfg.algo.optimizer == "adamw8bit"  # the rest of the smoke recipe is kept

    plan = dry_run(cfg)  # `--dry-run`: context, KV cache and memory plan against this machine
    assert not plan.errors, plan.errors
    return {"phases": [p.turn_limit for p in cfg.curriculum.phases], "plan": plan.lines}


if __name__ == "__main__":
    for line in demo()["plan"]:
        print(line)
