// Smoke test of the real OpenClaw gateway + fake LLM started by tests/support/gateway.sh.
//
//   tests/support/gateway.sh start /tmp/gw            # or: ... start /tmp/gw v3
//   "$NODE_BIN" tests/support/smoke-real-gateway.mjs /tmp/gw [--extended]
//   tests/support/gateway.sh stop /tmp/gw
//
// NODE_BIN is in /tmp/gw/env (Node 24); the `ws` package comes from the openclaw install.
// Checks (v4): connect (protocol 3..4, scopes, session-scoped-events), sessions.patch to
// cogni/fake-model-b, sessions.messages.subscribe, an `agent` run with a frame-level traceparent;
// the final text echoes the message and model=fake-model-b, and the LLM saw the same trace id.
// --extended adds: a default-model run (model=fake-model), a TOOL run (exec tool call, then
// "after-tool"), and a SLOW run aborted with chat.abort (LLM log shows stream_end completed:false).
// v3 (2026.4.12): connects with a signed Ed25519 device identity (needed for scopes there), sends
// no traceparent (v3 rejects it) and aborts nothing (v3 cannot abort `agent` runs).
// Exit 0 and a last line "N passed, 0 failed" on success.
import { createRequire } from "node:module";
import crypto from "node:crypto";
import fs from "node:fs";
import path from "node:path";

const runDir = process.argv[2];
const extended = process.argv.includes("--extended");
if (!runDir) {
  console.error("usage: node smoke-real-gateway.mjs RUN_DIR [--extended]");
  process.exit(2);
}
const env = Object.fromEntries(
  fs.readFileSync(path.join(runDir, "env"), "utf8").split("\n").filter(Boolean)
    .map((l) => [l.slice(0, l.indexOf("=")), l.slice(l.indexOf("=") + 1)]),
);
const v3 = env.GATEWAY_FLAVOR === "v3";
const WebSocket = createRequire(env.OPENCLAW_MJS)("ws");
const T0 = Date.now();
const ms = () => `${String(Date.now() - T0).padStart(6)} ms`;
let passed = 0;
let failed = 0;
function check(name, cond, detail = "") {
  if (cond) passed++;
  else failed++;
  console.log(`${ms()} ${cond ? "ok  " : "FAIL"} ${name}${detail ? `  (${detail})` : ""}`);
}
const llmLog = () =>
  fs.readFileSync(env.LLM_LOG, "utf8").split("\n").filter(Boolean).map((l) => JSON.parse(l));
const sleep = (t) => new Promise((r) => setTimeout(r, t));

class Conn {
  constructor(url) {
    this.ws = new WebSocket(url);
    this.pending = new Map(); // id -> {frames:[], waiters:[]}
    this.events = [];
    this.eventWaiters = [];
    this.n = 0;
    this.ws.on("message", (data) => {
      const f = JSON.parse(data.toString());
      if (f.type === "res") {
        const p = this.pending.get(f.id);
        if (p) {
          p.frames.push(f);
          p.waiters.splice(0).forEach((w) => w());
        }
      } else if (f.type === "event") {
        this.events.push(f);
        this.eventWaiters.splice(0).forEach((w) => w());
      }
    });
    this.error = null;
    this.ws.on("error", (e) => {
      this.error = e;
      this.eventWaiters.splice(0).forEach((w) => w());
      for (const p of this.pending.values()) p.waiters.splice(0).forEach((w) => w());
    });
    this.closed = new Promise((r) => this.ws.on("close", (code, reason) => r({ code, reason: String(reason) })));
  }
  async waitEvent(pred, timeoutMs = 15000) {
    const end = Date.now() + timeoutMs;
    for (;;) {
      const e = this.events.find(pred);
      if (e) return e;
      if (this.error) throw this.error;
      if (Date.now() > end) throw new Error("timeout waiting for event");
      await new Promise((r) => { this.eventWaiters.push(r); setTimeout(r, 200); });
    }
  }
  send(method, params, extra = {}) {
    const id = `r${++this.n}`;
    this.pending.set(id, { frames: [], waiters: [] });
    this.ws.send(JSON.stringify({ type: "req", id, method, params, ...extra }));
    return id;
  }
  // resolves with the n-th res frame for id
  async res(id, nth = 1, timeoutMs = 60000) {
    const p = this.pending.get(id);
    const end = Date.now() + timeoutMs;
    while (p.frames.length < nth) {
      if (this.error) throw this.error;
      if (Date.now() > end) throw new Error(`timeout waiting for res #${nth} of ${id}`);
      await new Promise((r) => { p.waiters.push(r); setTimeout(r, 200); });
    }
    return p.frames[nth - 1];
  }
  async call(method, params, extra) {
    return this.res(this.send(method, params, extra));
  }
}

