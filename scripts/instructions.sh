#!/usr/bin/env bash
# Instructions per request of the proxy's request path, counted by callgrind (repeatable
# where wall-clock CPU figures on a shared 2-core machine are not; docs/performance.md).
#
#   scripts/instructions.sh [PROXY_BINARY] [CONNECTOR]
#   STREAM=1 scripts/instructions.sh ...     (streamed answers, 16 tokens each)
#   PROXY_ARGS="--access-log json" scripts/instructions.sh ...   (more serve flags)
#   TRACE=1 scripts/instructions.sh ...      (traces at --trace-ratio 1.0, exported to a
#                                             local OTLP sink that answers 200)
#   IMAGES=K scripts/instructions.sh ...   (E/P/D: an encoder-only engine and a consuming
#                                             prefill, `--encode`; each request carries K
#                                             images, K=0 a text-only request through the
#                                             same proxy; nixl only)
#   BODY_BYTES=131072 scripts/instructions.sh ...   (chat bodies padded to about this many
#                                             bytes with the bench's text, as its
#                                             --body-bytes; the engines' context grows to fit)
#   COPIES=1 scripts/instructions.sh ...   (instead of callgrind, an LD_PRELOAD
#                                             interposer, scripts/copies.c, counts the
#                                             bytes memcpy and memmove copy per call
#                                             site; prints bytes per request and the
#                                             top sites, TOP=20; needs cc and addr2line)
#   FLOOR=1 scripts/instructions.sh target/release/disagg-bench
#                                            (the bench's floor proxy instead of disagg:
#                                             the yardstick of docs/performance.md; nixl only)
#
# At the edge (docs/security.md; the certificates are made by openssl):
#   AUTH=1       the proxy checks a client key (`--api-key`), the client sends it
#   TLS_IN=1     the proxy serves HTTPS (`--tls-cert`), the client speaks TLS to it
#   TLS_OUT=1    the engines serve HTTPS, the proxy reaches them with `--engine-ca`
#   NEW_CONN=1   a new client connection per request (with TLS_IN: a handshake each)
#
# Starts two simulated engines (prefill and decode, speaking CONNECTOR: nixl, sglang or
# mooncake; default nixl) and the proxy under `valgrind --tool=callgrind --threads 1`,
# sends WARM then WARM+N sequential non-streaming chat requests (about 250 bytes) over one
# keep-alive connection in two runs, and prints (I(WARM+N) - I(WARM)) / N: start-up
# cost cancels out. Needs valgrind and python3; everything listens on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${1:-target/release/disagg-proxy}
CONNECTOR=${2:-nixl}
WARM=${WARM:-200}
N=${N:-2000}
# The engines always run from this tree's build; only the measured proxy may be another
# binary (an older commit's, for a before/after comparison).
cargo build --release -q -p disagg-proxy
SIM=target/release/disagg-proxy
OUT=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

case "$CONNECTOR" in
  nixl) PMODE=nixl; DMODE=nixl ;;
  sglang) PMODE=sglang-prefill; DMODE=sglang-decode ;;
  mooncake) PMODE=mooncake-prefill; DMODE=mooncake-decode ;;
  *) echo "unknown connector $CONNECTOR" >&2; exit 2 ;;
esac

