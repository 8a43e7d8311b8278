#!/usr/bin/env bash
# Memory per held stream of a proxy binary, the way disagg-bench's memory phase reads it
# (docs/performance.md, "Memory per held stream: where the 32 KiB go"), but with the
# proxy binary itself, so that it can run under a heap profiler or another allocator.
#
#   scripts/held-streams.sh [PROXY_BINARY] [STREAMS]
#   WORDS=8000 scripts/held-streams.sh ...        (prompt of WORDS words, 2 bytes each;
#                                                  the simulator's context is 8192 tokens)
#   WORD=xxxxxxxxxxxxxxx WORDS=8000 ...           (words of 16 bytes: 128 KB prompts)
#   WRAP="heaptrack -o /tmp/held" scripts/held-streams.sh ...
#                                                 (run the proxy under a command: a
#                                                  profiler, `env LD_PRELOAD=...`)
#   PROXY_ARGS="--prompt-token-reuse off" scripts/held-streams.sh ...  (more serve flags)
#
# Starts two simulated vLLM NIXL engines (the decode one with 400 ms between tokens, so
# that a stream lasts about 6 s) and the proxy with 2 threads, holds 4 streams as a
# warm-up, reads the proxy's VmRSS, then opens STREAMS streams (default 256) 2 ms apart,
# waits until each has received its first `data:` event, reads VmRSS again and prints
# (RSS with all open - idle RSS) / STREAMS. Everything listens on 127.0.0.1. Needs
# python3.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${1:-target/release/disagg-proxy}
STREAMS=${2:-256}
cargo build --release -q -p disagg-proxy
SIM=target/release/disagg-proxy
OUT=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$OUT"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(free_port); PS=$(free_port); D=$(free_port); DS=$(free_port); X=$(free_port)

"$SIM" sim --listen 127.0.0.1:$P --side-channel 127.0.0.1:$PS --kv-mode nixl >/dev/null 2>&1 &
"$SIM" sim --listen 127.0.0.1:$D --side-channel 127.0.0.1:$DS --kv-mode nixl \
  --inter-token-ms 400 >/dev/null 2>&1 &
sleep 0.5
# shellcheck disable=SC2086 # WRAP and PROXY_ARGS are word lists
${WRAP:-} "$BIN" serve --threads 2 --listen 127.0.0.1:$X \
  --prefill http://127.0.0.1:$P --decode http://127.0.0.1:$D ${PROXY_ARGS:-} \
  >"$OUT/proxy.log" 2>&1 &
for _ in $(seq 300); do
  (echo >/dev/tcp/127.0.0.1/$X) 2>/dev/null && break
  sleep 0.1
done
sleep 1
# The proxy's own process (under WRAP it is a child of the wrapper).
PID=$(pgrep -n -f "^[^ ]*$(basename "$BIN") serve --threads 2 --listen 127.0.0.1:$X")

python3 - "$X" "$STREAMS" "$PID" "${WORDS:-100}" "${WORD:-x}" <<'EOF'
import asyncio, json, sys
port, n, pid, words = (int(a) for a in sys.argv[1:5])
word = sys.argv[5]
body = json.dumps({"model": "sim-model", "max_tokens": 16, "stream": True,
                   "messages": [{"role": "user", "content": (word + " ") * words}]}).encode()
req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body

def rss_kib():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

async def hold(started, release):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(req)
    await w.drain()
    seen = b""
    while b"data:" not in seen:
        got = await r.read(4096)
        if not got:
            sys.exit("stream closed before its first event: " + seen[:300].decode(errors="replace"))
        seen += got
    started.append(1)
    await release.wait()
    w.close()

async def batch(count, measure):
    started, release = [], asyncio.Event()
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(hold(started, release)))
        await asyncio.sleep(0.002)
    while len(started) < count:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    rss = rss_kib() if measure else None
    release.set()
    await asyncio.gather(*tasks)
    return rss

async def main():
    await batch(4, False)
    await asyncio.sleep(0.5)
    idle = rss_kib()
    during = await batch(n, True)
    print(f"idle RSS {idle} KiB, with {n} streams open {during} KiB: "
          f"{(during - idle) / n:.1f} KiB per held stream")

asyncio.run(main())
EOF
# A profiler writes its data when the proxy exits.
kill -INT "$PID" 2>/dev/null || true
if [ -n "${WRAP:-}" ]; then sleep 3; fi
