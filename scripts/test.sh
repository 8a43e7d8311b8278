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

# The DNS discovery tests (crates/disagg-discovery) run a real DNS server, Debian's
# dnsmasq, on a loopback port. Installed when missing: the dnsmasq-base package, the
# binary alone (the dnsmasq package would also install and start a system DNS service).
have_dnsmasq() { command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ]; }
if ! have_dnsmasq && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "scripts/test.sh: installing dnsmasq-base for the DNS discovery tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q dnsmasq-base >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q dnsmasq-base >/dev/null; } ||
    true
fi
if have_dnsmasq; then
  # Installed: the DNS tests must run (a missing dnsmasq fails them).
  export DISAGG_REQUIRE_DNSMASQ=1
else
  echo "scripts/test.sh: WARNING: dnsmasq could not be installed; the DNS discovery tests will be SKIPPED" >&2
fi

cargo test --workspace "$@"
