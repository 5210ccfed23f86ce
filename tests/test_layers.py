"""Layers hold: imports point down only (flows -> tasks -> storage -> runtime -> envs -> core; a layer may use any
layer below it, never one above).

Every import statement in core/, envs/, runtime/, storage/, tasks/ and flows/ — module level or inside a function — is read with
``ast``; one that reaches a higher layer fails the test with the file, the line and the fix."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("core", "envs", "runtime", "storage", "tasks", "flows")
ALLOWED = {  # layer -> what of ours it may import
    "core": {"core"},
    "envs": {"core", "envs"},
    "runtime": {"core", "envs", "runtime"},
    "storage": {"core", "envs", "runtime", "storage"},
    "tasks": {"core", "envs", "runtime", "storage", "tasks"},
    "flows": {"core", "envs", "runtime", "storage", "tasks", "flows"},
}
FIX = {
    "core": "core/ is pure and imports nothing of ours but core: pass the data in as an argument (as "
            "core.config.build_config takes presets=) or move the code up to the layer that needs it",
    "envs": "envs/ may import only envs and core (an env image carries no trainer code): move the shared helper "
            "down into envs/ or core/ (as envs.cache.cache_root) and import it from there",
    "runtime": "runtime/ (rollout, env sessions, generation and learner backends, console, timing) may not import "
               "storage/, tasks/ or flows/: pass the value in (a path, a callback) from the task that calls it",
    "storage": "storage/ (checkpoints, tracking, S3) may not import tasks/ or flows/: move the helper down into "
               "storage/ or core/ and have the caller pass values in",
    "tasks": "tasks/ may not import flows/: move the helper down into tasks/ (or core/) and have the flow pass "
             "values in",
    "flows": "",
}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in the tree, nested ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for layer in OURS:
        for path in sorted((root / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, mod in imported_modules(tree):
                top = mod.split(".")[0]
                if top in OURS and top not in ALLOWED[layer]:
                    rel = path.relative_to(root)
                    found.append(f"{rel}:{line} imports {mod} ({layer} -> {top}). Fix: {FIX[layer]}")
    return found


def test_imports_point_down_only():
    bad = violations(REPO)
    assert not bad, "layer violations:\n" + "\n".join(bad)


def test_checker_names_the_file_and_the_fix(tmp_path):
    """The checker itself can fail: a tree with a core -> envs import (inside a function), an envs -> runtime
    import and a runtime -> storage import (the two rooms in the middle are ordered too) is reported, file and
    line and fix; a downward import is not."""
    for layer in OURS:
        (tmp_path / layer).mkdir()
    (tmp_path / "core" / "config.py").write_text("import json\n\ndef f():\n    from envs.base import env_presets\n")
    (tmp_path / "envs" / "x.py").write_text("from core.config import RunConfig\nimport runtime.backends.model\n")
    (tmp_path / "tasks" / "ok.py").write_text("from envs.cache import cache_root\nfrom core import chat\n")
    (tmp_path / "flows" / "ok.py").write_text("from tasks import steps\n")
    (tmp_path / "storage" / "ok.py").write_text("from runtime.killpoint import kill_point\n")
    (tmp_path / "runtime" / "up.py").write_text("import os\nfrom storage.checkpoint_store import join_uri\n")
    bad = violations(tmp_path)
    assert len(bad) == 3
    assert bad[0].startswith("core/config.py:4 imports envs.base (core -> envs). Fix: core/ is pure")
    assert bad[1].startswith("envs/x.py:2 imports runtime.backends.model (envs -> runtime). Fix: envs/ may import")
    assert bad[2].startswith("runtime/up.py:2 imports storage.checkpoint_store (runtime -> storage). Fix: runtime/")


def test_env_modules_import_without_trainer_code():
    """At run time too: every envs/ module imports with runtime/, storage/, tasks/ and flows/ made unimportable (as in an env image).
    A module whose third-party dependency is not installed here is skipped, not failed."""
    import subprocess
    import sys

    code = r'''
import importlib, importlib.abc, pkgutil, sys
class NoTrainer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("runtime", "storage", "tasks", "flows"):
            raise ImportError(f"{name} is trainer code, absent from an env image")
sys.meta_path.insert(0, NoTrainer())
import envs
bad = []
for m in pkgutil.walk_packages(envs.__path__, "envs."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("runtime", "storage", "tasks", "flows"):
            bad.append(f"{m.name}: {e}")
    except ImportError as e:
        bad.append(f"{m.name}: {e}")
from envs.textcraft.tasks import cache_dir
cache_dir()
print("\n".join(bad))
'''
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not p.stdout.strip(), "envs modules that need trainer code:\n" + p.stdout
