# The kvgate gateway image (used by docker-compose.gpu.yml). It carries only the gateway and its
# pure-Python dependencies: no vLLM, no torch, no CUDA (workers run the official vLLM image).
#
#   docker build -t kvgate .
#   docker run -p 8000:8000 -v $PWD/my.toml:/etc/kvgate/config.toml:ro kvgate
#
# my.toml reloads live when edited in place; a file renamed over it on the host is not seen
# through a single-file mount (README, Configuration: mount a directory for write-then-rename).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Metadata first, then the packages: pyproject needs README.md (its `readme`). The `tokens`
# extra enables token-mode prefix hashing ([routing.token_mode] with mounted tokenizer files).
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY workers ./workers
COPY scoring ./scoring
RUN pip install ".[tokens]" \
    && useradd --system --uid 10001 --create-home kvgate \
    && mkdir -p /etc/kvgate
# A default config so the image starts on its own; compose mounts deploy/kvgate.compose.toml here.
COPY config.example.toml /etc/kvgate/config.toml

USER kvgate
WORKDIR /home/kvgate
# Config files default to 127.0.0.1; inside a container the gateway must listen on all interfaces.
ENV KVGATE_SERVER__HOST=0.0.0.0
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
CMD ["kvgate", "serve", "--config", "/etc/kvgate/config.toml"]
