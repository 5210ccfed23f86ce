"""The Extending pages' worked examples run (docs/examples/*.py, included into docs/extending/*.md as they are).

Each example registers something (an env, an estimator) when imported; the registries are swapped for copies first,
so nothing leaks into the other tests (tests/test_advantages.py checks the exact set of built-in estimators).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import core.advantages as advantages
import envs  # noqa: F401  (registers the built-in envs before the registries are copied)
import envs.base as base

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
PAGES = {"add_env.py": "add-env.md", "add_estimator.py": "add-estimator.md", "add_preset.py": "add-preset.md"}


@pytest.fixture
def isolated_registries(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_PRESETS", dict(base._PRESETS))
    monkeypatch.setattr(advantages, "_ESTIMATORS", dict(advantages._ESTIMATORS))


def _load(path: Path, monkeypatch):
    """Import an example under a name of its own (its registrations name their target by ``__name__``)."""
    name = f"docs_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_on_its_page():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(PAGES)
    for example, page in PAGES.items():
        text = (ROOT / "docs" / "extending" / page).read_text()
        assert f'--8<-- "docs/examples/{example}"' in text, f"docs/extending/{page} does not include {example}"


def test_add_env_example(isolated_registries, monkeypatch):
    mod = _load(EXAMPLES / "add_env.py", monkeypatch)
    out = mod.demo()
    assert out["phases"] == [3, 5, 8] and 1 <= out["turns"] <= 7
    assert "guess" in base.env_names() and set(base.env_presets("guess")) == {"smoke"}


def test_add_estimator_example(isolated_registries, monkeypatch):
    mod = _load(EXAMPLES / "add_estimator.py", monkeypatch)
    assert mod.demo()["advantages"] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert "median-baseline" in advantages.estimator_names()


def test_add_preset_example(isolated_registries, monkeypatch):
    mod = _load(EXAMPLES / "add_preset.py", monkeypatch)
    out = mod.demo()
    assert out["phases"] == [2, 3, 4, 6] and any(line.startswith("KV cache") for line in out["plan"])
    assert "smoke-long" not in base.env_presets("babyai")  # the example changed no global table


def test_registries_are_restored():
    """After the examples ran (the fixture undid their registrations), the built-in sets are as before."""
    assert "guess" not in base.env_names()
    assert "median-baseline" not in advantages.estimator_names()
