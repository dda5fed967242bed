# Sluice egress proxy. Build: docker build -t sluice .
# Run:   mkdir -p policy && cp config/policy.yaml policy/
#        docker run -p 8080:8080 -v "$PWD/policy:/etc/sluice:ro" sluice
#        Mount the directory, never the single file: a file bind mount keeps the old inode, so an
#        editor's rename-over save is never seen inside and hot reload silently stops.
# Agents: HTTP_PROXY=http://sluice:8080 HTTPS_PROXY=http://sluice:8080 (ALL_PROXY=socks5h://sluice:1080 with the SOCKS mode)
FROM python:3.12-slim

# No compilers or network tools in the image: nothing an agent could borrow.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    SLUICE_CA_DIR=/var/lib/sluice/ca

WORKDIR /opt/sluice
COPY pyproject.toml README.md ./
COPY policy ./policy
COPY addons ./addons
COPY sluice ./sluice
RUN pip install . \
 && useradd --system --uid 10001 --home-dir /var/lib/sluice --create-home sluice \
 && mkdir -p /etc/sluice /var/lib/sluice/ca \
 && chown -R sluice /var/lib/sluice
COPY config/policy.yaml /etc/sluice/policy.yaml

USER sluice
EXPOSE 8080 1080
# The policy is watched: mount a directory or a ConfigMap at /etc/sluice and edit it live.
# Listening on 0.0.0.0: mitmproxy's block_global stays on, so clients connecting from public
# addresses are cut off (see README, Running it); private networks are served.
ENTRYPOINT ["sluice", "proxy", "--policy", "/etc/sluice/policy.yaml", "--listen", "0.0.0.0:8080"]
# Add e.g. `--mode regular --mode socks5@1080` or `--workers 2` as arguments.
CMD []
