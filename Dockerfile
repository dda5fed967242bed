# Sluice egress proxy. Build: docker build -t sluice .
# Run:   mkdir -p policy && cp config/policy.yaml policy/
#        docker run -p 8080:8080 -v "$PWD/policy:/etc/sluice:ro" sluice
#        Mount the directory, never the single file: a file bind mount keeps the old inode, so an
#        editor's rename-over save is never seen inside and hot reload silently stops.
# Agents: HTTP_PROXY=http://sluice:8080 HTTPS_PROXY=http://sluice:8080 (ALL_PROXY=socks5h://sluice:1080 with the SOCKS mode)
# Compose and Kubernetes set-ups: deploy/ and docs/deploy.md.
#
# The base is pinned by exact tag (bump it deliberately); dependencies come from requirements.lock
# (versions and hashes, the same file `make venv` installs), as wheels only: nothing is compiled
# and no compiler is in either stage.

FROM python:3.12.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY requirements.lock ./
RUN python -m venv /opt/sluice \
 && /opt/sluice/bin/pip install --require-hashes --only-binary :all: -r requirements.lock
# The source (.dockerignore keeps out tests, docs, the venv, git); Sluice itself without dependencies.
COPY . .
RUN /opt/sluice/bin/pip install --no-deps .

FROM python:3.12.12-slim-bookworm
# No compilers or network tools in the image: nothing an agent could borrow.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/sluice/bin:$PATH \
    SLUICE_CA_DIR=/var/lib/sluice/ca
COPY --from=build /opt/sluice /opt/sluice
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/sluice --create-home \
        --shell /usr/sbin/nologin sluice \
 && mkdir -p /etc/sluice /var/lib/sluice/ca \
 && chown -R 10001:10001 /var/lib/sluice \
 && chmod 0700 /var/lib/sluice/ca
COPY config/policy.yaml /etc/sluice/policy.yaml
# The CA (created on first start unless --ca-dir names a mounted one): keep it across restarts.
VOLUME ["/var/lib/sluice"]

USER 10001:10001
# The policy is watched: mount a directory or a ConfigMap at /etc/sluice and edit it live.
# Listening on 0.0.0.0: mitmproxy's block_global stays on, so clients connecting from public
# addresses are cut off (see README, Running it); private networks are served.
# The admin listener (/healthz, /readyz, /metrics) stays on its default 127.0.0.1:9090 here, so only
# this HEALTHCHECK reaches it; Kubernetes adds `--admin 0.0.0.0:9090` for probes and scrapes.
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:9090/readyz', timeout=2)"]
ENTRYPOINT ["sluice", "proxy", "--policy", "/etc/sluice/policy.yaml", "--listen", "0.0.0.0:8080"]
# Add e.g. `--mode regular --mode socks5@1080`, `--workers 2` or `--ca-dir /etc/sluice-ca` (a directory uid 10001
# owns: `sluice ca --ca-dir DIR --owner 10001`, docs/deploy.md) as arguments.
CMD []
