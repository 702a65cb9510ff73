# The Savepoint operator image. Its entrypoint is `python -m savepoint`, the same command
# the tests run; settings come from SAVEPOINT_* environment variables (the Helm chart
# sets them). Build: docker build -t savepoint:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: install the package and its dependencies into a self-contained venv --------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/savepoint
WORKDIR /src
# Dependencies first, so a code-only change reuses this layer.
COPY pyproject.toml README.md ./
RUN mkdir -p operator/savepoint && touch operator/savepoint/__init__.py \
 && /opt/savepoint/bin/pip install . \
 && /opt/savepoint/bin/pip uninstall -y savepoint
COPY operator/ operator/
RUN /opt/savepoint/bin/pip install --no-deps . \
 && /opt/savepoint/bin/python -m compileall -q /opt/savepoint

# --- runtime: the venv, no build tools, a fixed non-root user --------------------------
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/savepoint/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 savepoint \
 && useradd --system --uid 10001 --gid savepoint --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin savepoint
COPY --from=build /opt/savepoint /opt/savepoint
# Numeric, so Kubernetes can verify runAsNonRoot without resolving the name.
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "savepoint"]
