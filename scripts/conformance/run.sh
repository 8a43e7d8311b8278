#!/usr/bin/env bash
# Checks every leg disagg-proxy sends against vLLM's and SGLang's own request code
# (scripts/conformance/README.md). Not part of the test suite: it needs the engines'
# packages (about 10 GB), which it never installs; point DISAGG_ENGINES_PYTHON at a
# Python that has them.
#
#   DISAGG_ENGINES_PYTHON=/path/to/venv/bin/python scripts/conformance/run.sh [check.py flags]
#
# Builds the proxy (cargo build --release -p disagg-proxy) unless --proxy or
# --verdicts-only is given. Exit status: 0 no violation, 1 violations, 2 setup error.
set -euo pipefail
cd "$(dirname "$0")/../.."

py="${DISAGG_ENGINES_PYTHON:-}"
if [ -z "$py" ]; then
  echo "run.sh: set DISAGG_ENGINES_PYTHON to a Python with vllm==0.33.0 and sglang==0.5.23" >&2
  echo "        (scripts/conformance/README.md says how to make one)" >&2
  exit 2
fi
# find_spec only locates the packages: importing vLLM takes seconds, check.py does it once.
if ! "$py" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("vllm") else 1)'; then
  echo "run.sh: $py has no vllm package" >&2
  exit 2
fi
"$py" - <<'PY' >&2 || true
from importlib.metadata import version, PackageNotFoundError
for name, want in (("vllm", "0.33.0"), ("sglang", "0.5.23")):
    try:
        got = version(name)
    except PackageNotFoundError:
        got = None
    if got != want:
        print(f"run.sh: warning: {name} is {got}, the checks were written against {want}")
PY

build=1
script=check.py
args=()
for arg in "$@"; do
  case "$arg" in
    --proxy|--proxy=*|--verdicts-only) build=0 ;;
  esac
  # --routes: the other generation routes (routes.py) instead of chat and completions;
  # --epd: encoder disaggregation (epd.py).
  case "$arg" in
    --routes) script=routes.py ;;
    --epd) script=epd.py ;;
    *) args+=("$arg") ;;
  esac
done
if [ "$build" = 1 ]; then
  cargo build --release -p disagg-proxy
  args+=(--proxy "${CARGO_TARGET_DIR:-target}/release/disagg-proxy")
fi
exec "$py" "scripts/conformance/$script" "${args[@]}"
