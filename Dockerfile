# specops images — `make image` builds both targets:
#   controller  the light install (no torch): `specops controller run`, `specops policy …`,
#               `specops alerts …`. What charts/specops runs, as controller and as sidecar.
#   runtime     + torch and the decoding extras: `specops demo`, `specops bench …`, serving.
# The torch build is a build argument (CPU by default); CUDA users pass theirs, e.g.
#   --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" \
#   --build-arg EXTRAS=runtime,kernels
# BASE is any Debian-based image with python3 (>= 3.10) and its venv module.
ARG BASE=python:3.11-slim-bookworm

# ---- build: a virtualenv in /opt/specops; sources and pip's leftovers stay behind ----
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/specops
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specops ./specops

FROM build AS build-controller
# The light install: the project's own dependencies, pinned by pyproject.toml's ranges.
RUN /opt/specops/bin/pip install --no-cache-dir . \
 && /opt/specops/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM build AS build-runtime
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ARG EXTRAS=runtime
# torch first and alone, from the index named in TORCH, so pip never picks a CUDA build
# by itself; then the extras. $TORCH is split into words on purpose (version + index).
RUN /opt/specops/bin/pip install --no-cache-dir ${TORCH} \
 && /opt/specops/bin/pip install --no-cache-dir ".[${EXTRAS}]"

FROM build AS build-kernels
# The CPU kernels (specops/kernels/*.c: the fast path of CPU decoding), compiled here because
# the images carry no C compiler. One library per instruction-set level, x86-64-v4 (AVX-512),
# x86-64-v3 (AVX2 + FMA) and the portable x86-64 (on other architectures one build for the
# compiler's default target), with a manifest of their SHA-256s and of the sources they were
# built from, into the venv's share/specops/kernels. At first use the runtime picks the best
# level the CPU it runs on supports (its /proc/cpuinfo flags then, never this build host's),
# checks the file against the manifest and loads it; `specops.kernels.cpu_linear.loaded_from()`
# says which. cbuild.py runs as a plain script: it needs only the standard library.
# gcc and libc6-dev are the base release's own, used in this stage only and not shipped.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y -q --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && /opt/specops/bin/python specops/kernels/cbuild.py prebuild /opt/specops/share/specops/kernels

# ---- the images: the venv on a slim base, a non-root user, `specops` as entrypoint ----
FROM ${BASE} AS runtime
LABEL org.opencontainers.image.title="specops-runtime" \
      org.opencontainers.image.description="specops decoding runtime (torch) and ops layer" \
      org.opencontainers.image.source="https://github.com/specops/specops" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-runtime /opt/specops /opt/specops
# the prebuilt CPU kernels (build-kernels), where the runtime looks for them by default
COPY --from=build-kernels /opt/specops/share/specops/kernels /opt/specops/share/specops/kernels
# uid 10001 is the chart's securityContext.runAsUser; /var/lib/specops its state dir.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/specops --create-home --shell /usr/sbin/nologin specops
ENV PATH=/opt/specops/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /var/lib/specops
ENTRYPOINT ["specops"]
CMD ["--help"]

FROM ${BASE} AS controller
LABEL org.opencontainers.image.title="specops" \
      org.opencontainers.image.description="specops controller / sidecar: policies, rollout, adaptive control loop (no torch)" \
      org.opencontainers.image.source="https://github.com/specops/specops" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-controller /opt/specops /opt/specops
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/specops --create-home --shell /usr/sbin/nologin specops
ENV PATH=/opt/specops/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /var/lib/specops
ENTRYPOINT ["specops"]
CMD ["--help"]
