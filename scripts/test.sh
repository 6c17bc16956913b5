#!/usr/bin/env bash
# The README's test command (and CI's, .ci/run): install what the suite needs, then run it all.
# - Debian's chromium for the browser test of the web page, when no chromium is on PATH,
#   and gcc for the compiled kernels (kernels.py), when there is no C compiler (apt-get; as
#   root, else through sudo);
# - a virtual environment .venv with the package and its dev extras;
# then ruff (lint and format) and the whole suite, one pytest-xdist worker per core, each with
# one torch thread (two threads per worker beside another worker run several times slower).
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."

has_chromium() {
    for name in "${CHROMIUM:-}" chromium chromium-browser google-chrome; do
        [ -n "$name" ] && command -v "$name" >/dev/null && return 0
    done
    return 1
}

apt_install() {  # Debian packages, as root or through sudo
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$@"
}

if ! has_chromium; then
    if command -v apt-get >/dev/null; then
        apt_install chromium
    else
        echo "scripts/test.sh: no chromium and no apt-get: install chromium for the browser test" >&2
    fi
fi

# A C compiler with OpenMP for the compiled kernels (src/transformer/kernels.py).
if ! command -v "${CC:-cc}" >/dev/null && ! command -v gcc >/dev/null; then
    if command -v apt-get >/dev/null; then
        apt_install gcc libc6-dev
    else
        echo "scripts/test.sh: no C compiler and no apt-get: install gcc for the kernel tests" >&2
    fi
fi

python3 -m venv .venv
.venv/bin/pip install -e ".[dev]"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist worksteal "$@"
