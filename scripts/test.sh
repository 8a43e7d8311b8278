#!/usr/bin/env bash
# The project's test command (README "Test"): makes sure a Python with the `openai`, `anthropic`,
# `tokenizers`, `jinja2`, `opentelemetry-proto` and `pyzmq` packages exists in .venv
# (created on first run, from PyPI), then runs every test of the workspace: unit,
# integration (real loopback sockets) and doc tests. `tokenizers` and `jinja2` serve
# disagg-tokenize's cross-check with Python; `opentelemetry-proto` the OTLP receiver of
# the trace tests; `pyzmq` (libzmq) the ZMQ peers of the disagg-zmtp, disagg-kvevents
# and disagg-connectors (LMCache) tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# Under CI (`CI=true`, which .ci/run sets) a tool the tests need that cannot be
# installed fails the run here, naming it, instead of letting its tests skip: a green
# CI must mean every test ran. Outside CI a missing tool is a warning and the tests
# that need it skip (saying so loudly), unless DISAGG_REQUIRE_<TOOL>=1.
missing() {
  if [ "${CI:-}" = true ]; then
    echo "scripts/test.sh: ERROR: $1 is required under CI=true and could not be installed" >&2
    exit 1
  fi
  echo "scripts/test.sh: WARNING: $1 could not be installed; $2 will be SKIPPED" >&2
}

if [ -z "${DISAGG_PYTHON:-}" ]; then
  if ! .venv/bin/python -c "import openai, anthropic, tokenizers, jinja2, opentelemetry.proto, zmq" >/dev/null 2>&1; then
    echo "scripts/test.sh: creating .venv with the openai, anthropic, tokenizers, jinja2, opentelemetry-proto and pyzmq packages" >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
      "openai>=1.40,<3" "anthropic>=0.40,<3" "tokenizers>=0.21,<1" "jinja2>=3.1,<4" "opentelemetry-proto>=1.20,<2" \
      "pyzmq>=25,<28"
    .venv/bin/python -c "import openai, anthropic, tokenizers, jinja2, opentelemetry.proto, zmq" ||
      { echo "scripts/test.sh: ERROR: .venv lacks a package the tests import after pip install" >&2; exit 1; }
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
  missing dnsmasq "the DNS discovery tests"
fi

# The metrics tests (crates/disagg-proxy/tests/observe.rs) have a real Prometheus server
# scrape the proxy: Debian's prometheus package, installed when missing. Its service is
# not started by the tests (they run the binary on a loopback port with a config of
# their own).
have_prometheus() { command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ]; }
if ! have_prometheus && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "scripts/test.sh: installing prometheus for the metrics tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; } ||
    true
fi
if have_prometheus; then
  export DISAGG_REQUIRE_PROMETHEUS=1
else
  missing prometheus "the Prometheus scrape test"
fi

cargo test --workspace "$@"
