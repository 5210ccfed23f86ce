"""Checkpoint storage on local disk or any S3-compatible endpoint.

A *checkpoint* is a directory written by the learner (HF model files, tokenizer
files, ``optimizer.pt``, ``trainer_state.json``, ...).  This module publishes such
directories at a URI and fetches them back:

* a local path (``runs/<run>/phase-1/step-000003``, also ``file:///abs/path``), or
* ``s3://bucket/prefix/...`` on AWS S3 or any S3-compatible server.

Atomicity contract: **a checkpoint is either complete or absent**.  Presence is
defined by ``manifest.json``, which is always written last and lists every file
with its size and sha256:

* local: files are copied (or moved) into a hidden temp directory next to the
  target, the manifest is written and fsynced, then the directory is renamed
  onto the target in one ``rename(2)``;
* S3: every file is uploaded (managed transfer, multipart for big files), then
  ``manifest.json`` is PUT (a single PUT is atomic).  Objects without a manifest
  are ignored by :func:`checkpoint_exists`, :func:`list_checkpoints` and
  :func:`load_checkpoint`.

S3 configuration comes from the standard AWS environment (``AWS_ENDPOINT_URL_S3``
/ ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION`` / ``AWS_REGION``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, ...) or from an explicit :class:`S3Options`.  Credentials are
never taken from code.

Pure I/O module: no torch / Prefect / MLflow imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from runtime.killpoint import kill_point

__all__ = [
    "CheckpointCorrupted",
    "CheckpointNotFound",
    "CheckpointStoreError",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "LocalStore",
    "S3Options",
    "S3Store",
    "Store",
    "checkpoint_exists",
    "delete_checkpoint",
    "is_s3_uri",
    "join_uri",
    "list_checkpoints",
    "load_checkpoint",
    "read_latest",
    "read_manifest",
    "save_checkpoint",
    "store_for",
    "write_latest",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
FORMAT_NAME = "scalinginter.checkpoint"
FORMAT_VERSION = 1
LATEST_FORMAT_NAME = "scalinginter.latest"

_CHUNK = 8 * 1024 * 1024
_MB = 1024 * 1024
_CACHE_ENV = "SCALINGINTER_CHECKPOINT_CACHE"
_UPLOAD_FILES_AT_ONCE = 4  # files uploaded in parallel by one save


# --------------------------------------------------------------------------- errors


class CheckpointStoreError(RuntimeError):
    """Any storage failure (bad URI, missing bucket, bad credentials, I/O error)."""

    def __init__(self, uri: str, reason: str) -> None:
        self.uri = uri
        self.reason = reason
        super().__init__(f"{uri}: {reason}")


class CheckpointNotFound(CheckpointStoreError):
    """No complete checkpoint (no manifest.json) at the URI."""


class CheckpointCorrupted(CheckpointStoreError):
    """The manifest exists but the files do not match it (size / sha256)."""


# --------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class S3Options:
    """Explicit S3 settings.  ``None`` fields fall back to the AWS environment.

    Credentials are deliberately not part of this object: they come from the
    standard AWS credential chain (env vars, shared config/profile, instance role).
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    # "path" | "virtual" | "auto"; None = "path" for custom endpoints, else "auto".
    addressing_style: str | None = None
    max_attempts: int = 8  # botocore "standard" retry mode, total attempts
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    multipart_threshold: int = 64 * _MB
    multipart_chunksize: int = 16 * _MB
    max_concurrency: int = 10

    def resolved_endpoint_url(self) -> str | None:
        return (
            self.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )

    def resolved_region(self) -> str:
        return (
            self.region
            or os.environ.get("AWS_DEFAULT_REGION")
            or os.environ.get("AWS_REGION")
            or "us-east-1"
        )


# --------------------------------------------------------------------------- URIs


def is_s3_uri(uri: str | os.PathLike[str]) -> bool:
    return str(uri).startswith("s3://")


def _check_scheme(uri: str) -> None:
    if "://" in uri and not (uri.startswith("s3://") or uri.startswith("file://")):
        raise CheckpointStoreError(
            uri, "unsupported URI scheme (use a local path, file:// or s3://)"
        )


def _local_path(uri: str | os.PathLike[str]) -> Path:
    s = os.fspath(uri)
    _check_scheme(s)
    if s.startswith("file://"):
        s = s[len("file://") :]
        if not s.startswith("/"):
            raise CheckpointStoreError(str(uri), "file:// URIs must be absolute (file:///...)")
    return Path(os.path.abspath(os.path.expanduser(s)))


def _split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")`` (key prefix without slashes)."""
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise CheckpointStoreError(uri, "S3 URI has no bucket (expected s3://bucket/prefix)")
    key = key.strip("/")
    if any(p in (".", "..") for p in key.split("/") if p) or "//" in key:
        raise CheckpointStoreError(uri, "S3 key must not contain '.', '..' or empty segments")
    return bucket, key