// v3 device identity (REPORT-v3 recipe): scopes are cleared without one on 2026.4.12.
function deviceFor(nonce, clientId, mode, role, scopes, token) {
  const { publicKey, privateKey } = crypto.generateKeyPairSync("ed25519");
  const raw = publicKey.export({ format: "der", type: "spki" }).subarray(-32);
  const id = crypto.createHash("sha256").update(raw).digest("hex");
  const signedAt = Date.now();
  const payload = ["v3", id, clientId, mode, role, scopes.join(","), signedAt, token, nonce, "linux", ""].join("|");
  const signature = crypto.sign(null, Buffer.from(payload), privateKey).toString("base64url");
  return { id, publicKey: raw.toString("base64url"), signature, signedAt, nonce };
}

async function connect() {
  const c = new Conn(env.GATEWAY_URL);
  const ch = await c.waitEvent((e) => e.event === "connect.challenge");
  const scopes = ["operator.read", "operator.write", "operator.admin"];
  const params = {
    minProtocol: 3, maxProtocol: 4,
    client: { id: "gateway-client", version: "0.1.0", platform: "linux", mode: "backend" },
    role: "operator", scopes, caps: ["session-scoped-events"], auth: { token: env.GATEWAY_TOKEN },
  };
  if (v3) params.device = deviceFor(ch.payload.nonce, "gateway-client", "backend", "operator", scopes, env.GATEWAY_TOKEN);
  const r = await c.call("connect", params);
  return { c, hello: r };
}

const traceId = crypto.randomBytes(16).toString("hex");
const spanId = crypto.randomBytes(8).toString("hex");

async function agentRun(c, sessionKey, message, extra = {}) {
  const t = Date.now();
  const id = c.send("agent", { message, agentId: "main", sessionKey, idempotencyKey: crypto.randomUUID() }, extra);
  const ack = await c.res(id, 1);
  if (ack.ok && ack.payload?.status !== "accepted") return { ack, fin: ack, dt: Date.now() - t }; // cached
  const fin = ack.ok ? await c.res(id, 2, 90000) : ack;
  return { ack, fin, dt: Date.now() - t, id };
}
const finalText = (fin) => (fin?.payload?.result?.payloads || []).map((p) => p.text).join("\n");

