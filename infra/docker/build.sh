#!/usr/bin/env bash
# Build the env server images without a registry (and, with `trainer-gpu`, the GPU trainer image, which needs one):
#   sudo infra/docker/engine.sh                 # first, where no Docker engine runs yet
#   infra/docker/build.sh                       # env-light env-sciworld env-web
#   infra/docker/build.sh env-light             # one image
#   infra/docker/build.sh env-light --base debootstrap --json sizes.json
# Base: python:3.11-slim-bookworm where a registry answers, else one made from Debian packages (debootstrap +
# docker import, root); Python dependencies: wheels made on this host by pip (its own index settings) under
# build/wheelhouse/, installed in the image with --no-index. Tags: scalinginter/<image>:<content hash> and :latest;
# an image whose hash tag exists is not rebuilt. Details: infra/docker/images.py (--help).
# The phase flow starts containers of these images when env.runtime is docker (or auto and the image is here).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
command -v docker >/dev/null || { echo "build.sh: no docker CLI: sudo infra/docker/engine.sh installs the engine" >&2; exit 2; }
exec nice -n "${BUILD_NICE:-10}" "$PY" infra/docker/images.py "$@"
