import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Prefect: a private home per test session, no analytics, ephemeral API unless the caller set one.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402

from tests import sharedapi  # noqa: E402


def pytest_collection_finish(session):
    """One Prefect API server for the session's CLI runs, when some collected test starts the CLI
    (tests/sharedapi.py)."""
    sharedapi.start(str(item.path) for item in session.items)


def pytest_sessionfinish(session, exitstatus):
    sharedapi.stop()


@pytest.fixture(scope="session")
def toy_policy(tmp_path_factory):
    """A tiny Llama that writes the toy env's actions (tests/toypolicy.py), for the end-to-end crash and resume
    tests: their runs are bounded by process start-up, not by the model."""
    from tests.toypolicy import make_toy_policy

    return make_toy_policy(tmp_path_factory.mktemp("toy-policy"))


@pytest.fixture(scope="session")
def tiny_babyai_run(tmp_path_factory):
    """One real ``scalinginter run babyai --preset tiny`` (run name ``e2e``), shared: tests/test_e2e.py inspects and
    re-runs it (and drops its checkpoints when its module ends), tests/test_viewer.py serves a copy of it. Yields the
    output dir and the run's printed log; its checkpoints are removed when the session ends."""
    from tests.clirun import cli

    out = tmp_path_factory.mktemp("e2e")
    p = cli("run", "babyai", "--preset", "tiny", "--set", f"output_dir={out}", "--run-name", "e2e", cwd=out,
            own_api=True)  # the README's path: Prefect's temporary server, started while the command imports
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    yield out, p.stdout + p.stderr
    import shutil

    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # pytest keeps the last sessions' temp dirs