try {
  const { c, hello } = await connect();
  check("connect -> hello-ok", hello.ok && hello.payload?.type === "hello-ok",
    `protocol=${hello.payload?.protocol} server=${hello.payload?.server?.version}`);
  if (!hello.ok) throw new Error(JSON.stringify(hello.error));

  const key = "agent:main:acct1:r1";
  const patch = await c.call("sessions.patch", { key, model: "cogni/fake-model-b" });
  check("sessions.patch model=cogni/fake-model-b", patch.ok,
    JSON.stringify(patch.ok ? patch.payload?.resolved : patch.error));
  const sub = await c.call("sessions.messages.subscribe", { key });
  check("sessions.messages.subscribe", sub.ok, JSON.stringify(sub.payload ?? sub.error));

  const before = llmLog().length;
  const extra = v3 ? {} : { traceparent: `00-${traceId}-${spanId}-01` };
  const r1 = await agentRun(c, key, "hello MARK1", extra);
  const text1 = finalText(r1.fin);
  check("agent ack accepted", r1.ack.ok && r1.ack.payload?.status === "accepted", JSON.stringify(r1.ack.payload ?? r1.ack.error));
  check("agent final status ok", r1.fin.ok && r1.fin.payload?.status === "ok", `${r1.dt} ms`);
  check("final text echoes the message", text1.includes("Reply to: hello MARK1"), JSON.stringify(text1));
  check("final text shows model=fake-model-b", text1.includes("model=fake-model-b"));
  const reqs1 = llmLog().slice(before).filter((e) => e.method === "POST");
  check("LLM got 1 request for the run", reqs1.length === 1, `${reqs1.length}`);
  const req1 = reqs1[0] || { headers: {} };
  check("LLM request model=fake-model-b, last_user=hello MARK1", req1.model === "fake-model-b" && req1.last_user === "hello MARK1");
  if (!v3) {
    const tp = req1.headers.traceparent || "";
    check("LLM traceparent carries the frame's trace id", tp.split("-")[1] === traceId, `sent ${traceId}, LLM saw ${tp}`);
    const chatEvents = c.events.filter((e) => e.event === "chat" && e.payload?.sessionKey === key);
    check("subscribed session's chat events arrive", chatEvents.some((e) => e.payload.state === "final"), `${chatEvents.length} chat events`);
  } else {
    check("v3: LLM request has no traceparent", !("traceparent" in req1.headers));
  }

  if (extended) {
    // default model on another session
    const k2 = "agent:main:acct1:r2";
    if (!v3) await c.call("sessions.messages.subscribe", { key: k2 });
    const r2 = await agentRun(c, k2, "second MARK2");
    check("default model run: model=fake-model", finalText(r2.fin).includes("Reply to: second MARK2 | model=fake-model |"),
      `${r2.dt} ms ${JSON.stringify(finalText(r2.fin))}`);

    // tool call round trip
    const k3 = "agent:main:acct1:r3";
    const b3 = llmLog().length;
    const r3 = await agentRun(c, k3, "please TOOL:t3 now");
    const t3 = finalText(r3.fin);
    const reqs3 = llmLog().slice(b3).filter((e) => e.method === "POST");
    check("TOOL run: 2 LLM calls (tool call, then with tool result)",
      reqs3.length === 2 && reqs3[0].reply === "tool_call" && reqs3[1].has_tool_result === true,
      reqs3.map((e) => e.reply).join(","));
    check("TOOL run: final text mentions after-tool", t3.includes("after-tool"), `${r3.dt} ms ${JSON.stringify(t3)}`);

    if (!v3) {
      // abort a SLOW run
      const k4 = "agent:main:acct1:r4";
      await c.call("sessions.messages.subscribe", { key: k4 });
      const b4 = llmLog().length;
      const id4 = crypto.randomUUID();
      const rid = c.send("agent", { message: "be SLOW please", agentId: "main", sessionKey: k4, idempotencyKey: id4 });
      await c.res(rid, 1);
      await c.waitEvent((e) => e.event === "chat" && e.payload?.sessionKey === k4 && e.payload?.state === "delta", 30000);
      const ab = await c.call("chat.abort", { sessionKey: k4, runId: id4 });
      check("chat.abort aborted the run", ab.ok && ab.payload?.aborted === true, JSON.stringify(ab.payload ?? ab.error));
      const fin4 = await c.res(rid, 2, 30000);
      check("aborted run final res", fin4.ok && fin4.payload?.summary === "aborted", JSON.stringify(fin4.payload).slice(0, 160));
      let end4;
      for (let i = 0; i < 50 && !end4; i++) {
        const call = llmLog().slice(b4).find((e) => e.method === "POST");
        end4 = call && llmLog().find((e) => e.event === "stream_end" && e.id === call.id);
        if (!end4) await sleep(100);
      }
      check("LLM stream_end completed:false after abort", end4 && end4.completed === false, JSON.stringify(end4));
    }
  }
  c.ws.close();
} catch (e) {
  check("no exception", false, e.stack || String(e));
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
