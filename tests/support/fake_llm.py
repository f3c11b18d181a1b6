#!/usr/bin/env python3
"""clawmux test support: a deterministic fake OpenAI-compatible LLM (stdlib only, 127.0.0.1).

Endpoints
  POST /v1/chat/completions   stream:true  -> SSE chat.completion.chunk events, an optional usage
                                              chunk (stream_options.include_usage), then [DONE]
                              stream:false -> one JSON chat.completion with usage
  GET  /v1/models             -> the model list (FAKE_LLM_MODELS)
  anything else               -> 404 JSON error
Every response carries `x-litellm-call-id: <uuid>` (like LiteLLM); the same uuid is the body `id`.

Reply (deterministic, echoes the caller):
  "Reply to: <echo> | model=<body.model> | w1 w2 ... wN"   streamed as N content chunks
  <echo> = first line of the last real user message (max 200 chars): user messages holding
  <<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> are skipped, a leading "[<timestamp>] " and a leading
  "Sender (untrusted metadata): ```json ...```" block are stripped, the text is cut at the first
  blank line (OpenClaw appends "\n\nRuntime: agent=... | session=..." there).
  The gateway's own retry prompts are not real user messages (openclaw 2026.9.6): when an LLM call
  of a run fails with a transient error (seen on a stalled gateway: `request timed out, HTTP 408`,
  the 408 clawmux's proxy listener sends when a request head is not complete 5 s after connecting,
  or `Connection error.`; gateway log: "transient same-model retry 1/8 ... reason=timeout"),
  the gateway retries the run with an internal prompt, CONTINUATION_PROMPT below, in one of two shapes:
   a) the run's user message already has an answer in the transcript: a separate user message
        "[Mon 2026-11-23 23:24 UTC] Continue the current task from the existing transcript, ..."
      -> skipped like the internal context (the run's own message stays the last real one, so a
         TOOL run still gets its "after-tool" answer);
   b) the run's user message has no answer yet ("orphaned"): the gateway merges it into the retry
      prompt under QUEUED_USER_MARKER, e.g. (real text; "\n" = newline):
        "[Mon 2026-11-23 23:28 UTC] [Queued user message from a previous active turn; preserved as
         context only. Continue with the active prompt below.]\nTOOL:BILL6f858143R1X billing check
         BILL6f858143R1X\n\nContinue the current task from the existing transcript, preserving
         completed work. ...\n\nRuntime: agent=main | session=..."
      -> the queued message is the one being continued: it is echoed and searched for keywords
         (when the prompt below the queued message is not CONTINUATION_PROMPT, that prompt is a new
         real message and is used instead).
  Keywords, looked for (case-sensitive, as whole words) in the last real user message (for shape b
  in the queued message, as for the echo):
    SLOW  -> 40 chunks at 1.0 s each (lets abort tests see the stream stop)
    SLOWEST -> 600 chunks at 1.0 s each (a stream that outlasts any run timeout a test sets)
    TOOL  -> if no `tool` message follows the last real user message: a streamed tool call to the
             function `exec` with {"command":"echo tool-ran-<marker>"} (marker from "TOOL:<marker>",
             else "x") and finish_reason "tool_calls"; once a tool result is present: normal text
             "Reply to: ... | after-tool | ..." (the tool result's first line is echoed as well).
    COMMIT:<dir>:<mark>  (the agent commits in a git worktree; for the git relay tests)
          -> if no `tool` message follows the last real user message: a streamed tool call to `exec`
             with {"command": "cd <dir> && printf '%s\n' <mark> > agent-<mark>.txt && git add
             agent-<mark>.txt && git commit -q -m 'agent: <mark>' && git log -1 --format=%H"};
             once a tool result is present: the text "committed <mark>" (or "NOT committed <mark>:
             <first line of the tool output>" when the command failed). <dir> must match
             /[A-Za-z0-9._/-]{1,200} without "..", <mark> [A-Za-z0-9._-]{1,64}; anything else is
             answered with the text "COMMIT refused: ..." and no tool call (the values end up in a
             shell command, so nothing outside those characters ever gets there).

Log: one JSON line per request to FAKE_LLM_LOG (default ./llm-requests.jsonl), flushed at once,
ASCII only (json.dumps ensure_ascii: a reader racing a write never sees half a UTF-8 character):
  {"ts","id","method","path","headers"{lower-cased},"model","stream","last_user","user_text",
   "n_messages","has_tool_result","reply"}
                                         last_user = <echo>; user_text = the last real user
                                         message as sent (max 1000 chars), for diagnosis
                                         reply = text | slow | tool_call | after_tool | commit_call |
                                         committed | commit_refused | error | models | not_found
plus, per completion, the usage it reports:
  {"event":"usage","id","prompt_tokens","completion_tokens","ts"}
plus, when a streamed response ends:
  {"event":"stream_end","id","completed":true|false,"chunks_sent":n,"chunks_planned":n,"ts"}
  completed:false = the client disconnected mid-stream. chunks_sent counts SSE data events written.

Env
  FAKE_LLM_PORT       port (default 0 = any free port)
  FAKE_LLM_PORT_FILE  if set, the bound port is written there (atomically) after binding
  FAKE_LLM_LOG        request log path (default ./llm-requests.jsonl)
  FAKE_LLM_DELAY      seconds between chunks (default 0.02)
  FAKE_LLM_CHUNKS     content chunks of a normal reply (default 8)
  FAKE_LLM_MODELS     comma-separated ids for GET /v1/models (default fake-model,fake-model-b)
  FAKE_LLM_LOG_BODY   "1" = also log the full request body under "body"
Prints "fake_llm listening on 127.0.0.1:<port>" on stdout once bound. Exits 0 on SIGTERM/SIGINT.
"""
import json
import os
import re
import secrets
import select
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOST = "127.0.0.1"
PORT = int(os.environ.get("FAKE_LLM_PORT") or 0)
PORT_FILE = os.environ.get("FAKE_LLM_PORT_FILE") or ""
LOG_PATH = os.environ.get("FAKE_LLM_LOG") or "./llm-requests.jsonl"
DELAY = float(os.environ.get("FAKE_LLM_DELAY") or 0.02)
CHUNKS = max(1, int(os.environ.get("FAKE_LLM_CHUNKS") or 8))
MODELS = [m.strip() for m in (os.environ.get("FAKE_LLM_MODELS") or "fake-model,fake-model-b").split(",") if m.strip()]
LOG_BODY = os.environ.get("FAKE_LLM_LOG_BODY") == "1"