# A CA and a certificate for 127.0.0.1, for the TLS variants.
EDGE=(); SIM_TLS=(); SCHEME=http; CLIENT_CA=""; KEY=""
if [ -n "${TLS_IN:-}${TLS_OUT:-}" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=instructions-ca -keyout "$OUT/ca.key" -out "$OUT/ca.pem" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
    -keyout "$OUT/tls.key" -out "$OUT/tls.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >"$OUT/ext"
  openssl x509 -req -in "$OUT/tls.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca.key" \
    -CAcreateserial -days 2 -extfile "$OUT/ext" -out "$OUT/tls.crt" 2>/dev/null
fi
# The certificate is never re-read during a run (polls would add instructions in
# proportion to the run's length, which does not cancel out).
if [ -n "${TLS_IN:-}" ]; then
  EDGE+=(--tls-cert "$OUT/tls.crt" --tls-key "$OUT/tls.key" --reload-interval 86400)
  CLIENT_CA="$OUT/ca.pem"; fi
if [ -n "${TLS_OUT:-}" ]; then
  SIM_TLS=(--tls-cert "$OUT/tls.crt" --tls-key "$OUT/tls.key"); SCHEME=https
  EDGE+=(--engine-ca "$OUT/ca.pem"); fi
if [ -n "${AUTH:-}" ]; then KEY=sk-instructions-0123456789abcdef; EDGE+=(--api-key "$KEY"); fi

# A context as long as the body in bytes admits any prompt (as disagg-bench sets it).
CONTEXT=()
if [ -n "${BODY_BYTES:-}" ]; then CONTEXT=(--max-model-len $(( BODY_BYTES > 8192 ? BODY_BYTES + 64 : 8192 ))); fi
P=$(free_port); PS=$(free_port); PB=$(free_port); D=$(free_port); DS=$(free_port)
# shellcheck disable=SC2206 # split on purpose: several flags in one variable
EXTRA=(${PROXY_ARGS:-})
# E/P/D: an encoder writes each item's embeddings to a store the prefill reads from.
EC_PREFILL=()
if [ -n "${IMAGES:-}" ]; then
  if [ "$CONNECTOR" != nixl ]; then echo "IMAGES needs the nixl connector" >&2; exit 2; fi
  E=$(free_port); ES=$(free_port); mkdir -p "$OUT/ec"
  "$SIM" sim --listen 127.0.0.1:$E --side-channel 127.0.0.1:$ES \
    --ec-role producer --ec-store "$OUT/ec" >/dev/null 2>&1 &
  EC_PREFILL=(--ec-role consumer --ec-store "$OUT/ec")
  EXTRA+=(--encode "http://127.0.0.1:$E")
fi
if [ -n "${TRACE:-}" ]; then
  # A sink for the exported spans, so that the export (the SDK's batch thread, the
  # encoding, the POST) is counted as it runs in production.
  OT=$(free_port)
  python3 - "$OT" <<'SINK' &
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
SINK
  EXTRA+=(--otlp-endpoint "http://127.0.0.1:$OT" --trace-ratio 1.0)
fi
if [ "$CONNECTOR" = nixl ]; then BOOT=(); PORT_ARG=(); CONN=(); else
  BOOT=(--bootstrap 127.0.0.1:$PB); PORT_ARG=("$PB"); CONN=(--connector "$CONNECTOR"); fi
"$SIM" sim --listen 127.0.0.1:$P --side-channel 127.0.0.1:$PS "${BOOT[@]}" "${SIM_TLS[@]}" \
  --kv-mode $PMODE "${EC_PREFILL[@]}" "${CONTEXT[@]}" >/dev/null 2>&1 &
"$SIM" sim --listen 127.0.0.1:$D --side-channel 127.0.0.1:$DS "${SIM_TLS[@]}" \
  --kv-mode $DMODE "${CONTEXT[@]}" >/dev/null 2>&1 &
sleep 0.5
PREFILL="$SCHEME://127.0.0.1:$P"

if [ -n "${COPIES:-}" ]; then
  cc -O2 -shared -fPIC -o "$OUT/copies.so" scripts/copies.c -ldl
fi

count() { # requests → total instructions of one proxy run
  local n=$1 port
  port=$(free_port)
  # The runner of the measured proxy: callgrind, or the copy counter.
  local run=(valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$n")
  if [ -n "${COPIES:-}" ]; then
    run=(env LD_PRELOAD="$OUT/copies.so" COPIES_OUT="$OUT/copies.$n")
  fi
  if [ -n "${FLOOR:-}" ]; then
    "${run[@]}" \
      "$BIN" floor --threads 1 --listen 127.0.0.1:$port \
      --prefill "$PREFILL" --decode "$SCHEME://127.0.0.1:$D" \
      >/dev/null 2>"$OUT/log.$n" &
  else
  "${run[@]}" \
    "$BIN" serve --threads 1 --listen 127.0.0.1:$port "${CONN[@]}" \
    --prefill "$PREFILL" "${PORT_ARG[@]}" --decode "$SCHEME://127.0.0.1:$D" "${EDGE[@]}" \
    "${EXTRA[@]}" \
    >/dev/null 2>"$OUT/log.$n" &
  fi
  local pid=$!
  python3 - "$port" "$n" "${STREAM:-0}" "$CLIENT_CA" "$KEY" "${NEW_CONN:-0}" \
    "${IMAGES:-}" "${BODY_BYTES:-0}" <<'EOF'
import http.client, json, ssl, sys, time
port, n, stream = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
ca, key, new_conn = sys.argv[4], sys.argv[5], sys.argv[6] == "1"
content = "x " * 100
if sys.argv[7]:
    # Small inline images (the proxy's cost per item, not a decoder's), each its own.
    content = [{"type": "text", "text": content}] + [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,iVBORw0KGgo{i:04d}"}}
        for i in range(int(sys.argv[7]))]
def make(content):
    return json.dumps({"model": "sim-model", "max_tokens": 16, "stream": stream,
                       "messages": [{"role": "user", "content": content}]})
body = make(content)
size = int(sys.argv[8])
if size:
    # disagg-bench's text (run.rs, chat_body), repeated to pad the body to about SIZE.
    words = ("Explain why splitting prefill and decode across engines helps serving "
             "large language models at scale, with the costs of moving the KV cache. ")
    pad = max(size - len(make("")), 0)
    body = make((words * (pad // len(words) + 1))[:pad])
headers = {"content-type": "application/json"}
if key:
    headers["authorization"] = f"Bearer {key}"
def connect():
    if ca:
        return http.client.HTTPSConnection(
            "127.0.0.1", port, context=ssl.create_default_context(cafile=ca))
    return http.client.HTTPConnection("127.0.0.1", port)
for _ in range(600):
    try:
        c = connect(); c.connect(); break
    except OSError:
        time.sleep(0.05)
for _ in range(n):
    if new_conn:
        c.close(); c = connect()
    c.request("POST", "/v1/chat/completions", body, headers)
    r = c.getresponse(); data = r.read()
    assert r.status == 200, (r.status, data)
EOF
  kill -TERM $pid; wait $pid || true
  if [ -n "${COPIES:-}" ]; then return; fi
  [ -n "${KEEP:-}" ] && cp "$OUT/cg.$n" "$KEEP.$n"
  grep -E '^(summary|totals):' "$OUT/cg.$n" | head -1 | awk '{print $2}'
}

if [ -n "${COPIES:-}" ]; then
  count "$WARM"; count "$((WARM + N))"
  python3 scripts/copies.py "$OUT/copies.$WARM" "$OUT/copies.$((WARM + N))" "$N" "${TOP:-20}"
  exit 0
fi

A=$(count "$WARM")
B=$(count "$((WARM + N))")
# Built with `if`s: under `set -e` an assignment whose last `$(... && ...)` is false
# would end the script before it prints.
VARIANT=""
if [ "${STREAM:-0}" = 1 ]; then VARIANT+=" streamed"; fi
if [ -n "${AUTH:-}" ]; then VARIANT+=" auth"; fi
if [ -n "${TLS_IN:-}" ]; then VARIANT+=" tls-in"; fi
if [ -n "${TLS_OUT:-}" ]; then VARIANT+=" tls-out"; fi
if [ "${NEW_CONN:-0}" = 1 ]; then VARIANT+=" new-conn"; fi
if [ -n "${FLOOR:-}" ]; then VARIANT+=" floor"; fi
if [ -n "${IMAGES:-}" ]; then VARIANT+=" epd images=$IMAGES"; fi
if [ -n "${BODY_BYTES:-}" ]; then VARIANT+=" body=$BODY_BYTES"; fi
echo "$CONNECTOR$VARIANT: $(( (B - A) / N )) instructions per request ($BIN)"