def _s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"


def _s3_key(prefix: str, *parts: str) -> str:
    return "/".join(p for p in (prefix, *parts) if p)


def _normalize(uri: str | os.PathLike[str]) -> str:
    s = os.fspath(uri)
    if is_s3_uri(s):
        return _s3_uri(*_split_s3(s))
    return str(_local_path(s))


def join_uri(base: str | os.PathLike[str], *parts: str) -> str:
    """Join path segments onto a local path or an ``s3://`` URI.

    ``join_uri("s3://b/runs", "r1", "phase-1/step-000003")`` ->
    ``"s3://b/runs/r1/phase-1/step-000003"``; local bases use ``os.path.join``
    semantics (but a part starting with ``/`` is an error, not a reset).
    """
    base_s = os.fspath(base)
    clean: list[str] = []
    for part in parts:
        p = os.fspath(part)
        if p.startswith("/"):
            raise ValueError(f"join_uri: part {p!r} must be relative")
        segs = [s for s in p.split("/") if s]
        if any(s in (".", "..") for s in segs):
            raise ValueError(f"join_uri: part {p!r} must not contain '.' or '..'")
        clean.extend(segs)
    if is_s3_uri(base_s):
        bucket, key = _split_s3(base_s)
        return _s3_uri(bucket, _s3_key(key, *clean))
    _check_scheme(base_s)
    if base_s.startswith("file://"):
        return "/".join([base_s.rstrip("/"), *clean]) if clean else base_s
    return os.path.join(base_s, *clean) if clean else base_s


def _relative_to(uri: str, base: str) -> str | None:
    """Relative path of ``uri`` under ``base`` (both normalized), else None."""
    if is_s3_uri(uri) != is_s3_uri(base):
        return None
    prefix = base.rstrip("/") + "/"
    if uri.startswith(prefix):
        return uri[len(prefix) :]
    return None


# --------------------------------------------------------------------------- manifest


def _utc_now() -> tuple[str, float]:
    now = time.time()
    return datetime.fromtimestamp(now, tz=timezone.utc).isoformat(), now


def _build_manifest(files: list[dict[str, Any]]) -> bytes:
    created_at, created_unix = _utc_now()
    files = sorted(files, key=lambda f: f["path"])
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_at": created_at,
        "created_unix": created_unix,
        "num_files": len(files),
        "total_bytes": sum(f["size"] for f in files),
        "files": files,
    }
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()


def _safe_rel(path: str) -> bool:
    if not path or path.startswith("/") or "\\" in path:
        return False
    parts = path.split("/")
    return all(p not in ("", ".", "..") for p in parts) and path != MANIFEST_NAME


def _parse_manifest(raw: bytes, uri: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupted(uri, f"manifest.json is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorrupted(uri, "manifest.json is not a checkpoint manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointStoreError(
            uri, f"unsupported manifest format_version {version!r} (max {FORMAT_VERSION})"
        )
    files = doc.get("files")
    if not isinstance(files, list):
        raise CheckpointCorrupted(uri, "manifest.json has no file list")
    for f in files:
        if not (
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and _safe_rel(f["path"])
            and isinstance(f.get("size"), int)
            and f["size"] >= 0
            and isinstance(f.get("sha256"), str)
        ):
            raise CheckpointCorrupted(uri, f"manifest.json has an invalid file entry: {f!r}")
    return doc


def _source_files(local_dir: Path) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every regular file, sorted.

    A ``manifest.json`` at the top level is skipped (it is regenerated), so a
    loaded checkpoint directory can be re-saved elsewhere.
    """
    out: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(local_dir, followlinks=False):
        dirs.sort()
        for name in sorted(names):
            full = Path(root) / name
            rel = full.relative_to(local_dir).as_posix()
            if rel == MANIFEST_NAME:
                continue
            if not full.is_file():  # broken symlink, socket, ...
                raise CheckpointStoreError(str(local_dir), f"{rel} is not a regular file")
            out.append((rel, full))
    return out


def _sha256_file(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _copy_and_hash(src: Path, dst: Path) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` in one pass, returning (size, sha256); fsyncs dst."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while n := fin.readinto(buf):
            chunk = view[:n]
            h.update(chunk)
            fout.write(chunk)
            size += n
        fout.flush()
        os.fsync(fout.fileno())
    shutil.copymode(src, dst)
    return size, h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _tmp_sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


_TEMP_NAME = re.compile(r"^\..+\.(?:tmp|old)-(\d+)-[0-9a-f]{8}$")  # what _tmp_sibling names


def _temp_owner(name: str) -> int | None:
    """The pid of the process that made the ``_tmp_sibling`` named ``name`` (``.<target>.<tmp|old>-<pid>-<hex>``);
    None for any other name."""
    m = _TEMP_NAME.match(name)
    return int(m.group(1)) if m else None


def _remove_dead_temps(folder: Path) -> None:
    """Delete the temporary siblings in ``folder`` whose process no longer exists. A save killed before its rename
    (SIGKILL, OOM, power loss) leaves one, as big as the checkpoint; the next save into the folder removes it. A
    live process's are left alone (a run's checkpoint folders have one writer, on this machine)."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for p in entries:
        pid = _temp_owner(p.name)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (ours, or another live writer)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        if p.is_dir() and not p.is_symlink():
            _rmtree_quiet(p)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


# --------------------------------------------------------------------------- S3 client


_client_lock = threading.Lock()
_client_cache: dict[tuple[Any, ...], Any] = {}

_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_EC2_METADATA_DISABLED",
)


