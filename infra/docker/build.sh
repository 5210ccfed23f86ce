#!/usr/bin/env bash
# Build the env server images (and, with `trainer-gpu`, the GPU trainer image) from the repository root.
#   infra/docker/build.sh                 # env-light env-web env-sciworld
#   infra/docker/build.sh env-light       # one image
#   TAG=v1 REPO=registry.example/si infra/docker/build.sh
# The phase flow starts containers of these images when env.runtime is docker (or auto and a daemon answers).
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG="${TAG:-latest}"
REPO="${REPO:-scalinginter}"
IMAGES=("$@")
[ ${#IMAGES[@]} -eq 0 ] && IMAGES=(env-light env-web env-sciworld)
command -v docker >/dev/null || { echo "docker CLI not found" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "no Docker daemon answers (docker info failed)" >&2; exit 2; }
for name in "${IMAGES[@]}"; do
  file="infra/docker/${name}.Dockerfile"
  [ -f "$file" ] || { echo "no $file (images: env-light env-web env-sciworld trainer-gpu)" >&2; exit 2; }
  echo "== building $REPO/$name:$TAG from $file"
  docker build -f "$file" -t "$REPO/$name:$TAG" .
done
