# SciWorld env servers: ScienceWorld's JVM needs a Java 17 runtime. Each server keeps a capped pool of JVMs
# (env option max_jvms, heap jvm_heap_mb), so size the container's memory to max_jvms x ~400 MB + 300 MB.
# Build from the repository root: infra/docker/build.sh
# Run: docker run -m 4g -p 127.0.0.1:8000:8000 scalinginter/env-sciworld
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/app \
    SCALINGINTER_CACHE=/cache
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY infra/docker/requirements-env.txt /tmp/requirements-env.txt
RUN pip install -r /tmp/requirements-env.txt scienceworld==1.2.3
COPY core /app/core
COPY envs /app/envs
RUN useradd --create-home --uid 1000 envs && mkdir -p /cache && chown envs /cache
USER envs
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
CMD ["python", "-m", "envs.server", "--env", "sciworld", "--host", "0.0.0.0", "--port", "8000"]
