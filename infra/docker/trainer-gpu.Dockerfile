# The trainer on a CUDA node: the package with its [gpu] extra (CUDA vLLM + DeepSpeed) on a CUDA runtime base.
# Env servers run in their own images (env-light / env-web / env-sciworld), started by the phase flow through
# the Docker SDK when the trainer can reach a daemon, or given with --set env.url=...
# Build from the repository root: infra/docker/build.sh trainer-gpu
# Run: docker run --gpus all --shm-size 16g -v $PWD/runs:/app/runs scalinginter/trainer-gpu \
#        scalinginter run babyai --preset paper --set learner.engine=deepspeed
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev build-essential git \
      openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md /app/
COPY core /app/core
COPY envs /app/envs
COPY tasks /app/tasks
COPY flows /app/flows
COPY infra /app/infra
COPY prefect.yaml /app/prefect.yaml
# The CUDA torch build comes from PyPI (vllm pins it); DeepSpeed's ops compile on first use on the GPU node.
RUN DS_BUILD_OPS=0 pip install "/app[gpu]" docker
CMD ["scalinginter", "--help"]
