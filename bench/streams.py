#!/usr/bin/env python3
"""Holds N concurrent SSE streams open through a server and reports its RSS (SPEC §10:
1,000 concurrent SSE streams, gateway RSS <= 150 MB) and the chunk gaps the clients saw.

Usage: streams.py HOST:PORT PID N   (talks plain HTTP/1.1 on loopback only)
BENCH_BODY_KIB=K pads each request's message to about K KiB, as an agent's context would.
"""
import asyncio
import os
import statistics
import sys
import time

PAD = "x" * (int(os.environ.get("BENCH_BODY_KIB", "0")) * 1024)
BODY = ('{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi%s"}]}'
        % PAD).encode()


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def stream(host, port, opened, gaps, done):
    r, w = await asyncio.open_connection(host, port)
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY)
    await w.drain()
    head = await r.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:80])
    opened.append(1)
    last = None
    while True:
        chunk = await r.read(65536)
        if not chunk:
            break
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
    done.append(1)
    w.close()


async def main():
    host, port = sys.argv[1].rsplit(":", 1)
    pid, n = int(sys.argv[2]), int(sys.argv[3])
    opened, gaps, done = [], [], []
    base = rss_mb(pid)
    tasks = [asyncio.create_task(stream(host, int(port), opened, gaps, done)) for _ in range(n)]
    peak = base
    deadline = time.monotonic() + 120
    reported = False
    while len(done) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        peak = max(peak, rss_mb(pid))
        if len(opened) == n and not done and not reported:
            reported = True
            print(f"all {n} streams open: RSS {rss_mb(pid):.1f} MB", flush=True)
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps.sort()
    p50 = statistics.median(gaps) * 1000 if gaps else float("nan")
    p99 = gaps[int(len(gaps) * 0.99) - 1] * 1000 if gaps else float("nan")
    print(f"streams: {n} opened {len(opened)} completed {len(done)}")
    print(f"RSS of pid {pid}: idle {base:.1f} MB, peak {peak:.1f} MB")
    print(f"client-side chunk gaps: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    per = (peak - base) * 1024 / n if n else float("nan")
    # One line for bench/streams.sh's table.
    print(f"RESULT {n} {len(done)} {base:.1f} {peak:.1f} {per:.1f} {p50:.1f} {p99:.1f}")


asyncio.run(main())