def _s3_client(options: S3Options | None) -> Any:
    """A (cached) boto3 S3 client.  Cache key includes the relevant env vars so
    changing credentials/endpoint in the environment takes effect."""
    opts = options or S3Options()
    key = (opts, tuple(os.environ.get(k) for k in _ENV_KEYS))
    with _client_lock:
        client = _client_cache.get(key)
        if client is not None:
            return client
        import boto3
        from botocore.config import Config

        endpoint = opts.resolved_endpoint_url()
        style = opts.addressing_style or ("path" if endpoint else "auto")
        config = Config(
            region_name=opts.resolved_region(),
            retries={"mode": "standard", "max_attempts": opts.max_attempts},
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            max_pool_connections=max(10, opts.max_concurrency + 2),
            s3={"addressing_style": style},
        )
        session = boto3.session.Session(profile_name=opts.profile)
        client = session.client("s3", endpoint_url=endpoint, config=config)
        if len(_client_cache) > 16:
            _client_cache.clear()
        _client_cache[key] = client
        return client


def _transfer_config(options: S3Options | None) -> Any:
    from boto3.s3.transfer import TransferConfig

    opts = options or S3Options()
    return TransferConfig(
        multipart_threshold=opts.multipart_threshold,
        multipart_chunksize=opts.multipart_chunksize,
        max_concurrency=opts.max_concurrency,
        use_threads=True,
    )


def _error_code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", ""))


