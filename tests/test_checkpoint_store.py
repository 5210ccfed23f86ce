"""Tests for storage.checkpoint_store: local disk and a real S3 server (moto) on loopback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from storage import checkpoint_store as cs
from storage.checkpoint_store import (
    CheckpointCorrupted,
    CheckpointNotFound,
    CheckpointStoreError,
    S3Options,
    checkpoint_exists,
    delete_checkpoint,
    join_uri,
    list_checkpoints,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    write_latest,
)

MB = 1024 * 1024


# --------------------------------------------------------------------------- helpers


def make_ckpt(root: Path, big_bytes: int = 0, seed: int = 0) -> Path:
    """A fake HF-style checkpoint directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "toy", "seed": seed}))
    (root / "trainer_state.json").write_text(json.dumps({"global_step": seed}))
    (root / "tokenizer").mkdir(exist_ok=True)
    (root / "tokenizer" / "tokenizer.json").write_text('{"vocab": {"a": 0}}' * 50)
    (root / "tokenizer" / "special_tokens_map.json").write_text("{}")
    (root / "empty.txt").write_bytes(b"")
    (root / "optimizer.pt").write_bytes(os.urandom(256 * 1024))
    if big_bytes:
        (root / "model.safetensors").write_bytes(os.urandom(big_bytes))
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != cs.MANIFEST_NAME
    }


# --------------------------------------------------------------------------- URIs


def test_join_uri() -> None:
    assert join_uri("s3://b", "runs", "r1") == "s3://b/runs/r1"
    assert join_uri("s3://b/", "runs/r1/", "phase-1/step-000003") == "s3://b/runs/r1/phase-1/step-000003"
    assert join_uri("s3://b/x/", "y") == "s3://b/x/y"
    assert join_uri("runs/r1", "phase-1", "step-000003") == os.path.join("runs/r1", "phase-1", "step-000003")
    assert join_uri("/abs/runs", "a/b") == "/abs/runs/a/b"
    assert join_uri("file:///abs/runs/", "a") == "file:///abs/runs/a"
    with pytest.raises(ValueError):
        join_uri("s3://b/x", "../y")
    with pytest.raises(ValueError):
        join_uri("runs", "/etc")
    with pytest.raises(CheckpointStoreError, match="unsupported URI scheme"):
        join_uri("gs://b/x", "y")


# --------------------------------------------------------------------------- local


def test_local_round_trip(tmp_path: Path) -> None:
    src = make_ckpt(tmp_path / "staging", big_bytes=3 * MB)
    uri = join_uri(str(tmp_path / "runs" / "r1"), "phase-1", "step-000003")

    assert not checkpoint_exists(uri)
    out = save_checkpoint(src, uri)
    assert out == str(Path(uri).absolute())
    assert checkpoint_exists(uri)
    assert src.exists()  # copy, not move

    manifest = json.loads((Path(uri) / "manifest.json").read_text())
    assert manifest["format_version"] == cs.FORMAT_VERSION
    assert manifest["created_at"]
    paths = [f["path"] for f in manifest["files"]]
    assert paths == sorted(tree(src))
    assert all(len(f["sha256"]) == 64 for f in manifest["files"])
    assert manifest["total_bytes"] == sum(len(b) for b in tree(src).values())

    loaded = load_checkpoint(uri, verify_sha256=True)
    assert loaded == Path(out)
    assert tree(loaded) == tree(src)
    assert list_checkpoints(str(tmp_path / "runs")) == [out]

    # No temp leftovers next to the target.
    assert os.listdir(Path(uri).parent) == ["step-000003"]

    # Second save refuses, overwrite replaces.
    with pytest.raises(CheckpointStoreError, match="already exists"):
        save_checkpoint(src, uri)
    src2 = make_ckpt(tmp_path / "staging2", seed=7)
    save_checkpoint(src2, uri, overwrite=True)
    assert tree(load_checkpoint(uri)) == tree(src2)
    assert os.listdir(Path(uri).parent) == ["step-000003"]

    # Re-saving a loaded checkpoint directory elsewhere works (its manifest is regenerated).
    other = save_checkpoint(load_checkpoint(uri), str(tmp_path / "copy"))
    assert tree(Path(other)) == tree(src2)


