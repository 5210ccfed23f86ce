"""S3 checkpoints against a real S3 server on loopback (moto's standalone server): a writer killed in the
middle of a multipart upload leaves no usable checkpoint (and `latest` still names the previous one), a
Prefect block supplies credentials, and (slow) a killed training run resumes from its S3 checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage import checkpoint_store as cs
from tests.toypolicy import toy_run_cmd

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024


@pytest.fixture(scope="module")
def moto_url():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(moto_url, monkeypatch, tmp_path):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret-value",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_url, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = f"b-{os.urandom(4).hex()}"
    cs._s3_client(None).create_bucket(Bucket=bucket)
    return env, bucket


WRITER = textwrap.dedent("""
    import os, sys, time
    from storage import checkpoint_store as cs
    src, uri = sys.argv[1], sys.argv[2]
    opts = cs.S3Options(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20, max_concurrency=1)
    client = cs._s3_client(opts)  # the cached client save_checkpoint will use
    client.meta.events.register("after-call.s3.UploadPart", lambda **kw: (print("PART", flush=True), time.sleep(0.3)))
    cs.save_checkpoint(src, uri, options=opts)
    print("DONE", flush=True)
""")


def _ckpt(d: Path, seed: int, big: int = 0) -> Path:
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": seed}))
    (d / "config.json").write_text("{}")
    if big:
        (d / "model.safetensors").write_bytes(os.urandom(big))
    return d


def test_killed_multipart_upload_leaves_no_usable_checkpoint(aws_env, tmp_path):
    env, bucket = aws_env
    run = f"s3://{bucket}/runs/r1/phase-2"
    good = cs.save_checkpoint(_ckpt(tmp_path / "a", 1), cs.join_uri(run, "step-000001"))
    cs.write_latest(run, good)
    half = cs.join_uri(run, "step-000002")
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(_ckpt(tmp_path / "b", 2, big=30 * MB)), half],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "PART"  # the multipart upload is under way
        os.kill(p.pid, signal.SIGKILL)  # no cleanup, no manifest: like a node dying mid-upload
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    client = cs._s3_client(None)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "the kill did land mid-multipart"
    assert not cs.checkpoint_exists(half)
    assert cs.list_checkpoints(run) == [good]
    assert cs.read_latest(run) == good  # resume picks the previous complete checkpoint
    with pytest.raises(cs.CheckpointNotFound):
        cs.load_checkpoint(half, cache_dir=tmp_path / "cache")
    loaded = cs.load_checkpoint(cs.read_latest(run), cache_dir=tmp_path / "cache")
    assert json.loads((loaded / "trainer_state.json").read_text()) == {"global_step": 1}
    # a new save at the same URI after the crash works and becomes visible only when complete
    cs.save_checkpoint(_ckpt(tmp_path / "c", 3), half)
    assert cs.list_checkpoints(run) == [good, half]


def test_credentials_from_a_prefect_block(aws_env, monkeypatch, tmp_path):
    from storage.s3_block import S3Credentials, apply_s3_block

    env, bucket = aws_env
    S3Credentials(endpoint_url=env["AWS_ENDPOINT_URL"], region="us-east-1", aws_access_key_id="testing",
                  aws_secret_access_key="testing-secret-value").save("ckpt-test", overwrite=True)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k)
    assert apply_s3_block("ckpt-test") == ["AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                                           "AWS_SECRET_ACCESS_KEY"]
    uri = cs.save_checkpoint(_ckpt(tmp_path / "a", 1), f"s3://{bucket}/blk/step-1")
    assert cs.checkpoint_exists(uri)
    with pytest.raises(ValueError, match="no scalinginter-s3-credentials block named 'nope'"):
        apply_s3_block("nope")
    assert apply_s3_block(None) == []


def cli(out, model, name, env, *extra):
    """The toy env and a tiny policy (tests/toypolicy.py): the S3 checkpoint path is the point, not the model."""
    cmd = toy_run_cmd(out, model, name, ["rollout.samples_per_task=2", "tracking.log_trajectories=0"])
    cmd += list(extra)
    return subprocess.run(cmd, cwd=out, env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_killed_run_resumes_from_s3(aws_env, tmp_path, toy_policy):
    env, bucket = aws_env
    root = f"s3://{bucket}/runs"
    p = cli(tmp_path, toy_policy, "s3run", {**env, "SCALINGINTER_FAULT_AFTER_STEP": "2"}, "--set", f"checkpoint.root={root}")
    assert p.returncode != 0 and "fault injection" in p.stdout + p.stderr
    run = f"{root}/s3run"
    assert cs.list_checkpoints(run) == [f"{run}/phase-1/final", f"{run}/phase-2/step-000001"]
    assert cs.read_latest(f"{run}/phase-2") == f"{run}/phase-2/step-000001"
    p = cli(tmp_path, toy_policy, "s3run", env, "--set", f"checkpoint.root={root}")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert "phase 1: final checkpoint exists" in log and "phase 2: resuming after step 1/2" in log
    steps = [json.loads(l)["global_step"] for l in (tmp_path / "s3run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert cs.read_latest(run) == f"{run}/phase-2/final"
    final = cs.load_checkpoint(f"{run}/phase-2/final", cache_dir=tmp_path / "c")
    assert json.loads((final / "trainer_state.json").read_text())["global_step"] == 3
    # credentials never reach MLflow params
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("scalinginter").experiment_id])
    assert runs and not any(env["AWS_SECRET_ACCESS_KEY"] in v for r in runs for v in r.data.params.values())
