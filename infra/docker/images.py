"""Build the env server images without a registry (``infra/docker/build.sh`` runs this).

    infra/docker/build.sh                          # env-light env-sciworld env-web
    infra/docker/build.sh env-light                # one image
    infra/docker/build.sh env-light --base debootstrap --json sizes.json

For each image:

1. **Base**: ``python:3.11-slim-bookworm`` where a registry answers (or the image is already here); else a base made
   here from Debian's packages: ``debootstrap --variant=minbase --include=python3,python3-venv bookworm`` then
   ``docker import`` (``scalinginter/base-bookworm:<hash>``, made once). ``--base`` picks one: ``auto``,
   ``registry``, ``debootstrap`` or any image reference.
2. **Wheelhouse**: the image's Python dependencies as wheels, made on this host by ``pip wheel`` with the host's
   own index settings (pip.conf, ``PIP_*``), in ``build/wheelhouse/<hash of the requirements>/``, made once. The
   image installs them with ``pip install --no-index``: nothing is fetched from a package index inside a build.
3. **Context**: a small folder with exactly what the Dockerfile copies (``core/``, ``envs/``, the requirement
   files, the wheels), in ``build/context/<image>/``.
4. **Tag**: ``scalinginter/<image>:<content hash>`` (the hash of the context, the base image's id and the build
   arguments), and ``:latest`` (``--tag``) pointing at it: the tag runs look for (``$SCALINGINTER_IMAGE_TAG``,
   default latest). An image whose hash tag exists is not built again.

The images carry the label ``org.scalinginter.sources`` (``envs.containers.source_hash``: ``core/`` + ``envs/``),
so a run can say when an image is older than the code it runs with. ``trainer-gpu`` is built as before, from the
whole repository and a registry base.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from envs.containers import SOURCE_DIRS, SOURCES_LABEL, source_files, source_hash  # noqa: E402

DOCKER_DIR = ROOT / "infra" / "docker"
BUILD = ROOT / "build"
REGISTRY_BASE = "python:3.11-slim-bookworm"
DEBIAN = {"suite": "bookworm", "variant": "minbase", "include": "python3,python3-venv",
          "mirror": os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")}
BASE_REPO = "scalinginter/base-bookworm"
PYTHON_MINOR = "3.11"  # the bases' Python: wheels are made by a host Python of the same minor version
# image -> the requirements file it installs (each may include requirements-env.txt with -r)
REQUIREMENTS = {"env-light": "requirements-env.txt", "env-sciworld": "requirements-sciworld.txt",
                "env-web": "requirements-web.txt"}
DENSE = "requirements-dense.txt"  # env-light --dense: CPU torch + transformers (searchqa's dense retriever)
CONTENT_LABEL = "org.scalinginter.content"


def log(msg: str) -> None:
    print(f"build: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def docker_out(*args: str) -> str | None:
    r = subprocess.run(["docker", *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def image_id(ref: str) -> str | None:
    return docker_out("image", "inspect", "--format", "{{.Id}}", ref)


def image_size(ref: str) -> int:
    return int(docker_out("image", "inspect", "--format", "{{.Size}}", ref) or 0)


def sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


# --- 1. the base -----------------------------------------------------------------------------------------------
def registry_base(pull_timeout_s: float = 60.0) -> str | None:
    """REGISTRY_BASE if it is here or a registry gives it within the timeout, else None."""
    if image_id(REGISTRY_BASE):
        return REGISTRY_BASE
    try:
        r = subprocess.run(["docker", "pull", REGISTRY_BASE], capture_output=True, text=True, timeout=pull_timeout_s)
    except subprocess.TimeoutExpired:
        log(f"no registry answered within {pull_timeout_s:g} s for {REGISTRY_BASE}")
        return None
    if r.returncode != 0:
        log(f"no registry gives {REGISTRY_BASE}: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}")
        return None
    return REGISTRY_BASE


def debian_base() -> str:
    """The base made from Debian's packages (debootstrap + docker import), made once per recipe."""
    ref = f"{BASE_REPO}:{sha(json.dumps(DEBIAN, sort_keys=True))[:12]}"
    if image_id(ref):
        log(f"base {ref} (from Debian packages) is here")
        return ref
    if os.geteuid() != 0:
        raise SystemExit("build: making the base from Debian packages needs root (debootstrap): run with sudo, or "
                         "give a base that has Python 3.11: --base IMAGE")
    if shutil.which("debootstrap") is None:
        if shutil.which("apt-get") is None:
            raise SystemExit("build: no debootstrap and no apt-get to install it: give a base with --base IMAGE")
        log("installing debootstrap")
        run(["apt-get", "install", "-y", "-q", "debootstrap"], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            stdout=subprocess.DEVNULL)
    work = BUILD / "base"
    rootfs = work / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"debootstrap {DEBIAN['suite']} ({DEBIAN['variant']}, +{DEBIAN['include']}) from {DEBIAN['mirror']}")
    run(["debootstrap", f"--variant={DEBIAN['variant']}", f"--include={DEBIAN['include']}", DEBIAN["suite"],
         str(rootfs), DEBIAN["mirror"]], stdout=subprocess.DEVNULL)
    suite, mirror = DEBIAN["suite"], DEBIAN["mirror"]
    security = mirror.replace("/debian", "/debian-security") if mirror.endswith("/debian") else mirror
    (rootfs / "etc/apt/sources.list").write_text(
        f"deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\ndeb {security} {suite}-security main\n")
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / d).glob("*"):
            if p.is_file():
                p.unlink()
    log(f"debootstrap took {time.time() - t0:.0f} s; importing")
    t1 = time.time()
    changes = ["ENV LANG=C.UTF-8", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               'CMD ["python3"]']
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", *[a for c in changes for a in ("--change", c)], "-", ref], stdin=tar.stdout,
        stdout=subprocess.DEVNULL)
    if tar.wait() != 0:
        raise SystemExit("build: tar of the debootstrap root failed")
    shutil.rmtree(rootfs)
    log(f"imported {ref} in {time.time() - t1:.0f} s ({image_size(ref) / 1e6:.0f} MB)")
    return ref


