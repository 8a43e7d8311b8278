#!/usr/bin/env bash
# The project's test command (README "Test"): makes sure a Python with the `openai`,
# `tokenizers` and `jinja2` packages exists in .venv (created on first run, from PyPI),
# then runs every test of the workspace: unit, integration (real loopback sockets) and
# doc tests. `tokenizers` and `jinja2` serve disagg-tokenize's cross-check with Python.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${DISAGG_PYTHON:-}" ]; then
  if ! .venv/bin/python -c "import openai, tokenizers, jinja2" >/dev/null 2>&1; then
    echo "scripts/test.sh: creating .venv with the openai, tokenizers and jinja2 packages" >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
      "openai>=1.40,<3" "tokenizers>=0.21,<1" "jinja2>=3.1,<4"
  fi
  export DISAGG_PYTHON="$PWD/.venv/bin/python"
fi

cargo test --workspace "$@"