def test_local_corruption_detected(tmp_path: Path) -> None:
    uri = save_checkpoint(make_ckpt(tmp_path / "s"), str(tmp_path / "ck"))
    p = Path(uri) / "optimizer.pt"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    load_checkpoint(uri)  # size-only check passes
    with pytest.raises(CheckpointCorrupted, match="sha256 mismatch"):
        load_checkpoint(uri, verify_sha256=True)
    (Path(uri) / "config.json").write_text("{}")
    with pytest.raises(CheckpointCorrupted, match="config.json.*size"):
        load_checkpoint(uri)


def test_local_move(tmp_path: Path) -> None:
    src = make_ckpt(tmp_path / "staging", big_bytes=MB)
    expected = tree(src)
    uri = str(tmp_path / "runs" / "step-1")
    save_checkpoint(src, uri, move=True)
    assert not src.exists()
    assert tree(load_checkpoint(uri, verify_sha256=True)) == expected


@pytest.mark.parametrize("failure", ["copy_midway", "manifest", "interrupt"])
def test_local_interrupted_save_leaves_nothing(tmp_path: Path, monkeypatch, failure: str) -> None:
    src = make_ckpt(tmp_path / "staging", big_bytes=2 * MB)
    runs = tmp_path / "runs"
    uri = str(runs / "phase-1" / "step-000003")
    real_copy = cs._copy_and_hash
    calls = {"n": 0}

    def flaky_copy(s: Path, d: Path):
        calls["n"] += 1
        if calls["n"] == 3:
            # Write half of the file, then die like a full disk / killed process would.
            data = s.read_bytes()
            d.write_bytes(data[: len(data) // 2])
            if failure == "interrupt":
                raise KeyboardInterrupt
            raise OSError(28, "No space left on device")
        return real_copy(s, d)

    def failing_manifest(files):
        raise OSError(5, "I/O error while writing manifest")

    if failure == "manifest":
        monkeypatch.setattr(cs, "_build_manifest", failing_manifest)
        exc_type: type[BaseException] = OSError
    else:
        monkeypatch.setattr(cs, "_copy_and_hash", flaky_copy)
        exc_type = KeyboardInterrupt if failure == "interrupt" else OSError

    with pytest.raises(exc_type):
        save_checkpoint(src, uri)

    # Nothing visible: no target, no half directory, no temp dir next to the target.
    assert not Path(uri).exists()
    assert os.listdir(Path(uri).parent) == []
    assert not checkpoint_exists(uri)
    assert list_checkpoints(str(runs)) == []
    with pytest.raises(CheckpointNotFound, match="no checkpoint"):
        load_checkpoint(uri)
    assert tree(src)  # source untouched

    # A later save succeeds normally.
    monkeypatch.undo()
    save_checkpoint(src, uri)
    assert list_checkpoints(str(runs)) == [uri]


def test_local_move_interrupted_restores_source(tmp_path: Path, monkeypatch) -> None:
    src = make_ckpt(tmp_path / "staging")
    expected = tree(src)
    uri = str(tmp_path / "runs" / "step-1")
    monkeypatch.setattr(cs, "_build_manifest", lambda files: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError):
        save_checkpoint(src, uri, move=True)
    assert not Path(uri).exists()
    assert tree(src) == expected
    assert sorted(os.listdir(tmp_path / "runs")) == []


def test_local_incomplete_directory(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    half = make_ckpt(runs / "step-000001")  # files, but never got a manifest
    good = save_checkpoint(make_ckpt(tmp_path / "s"), str(runs / "step-000002"))
    (runs / ".step-000003.tmp-1-abc").mkdir()  # leftover of a killed save
    assert not checkpoint_exists(str(half))
    assert list_checkpoints(str(runs)) == [good]
    with pytest.raises(CheckpointNotFound, match="no manifest.json"):
        load_checkpoint(str(half))
    with pytest.raises(CheckpointStoreError, match="not a checkpoint"):
        save_checkpoint(tmp_path / "s", str(half))
    with pytest.raises(CheckpointStoreError, match="does not exist"):
        save_checkpoint(tmp_path / "nope", str(runs / "x"))
    assert list_checkpoints(str(tmp_path / "missing")) == []


def test_latest_pointer_local(tmp_path: Path) -> None:
    run = str(tmp_path / "runs" / "r1")
    assert read_latest(run) is None
    c1 = save_checkpoint(make_ckpt(tmp_path / "s1", seed=1), join_uri(run, "phase-1", "step-000001"))
    c2 = save_checkpoint(make_ckpt(tmp_path / "s2", seed=2), join_uri(run, "phase-1", "step-000002"))
    with pytest.raises(CheckpointNotFound):
        write_latest(run, join_uri(run, "phase-1", "step-000009"))
    write_latest(run, c1)
    assert read_latest(run) == c1
    write_latest(run, c2)
    assert read_latest(run) == c2
    assert sorted(os.listdir(run)) == ["latest", "phase-1"]  # no temp files left
    assert list_checkpoints(run) == [c1, c2]

    # The pointer is stored relative to the run, so a moved run dir still resolves.
    moved = tmp_path / "elsewhere" / "r1"
    shutil.move(run, moved)
    assert read_latest(str(moved)) == str(moved / "phase-1" / "step-000002")
    assert checkpoint_exists(read_latest(str(moved)))

    # Pointer to a checkpoint outside the run keeps the absolute URI.
    outside = save_checkpoint(make_ckpt(tmp_path / "s3"), str(tmp_path / "shared" / "ck"))
    write_latest(str(moved), outside)
    assert read_latest(str(moved)) == outside


def test_delete_checkpoint_local(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    c1 = save_checkpoint(make_ckpt(tmp_path / "s1", seed=1), join_uri(run, "phase-1", "step-1"))
    c10 = save_checkpoint(make_ckpt(tmp_path / "s10", seed=10), join_uri(run, "phase-1", "step-10"))
    assert delete_checkpoint(c1) is True
    assert not Path(c1).exists()
    assert list_checkpoints(run) == [c10]  # the sibling whose name starts the same is untouched
    assert delete_checkpoint(c1) is False  # already gone: not an error
    # a directory a killed save left without a manifest is removed too, and reported as no checkpoint
    half = make_ckpt(tmp_path / "run" / "phase-1" / "step-2")
    assert delete_checkpoint(str(half)) is False and not half.exists()


# --------------------------------------------------------------------------- S3 (moto server)


@pytest.fixture(scope="module")
def moto_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_server, monkeypatch, tmp_path):
    """Fake credentials + endpoint via the standard AWS env vars; a fresh bucket."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = cs._s3_client(None)
    bucket = f"ckpt-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


# Small multipart threshold so a few-MB file is uploaded/downloaded in parts
# (5 MiB is the S3 minimum part size).
SMALL_MP = S3Options(multipart_threshold=5 * MB, multipart_chunksize=5 * MB, max_concurrency=4)


def test_s3_round_trip_multipart(s3_env, tmp_path: Path, monkeypatch) -> None:
    client, bucket = s3_env
    src = make_ckpt(tmp_path / "staging", big_bytes=12 * MB)
    run = f"s3://{bucket}/runs/r1"
    uri = join_uri(run, "phase-1", "step-000003")

    assert not checkpoint_exists(uri)
    assert save_checkpoint(src, uri + "/", options=SMALL_MP) == uri
    assert checkpoint_exists(uri)

    head = client.head_object(Bucket=bucket, Key="runs/r1/phase-1/step-000003/model.safetensors")
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # 12 MiB / 5 MiB parts
    assert head["Metadata"]["sha256"]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert "runs/r1/phase-1/step-000003/manifest.json" in keys

    cache = tmp_path / "cache"
    local = load_checkpoint(uri, cache_dir=cache, options=SMALL_MP)
    assert local.parent == cache
    assert tree(local) == tree(src)
    assert json.loads((local / "manifest.json").read_text())["num_files"] == len(tree(src))
    assert [p.name for p in cache.iterdir()] == [local.name]  # no temp dirs left

    # Cached copy is reused without downloading again.
    with monkeypatch.context() as m:
        m.setattr(client, "download_file", lambda *a, **k: pytest.fail("re-downloaded"))
        assert load_checkpoint(uri, cache_dir=cache) == local

    # Listing, latest pointer, second checkpoint.
    uri2 = save_checkpoint(make_ckpt(tmp_path / "s2", seed=2), join_uri(run, "phase-1", "step-000004"))
    assert list_checkpoints(run) == [uri, uri2]
    assert list_checkpoints(f"s3://{bucket}") == [uri, uri2]
    assert list_checkpoints(f"s3://{bucket}/runs/r1/phase-2") == []
    assert read_latest(run) is None
    write_latest(run, uri)
    assert read_latest(run) == uri
    write_latest(run, uri2)
    assert read_latest(run) == uri2
    with pytest.raises(CheckpointNotFound):
        write_latest(run, join_uri(run, "phase-1", "step-000099"))

    # Overwrite replaces content and removes objects the new checkpoint lacks.
    with pytest.raises(CheckpointStoreError, match="already exists"):
        save_checkpoint(src, uri)
    small = make_ckpt(tmp_path / "s3", seed=3)
    save_checkpoint(small, uri, overwrite=True)
    assert tree(load_checkpoint(uri, cache_dir=cache)) == tree(small)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/r1/phase-1/step-000003/")["Contents"]]
    assert not any(k.endswith("model.safetensors") for k in keys)


def test_s3_incomplete_checkpoint_is_invisible(s3_env, tmp_path: Path, monkeypatch) -> None:
    client, bucket = s3_env
    prefix = f"s3://{bucket}/runs/r1"
    # Files uploaded but no manifest (e.g. the writer died before the last PUT).
    for name in ("config.json", "model.safetensors"):
        client.put_object(Bucket=bucket, Key=f"runs/r1/step-000001/{name}", Body=b"x" * 10)
    half = f"{prefix}/step-000001"
    assert not checkpoint_exists(half)
    assert list_checkpoints(prefix) == []
    with pytest.raises(CheckpointNotFound, match="manifest.json missing"):
        load_checkpoint(half, cache_dir=tmp_path / "cache")

    # An upload that fails midway leaves no manifest, so nothing becomes visible.
    real_upload = client.upload_file
    calls = {"n": 0}

    def flaky_upload(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("connection reset mid-upload")
        return real_upload(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(client, "upload_file", flaky_upload)
        with pytest.raises(ConnectionError):
            save_checkpoint(make_ckpt(tmp_path / "s"), f"{prefix}/step-000002")
    assert not checkpoint_exists(f"{prefix}/step-000002")
    assert list_checkpoints(prefix) == []
    with pytest.raises(CheckpointNotFound):
        load_checkpoint(f"{prefix}/step-000002", cache_dir=tmp_path / "cache")
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir())
    # Best-effort cleanup removed the objects the failed save had uploaded.
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="runs/r1/step-000002/")


def test_s3_corruption_detected(s3_env, tmp_path: Path) -> None:
    client, bucket = s3_env
    uri = save_checkpoint(make_ckpt(tmp_path / "s"), f"s3://{bucket}/ck/step-1")
    key = "ck/step-1/optimizer.pt"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[0] ^= 0xFF  # same size, different content
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointCorrupted, match="optimizer.pt.*sha256 mismatch"):
        load_checkpoint(uri, cache_dir=cache)
    assert list(cache.iterdir()) == []  # nothing half-published in the cache

    client.put_object(Bucket=bucket, Key=key, Body=b"short")
    with pytest.raises(CheckpointCorrupted, match="size"):
        load_checkpoint(uri, cache_dir=cache)

    client.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(CheckpointCorrupted, match="missing"):
        load_checkpoint(uri, cache_dir=cache)


def test_s3_missing_bucket_and_credentials(s3_env, tmp_path: Path, monkeypatch) -> None:
    src = make_ckpt(tmp_path / "s")
    uri = "s3://no-such-bucket-xyz/runs/r1/step-1"
    with pytest.raises(CheckpointStoreError, match="no-such-bucket-xyz.*does not exist") as ei:
        save_checkpoint(src, uri)
    assert ei.value.uri == uri
    for call in (
        lambda: load_checkpoint(uri, cache_dir=tmp_path / "c"),
        lambda: checkpoint_exists(uri),
        lambda: list_checkpoints("s3://no-such-bucket-xyz/runs"),
        lambda: read_latest("s3://no-such-bucket-xyz/runs/r1"),
    ):
        with pytest.raises(CheckpointStoreError, match="does not exist") as ei:
            call()
        assert not isinstance(ei.value, CheckpointNotFound)

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(CheckpointStoreError, match="no AWS credentials"):
        checkpoint_exists(f"s3://{s3_env[1]}/x")


def test_s3_error_descriptions() -> None:
    from botocore.exceptions import ClientError

    def err(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
            "GetObject",
        )

    assert "bad credentials" in cs._describe_s3_error(err("InvalidAccessKeyId", 403))
    assert "wrong secret key" in cs._describe_s3_error(err("SignatureDoesNotMatch", 403))
    assert "access denied" in cs._describe_s3_error(err("AccessDenied", 403), "b")
    assert "'b' does not exist" in cs._describe_s3_error(err("NoSuchBucket", 404), "b")


def test_s3_options_explicit_endpoint(s3_env, moto_server, tmp_path: Path, monkeypatch) -> None:
    """Explicit S3Options(endpoint_url=..., region=...) works without the endpoint env var."""
    _, bucket = s3_env
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    opts = S3Options(endpoint_url=moto_server, region="us-east-1", max_attempts=2)
    uri = save_checkpoint(make_ckpt(tmp_path / "s"), f"s3://{bucket}/e/step-1", options=opts)
    assert checkpoint_exists(uri, options=opts)
    assert tree(load_checkpoint(uri, cache_dir=tmp_path / "c", options=opts)) == tree(tmp_path / "s")


def test_delete_checkpoint_s3(s3_env, tmp_path: Path) -> None:
    client, bucket = s3_env
    run = f"s3://{bucket}/runs/r1"
    c1 = save_checkpoint(make_ckpt(tmp_path / "s1", seed=1), join_uri(run, "phase-1", "step-1"))
    c10 = save_checkpoint(make_ckpt(tmp_path / "s10", seed=10), join_uri(run, "phase-1", "step-10"))
    assert delete_checkpoint(c1) is True
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys and all(k.startswith("runs/r1/phase-1/step-10/") for k in keys), keys
    assert list_checkpoints(run) == [c10]
    assert delete_checkpoint(c1) is False
    assert tree(load_checkpoint(c10, cache_dir=tmp_path / "cache")) == tree(tmp_path / "s10")


def test_public_functions_go_through_one_store_interface() -> None:
    """Every public function picks a Store by the URI (store_for) instead of branching on the scheme; both stores
    implement the whole protocol."""
    import ast
    import inspect

    from storage.checkpoint_store import LocalStore, S3Store, Store, store_for

    tree = ast.parse(inspect.getsource(cs))
    branching = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
                 and f.name not in ("is_s3_uri", "join_uri", "store_for")
                 and any(isinstance(n, ast.Name) and n.id == "is_s3_uri" for n in ast.walk(f))]
    assert branching == []
    methods = {n for n, v in vars(Store).items() if callable(v) and not n.startswith("_")}
    assert methods == {"save", "manifest_bytes", "load", "exists", "delete", "list", "put_pointer", "get_pointer"}
    for impl in (LocalStore, S3Store):
        assert methods <= set(dir(impl)), impl
    assert isinstance(store_for("s3://b/k"), S3Store) and isinstance(store_for("/tmp/x"), LocalStore)