def resolve_base(choice: str) -> str:
    if choice == "registry":
        base = registry_base()
        if base is None:
            raise SystemExit(f"build: no registry gives {REGISTRY_BASE}; use --base debootstrap (or auto)")
        return base
    if choice == "debootstrap":
        return debian_base()
    if choice == "auto":
        return registry_base() or debian_base()
    if not image_id(choice):
        raise SystemExit(f"build: base image {choice} is not here (docker pull it or build it first)")
    return choice


def base_python(base: str) -> str:
    r = subprocess.run(["docker", "run", "--rm", "--network", "none", base, "python3", "-c",
                        "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"build: the base {base} has no working python3: {r.stderr.strip()[-300:]}")
    return r.stdout.strip()


# --- 2. the wheelhouse ---------------------------------------------------------------------------------------
def requirement_files(image: str, dense: bool) -> list[Path]:
    """The image's requirement files: its own and the ones it includes (-r), and the dense extra."""
    files = [DOCKER_DIR / REQUIREMENTS[image]] + ([DOCKER_DIR / DENSE] if dense else [])
    seen: list[Path] = []
    while files:
        f = files.pop(0)
        if f in seen:
            continue
        seen.append(f)
        for line in f.read_text().splitlines():
            if line.strip().startswith("-r "):
                files.append(f.parent / line.split(None, 1)[1].strip())
    return seen


def wheelhouse(reqs: list[Path], python: str) -> Path:
    """Wheels of everything ``reqs`` need, made by ``python -m pip wheel`` with this host's index settings."""
    minor = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True, check=True).stdout.strip()
    if minor != PYTHON_MINOR:
        raise SystemExit(f"build: {python} is Python {minor}, the images run {PYTHON_MINOR}: give a Python "
                         f"{PYTHON_MINOR} to make the wheels (PYTHON=python{PYTHON_MINOR} infra/docker/build.sh)")
    key = sha(minor, *[f.name + "\n" + f.read_text() for f in reqs])[:12]
    out = BUILD / "wheelhouse" / f"py{minor.replace('.', '')}-{key}"
    if (out / ".complete").exists():
        log(f"wheelhouse {out.relative_to(ROOT)} is here ({len(list(out.glob('*.whl')))} wheels)")
        return out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"pip wheel -> {out.relative_to(ROOT)} (this host's pip settings)")
    cmd = [python, "-m", "pip", "wheel", "-q", "--prefer-binary", "-w", str(out)]
    for f in reqs[:1] + [f for f in reqs if f.name == DENSE]:
        cmd += ["-r", str(f)]
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    noise = ("is ignored: it is neither a file nor a directory",)  # pip's note on each empty local index folder
    sys.stderr.write("".join(line for line in r.stderr.splitlines(True) if not any(n in line for n in noise)))
    if r.returncode != 0:
        raise SystemExit(f"build: pip wheel failed (exit {r.returncode}); the messages are above")
    (out / ".complete").write_text("\n".join(sorted(p.name for p in out.glob("*.whl"))) + "\n")
    log(f"{len(list(out.glob('*.whl')))} wheels in {time.time() - t0:.0f} s")
    return out


# --- 3. the context, 4. the tag --------------------------------------------------------------------------------
def stage_context(image: str, reqs: list[Path], wheels: Path) -> Path:
    """``build/context/<image>/``: the Dockerfile, core/ and envs/, the requirement files and the wheels (hard
    links where the filesystem allows), at the paths the Dockerfile copies from."""
    ctx = BUILD / "context" / image
    if ctx.exists():
        shutil.rmtree(ctx)
    for src in source_files(ROOT) + [DOCKER_DIR / f"{image}.Dockerfile"] + list(DOCKER_DIR.glob("requirements-*.txt")):
        dst = ctx / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    (ctx / "build" / "wheels").mkdir(parents=True)
    for w in sorted(wheels.glob("*.whl")):
        try:
            os.link(w, ctx / "build" / "wheels" / w.name)
        except OSError:
            shutil.copy2(w, ctx / "build" / "wheels" / w.name)
    return ctx