def _http_status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None) or {}
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _describe_s3_error(exc: BaseException, bucket: str | None = None) -> str:
    from botocore import exceptions as bx

    if isinstance(exc, bx.NoCredentialsError):
        return (
            "no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or use an instance role)"
        )
    if isinstance(exc, bx.PartialCredentialsError):
        return f"incomplete AWS credentials: {exc}"
    if isinstance(exc, bx.EndpointConnectionError):
        return f"cannot connect to S3 endpoint: {exc}"
    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return f"S3 request timed out: {exc}"
    code = _error_code(exc)
    status = _http_status(exc)
    where = f"bucket {bucket!r}" if bucket else "bucket"
    if code == "NoSuchBucket":
        return f"{where} does not exist"
    if code == "InvalidAccessKeyId":
        return "bad credentials: the AWS access key id is not recognised (InvalidAccessKeyId)"
    if code == "SignatureDoesNotMatch":
        return "bad credentials: request signature does not match (wrong secret key?)"
    if code in ("ExpiredToken", "TokenRefreshRequired", "InvalidToken"):
        return f"bad credentials: session token invalid or expired ({code})"
    if code in ("AccessDenied", "AllAccessDisabled", "Forbidden") or status == 403:
        return f"access denied to {where} (check credentials and bucket policy)"
    if code:
        msg = (getattr(exc, "response", None) or {}).get("Error", {}).get("Message", "")
        return f"S3 error {code}" + (f": {msg}" if msg else "") + (f" (HTTP {status})" if status else "")
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _s3_errors(uri: str, action: str, bucket: str | None = None) -> Iterator[None]:
    """Translate botocore/boto3 exceptions into CheckpointStoreError."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except CheckpointStoreError:
        raise
    except (ClientError, BotoCoreError) as exc:
        raise CheckpointStoreError(uri, f"{action} failed: {_describe_s3_error(exc, bucket)}") from exc
    except Boto3Error as exc:  # S3UploadFailedError wraps the ClientError as text
        cause = exc.__cause__ or exc.__context__
        if cause is not None and isinstance(cause, (ClientError, BotoCoreError)):
            reason = _describe_s3_error(cause, bucket)
        else:
            reason = str(exc)
        raise CheckpointStoreError(uri, f"{action} failed: {reason}") from exc


def _is_not_found(exc: BaseException) -> bool:
    return _error_code(exc) in ("NoSuchKey", "404", "NotFound") or _http_status(exc) == 404


def _check_bucket(client: Any, bucket: str, uri: str) -> None:
    from botocore.exceptions import ClientError

    with _s3_errors(uri, "bucket check", bucket):
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            code, status = _error_code(exc), _http_status(exc)
            if code in ("404", "NoSuchBucket", "NotFound") or status == 404:
                raise CheckpointStoreError(uri, f"bucket {bucket!r} does not exist") from exc
            if status == 403:
                raise CheckpointStoreError(
                    uri,
                    f"access denied to bucket {bucket!r} (bad credentials or missing "
                    "s3:ListBucket permission)",
                ) from exc
            raise


def _s3_get_bytes(client: Any, bucket: str, key: str, uri: str, what: str) -> bytes | None:
    """GET a small object; None if the key is missing (missing bucket -> error)."""
    from botocore.exceptions import ClientError

    with _s3_errors(uri, f"reading {what}", bucket):
        try:
            resp = client.get_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if _error_code(exc) == "NoSuchBucket":
                raise
            if _is_not_found(exc):
                return None
            raise
        with contextlib.closing(resp["Body"]) as body:
            return body.read()


def _s3_list(client: Any, bucket: str, prefix: str, uri: str) -> Iterator[dict[str, Any]]:
    with _s3_errors(uri, "listing", bucket):
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            yield from page.get("Contents", [])


def _s3_delete_keys(client: Any, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        batch = keys[i : i + 1000]
        client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
        )


# --------------------------------------------------------------------------- save


def _save_local(src: Path, uri: str, *, move: bool, overwrite: bool) -> str:
    target = _local_path(uri)
    src_abs = Path(os.path.abspath(src))
    if src_abs == target or target in src_abs.parents or src_abs in target.parents:
        raise CheckpointStoreError(
            str(target), f"source {str(src_abs)!r} and target must not contain each other"
        )
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(target.parent)

    if target.exists():
        if not (target / MANIFEST_NAME).is_file():
            if target.is_dir() and not any(target.iterdir()):
                target.rmdir()
            else:
                raise CheckpointStoreError(
                    str(target), "target exists but is not a checkpoint (no manifest.json); refusing to replace it"
                )
        elif not overwrite:
            raise CheckpointStoreError(
                str(target), "checkpoint already exists (pass overwrite=True to replace it)"
            )

    tmp = _tmp_sibling(target, "tmp")
    moved_source = False
    try:
        files: list[dict[str, Any]] = []
        if move:
            try:
                os.rename(src_abs, tmp)
                moved_source = True
            except OSError:
                moved_source = False  # e.g. EXDEV: different filesystem -> copy
        if moved_source:
            for rel, full in _source_files(tmp):
                size, digest = _sha256_file(full)
                _fsync_file(full)
                files.append({"path": rel, "size": size, "sha256": digest})
            stale = tmp / MANIFEST_NAME
            if stale.exists():
                stale.unlink()
        else:
            tmp.mkdir()
            for rel, full in _source_files(src_abs):
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                size, digest = _copy_and_hash(full, dst)
                files.append({"path": rel, "size": size, "sha256": digest})
        kill_point("checkpoint")  # test hook (runtime.killpoint): a no-op unless $SCALINGINTER_KILL_AT names it
        # fsync directories so the entries survive a crash, then the manifest LAST.
        for d in sorted({(tmp / f["path"]).parent for f in files}, key=lambda p: -len(p.parts)):
            _fsync_dir(d)
        _write_file_durable(tmp / MANIFEST_NAME, _build_manifest(files))
        _fsync_dir(tmp)
        _publish_dir(tmp, target, overwrite=overwrite)
    except BaseException:
        if moved_source and tmp.exists() and not src_abs.exists():
            with contextlib.suppress(OSError):
                (tmp / MANIFEST_NAME).unlink(missing_ok=True)
                os.rename(tmp, src_abs)  # give the source back
        _rmtree_quiet(tmp)
        raise
    if move and not moved_source:
        _rmtree_quiet(src_abs)
    _log_saved(target, files, t0)
    return str(target)


def _log_saved(where: object, files: list[dict[str, Any]], t0: float) -> None:
    total = sum(f["size"] for f in files)
    dt = time.perf_counter() - t0
    log.info(
        "saved checkpoint %s (%d files, %.1f MB) in %.2fs (%.0f MB/s)",
        where, len(files), total / _MB, dt, total / _MB / max(dt, 1e-9),
    )


def _publish_dir(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` onto ``target``; replace an existing checkpoint if asked."""
    try:
        os.rename(tmp, target)
    except OSError as exc:
        if not (target.exists() and overwrite and (target / MANIFEST_NAME).is_file()):
            if target.exists():
                raise CheckpointStoreError(
                    str(target), "checkpoint already exists (concurrent writer?)"
                ) from exc
            raise CheckpointStoreError(str(target), f"rename failed: {exc}") from exc
        # rename(2) cannot replace a non-empty directory: swap via a trash name.
        # Between the two renames the checkpoint is briefly absent (never partial).
        trash = _tmp_sibling(target, "old")
        os.rename(target, trash)
        try:
            os.rename(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(trash, target)
            raise
        _rmtree_quiet(trash)
    _fsync_dir(target.parent)


def _save_s3(
    src: Path, uri: str, *, move: bool, overwrite: bool, options: S3Options | None
) -> str:
    uri = _normalize(uri)
    bucket, prefix = _split_s3(uri)
    client = _s3_client(options)
    tconfig = _transfer_config(options)
    manifest_key = _s3_key(prefix, MANIFEST_NAME)
    t0 = time.perf_counter()

    _check_bucket(client, bucket, uri)
    old_manifest = _s3_get_bytes(client, bucket, manifest_key, uri, "manifest")
    if old_manifest is not None:
        if not overwrite:
            raise CheckpointStoreError(
                uri, "checkpoint already exists (pass overwrite=True to replace it)"
            )
        # Make the old checkpoint absent first: from now on it is "incomplete".
        with _s3_errors(uri, "deleting old manifest", bucket):
            client.delete_object(Bucket=bucket, Key=manifest_key)

    sources = _source_files(src)
    files: list[dict[str, Any]] = []
    uploaded: list[str] = []
    def put(rel: str, full: Path) -> dict[str, Any]:
        """Hash then upload one file in the same worker (the second read comes from the page cache); the
        digest also goes on the object as metadata."""
        size, digest = _sha256_file(full)
        key = _s3_key(prefix, rel)
        with _s3_errors(uri, f"uploading {rel}", bucket):
            client.upload_file(str(full), bucket, key, ExtraArgs={"Metadata": {"sha256": digest}}, Config=tconfig)
        uploaded.append(key)
        return {"path": rel, "size": size, "sha256": digest}

    try:
        # files in parallel (each big one in parallel parts too); the manifest waits for all of them
        with ThreadPoolExecutor(max_workers=max(1, min(_UPLOAD_FILES_AT_ONCE, len(sources)))) as pool:
            futures = [pool.submit(put, rel, full) for rel, full in sources]
            try:
                files = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

        # Cheap sanity check before declaring the checkpoint complete.
        listed = {
            o["Key"]: o["Size"] for o in _s3_list(client, bucket, prefix + "/" if prefix else "", uri)
        }
        for f in files:
            key = _s3_key(prefix, f["path"])
            if listed.get(key) != f["size"]:
                raise CheckpointStoreError(
                    uri, f"uploaded object {key!r} has size {listed.get(key)} != {f['size']}"
                )

        with _s3_errors(uri, "writing manifest", bucket):
            client.put_object(
                Bucket=bucket,
                Key=manifest_key,
                Body=_build_manifest(files),
                ContentType="application/json",
            )
    except BaseException:
        # Best effort: don't leave orphaned objects (they would be ignored anyway).
        with contextlib.suppress(Exception):
            _s3_delete_keys(client, bucket, uploaded)
        raise

    # Remove leftovers of an overwritten checkpoint that the new one doesn't have.
    if old_manifest is not None:
        keep = {_s3_key(prefix, f["path"]) for f in files} | {manifest_key}
        with contextlib.suppress(Exception):
            old = _parse_manifest(old_manifest, uri)
            stale = [
                _s3_key(prefix, f["path"]) for f in old["files"]
                if _s3_key(prefix, f["path"]) not in keep
            ]
            _s3_delete_keys(client, bucket, stale)

    if move:
        _rmtree_quiet(src)
    _log_saved(uri, files, t0)
    return uri


# --------------------------------------------------------------------------- load


def _verify_dir(root: Path, manifest: dict[str, Any], uri: str, *, sha: bool) -> None:
    for f in manifest["files"]:
        p = root / f["path"]
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorrupted(uri, f"file {f['path']!r} listed in manifest is missing") from None
        if size != f["size"]:
            raise CheckpointCorrupted(
                uri, f"file {f['path']!r} has size {size}, manifest says {f['size']}"
            )
        if sha:
            _, digest = _sha256_file(p)
            if digest != f["sha256"]:
                raise CheckpointCorrupted(
                    uri, f"file {f['path']!r} sha256 mismatch ({digest} != {f['sha256']})"
                )


def _default_cache_root() -> Path:
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "scalinginter" / "checkpoints"


def _cache_dir_for(uri: str, cache_root: Path) -> Path:
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in uri.rsplit("/", 1)[-1])
    return cache_root / f"{tail[:64] or 'root'}-{digest}"