SLOW_CHUNKS = 40
SLOWEST_CHUNKS = 600
SLOW_DELAY = 1.0
INTERNAL_MARKER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
# openclaw 2026.9.6: CONTINUATION_PROMPT (src/agents/embedded-agent-runner/run/session-prompt-state.ts)
# and QUEUED_USER_MESSAGE_MARKER (mergeOrphanedTrailingUserPrompt); see the module docstring.
CONTINUATION_PROMPT = ("Continue the current task from the existing transcript, preserving completed work. "
                       "If an action was interrupted, inspect its state before deciding whether to retry it. "
                       "Do not restart the task or repeat completed actions.")
QUEUED_USER_MARKER = ("[Queued user message from a previous active turn; preserved as context only. "
                      "Continue with the active prompt below.]")
USER_TEXT_LOG_MAX = 1000

_log_lock = threading.Lock()
_log_file = None


def log(entry):
    entry.setdefault("ts", time.time())
    line = json.dumps(entry, ensure_ascii=True) + "\n"
    with _log_lock:
        _log_file.write(line)
        _log_file.flush()


# ---------------------------------------------------------------- message helpers

def content_text(content):
    """Message content may be a string or a list of {type:"text", text} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
        return "\n".join(parts)
    return ""


_TS_RE = re.compile(r"^\[[^\]\n]*\]\s*")
_SENDER_RE = re.compile(r"^Sender \(untrusted metadata\):\s*```.*?```\s*", re.S)


def strip_envelope(text):
    """Drops what the gateway puts before the user's words: a Sender block, a [timestamp]."""
    t = text.lstrip()
    t = _SENDER_RE.sub("", t, count=1)
    return _TS_RE.sub("", t, count=1)


