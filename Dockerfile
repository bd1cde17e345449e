# lmserver container: `docker run -p 65432:65432 -v kvcache:/data lmserver`
# With a shared tier's library (docs/fleet.md): `docker build --build-arg EXTRAS=hf .` (or nixl)

# Build stage: a wheel with the hot path compiled by mypyc (setup.py). The full image has the
# C compiler that the slim runtime image leaves out.
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY lmserver ./lmserver
COPY protocol ./protocol
COPY clients ./clients
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

# Optional extras installed with the wheel: "hf" (the Hugging Face Buckets tier), "nixl" (the
# NIXL tier: it brings torch from your pip index, a CUDA build unless that index offers a CPU one).
ARG EXTRAS=""

# HF_HOME: the HF tier's client keeps its caches there; the user has no home directory.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/.huggingface

RUN groupadd --system --gid 10001 lmserver \
    && useradd --system --uid 10001 --gid lmserver --home-dir /nonexistent --shell /usr/sbin/nologin lmserver \
    && mkdir -p /data \
    && chown lmserver:lmserver /data

# The check fails the build if the wheel fell back to pure Python (no compiled modules).
# DL3013: what pip installs is the wheel just built (its extras' versions bounded in pyproject).
COPY --from=build /wheels /wheels
# hadolint ignore=DL3013
RUN wheel="$(echo /wheels/*.whl)" \
    && pip install --no-cache-dir "${wheel}${EXTRAS:+[$EXTRAS]}" \
    && rm -rf /wheels \
    && python -c "import lmserver, sys; sys.exit(not all(lmserver.compiled().values()))"

WORKDIR /data
USER 10001:10001
EXPOSE 65432
VOLUME ["/data"]

# Asks the server itself over the lm:// protocol (HEALTH), not just whether the port is open.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["lmcache-server", "health", "--host", "127.0.0.1", "--port", "65432", "--timeout", "3"]

# Logs are JSON lines on stderr (no TTY); SIGTERM drains in-flight requests.
ENTRYPOINT ["lmcache-server"]
CMD ["serve", "--host", "0.0.0.0", "--port", "65432", "--disk", "/data", "--log-format", "json"]
