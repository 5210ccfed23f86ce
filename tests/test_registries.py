"""The two plug-in points (envs, advantage estimators) refuse a name that is already taken by something else, and
accept the same registration again (a module imported twice)."""

from __future__ import annotations

import pytest

import envs  # noqa: F401  (registers the built-in envs)
from core import advantages as A
from envs import base


def test_env_name_taken_by_another_factory_is_refused():
    with pytest.raises(ValueError, match="'babyai' is already registered with factory 'envs.babyai.env:BabyAIEnv'"):
        base.register_env("babyai", "my_pkg.env:OtherEnv")
    with pytest.raises(ValueError, match="'textcraft' is already registered with presets"):
        base.register_env("textcraft", "envs.textcraft.env:TextCraftEnv", presets="my_pkg:PRESETS")
    assert base._REGISTRY["babyai"] == "envs.babyai.env:BabyAIEnv"


def test_same_env_registration_again_is_a_no_op():
    before = (dict(base._REGISTRY), dict(base._PRESETS))
    base.register_env("textcraft", "envs.textcraft.env:TextCraftEnv", presets="envs.textcraft.presets:PRESETS")
    base.register_env("toy", "envs.toy:ToyEnv")
    assert (base._REGISTRY, base._PRESETS) == before


def test_new_env_name_registers(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    base.register_env("my-env", "envs.toy:ToyEnv")
    assert "my-env" in base.env_names()


def test_estimator_name_taken_by_another_function_is_refused():
    def grpo(batch, params):  # another function under a built-in name
        return None

    with pytest.raises(ValueError, match="estimator 'grpo' is already registered by core.advantages"):
        A.register("grpo")(grpo)
    assert A.get_estimator("grpo").fn.__module__ == "core.advantages"


def test_same_estimator_function_again_is_accepted(monkeypatch):
    monkeypatch.setattr(A, "_ESTIMATORS", dict(A._ESTIMATORS))
    spec = A.get_estimator("rloo")
    A.register("rloo", needs_groups=True, description=spec.description)(spec.fn)
    assert A.get_estimator("rloo").fn is spec.fn
