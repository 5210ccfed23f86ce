# Web env servers (webarena-style local sites, MiniWoB++): Debian's Chromium driven by Playwright's Python
# client. Playwright's own browser download is never used (SI_CHROMIUM points at Debian's binary).
# Build from the repository root: infra/docker/build.sh
# Run: docker run --shm-size 1g -p 127.0.0.1:8000:8000 scalinginter/env-web \
#        python -m envs.server --env webarena --host 0.0.0.0
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/app \
    SCALINGINTER_CACHE=/cache SI_CHROMIUM=/usr/bin/chromium
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-dejavu-core \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY infra/docker/requirements-env.txt /tmp/requirements-env.txt
RUN pip install -r /tmp/requirements-env.txt playwright==1.65.2 miniwob==1.1.0
COPY core /app/core
COPY envs /app/envs
RUN useradd --create-home --uid 1000 envs && mkdir -p /cache && chown envs /cache
USER envs
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
CMD ["python", "-m", "envs.server", "--env", "webarena", "--host", "0.0.0.0", "--port", "8000"]
