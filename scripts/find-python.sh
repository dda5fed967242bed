#!/usr/bin/env bash
# Print the path of a Python >= 3.12: PATH first, then pyenv's versions.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for cand in python3.12 python3 python3.13; do
    if p=$(command -v "$cand" 2>/dev/null) && ok "$p"; then echo "$p"; exit 0; fi
done
for root in "${PYENV_ROOT:-}" "$HOME/.pyenv" /root/.pyenv /opt/pyenv; do
    [ -n "$root" ] && [ -d "$root/versions" ] || continue
    for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
        if ok "$p"; then echo "$p"; exit 0; fi
    done
done
echo "find-python: no Python >= 3.12 found (install one, e.g. 'pyenv install 3.12')" >&2
exit 1
