#!/usr/bin/env python3
"""Convert real captured gateway frames into a replay cassette (docs/cassette.md).

Input: a frames log as written by the peer probes (/work/shared/peer/frames.jsonl): one JSON object
per line, `{t_ms, conn, dir, frame}` for frames (`dir` "in" = gateway to client, "out" = client to
gateway), plus `step`, `open`, `close` and `summary` lines that are skipped.

For every `--track NAME=RUN_ID` it finds the `agent` request whose idempotencyKey is RUN_ID, and on
the connection that sent it: the ACK `res`, the final `res`, and every kept event whose payload
belongs to that run. Times become `tMs` relative to the `agent` request. Payloads are copied
verbatim; only the top-level frame `seq` is dropped (the replay gateway numbers frames itself).

Nothing secret may leave: the connect tokens and challenge nonces seen in the input are collected
and the output is refused if any of them (or a key such as `nonce`/`token`) appears in it.

Usage (how the shipped cassettes were made):
  python3 tests/support/frames_to_cassette.py --frames /work/shared/peer/frames.jsonl \
      --source openclaw@2026.9.6 --protocol 4 --track cold=k1 --track short=k7 \
      --out tests/cassettes/openclaw-2026.9.6.jsonl
Stdlib only.
"""

import argparse
import datetime
import json
import re
import sys

# Keys that must never appear in a cassette (same list as the Rust parser's).
FORBIDDEN_KEYS = {"nonce", "token", "apikey", "recoveryscope", "signature", "password", "secret", "devicetoken"}
TRACK_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def die(msg):
    print(f"frames_to_cassette: {msg}", file=sys.stderr)
    sys.exit(1)


def load_frames(path):
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                die(f"{path}:{n}: not JSON: {e}")
            if "frame" in obj and obj.get("dir") in ("in", "out"):
                rows.append(obj)
    return rows


def collect_secrets(rows):
    """Every token and nonce the capture holds: none of them may reach the cassette."""
    secrets = set()
    for r in rows:
        f = r["frame"]
        if f.get("type") == "event" and f.get("event") == "connect.challenge":
            nonce = (f.get("payload") or {}).get("nonce")
            if nonce:
                secrets.add(nonce)
        if f.get("type") == "req" and f.get("method") == "connect":
            p = f.get("params") or {}
            tok = (p.get("auth") or {}).get("token")
            if tok:
                secrets.add(tok)
            dev = p.get("device") or {}
            for k in ("nonce", "signature"):
                if dev.get(k):
                    secrets.add(dev[k])
        if f.get("type") == "res" and isinstance(f.get("payload"), dict):
            auth = f["payload"].get("auth")
            if isinstance(auth, dict):
                for k in ("recoveryScope", "deviceToken"):
                    if auth.get(k):
                        secrets.add(auth[k])
    return secrets


def event_run_id(frame):
    p = frame.get("payload")
    if not isinstance(p, dict):
        return None
    if "runId" in p:
        return p["runId"]
    task = p.get("task")
    if isinstance(task, dict):
        return task.get("runId")
    return None