def is_gateway_prompt(text):
    """A user message the gateway wrote itself: internal context, or a bare retry prompt (shape a)."""
    return INTERNAL_MARKER in text or strip_envelope(text).startswith(CONTINUATION_PROMPT)


def last_real_user_index(messages):
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "user":
            if not is_gateway_prompt(content_text(m.get("content"))):
                return i
    return -1


def effective_user_text(text):
    """The user's own words in the last real user message: the envelope stripped, and for a retry
    that merged an unanswered message (shape b) the queued message being continued."""
    t = strip_envelope(text)
    if not t.startswith(QUEUED_USER_MARKER):
        return t
    rest = t[len(QUEUED_USER_MARKER):].lstrip("\n")
    cut = rest.find("\n\n" + CONTINUATION_PROMPT)
    if cut >= 0:
        return strip_envelope(rest[:cut])
    return strip_envelope(rest.partition("\n\n")[2])


def echo_line(text):
    t = effective_user_text(text)
    t = t.split("\n\n", 1)[0]
    t = t.split("\n", 1)[0].strip()
    return t[:200]


def marker_of(text):
    m = re.search(r"\bTOOL:([A-Za-z0-9._-]+)", text)
    return m.group(1)[:64] if m else "x"


_COMMIT_RE = re.compile(r"\bCOMMIT:(\S+)")
_COMMIT_DIR_RE = re.compile(r"/[A-Za-z0-9._/-]{1,200}")
_COMMIT_MARK_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def commit_spec(text):
    """None (no COMMIT keyword), ("ok", dir, mark) or ("refused", reason)."""
    m = _COMMIT_RE.search(text)
    if not m:
        return None
    arg = m.group(1)
    if ":" not in arg:
        return ("refused", "expected COMMIT:<dir>:<mark>")
    d, mark = arg.rsplit(":", 1)
    if not _COMMIT_DIR_RE.fullmatch(d) or ".." in d:
        return ("refused", "bad dir")
    if not _COMMIT_MARK_RE.fullmatch(mark):
        return ("refused", "bad mark")
    return ("ok", d, mark)


def commit_command(d, mark):
    return (f"cd {d} && printf '%s\\n' {mark} > agent-{mark}.txt && git add agent-{mark}.txt && "
            f"git commit -q -m 'agent: {mark}' && git log -1 --format=%H")


