"""Secrets in URIs never land in what a run records, and spawned env servers inherit no credentials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.redact import child_environ, is_credential_var, redact, redact_uri

PW = "Hunter2-pw-7731"
TOKEN = "ghp_tok3nValue99"


@pytest.mark.parametrize("raw, expect", [
    (f"http://alice:{PW}@mlflow.example:5000/x", "http://alice:***@mlflow.example:5000/x"),
    (f"postgresql+psycopg2://u:{PW}@db/mlflow", "postgresql+psycopg2://u:***@db/mlflow"),
    (f"https://{TOKEN}@host/a?b=1", "https://***@host/a?b=1"),  # a bare user part may be a token
    (f"http://a:{PW}@c@host/", "http://a:***@host/"),  # an '@' inside the password
    (f"http://h/x?token={TOKEN}&x=1&password={PW}", "http://h/x?token=***&x=1&password=***"),
    (f"two: http://a:{PW}@h and s3://k:{PW}@b/", "two: http://a:***@h and s3://k:***@b/"),
    ("http://127.0.0.1:8000/path", "http://127.0.0.1:8000/path"),  # nothing to hide: unchanged
    ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
    ("file:///a/b@c", "file:///a/b@c"),  # '@' in a path is not userinfo
    ("mailto:x@y.com", "mailto:x@y.com"),
    ("", ""),
])
def test_redact_uri_hand_cases(raw, expect):
    assert redact_uri(raw) == expect


def test_redact_walks_nested_config_and_keeps_other_values():
    cfg = {"env": {"url": f"http://u:{PW}@h:1/", "n": 3, "opts": [f"x://a:{PW}@b", None, 1.5]}, "ok": True}
    assert redact(cfg) == {"env": {"url": "http://u:***@h:1/", "n": 3, "opts": ["x://a:***@b", None, 1.5]},
                           "ok": True}
    assert PW in json.dumps(cfg)  # a copy: the input is untouched


def test_child_environ_drops_credentials_keeps_what_servers_need():
    env = {"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/x", "AWS_ACCESS_KEY_ID": "AKIA1",
           "AWS_SECRET_ACCESS_KEY": PW, "AWS_SESSION_TOKEN": TOKEN, "MLFLOW_TRACKING_PASSWORD": PW,
           "PREFECT_API_KEY": PW, "HF_TOKEN": TOKEN, "MY_DB_URL": f"postgres://u:{PW}@h/db",
           "SCALINGINTER_ENV_TOKEN": "shared", "SI_JUDGE_API_KEY": "judge", "SI_CHROMIUM": "/bin/chromium"}
    out = child_environ(env)
    assert out == {"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/x", "SCALINGINTER_ENV_TOKEN": "shared",
                   "SI_JUDGE_API_KEY": "judge", "SI_CHROMIUM": "/bin/chromium"}
    assert is_credential_var("aws_secret_access_key") and not is_credential_var("LANG")


def test_run_records_hold_no_uri_password(tmp_path):
    """A config with credentials in env.url and tracking.uri; write what a run writes from it (config.json, the
    parent run's MLflow params in a real sqlite store, a checkpoint's trainer_state.json) and grep every byte."""
    from flows.config import build_config
    from tasks.resume import PhasePlan, PhaseProgress
    from tasks.runs import recorded_config, run_dir, write_run_config
    from storage.tracking import Tracker

    cfg = build_config("babyai", "tiny", [f"output_dir={tmp_path / 'out'}", "run_name=secret-run",
                                          f"env.url=http://alice:{PW}@127.0.0.1:9/",
                                          f"tracking.uri=https://bob:{PW}@mlflow.example/"])
    assert PW in cfg.model_dump_json()
    rd = run_dir(cfg)
    write_run_config(rd, cfg)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "redact-test", artifact_root=tmp_path / "mlartifacts")
    run_id = tracker.start_run(cfg.run_name, params=recorded_config(cfg))
    state = PhaseProgress(PhasePlan.of(cfg, 1), cfg).trainer_state(0, 1)
    (rd / "trainer_state.json").write_text(json.dumps(state, indent=2))  # what the learner's save writes

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"config.json", "trainer_state.json", "mlflow.db"} <= {p.name for p in files}
    leaks = [str(p) for p in files if PW.encode() in p.read_bytes()]
    assert not leaks, f"password found in {leaks}"
    saved = json.loads((rd / "config.json").read_text())
    assert saved["env"]["url"] == "http://alice:***@127.0.0.1:9/"
    assert saved["tracking"]["uri"] == "https://bob:***@mlflow.example/"
    assert tracker.client.get_run(run_id).data.params["env.url"] == "http://alice:***@127.0.0.1:9/"


def test_spawned_env_server_inherits_no_aws_secrets(monkeypatch):
    """A real toy env server subprocess: its environment (read from /proc) has no S3 block secrets."""
    from envs.spawn import EnvServerProcess

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PW)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATEST")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PW)
    with EnvServerProcess("toy", startup_timeout_s=120) as srv:
        environ = Path(f"/proc/{srv.proc.pid}/environ").read_bytes()
    names = {kv.split(b"=", 1)[0].decode() for kv in environ.split(b"\0") if kv}
    assert "PYTHONPATH" in names and "SCALINGINTER_INSTANCE" in names
    assert PW.encode() not in environ and not any(n.startswith("AWS_") for n in names), sorted(names)