def context_hash(ctx: Path, base_id: str, build_args: dict[str, str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"base": base_id, "args": build_args}, sort_keys=True).encode())
    for p in sorted(q for q in ctx.rglob("*") if q.is_file()):
        h.update(p.relative_to(ctx).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def docker_build_env() -> dict[str, str]:
    """BuildKit where the CLI has buildx, else the classic builder (Debian's docker.io has no buildx plugin)."""
    env = dict(os.environ)
    if "DOCKER_BUILDKIT" not in env and subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode:
        env["DOCKER_BUILDKIT"] = "0"
    return env


def build_image(image: str, base: str, repo: str, python: str, force: bool, dense: bool,
                tag: str = "latest") -> dict:
    t0 = time.time()
    reqs = requirement_files(image, dense)
    wheels = wheelhouse(reqs, python)
    t_wheels = time.time() - t0
    ctx = stage_context(image, reqs, wheels)
    args = {"BASE": base, "REQUIREMENTS": REQUIREMENTS[image], "EXTRA_REQUIREMENTS": DENSE if dense else ""}
    digest = context_hash(ctx, image_id(base) or base, args)
    ref, latest = f"{repo}/{image}:{digest[:12]}", f"{repo}/{image}:{tag}"
    skipped = bool(image_id(ref)) and not force
    if skipped:
        log(f"{ref} is up to date (nothing that goes into it changed): not rebuilt")
    else:
        log(f"building {ref} on {base}")
        t1 = time.time()
        run(["docker", "build", "-f", str(ctx / "infra" / "docker" / f"{image}.Dockerfile"),
             *[a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")],
             "--label", f"{CONTENT_LABEL}={digest}", "--label", f"{SOURCES_LABEL}={source_hash(ROOT)}",
             "-t", ref, str(ctx)], env=docker_build_env())
        log(f"built {ref} in {time.time() - t1:.0f} s")
    run(["docker", "tag", ref, latest])
    shutil.rmtree(ctx)
    size = image_size(ref)
    log(f"{latest} -> {ref}: {size / 1e6:.0f} MB")
    return {"image": image, "ref": ref, "base": base, "skipped": skipped, "size_bytes": size,
            "wheels": len(list(wheels.glob("*.whl"))), "wheelhouse_s": round(t_wheels, 1),
            "total_s": round(time.time() - t0, 1)}


def build_trainer(repo: str) -> dict:
    """trainer-gpu: the whole repository on a registry base, as its Dockerfile says."""
    t0 = time.time()
    ref = f"{repo}/trainer-gpu:latest"
    run(["docker", "build", "-f", str(DOCKER_DIR / "trainer-gpu.Dockerfile"), "-t", ref, str(ROOT)],
        env=docker_build_env())
    return {"image": "trainer-gpu", "ref": ref, "skipped": False, "size_bytes": image_size(ref),
            "total_s": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infra/docker/build.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("images", nargs="*", help="env-light env-sciworld env-web trainer-gpu (default: the three env "
                                             "images)")
    p.add_argument("--base", default=os.environ.get("BASE", "auto"),
                   help="auto (default), registry, debootstrap, or an image reference")
    p.add_argument("--repo", default=os.environ.get("REPO", "scalinginter"))
    p.add_argument("--tag", default=os.environ.get("TAG", "latest"),
                   help="the moving tag set on the build (default latest: what runs use, $SCALINGINTER_IMAGE_TAG)")
    p.add_argument("--python", default=os.environ.get("PYTHON") or (str(ROOT / ".venv/bin/python")
                                                                    if (ROOT / ".venv/bin/python").exists()
                                                                    else sys.executable),
                   help="the Python (3.11) whose pip makes the wheels (default: .venv/bin/python)")
    p.add_argument("--dense", action="store_true", help="env-light with CPU torch + transformers (searchqa dense)")
    p.add_argument("--force", action="store_true", help="build even where the hash tag exists")
    p.add_argument("--json", help="write what was built (refs, sizes, seconds) to this file")
    a = p.parse_args(argv)
    images = a.images or ["env-light", "env-sciworld", "env-web"]
    for im in images:
        if im not in REQUIREMENTS and im != "trainer-gpu":
            raise SystemExit(f"build: no image {im!r} (images: {', '.join(REQUIREMENTS)}, trainer-gpu)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise SystemExit("build: no Docker engine answers: `sudo infra/docker/engine.sh` installs and starts one")
    results, base, base_s = [], None, 0.0
    for im in images:
        if im == "trainer-gpu":
            results.append(build_trainer(a.repo))
            continue
        if base is None:
            t0 = time.time()
            base = resolve_base(a.base)
            base_s = round(time.time() - t0, 1)
            minor = base_python(base)
            if minor != PYTHON_MINOR:
                raise SystemExit(f"build: {base} has Python {minor}; the wheels are made for {PYTHON_MINOR}")
            log(f"base {base} (Python {minor})")
        results.append(build_image(im, base, a.repo, a.python, a.force, a.dense and im == "env-light", a.tag))
        results[-1]["base_s"], base_s = base_s, 0.0  # finding (or making) the base: charged to the first image
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