def estimate_tokens(messages):
    n = 0
    for m in messages:
        if isinstance(m, dict):
            n += len(content_text(m.get("content")))
    return max(1, n // 4)


# ---------------------------------------------------------------- handler

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-llm/1"
    sys_version = ""

    def log_message(self, fmt, *args):  # keep stderr quiet; the JSONL log is the record
        pass

    # -- plumbing
    def _read_body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _headers_dict(self):
        return {k.lower(): v for k, v in self.headers.items()}

    def _send_json(self, code, obj, call_id):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-litellm-call-id", call_id)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _base_entry(self, call_id):
        return {"ts": time.time(), "id": call_id, "method": self.command, "path": self.path,
                "headers": self._headers_dict(), "model": None, "stream": None, "last_user": None,
                "user_text": None, "n_messages": 0, "has_tool_result": False}

    def _client_gone(self):
        """True when the peer has closed its side (EOF readable) without us writing."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _path(self):
        return self.path.split("?", 1)[0].rstrip("/")

    # -- GET
    def do_GET(self):
        call_id = str(uuid.uuid4())
        entry = self._base_entry(call_id)
        if self._path() in ("/v1/models", "/models"):
            entry["reply"] = "models"
            log(entry)
            self._send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake-llm"} for m in MODELS]}, call_id)
        else:
            entry["reply"] = "not_found"
            log(entry)
            self._send_json(404, {"error": {"message": f"no route for GET {self.path}",
                                            "type": "not_found_error", "code": 404}}, call_id)

    # -- POST
    def do_POST(self):
        call_id = str(uuid.uuid4())
        raw = self._read_body()
        entry = self._base_entry(call_id)
        if self._path() not in ("/v1/chat/completions", "/chat/completions"):
            entry["reply"] = "not_found"
            log(entry)
            self._send_json(404, {"error": {"message": f"no route for POST {self.path}",
                                            "type": "not_found_error", "code": 404}}, call_id)
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as e:
            entry["reply"] = "error"
            log(entry)
            self._send_json(400, {"error": {"message": f"invalid JSON body: {e}",
                                            "type": "invalid_request_error", "code": 400}}, call_id)
            return

        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        model = body.get("model")
        stream = bool(body.get("stream"))
        ui = last_real_user_index(messages)
        raw_user_text = content_text(messages[ui].get("content")) if ui >= 0 else ""
        echo = echo_line(raw_user_text)
        user_text = effective_user_text(raw_user_text)
        tool_msgs = [m for m in messages[ui + 1:] if isinstance(m, dict) and m.get("role") == "tool"] if ui >= 0 else []
        has_tool_result = bool(tool_msgs)
        slow = re.search(r"\bSLOW\b", user_text) is not None
        slowest = re.search(r"\bSLOWEST\b", user_text) is not None
        wants_tool = re.search(r"\bTOOL\b", user_text) is not None

        commit = commit_spec(user_text)
        n_chunks, delay = (SLOWEST_CHUNKS, SLOW_DELAY) if slowest else (SLOW_CHUNKS, SLOW_DELAY) if slow else (CHUNKS, DELAY)
        slow = slow or slowest
        words = [f"w{i}" for i in range(1, n_chunks + 1)]
        if commit is not None and commit[0] == "refused":
            kind = "commit_refused"
        elif commit is not None and not has_tool_result:
            kind = "commit_call"
        elif commit is not None:
            kind = "committed"
        elif wants_tool and not has_tool_result:
            kind = "tool_call"
        elif wants_tool:
            kind = "after_tool"
        else:
            kind = "slow" if slow else "text"

        entry.update({"model": model, "stream": stream, "last_user": echo,
                      "user_text": raw_user_text[:USER_TEXT_LOG_MAX], "n_messages": len(messages),
                      "has_tool_result": has_tool_result, "reply": kind})
        if LOG_BODY:
            entry["body"] = body
        log(entry)

        prompt_tokens = estimate_tokens(messages)
        created = int(time.time())

        if kind in ("tool_call", "commit_call"):
            if kind == "commit_call":
                args = json.dumps({"command": commit_command(commit[1], commit[2]), "timeoutSeconds": 60})
            else:
                args = json.dumps({"command": f"echo tool-ran-{marker_of(user_text)}"})
            tool_call = {"id": "call_" + secrets.token_hex(12), "type": "function",
                         "function": {"name": "exec", "arguments": args}}
            completion_tokens = max(1, len(args) // 4)
            log({"event": "usage", "id": call_id, "prompt_tokens": prompt_tokens,
                 "completion_tokens": completion_tokens})
            if not stream:
                self._send_json(200, self._completion(call_id, created, model, {
                    "role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls",
                    prompt_tokens, completion_tokens), call_id)
                return
            step = max(1, (len(args) + 3) // 4)
            slices = [args[i:i + step] for i in range(0, len(args), step)]
            deltas = [{"role": "assistant", "content": None, "tool_calls": [{
                "index": 0, "id": tool_call["id"], "type": "function",
                "function": {"name": "exec", "arguments": ""}}]}]
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": s}}]} for s in slices]
            self._stream(call_id, created, model, deltas, "tool_calls", delay, body,
                         prompt_tokens, completion_tokens)
            return

        if kind in ("committed", "commit_refused"):
            if kind == "commit_refused":
                text = f"COMMIT refused: {commit[1]}"
            else:
                out = content_text(tool_msgs[-1].get("content")).strip()
                failed = "(Command exited with code" in out or not re.search(r"\b[0-9a-f]{40}\b", out)
                text = f"NOT committed {commit[2]}: {out.splitlines()[0][:200] if out else 'no output'}" if failed \
                    else f"committed {commit[2]}"
            log({"event": "usage", "id": call_id, "prompt_tokens": prompt_tokens, "completion_tokens": 2})
            if not stream:
                self._send_json(200, self._completion(call_id, created, model, {
                    "role": "assistant", "content": text}, "stop", prompt_tokens, 2), call_id)
                return
            self._stream(call_id, created, model, [{"role": "assistant", "content": text}], "stop", delay, body,
                         prompt_tokens, 2)
            return

        head = f"Reply to: {echo} | model={model} | "
        if kind == "after_tool":
            tool_echo = content_text(tool_msgs[-1].get("content")).strip().split("\n", 1)[0][:200]
            head += f"after-tool: {tool_echo} | "
        text = head + " ".join(words)
        completion_tokens = len(words)
        # The usage this call reports (tests sum it to check billing-grade usage).
        log({"event": "usage", "id": call_id, "prompt_tokens": prompt_tokens,
             "completion_tokens": completion_tokens})
        if not stream:
            self._send_json(200, self._completion(call_id, created, model, {
                "role": "assistant", "content": text}, "stop", prompt_tokens, completion_tokens), call_id)
            return
        pieces = [head + words[0]] + [" " + w for w in words[1:]]
        deltas = [{"role": "assistant", "content": pieces[0]}] + [{"content": p} for p in pieces[1:]]
        self._stream(call_id, created, model, deltas, "stop", delay, body, prompt_tokens, completion_tokens)

    @staticmethod
    def _completion(call_id, created, model, message, finish, pt, ct):
        return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}}

    def _stream(self, call_id, created, model, deltas, finish, delay, body, pt, ct):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(choices, usage=None):
            obj = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        events = [chunk([{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
        events.append(chunk([{"index": 0, "delta": {}, "finish_reason": finish}]))
        if include_usage:
            events.append(chunk([], {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}))
        events.append(b"data: [DONE]\n\n")

        sent = 0
        completed = False
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.send_header("x-litellm-call-id", call_id)
            self.end_headers()
            self.wfile.flush()
            for i, ev in enumerate(events):
                # sleep between content chunks (not before the first one, not before the tail)
                if 0 < i < len(deltas):
                    deadline = time.monotonic() + delay
                    while True:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        if self._client_gone():
                            raise ConnectionResetError("client closed the connection")
                        time.sleep(min(left, 0.05))
                if self._client_gone():
                    raise ConnectionResetError("client closed the connection")
                self.wfile.write(ev)
                self.wfile.flush()
                sent += 1
            completed = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            completed = False
        finally:
            log({"event": "stream_end", "id": call_id, "completed": completed, "chunks_sent": sent,
                 "chunks_planned": len(events), "ts": time.time()})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):  # a dropped client is not an error worth a trace
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            return
        super().handle_error(request, client_address)


def main():
    global _log_file
    log_dir = os.path.dirname(os.path.abspath(LOG_PATH))
    os.makedirs(log_dir, exist_ok=True)
    _log_file = open(LOG_PATH, "a", encoding="utf-8")

    srv = Server((HOST, PORT), Handler)
    port = srv.server_address[1]
    if PORT_FILE:
        tmp = f"{PORT_FILE}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, PORT_FILE)

    def on_signal(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"fake_llm listening on {HOST}:{port}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    except SystemExit:
        pass
    finally:
        srv.server_close()
        with _log_lock:
            _log_file.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
