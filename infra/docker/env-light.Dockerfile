# Env servers without heavy system dependencies: babyai, textcraft, searchqa (BM25; the dense retriever needs
# WITH_DENSE=1), toy. Build from the repository root: infra/docker/build.sh (or
#   docker build -f infra/docker/env-light.Dockerfile -t scalinginter/env-light .)
# Run: docker run -p 127.0.0.1:8000:8000 scalinginter/env-light python -m envs.server --env babyai --host 0.0.0.0
FROM python:3.11-slim-bookworm
ARG WITH_DENSE=0
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/app \
    SCALINGINTER_CACHE=/cache
WORKDIR /app
COPY infra/docker/requirements-env.txt /tmp/requirements-env.txt
RUN pip install -r /tmp/requirements-env.txt \
 && if [ "$WITH_DENSE" = "1" ]; then \
      pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
      && pip install "transformers>=5.19,<5.20"; \
    fi
COPY core /app/core
COPY envs /app/envs
RUN useradd --create-home --uid 1000 envs && mkdir -p /cache && chown envs /cache
USER envs
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
CMD ["python", "-m", "envs.server", "--env", "babyai", "--host", "0.0.0.0", "--port", "8000"]
