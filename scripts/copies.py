#!/usr/bin/env python3
"""Bytes copied per request, by call site: the difference of two `copies.c` tables.

    copies.py FEWER MORE N [TOP]

FEWER and MORE are the tables of two proxy runs that served WARM and WARM+N requests
(`scripts/instructions.sh` with COPIES=1 writes and reads them); start-up cancels out.
Prints the bytes and calls per request in all, then the TOP sites by bytes, each named
by `addr2line` (the site and the two functions it was inlined into).
"""
import subprocess
import sys


def table(path):
    sites = {}
    with open(path) as f:
        for line in f:
            obj, offset, calls, size = line.split()
            sites[(obj, offset)] = (int(calls), int(size))
    return sites


def name(obj, offset):
    if "/" not in obj or obj.endswith(".so") or ".so." in obj:
        return obj.rsplit("/", 1)[-1]
    # The return address is the instruction after the call: look one byte back.
    out = subprocess.run(
        ["addr2line", "-f", "-C", "-i", "-e", obj, hex(int(offset, 16) - 1)],
        capture_output=True, text=True, check=False).stdout.splitlines()
    frames = []
    for fn, loc in zip(out[0::2], out[1::2]):
        frames.append(f"{fn.replace('::{{closure}}', '')} ({loc.rsplit('/', 1)[-1]})")
    return " <- ".join(frames[:3]) or obj


def main():
    fewer, more, n = table(sys.argv[1]), table(sys.argv[2]), int(sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    rows = []
    for site, (calls, size) in more.items():
        calls0, size0 = fewer.get(site, (0, 0))
        if size > size0:
            rows.append(((size - size0) / n, (calls - calls0) / n, site))
    rows.sort(reverse=True)
    print(f"{sum(r[0] for r in rows):.0f} bytes copied per request, "
          f"in {sum(r[1] for r in rows):.1f} calls")
    for per_request, calls, site in rows[:top]:
        each = per_request / calls if calls else 0
        print(f"{per_request:8.0f} B {calls:5.1f} x {each:6.0f} B  {name(*site)[:220]}")


if __name__ == "__main__":
    main()