def _load_s3(
    uri: str,
    cache_dir: str | os.PathLike[str] | None,
    *,
    verify_sha256: bool | None,
    options: S3Options | None,
) -> Path:
    uri = _normalize(uri)
    bucket, prefix = _split_s3(uri)
    client = _s3_client(options)
    raw = S3Store(options).manifest_bytes(uri)
    manifest = _parse_manifest(raw, uri)
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = _cache_dir_for(uri, root)

    # Cache hit: same manifest bytes and the files are all there.
    with contextlib.suppress(OSError, CheckpointCorrupted):
        if (target / MANIFEST_NAME).read_bytes() == raw:
            _verify_dir(target, manifest, uri, sha=bool(verify_sha256))
            log.info("checkpoint %s: using cached copy %s", uri, target)
            return target

    t0 = time.perf_counter()
    tconfig = _transfer_config(options)
    tmp = _tmp_sibling(target, "tmp")
    tmp.mkdir()
    from botocore.exceptions import ClientError

    try:
        for f in manifest["files"]:
            dst = tmp / f["path"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            key = _s3_key(prefix, f["path"])
            with _s3_errors(uri, f"downloading {f['path']}", bucket):
                try:
                    client.download_file(bucket, key, str(dst), Config=tconfig)
                except ClientError as exc:
                    if _is_not_found(exc) and _error_code(exc) != "NoSuchBucket":
                        raise CheckpointCorrupted(
                            uri, f"object {key!r} listed in manifest is missing"
                        ) from exc
                    raise
        _verify_dir(tmp, manifest, uri, sha=verify_sha256 is not False)
        _write_file_durable(tmp / MANIFEST_NAME, raw)
        _publish_cache(tmp, target, raw)
    except BaseException:
        _rmtree_quiet(tmp)
        raise
    total = manifest.get("total_bytes") or sum(f["size"] for f in manifest["files"])
    dt = time.perf_counter() - t0
    log.info(
        "loaded checkpoint %s -> %s (%.1f MB) in %.2fs (%.0f MB/s)",
        uri, target, total / _MB, dt, total / _MB / max(dt, 1e-9),
    )
    return target


def _publish_cache(tmp: Path, target: Path, raw: bytes) -> None:
    try:
        os.rename(tmp, target)
        return
    except OSError:
        pass
    # Target exists: either a concurrent loader won (same manifest) or it's stale.
    with contextlib.suppress(OSError):
        if (target / MANIFEST_NAME).read_bytes() == raw:
            _rmtree_quiet(tmp)
            return
    trash = _tmp_sibling(target, "old")
    with contextlib.suppress(FileNotFoundError):
        os.rename(target, trash)
    os.rename(tmp, target)
    _rmtree_quiet(trash)


# --------------------------------------------------------------------------- stores


class Store(Protocol):
    """Where checkpoints live. The manifest format (``_build_manifest`` / ``_parse_manifest`` / ``_verify_dir``)
    and the pointer format (``write_latest`` / ``read_latest``) are shared; a store only moves bytes. The public
    functions of this module pick a store by the URI (``store_for``) and never branch on the scheme themselves."""

    def save(self, src: Path, uri: str, *, move: bool, overwrite: bool) -> str: ...

    def manifest_bytes(self, uri: str) -> bytes: ...  # raises CheckpointNotFound

    def load(self, uri: str, cache_dir: str | os.PathLike[str] | None, *, verify_sha256: bool | None) -> Path: ...

    def exists(self, uri: str) -> bool: ...

    def delete(self, uri: str) -> bool: ...

    def list(self, prefix_uri: str) -> list[str]: ...

    def put_pointer(self, run: str, data: bytes) -> None: ...

    def get_pointer(self, run: str) -> bytes | None: ...


class LocalStore:
    """Checkpoints on a local (or mounted) filesystem: atomic rename publish, fsynced manifest last."""

    def save(self, src: Path, uri: str, *, move: bool, overwrite: bool) -> str:
        return _save_local(src, uri, move=move, overwrite=overwrite)

    def manifest_bytes(self, uri: str) -> bytes:
        path = _local_path(uri)
        try:
            return (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            if path.is_dir():
                reason = "directory exists but has no manifest.json (incomplete or not a checkpoint)"
            else:
                reason = "no checkpoint at this path"
            raise CheckpointNotFound(str(path), reason) from None
        except NotADirectoryError:
            raise CheckpointNotFound(str(path), "path is a file, not a checkpoint directory") from None

    def load(self, uri: str, cache_dir: str | os.PathLike[str] | None, *, verify_sha256: bool | None) -> Path:
        path = _local_path(uri)
        manifest = _parse_manifest(self.manifest_bytes(uri), str(path))
        _verify_dir(path, manifest, str(path), sha=bool(verify_sha256))
        return path

    def exists(self, uri: str) -> bool:
        return (_local_path(uri) / MANIFEST_NAME).is_file()

    def delete(self, uri: str) -> bool:
        root = _local_path(uri)
        manifest = root / MANIFEST_NAME
        had = manifest.is_file()
        if had:
            manifest.unlink()
            _fsync_dir(root)
        if root.is_dir():
            _rmtree_quiet(root)
        return had

    def list(self, prefix_uri: str) -> list[str]:
        root = _local_path(prefix_uri)
        if not root.is_dir():
            return []
        found = []
        for dirpath, dirs, names in os.walk(root):
            if MANIFEST_NAME in names:
                found.append(dirpath)
                dirs[:] = []  # a checkpoint's subdirectories are not checkpoints
                continue
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        return sorted(found)

    def put_pointer(self, run: str, data: bytes) -> None:
        run_path = Path(run)
        run_path.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_sibling(run_path / LATEST_NAME, "tmp")
        try:
            _write_file_durable(tmp, data)
            os.replace(tmp, run_path / LATEST_NAME)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(run_path)

    def get_pointer(self, run: str) -> bytes | None:
        try:
            return (Path(run) / LATEST_NAME).read_bytes()
        except FileNotFoundError:
            return None


class S3Store:
    """Checkpoints on S3 or an S3-compatible server: files uploaded in parallel (multipart above the threshold,
    retried), the manifest PUT last (a single PUT is atomic); loads go through a verified local cache."""

    def __init__(self, options: S3Options | None = None):
        self.options = options

    def save(self, src: Path, uri: str, *, move: bool, overwrite: bool) -> str:
        return _save_s3(src, uri, move=move, overwrite=overwrite, options=self.options)

    def manifest_bytes(self, uri: str) -> bytes:
        norm = _normalize(uri)
        bucket, prefix = _split_s3(norm)
        raw = _s3_get_bytes(_s3_client(self.options), bucket, _s3_key(prefix, MANIFEST_NAME), norm, "manifest")
        if raw is None:
            raise CheckpointNotFound(
                norm, "no complete checkpoint here (manifest.json missing: never saved or save incomplete)"
            )
        return raw

    def load(self, uri: str, cache_dir: str | os.PathLike[str] | None, *, verify_sha256: bool | None) -> Path:
        return _load_s3(uri, cache_dir, verify_sha256=verify_sha256, options=self.options)

    def exists(self, uri: str) -> bool:
        from botocore.exceptions import ClientError

        norm = _normalize(uri)
        bucket, prefix = _split_s3(norm)
        client = _s3_client(self.options)
        with _s3_errors(norm, "checking checkpoint", bucket):
            try:
                client.head_object(Bucket=bucket, Key=_s3_key(prefix, MANIFEST_NAME))
                return True
            except ClientError as exc:
                if not _is_not_found(exc):
                    raise
        # HEAD can't tell a missing key from a missing bucket: disambiguate.
        _check_bucket(client, bucket, norm)
        return False

    def delete(self, uri: str) -> bool:
        norm = _normalize(uri)
        bucket, prefix = _split_s3(norm)
        client = _s3_client(self.options)
        had = self.exists(norm)
        manifest_key = _s3_key(prefix, MANIFEST_NAME)
        with _s3_errors(norm, "deleting checkpoint", bucket):
            if had:
                client.delete_object(Bucket=bucket, Key=manifest_key)
            keys = [o["Key"] for o in _s3_list(client, bucket, prefix.rstrip("/") + "/", norm)]
            _s3_delete_keys(client, bucket, keys)
        return had

    def list(self, prefix_uri: str) -> list[str]:
        norm = _normalize(prefix_uri)
        bucket, prefix = _split_s3(norm)
        client = _s3_client(self.options)
        _check_bucket(client, bucket, norm)
        found = []
        list_prefix = prefix + "/" if prefix else ""
        for obj in _s3_list(client, bucket, list_prefix, norm):
            key = obj["Key"]
            if key == _s3_key(prefix, MANIFEST_NAME) or key.endswith("/" + MANIFEST_NAME):
                found.append(key[: -len(MANIFEST_NAME)].rstrip("/"))
        # A file named manifest.json inside a checkpoint is not a checkpoint.
        found_set = set(found)

        def nested(k: str) -> bool:
            parts = k.split("/")
            return any("/".join(parts[:i]) in found_set for i in range(len(parts)))

        return sorted(_s3_uri(bucket, k) for k in found if not nested(k))

    def put_pointer(self, run: str, data: bytes) -> None:
        bucket, prefix = _split_s3(run)
        with _s3_errors(join_uri(run, LATEST_NAME), "writing latest pointer", bucket):
            _s3_client(self.options).put_object(Bucket=bucket, Key=_s3_key(prefix, LATEST_NAME), Body=data,
                                                ContentType="application/json")

    def get_pointer(self, run: str) -> bytes | None:
        bucket, prefix = _split_s3(run)
        return _s3_get_bytes(_s3_client(self.options), bucket, _s3_key(prefix, LATEST_NAME),
                             join_uri(run, LATEST_NAME), "latest pointer")


def store_for(uri: str | os.PathLike[str], options: S3Options | None = None) -> Store:
    """The store of a URI: ``s3://...`` on S3, anything else on the local filesystem."""
    return S3Store(options) if is_s3_uri(uri) else LocalStore()


# --------------------------------------------------------------------------- public API


def save_checkpoint(
    local_dir: str | os.PathLike[str],
    uri: str,
    *,
    move: bool = False,
    overwrite: bool = False,
    options: S3Options | None = None,
) -> str:
    """Publish ``local_dir`` at ``uri`` atomically and return the normalized URI.

    Local targets: files are copied (hashing in the same pass) into a hidden temp
    directory next to the target, ``manifest.json`` is written last, everything is
    fsynced, then the temp dir is renamed onto the target.  With ``move=True`` the
    source directory is renamed instead of copied when it is on the same
    filesystem (falls back to copy + delete otherwise).

    S3 targets: files are hashed and uploaded in parallel (boto3's managed transfer,
    multipart above ``S3Options.multipart_threshold``), then ``manifest.json`` is PUT
    last.  With ``move=True`` the source directory is deleted after a successful upload.

    An existing complete checkpoint at ``uri`` raises unless ``overwrite=True``.
    Local URIs are returned as absolute paths.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise CheckpointStoreError(str(uri), f"source directory {str(src)!r} does not exist")
    return store_for(uri, options).save(src, uri, move=move, overwrite=overwrite)


def read_manifest(uri: str, *, options: S3Options | None = None) -> dict[str, Any]:
    """The parsed manifest of a complete checkpoint (raises CheckpointNotFound)."""
    return _parse_manifest(store_for(uri, options).manifest_bytes(uri), _normalize(uri))


def load_checkpoint(
    uri: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    verify_sha256: bool | None = None,
    options: S3Options | None = None,
) -> Path:
    """Return a local directory holding the checkpoint at ``uri``.

    Local: the directory itself, after checking the manifest and file sizes
    (``verify_sha256=True`` also hashes every file).

    S3: files are downloaded into ``<cache_dir>/<name>-<hash(uri)>`` (default cache
    root: ``$SCALINGINTER_CHECKPOINT_CACHE`` or ``~/.cache/scalinginter/checkpoints``),
    verified against the manifest (sizes and sha256 by default) and published into
    the cache atomically.  A cache entry whose manifest equals the remote one is
    reused without downloading (and re-hashed with ``verify_sha256=True``).

    Raises CheckpointNotFound if there is no complete checkpoint,
    CheckpointCorrupted if files don't match the manifest (naming the file).
    """
    return store_for(uri, options).load(uri, cache_dir, verify_sha256=verify_sha256)


def checkpoint_exists(uri: str, *, options: S3Options | None = None) -> bool:
    """True iff a complete checkpoint (manifest.json) is present at ``uri``."""
    return store_for(uri, options).exists(uri)


def delete_checkpoint(uri: str, *, options: S3Options | None = None) -> bool:
    """Delete the checkpoint at ``uri``; return whether one was there.

    The manifest goes first, so a delete cut short leaves an incomplete directory that
    ``checkpoint_exists`` and ``load_checkpoint`` already treat as absent. Objects under a
    prefix that merely starts with the same characters (``step-1`` vs ``step-10``) are untouched.
    """
    return store_for(uri, options).delete(uri)


def list_checkpoints(prefix_uri: str, *, options: S3Options | None = None) -> list[str]:
    """URIs of all complete checkpoints at or below ``prefix_uri``, sorted.

    ``prefix_uri`` is treated as a directory.  Temp directories and objects without
    a manifest are ignored.  Local results are absolute paths.
    """
    return store_for(prefix_uri, options).list(prefix_uri)


def write_latest(
    run_uri: str, checkpoint_uri: str, *, options: S3Options | None = None
) -> str:
    """Atomically point ``<run_uri>/latest`` at a complete checkpoint.

    The checkpoint must already be complete (CheckpointNotFound otherwise).
    When the checkpoint lives under the run, the pointer also stores the
    relative path so the run directory stays relocatable.  Returns the pointer URI.
    """
    ckpt = _normalize(checkpoint_uri)
    run = _normalize(run_uri)
    if not checkpoint_exists(ckpt, options=options):
        raise CheckpointNotFound(ckpt, "cannot point 'latest' at an incomplete or missing checkpoint")
    written_at, _ = _utc_now()
    doc = {
        "format": LATEST_FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checkpoint": ckpt,
        "relative": _relative_to(ckpt, run),
        "written_at": written_at,
    }
    store_for(run, options).put_pointer(run, (json.dumps(doc, indent=2) + "\n").encode())
    return join_uri(run, LATEST_NAME)


def read_latest(run_uri: str, *, options: S3Options | None = None) -> str | None:
    """The checkpoint URI recorded in ``<run_uri>/latest``, or None if unset.

    Does not check that the checkpoint still exists (use checkpoint_exists /
    load_checkpoint for that).
    """
    run = _normalize(run_uri)
    raw = store_for(run, options).get_pointer(run)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()  # tolerate a plain-text pointer
        return text or None
    if not isinstance(doc, dict) or not isinstance(doc.get("checkpoint"), str):
        raise CheckpointStoreError(join_uri(run, LATEST_NAME), "latest pointer is malformed")
    rel = doc.get("relative")
    if isinstance(rel, str) and rel:
        return join_uri(run, rel)
    return doc["checkpoint"]
