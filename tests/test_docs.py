"""The documentation: the generated references cover the config and the CLI, the README stays short and points
into the site, and bench/results' index and pages name files that exist (and every kept file is cited)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from core.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"


def _gen():
    spec = importlib.util.spec_from_file_location("docs_gen_reference", DOCS / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting of ``model`` as --set spells it, walked here independently of the generator."""
    keys = []
    for name, field in model.model_fields.items():
        t = field.annotation
        if isinstance(t, type) and issubclass(t, BaseModel):
            keys += _leaf_keys(t, f"{prefix}{name}.")
            continue
        keys.append(prefix + name)
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            if isinstance(item, type) and issubclass(item, BaseModel):
                keys += _leaf_keys(item, f"{prefix}{name}[].")
    return keys


def test_config_reference_lists_every_setting():
    page = _gen().config_markdown()
    rows = re.findall(r"^\| `([^`]+)` \|", page, flags=re.MULTILINE)
    keys = _leaf_keys(RunConfig)
    assert len(keys) > 80
    assert sorted(rows) == sorted(keys), {"missing": sorted(set(keys) - set(rows)), "extra": sorted(set(rows) - set(keys))}
    # each row carries the field's default and description as the config has them
    lr = RunConfig.model_fields["algo"].annotation.model_fields["lr"]
    row = next(line for line in page.splitlines() if line.startswith("| `algo.lr` |"))
    assert f"`{lr.default}`" in row and lr.description in row


def test_cli_reference_lists_every_command_and_option():
    import typer

    from flows.cli import app

    page = _gen().cli_markdown()
    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="scalinginter")
    seen = 0
    for name in root.list_commands(ctx):
        cmd = root.get_command(ctx, name)
        subs = [(f"{name} {s}", cmd.get_command(ctx, s)) for s in cmd.list_commands(ctx)] \
            if hasattr(cmd, "list_commands") else [(name, cmd)]
        assert f"## `scalinginter {name}`" in page
        for path, sub in subs:
            assert f"## `scalinginter {path}`" in page, path
            section = page.split(f"## `scalinginter {path}`", 1)[1].split("\n## ", 1)[0]
            for p in sub.params:
                if p.name == "help" or getattr(p, "hidden", False):
                    continue
                label = p.name.upper() if p.param_type_name == "argument" else p.opts[0]
                assert label in section, (path, label)
                seen += 1
    assert seen > 40


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "./infra/install.sh && .venv/bin/scalinginter run babyai --preset smoke" in first_block
    assert ".venv/bin/python -m pytest" in first_block
    assert "mkdocs serve" in text
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


# Every heading of the README before issue 46 and where its material lives now.
MOVED = {
    "Quick start": "README.md",
    "The command line": "docs/guides/configure.md",
    "Evaluation": "docs/guides/evaluation.md",
    "The learning study: ScalingInter vs fixed horizons": "docs/guides/learning-study.md",
    "Running it as a Prefect deployment": "docs/guides/prefect.md",
    "On a GPU": "docs/guides/gpu.md",
    "Beyond one machine": "docs/guides/multi-node.md",
    "Stability diagnostics": "docs/concepts/diagnostics.md",
    "Trajectory viewer": "docs/guides/viewer.md",
    "How it is built": "docs/concepts/architecture.md",
    "Tests and benchmarks": "docs/guides/testing.md",
}


def test_every_old_readme_heading_has_a_home():
    nav = (ROOT / "mkdocs.yml").read_text()
    for heading, home in MOVED.items():
        assert (ROOT / home).exists(), (heading, home)
        if home.startswith("docs/"):
            assert home.removeprefix("docs/") in nav, f"{home} ({heading}) is not in mkdocs.yml's nav"


def _index_rows() -> list[tuple[str, list[str], list[str]]]:
    """(folder, current files, pages) of each row of bench/results/README.md's table."""
    rows = []
    for line in (RESULTS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`/"), re.findall(r"`([^`]+)`", cells[2]), re.findall(r"`([^`]+)`", cells[3])))
    return rows


def test_results_index_names_files_that_exist():
    rows = _index_rows()
    assert {folder for folder, _, _ in rows} == {d.name for d in RESULTS.iterdir() if d.is_dir()}, \
        "every folder of bench/results has a row in its index, and every row a folder"
    for folder, files, pages in rows:
        assert files and pages, folder
        for f in files:
            if f.startswith("."):  # "(and `.png`)": the same stem with another suffix
                continue
            assert f.startswith(folder + "/") and (RESULTS / f).exists(), f"bench/results/README.md: {f} does not exist"
        for p in pages:
            assert (DOCS / p).exists(), f"bench/results/README.md names the page docs/{p}, which does not exist"
            page = (DOCS / p).read_text()
            main = next(f for f in files if not f.startswith("."))
            assert main.rsplit(".", 1)[0] in page, f"docs/{p} does not cite its current file {main}"


def test_every_result_file_is_cited():
    """A file under bench/results is kept only while a page, the README or the index cites it (a study's .json, .md
    and .png share a stem: citing one cites the report)."""
    cited = "\n".join(p.read_text() for p in DOCS.rglob("*.md")) + (ROOT / "README.md").read_text() \
        + (RESULTS / "README.md").read_text()
    # issue 44 names its report's path at the top level: bench/results/rl-vs-warmstart-babyai-multistep-<date>.json
    named = ("rl-vs-warmstart-",)
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md" and not p.name.startswith(named)]
    uncited = []
    for path in RESULTS.rglob("*"):
        if path.is_file() and (path.parent != RESULTS or path.name.startswith(named)):
            rel = path.relative_to(RESULTS).as_posix()
            if rel.rsplit(".", 1)[0] not in cited:
                uncited.append(rel)
    assert not uncited, f"result files no page cites (cite them or remove them): {uncited}"
    assert not loose, f"result files outside a folder (move them into their benchmark's folder): {loose}"


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (infra/install.sh installs it)")
def test_docs_build_strict(tmp_path):
    """The site builds with no warning (broken links, missing pages or anchors, missing snippets)."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
