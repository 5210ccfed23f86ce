# Web env servers (webarena-style local sites, MiniWoB++): Debian's Chromium (from the base's Debian mirror) driven
# by Playwright's Python client. Playwright's own browser download is never used (SI_CHROMIUM points at Debian's
# binary); Playwright's driver is a bundled Node binary that needs libatomic1. Built by infra/docker/build.sh (see
# env-light.Dockerfile: BASE, the staged context, wheels --no-index).
# Run: docker run --shm-size 1g -p 127.0.0.1:8000:8000 -e SCALINGINTER_ENV_TOKEN=... scalinginter/env-web \
#        python -m envs.server --env webarena --host 0.0.0.0
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE} AS deps
ARG REQUIREMENTS=requirements-web.txt
COPY infra/docker/requirements-*.txt /tmp/req/
COPY build/wheels /tmp/wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --no-cache-dir --find-links /tmp/wheels -r /tmp/req/${REQUIREMENTS}

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/app SCALINGINTER_CACHE=/cache \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SI_CHROMIUM=/usr/bin/chromium
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core libatomic1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
COPY --from=deps /opt/venv /opt/venv
RUN useradd --create-home --uid 1000 envs && mkdir -p /cache && chown envs /cache
COPY core /app/core
COPY envs /app/envs
WORKDIR /app
USER envs
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
CMD ["python", "-m", "envs.server", "--env", "webarena", "--host", "0.0.0.0", "--port", "8000"]