def convert_track(rows, name, run_id, keep_events, default_model):
    req = next(
        (r for r in rows
         if r["dir"] == "out" and r["frame"].get("method") == "agent"
         and (r["frame"].get("params") or {}).get("idempotencyKey") == run_id),
        None,
    )
    if req is None:
        die(f"no agent request with idempotencyKey {run_id!r}")
    conn, req_id, t0 = req["conn"], req["frame"]["id"], req["t_ms"]
    params = req["frame"]["params"]
    session_key = params["sessionKey"]
    start = rows.index(req)

    ack = final = None
    events = []
    timeline = []  # events and the final, in arrival order (which is time order)
    for r in rows[start + 1:]:
        if r["conn"] != conn or r["dir"] != "in":
            continue
        f = r["frame"]
        t = r["t_ms"] - t0
        if f.get("type") == "res" and f.get("id") == req_id:
            status = (f.get("payload") or {}).get("status")
            if status == "accepted" and ack is None:
                ack = {"kind": "ack", "track": name, "tMs": t, "payload": f["payload"]}
            elif final is None and ack is not None:
                if not f.get("ok"):
                    die(f"track {name}: the final res is an error frame; not supported by the format")
                final = {"kind": "final", "track": name, "tMs": t, "payload": f["payload"]}
                timeline.append(final)
        elif f.get("type") == "event" and f.get("event") in keep_events and event_run_id(f) == run_id:
            ev = {"kind": "event", "track": name, "tMs": t, "event": f["event"], "payload": f["payload"]}
            events.append(ev)
            timeline.append(ev)
    if ack is None or final is None:
        die(f"track {name}: run {run_id} has no ACK or no final res on connection {conn}")

    # The model in effect: the last sessions.patch of the session before the run, else the
    # lifecycle `model` event, else the gateway's default model.
    model = None
    for r in rows[:start]:
        f = r["frame"]
        if r["dir"] == "out" and f.get("method") == "sessions.patch" and (f.get("params") or {}).get("key") == session_key:
            model = f["params"].get("model") or model
    if model is None:
        for e in events:
            d = (e["payload"].get("data") or {}) if e["event"] == "agent" else {}
            if d.get("phase") == "model" and d.get("provider") and d.get("model"):
                model = f'{d["provider"]}/{d["model"]}'
                break
    session_id = next((e["payload"]["sessionId"] for e in events if isinstance(e["payload"].get("sessionId"), str)), None)

    header = {"kind": "track", "name": name, "message": params["message"], "model": model or default_model,
              "sessionKey": session_key, "runId": run_id}
    if session_id:
        header["sessionId"] = session_id
    # Arrival order is kept as file order; the ACK always comes first.
    records = [ack] + timeline
    return header, records, ack["payload"].get("acceptedAt")


def find_forbidden(value, path="$"):
    if isinstance(value, dict):
        for k, v in value.items():
            if k.lower() in FORBIDDEN_KEYS:
                return f"{path}.{k}"
            hit = find_forbidden(v, f"{path}.{k}")
            if hit:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            hit = find_forbidden(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", required=True, help="frames.jsonl from a peer probe")
    ap.add_argument("--out", required=True, help="cassette to write")
    ap.add_argument("--source", required=True, help="gateway that was recorded, e.g. openclaw@2026.9.6")
    ap.add_argument("--protocol", type=int, required=True, choices=(3, 4))
    ap.add_argument("--track", action="append", required=True, metavar="NAME=RUN_ID")
    ap.add_argument("--keep-event", action="append", default=[], metavar="NAME",
                    help="also keep these per-run events (chat and agent are always kept; task is dropped by default)")
    ap.add_argument("--default-model", default="cogni/fake-model",
                    help="model in effect when the session was never patched (the gateway's primary model)")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    rows = load_frames(args.frames)
    secrets = collect_secrets(rows)
    keep = {"chat", "agent", *args.keep_event}

    lines = []
    first_accepted = None
    names = set()
    for spec in args.track:
        name, sep, run_id = spec.partition("=")
        if not sep or not TRACK_NAME.match(name) or not run_id:
            die(f"bad --track {spec!r} (want NAME=RUN_ID, NAME of [A-Za-z0-9_.-])")
        if name in names:
            die(f"duplicate track name {name}")
        names.add(name)
        header, records, accepted_at = convert_track(rows, name, run_id, keep, args.default_model)
        if first_accepted is None and isinstance(accepted_at, int):
            first_accepted = accepted_at
        lines.append(header)
        lines.extend(records)

    recorded_at = "1970-01-01T00:00:00Z"
    if first_accepted:
        recorded_at = datetime.datetime.fromtimestamp(first_accepted / 1000, tz=datetime.timezone.utc) \
            .strftime("%Y-%m-%dT%H:%M:%S.") + f"{first_accepted % 1000:03d}Z"
    note = args.note or (f"converted from {args.frames.split('/')[-1]} by tests/support/frames_to_cassette.py; "
                         f"events kept: {', '.join(sorted(keep))}")
    head = {"kind": "cassette", "version": 1, "source": args.source, "protocol": args.protocol,
            "recordedAt": recorded_at, "note": note}

    out = [json.dumps(head, ensure_ascii=False, separators=(",", ":"))]
    for rec in lines:
        hit = find_forbidden(rec)
        if hit:
            die(f"refusing to write a secret-looking key at {hit} (record {rec.get('kind')} of {rec.get('track', rec.get('name'))})")
        out.append(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))
    text = "\n".join(out) + "\n"
    for s in secrets:
        if s in text:
            die("refusing to write: a token or challenge nonce from the capture appears in the output")
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {args.out}: {len(args.track)} track(s), {len(out)} lines")


if __name__ == "__main__":
    main()
