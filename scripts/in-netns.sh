#!/usr/bin/env bash
# Run a command inside a private network namespace whose only interface is
# `lo`, holding the test hosts: "public" origins (8.8.8.8, 1.1.1.1,
# 93.184.215.14, 2606:4700:4700::1111), private canaries (10.0.0.1,
# 169.254.169.254, 100.100.100.200, fd00:ec2::254) and 127.0.0.0/8. Nothing
# sent inside can leave the machine. Needs root (CI is root) or user namespaces.
set -euo pipefail
if [ "${SLUICE_NETNS:-}" = "1" ]; then exec "$@"; fi
if [ "$(id -u)" = 0 ]; then unshare_args=(-n); else unshare_args=(-r -n); fi
exec unshare "${unshare_args[@]}" -- bash -c '
    set -e
    ip link set lo up
    for a in 8.8.8.8 1.1.1.1 93.184.215.14 10.0.0.1 169.254.169.254 100.100.100.200; do
        ip addr add "$a/32" dev lo
    done
    for a in 2606:4700:4700::1111 fd00:ec2::254; do
        ip -6 addr add "$a/128" dev lo nodad
    done
    export SLUICE_NETNS=1
    exec "$@"
' bash "$@"
