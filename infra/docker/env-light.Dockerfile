# Env servers without heavy system dependencies: babyai, textcraft, searchqa (BM25; the dense retriever needs
# build.sh --dense), toy. Built by infra/docker/build.sh (infra/docker/images.py), which stages the context: core/,
# envs/, the requirement files and build/wheels/ (the dependencies as wheels, made on the host), and passes BASE:
# python:3.11-slim-bookworm where a registry answers, else a base made from Debian packages (debootstrap + import).
# Nothing is fetched from a package index here: pip installs from the wheels only (--no-index).
# Run: docker run -p 127.0.0.1:8000:8000 -e SCALINGINTER_ENV_TOKEN=... scalinginter/env-light \
#        python -m envs.server --env babyai --host 0.0.0.0
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE} AS deps
ARG REQUIREMENTS=requirements-env.txt
ARG EXTRA_REQUIREMENTS=
COPY infra/docker/requirements-*.txt /tmp/req/
COPY build/wheels /tmp/wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --no-cache-dir --find-links /tmp/wheels -r /tmp/req/${REQUIREMENTS} \
      ${EXTRA_REQUIREMENTS:+-r /tmp/req/${EXTRA_REQUIREMENTS}}

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/app SCALINGINTER_CACHE=/cache \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=deps /opt/venv /opt/venv
RUN useradd --create-home --uid 1000 envs && mkdir -p /cache && chown envs /cache
COPY core /app/core
COPY envs /app/envs
WORKDIR /app
USER envs
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
CMD ["python", "-m", "envs.server", "--env", "babyai", "--host", "0.0.0.0", "--port", "8000"]
