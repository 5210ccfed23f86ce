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
    return _build(env, preset, overrides, extra, presets=presets)


__all__ = ["ConfigError", "build_config"]
