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


@pytest.fixture(scope="session")
def toy_policy(tmp_path_factory):
    """A tiny Llama that writes the toy env's actions (tests/toypolicy.py), for the end-to-end crash and resume
    tests: their runs are bounded by process start-up, not by the model."""
    from tests.toypolicy import make_toy_policy

    return make_toy_policy(tmp_path_factory.mktemp("toy-policy"))
