#!/usr/bin/env python3
"""Cross-replica live latency (bench/replicas.sh): RUNS runs, one at a time, each POSTed as an SSE
stream to replica A (its owner) while a second stream re-attaches to it on replica B
(`GET /v1/runs/{id}/events`). For every event B received live (A got it after B's stream was
open), B's arrival minus A's arrival. Prints `xr_p50=… xr_p99=… xr_max=… xr_events=…` (ms).

    bench/replicas_xr.py http://127.0.0.1:A http://127.0.0.1:B 50
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse
import uuid


def sse(conn, record, stop_at_end=True):
    """Reads an SSE response, appending (event id, arrival time) for each event; ends at the terminal."""
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ev_id, name = None, None
    while True:
        line = resp.fp.readline()
        if not line:
            return
        line = line.decode().rstrip("\r\n")
        if line.startswith("id:"):
            ev_id = int(line[3:].strip())
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line == "" and ev_id is not None:
            record.append((ev_id, time.monotonic()))
            if stop_at_end and name in ("final", "error"):
                return
            ev_id, name = None, None


def one(a, b):
    run_id = f"xr-{uuid.uuid4()}"
    got_a, got_b = [], []
    body = json.dumps({"message": f"cross-replica {run_id}", "billingAccountId": "bench-xr", "runId": run_id})
    ca = http.client.HTTPConnection(a.hostname, a.port, timeout=60)
    ca.request("POST", "/v1/runs", body, {"content-type": "application/json", "accept": "text/event-stream"})
    ta = threading.Thread(target=sse, args=(ca, got_a))
    ta.start()
    deadline = time.monotonic() + 30
    while not got_a and time.monotonic() < deadline:
        time.sleep(0.001)
    cb = http.client.HTTPConnection(b.hostname, b.port, timeout=60)
    cb.request("GET", f"/v1/runs/{run_id}/events", headers={"accept": "text/event-stream"})
    opened = time.monotonic()
    tb = threading.Thread(target=sse, args=(cb, got_b))
    tb.start()
    ta.join(90)
    tb.join(90)
    arrived_a = dict(got_a)
    return [(t - arrived_a[i]) * 1000 for i, t in got_b if i in arrived_a and arrived_a[i] > opened]


def main():
    a, b, runs = urllib.parse.urlparse(sys.argv[1]), urllib.parse.urlparse(sys.argv[2]), int(sys.argv[3])
    lat = sorted(x for _ in range(runs) for x in one(a, b))
    if not lat:
        print("xr_events=0")
        return
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    print(f"xr_p50={q(0.5):.1f}ms xr_p99={q(0.99):.1f}ms xr_max={lat[-1]:.1f}ms xr_events={len(lat)}")


main()
