"""The run config of an entry point (CLI, Prefect flow parameters, nightly eval): the env's presets — data of
each env package — looked up here and handed to the pure ``core.config.build_config``."""

from __future__ import annotations

from typing import Any

from core.config import ConfigError, RunConfig
from core.config import build_config as _build


def build_config(env: str, preset: str | None = None, overrides: list[str] | None = None,
                 extra: dict[str, Any] | None = None) -> RunConfig:
    """``env``'s preset ``preset`` (envs/<env>/presets.py) + ``extra`` + ``key.path=value`` overrides, validated."""
    presets = None
    if preset is not None:
        from envs.base import env_presets

        try:
            presets = env_presets(env)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
    cfg = _build(env, preset, overrides, extra, presets=presets)
    check_env_levers(cfg)
    return cfg


SHAPING_ENVS = ("babyai",)  # envs whose info carries expert_remaining_turns (an env option the run turns on)


def check_env_levers(cfg: RunConfig) -> None:
    """Levers that need something of the env, refused when the config is read: the expert term needs the env's
    scripted expert (envs/<env>/contract.py: expert_action); progress shaping needs an env that reports its expert's
    remaining turns (BabyAI)."""
    if cfg.algo.shaping_coef > 0 and cfg.env.name not in SHAPING_ENVS:
        raise ConfigError(f"algo.shaping_coef needs an env that reports its expert's remaining turns "
                          f"({', '.join(SHAPING_ENVS)}), not {cfg.env.name!r}: set algo.shaping_coef=0")
    if cfg.algo.expert_coef > 0 or cfg.algo.expert_groups:
        import tasks.demos

        try:
            tasks.demos.expert_for(cfg.env.name)
        except tasks.demos.DemoError as e:
            raise ConfigError(f"{e}; algo.expert_coef and algo.expert_groups need one: set algo.expert_coef=0 and "
                              "algo.expert_groups=false") from None


__all__ = ["ConfigError", "build_config"]
