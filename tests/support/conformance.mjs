// The official-client conformance suite: drives a gateway with OpenClaw's reference client
// (@openclaw/gateway-client, installed by tests/support/install-gateway-protocol.sh) and records
// what happens, one JSON row per behaviour, so that two gateways (the real one and clawmux's
// replay gateway) can be compared row by row (tests/conformance.rs does, and docs/conformance.md
// lists the rows).
//
//   CLAWMUX_GATEWAY_PROTOCOL_DIR=<prefix> CONFORMANCE_TOKEN=<gateway token> \
//     node tests/support/conformance.mjs --url ws://127.0.0.1:PORT --protocol 4 \
//       [--rows SUBSTRING] [--frames FILE]
//
// stdout: one line per row, {"row": "<id>", "observed": {...}}, in row order; progress on stderr.
// --frames FILE: every frame sent and received on every socket, one JSON line each
// ({"dir":"client"|"server","frame":{...},"answers":"<method>"?,"raw"?:"<text>"}), for the schema
// check (tests/support/protocol-check.mjs).
//
// What a row records is chosen to be the gateway's behaviour, not the LLM's: answers (their keys,
// statuses, error codes and texts with ids replaced by placeholders), close codes and reasons,
// the order of a run's milestones (ACK, lifecycle phases, chat states, abort answer, final), and
// times the gateway decides (a handshake timeout, an agent.wait timeout), as `...Ms` fields that
// the comparison allows a tolerance on. Streamed text is only checked to echo the message.
// Events other than chat/agent (task, session.message, chat.metadata.changed, health, presence)
// are outside the replay gateway's scope and not recorded.
//
// Messages carry both the fake LLM's keywords (tests/support/fake_llm.py: SLOW, TOOL:<mark>) and
// the replay gateway's track selectors ([track:NAME], tests/cassettes/openclaw-2026.9.6-conformance.jsonl),
// so the same message runs the same kind of run on both gateways.
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";
import crypto from "node:crypto";
import fs from "node:fs";

const args = process.argv.slice(2);
const arg = (name, dflt) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : dflt;
};
const URL_ = arg("url");
const PROTOCOL = Number(arg("protocol", "4"));
const ONLY = arg("rows", "");
const FRAMES = arg("frames", "");
const TOKEN = process.env.CONFORMANCE_TOKEN || "";
const DIR = process.env.CLAWMUX_GATEWAY_PROTOCOL_DIR || "";
if (!URL_ || !DIR || !TOKEN) {
  console.error("usage: CLAWMUX_GATEWAY_PROTOCOL_DIR=... CONFORMANCE_TOKEN=... node conformance.mjs --url URL [--protocol 4|3] [--rows S] [--frames FILE]");
  process.exit(2);
}
const pkg = createRequire(`${DIR}/package.json`);
const imp = (m) => import(pathToFileURL(pkg.resolve(m)).href);
const { GatewayClient } = await imp("@openclaw/gateway-client");
// The `ws` the client uses (same module instance: resolved from the same prefix).
const WebSocket = (await imp("ws")).default;

const T0 = Date.now();
const say = (...a) => console.error(`${String(Date.now() - T0).padStart(6)} ms`, ...a);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const TAG = crypto.randomBytes(4).toString("hex");

// ------------------------------------------------------------------ frame capture
// Every socket's frames (the client's and raw ones): sends are wrapped, receipts seen through emit.
const frameLog = FRAMES ? fs.openSync(FRAMES, "w") : null;
const methodsById = new WeakMap();
function logFrame(dir, text, ws) {
  if (dir === "client") {
    try {
      const f = JSON.parse(text);
      if (f && f.type === "req" && typeof f.id === "string") {
        const ids = methodsById.get(ws) ?? new Map();
        methodsById.set(ws, ids);
        ids.set(f.id, f.method);
      }
    } catch {
      // a deliberately broken frame
    }
  }
  if (!frameLog) return;
  let frame;
  try {
    frame = JSON.parse(text);
  } catch {
    fs.writeSync(frameLog, `${JSON.stringify({ dir, raw: String(text).slice(0, 200) })}\n`);
    return;
  }
  const entry = { dir, frame };
  const ids = methodsById.get(ws);
  if (dir === "server" && frame && frame.type === "res" && ids?.has(frame.id)) entry.answers = ids.get(frame.id);
  fs.writeSync(frameLog, `${JSON.stringify(entry)}\n`);
}
const origSend = WebSocket.prototype.send;
WebSocket.prototype.send = function (data, ...rest) {
  logFrame("client", typeof data === "string" ? data : Buffer.from(data).toString("utf8"), this);
  return origSend.call(this, data, ...rest);
};
// Every received frame is also kept on its socket, numbered in arrival order across all sockets:
// the order of a run's frames is read from there (a request's promise resolves a microtask later
// than the frames that arrived in the same TCP read, so its resolution time says nothing).
let frameNo = 0;
const origEmit = WebSocket.prototype.emit;
WebSocket.prototype.emit = function (event, ...rest) {
  if (event === "message") {
    const text = Buffer.isBuffer(rest[0]) ? rest[0].toString("utf8") : String(rest[0]);
    logFrame("server", text, this);
    try {
      const frame = JSON.parse(text);
      const answers = frame?.type === "res" ? methodsById.get(this)?.get(frame.id) : undefined;
      (this.received ??= []).push({ n: ++frameNo, frame, answers });
    } catch {
      // not JSON: nothing to order
    }
  }
  return origEmit.call(this, event, ...rest);
};

// ------------------------------------------------------------------ normalisation
const UUID = /[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/gi;
/** Replaces the row's own ids (given as [value, placeholder] pairs) and any UUID in a text. */
function norm(text, subst = []) {
  let s = String(text);
  for (const [v, p] of subst) if (v) s = s.split(v).join(p);
  return s.replace(UUID, "<uuid>");
}
function normValue(v, subst) {
  if (typeof v === "string") return norm(v, subst);
  if (Array.isArray(v)) return v.map((x) => normValue(x, subst));
  if (v && typeof v === "object") return Object.fromEntries(Object.keys(v).sort().map((k) => [k, normValue(v[k], subst)]));
  return v;
}
const keys = (o) => (o && typeof o === "object" && !Array.isArray(o) ? Object.keys(o).sort() : typeof o);
/** A gateway error as the client saw it (GatewayClientRequestError or a raw error shape). */
function errObs(e, subst = []) {
  if (!e) return null;
  const out = {
    code: e.gatewayCode ?? e.code ?? null,
    message: norm(e.message ?? "", subst),
  };
  if (e.details !== undefined) out.details = normValue(e.details, subst);
  if (e.retryable !== undefined) out.retryable = e.retryable;
  if (e.retryAfterMs !== undefined) out.retryAfterMs = e.retryAfterMs;
  return out;
}

// ------------------------------------------------------------------ official client
const ALL_SCOPES = ["operator.read", "operator.write", "operator.admin"];
const DEFAULT_CAPS = ["session-scoped-events"];

// Protocol 3 (2026.4.12) grants scopes only to a device identity: the suite's own Ed25519 key,
// signed with the client's host hooks (the gateway pairs a loopback device on its first connect).
const DEVICE = (() => {
  const { publicKey, privateKey } = crypto.generateKeyPairSync("ed25519");
  const rawKey = (pub) => pub.export({ type: "spki", format: "der" }).subarray(-32);
  return {
    identity: {
      deviceId: crypto.createHash("sha256").update(rawKey(publicKey)).digest("hex"),
      publicKeyPem: publicKey.export({ type: "spki", format: "pem" }),
      privateKeyPem: privateKey.export({ type: "pkcs8", format: "pem" }),
    },
    hostDeps: {
      signDevicePayload: (pem, payload) => crypto.sign(null, Buffer.from(payload, "utf8"), crypto.createPrivateKey(pem)).toString("base64url"),
      publicKeyRawBase64UrlFromPem: (pem) => rawKey(crypto.createPublicKey(pem)).toString("base64url"),
    },
  };
})();

/**
 * Starts a GatewayClient and waits for hello-ok or a connect error. Returns
 * {client, hello, error, closes, events, frames(), paused, stop()} (events: every event frame,
 * with its arrival time; frames(): every frame its socket received, numbered). A backend
 * connecting with the shared token; on protocol 3 also with the suite's device identity.
 */
async function official(opts = {}) {
  const events = [];
  const closes = [];
  let paused = null;
  const settled = Promise.withResolvers();
  const client = new GatewayClient({
    url: URL_,
    token: TOKEN,
    deviceIdentity: PROTOCOL === 3 ? DEVICE.identity : null,
    hostDeps: DEVICE.hostDeps,
    minProtocol: PROTOCOL,
    maxProtocol: PROTOCOL,
    scopes: ALL_SCOPES,
    caps: DEFAULT_CAPS,
    clientVersion: "conformance",
    platform: "linux",
    requestTimeoutMs: 20_000,
    ...opts,
    onHelloOk: (hello) => settled.resolve({ hello }),
    onConnectError: (error) => settled.resolve({ error }),
    onReconnectPaused: (info) => {
      paused = info;
    },
    onEvent: (ev) => events.push({ at: Date.now(), ev }),
    onClose: (code, reason) => closes.push({ code, reason }),
  });
  client.start();
  const timer = setTimeout(() => settled.resolve({ error: new Error("no hello-ok nor connect error in 20 s") }), 20_000);
  const { hello, error } = await settled.promise;
  clearTimeout(timer);
  // The socket of this connection (its received frames, in order); reconnects are not expected.
  const ws = client.ws;
  return {
    client,
    frames: () => ws?.received ?? [],
    hello,
    error,
    closes,
    events,
    get paused() {
      return paused;
    },
    stop: () => client.stop(),
  };
}

/**
 * Waits (at most 5 s) until a refused connection is closed: whether the client pauses its
 * reconnects is decided on the close, so it is read only after it.
 */
async function closed(c) {
  for (let i = 0; i < 250 && c.closes.length === 0; i++) await sleep(20);
}

/** A request through the official client: {ok, payload} or {ok:false, error}. */
async function call(c, method, params, opts = {}) {
  try {
    return { ok: true, payload: await c.client.request(method, params, opts) };
  } catch (error) {
    return { ok: false, error };
  }
}

/**
 * hello-ok as recorded: what a client relies on, not the gateway's full method catalogue, and of
 * its objects only the keys its schema lists (a key it does not list is a schema departure, which
 * the schema check reports; see schema-departures.json).
 */
const OUR_METHODS = [
  "health", "sessions.patch", "sessions.messages.subscribe", "sessions.messages.unsubscribe", "agent",
  "agent.wait", "chat.abort", "sessions.abort", "chat.history",
];
const OUR_EVENTS = ["connect.challenge", "agent", "chat", "tick", "shutdown"];
const protocolSchema = JSON.parse(
  fs.readFileSync(new URL("../protocol.schema.json", pathToFileURL(pkg.resolve("@openclaw/gateway-protocol"))), "utf8"),
);
const HELLO = protocolSchema.definitions.HelloOk.properties;
const listed = (o, props) => keys(o).filter((k) => Object.hasOwn(props, k));
function helloObs(h) {
  return {
    type: h.type,
    protocol: h.protocol,
    keys: listed(h, HELLO),
    serverKeys: listed(h.server, HELLO.server.properties).filter((k) => k !== "buildId" && k !== "controlUiBuildSource"),
    methods: OUR_METHODS.filter((m) => h.features?.methods?.includes(m)),
    events: OUR_EVENTS.filter((e) => h.features?.events?.includes(e)),
    featuresKeys: listed(h.features, HELLO.features.properties),
    snapshotKeys: listed(h.snapshot, HELLO.snapshot.properties),
    auth: h.auth ? { role: h.auth.role, scopes: [...(h.auth.scopes ?? [])].sort(), keys: listed(h.auth, HELLO.auth.properties) } : null,
    policy: h.policy,
  };
}

// ------------------------------------------------------------------ raw sockets
/** A raw socket with every frame and the close recorded. */
function raw() {
  const ws = new WebSocket(URL_);
  const frames = [];
  const waiters = [];
  const opened = Date.now();
  const closed = new Promise((resolve) => {
    ws.on("close", (code, reason) => resolve({ code, reason: reason.toString(), afterMs: Date.now() - opened }));
  });
  ws.on("error", () => {});
  ws.on("message", (data) => {
    let f;
    try {
      f = JSON.parse(data.toString());
    } catch {
      f = { unparsed: data.toString() };
    }
    frames.push(f);
    waiters.splice(0).forEach((w) => w());
  });
  const open = new Promise((resolve, reject) => {
    ws.once("open", resolve);
    ws.once("error", reject);
  });
  /** The first frame (from `from` on) that matches, or null after `ms`. */
  async function next(pred, ms = 10_000, from = 0) {
    const deadline = Date.now() + ms;
    for (;;) {
      const f = frames.slice(from).find(pred);
      if (f) return f;
      const left = deadline - Date.now();
      if (left <= 0) return null;
      await Promise.race([new Promise((r) => waiters.push(r)), sleep(left), closed]);
      if (frames.slice(from).find(pred)) continue;
      if (ws.readyState === WebSocket.CLOSED) return frames.slice(from).find(pred) ?? null;
    }
  }
  return { ws, frames, next, closed, open, send: (o) => ws.send(typeof o === "string" ? o : JSON.stringify(o)) };
}

/** The connect params the official client sends (for raw sockets that must get past the handshake). */
function connectParams(over = {}) {
  return {
    minProtocol: PROTOCOL,
    maxProtocol: PROTOCOL,
    client: { id: "gateway-client", version: "conformance", platform: "linux", mode: "backend" },
    caps: DEFAULT_CAPS,
    auth: { token: TOKEN },
    role: "operator",
    scopes: ALL_SCOPES,
    ...over,
  };
}

/** A raw socket that sends `first` once the challenge is in; records the answer and the close. */
async function rawFirstFrame(first, { waitClose = 5_000 } = {}) {
  const r = raw();
  await r.open;
  const challenge = await r.next((f) => f.type === "event" && f.event === "connect.challenge", 10_000);
  r.send(typeof first === "function" ? first() : first);
  // Generous: a gateway busy with the suite's other rows may take seconds to answer a connect.
  const answer = await r.next((f) => f.type === "res", 10_000);
  const close = await Promise.race([r.closed, sleep(waitClose).then(() => null)]);
  if (!close) r.ws.terminate();
  return { challenge, answer, close };
}

/** A raw socket past the handshake. */
async function rawSession() {
  const r = raw();
  await r.open;
  await r.next((f) => f.type === "event" && f.event === "connect.challenge", 10_000);
  r.send({ type: "req", id: "c1", method: "connect", params: connectParams() });
  const hello = await r.next((f) => f.type === "res" && f.id === "c1", 10_000);
  if (!hello?.ok) throw new Error(`raw connect failed: ${JSON.stringify(hello)}`);
  return r;
}

const resObs = (res, subst) =>
  res ? (res.ok ? { ok: true, payloadKeys: keys(res.payload) } : { ok: false, error: errObs(res.error, subst) }) : null;
const closeObs = (c) => (c ? { code: c.code, reason: c.reason } : "open");

// ------------------------------------------------------------------ runs
const keyFor = (row) => `agent:main:conf-${TAG}-${row}`.toLowerCase();
const MSG = {
  short: (row) => `conformance ${row} [track:short] ${TAG}`,
  slow: (row) => `SLOW conformance ${row} [track:slow] ${TAG}`,
  tool: (row) => `TOOL:${TAG} conformance ${row} [track:tool]`,
};

/**
 * Starts an `agent` run through a client and records its life: ACK, final (or error), and the
 * chat/agent events of its run id in arrival order (from the client's event list).
 */
function startRun(c, { key, message, runId = crypto.randomUUID(), extra = {}, method = "agent" }) {
  const rec = { runId, key, message, ack: null, final: null, error: null };
  rec.done = c.client
    .request(method, { message, agentId: "main", sessionKey: key, idempotencyKey: runId, ...extra }, {
      expectFinal: true,
      timeoutMs: 90_000,
      onAccepted: (ack) => {
        rec.ack = ack;
      },
    })
    .then((fin) => {
      rec.final = fin;
    })
    .catch((e) => {
      rec.error = e;
    });
  return rec;
}

/** Waits until the run's events include one matching `pred`, the run ends, or `ms` pass. */
async function waitEvent(c, rec, pred, ms = 30_000) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline && !rec.final && !rec.error) {
    if (c.frames().some(({ frame: f }) => f.type === "event" && f.payload?.runId === rec.runId && pred(f))) return true;
    await sleep(20);
  }
  return false;
}
const isChat = (state) => (ev) => ev.event === "chat" && ev.payload?.state === state;
const isLifecycle = (phase) => (ev) => ev.event === "agent" && ev.payload?.stream === "lifecycle" && ev.payload?.data?.phase === phase;

/** Collapses runs of equal neighbours: [a,a,b,a] -> [a,b,a]. */
const collapse = (xs) => xs.filter((x, i) => i === 0 || x !== xs[i - 1]);
const uniq = (xs) => [...new Set(xs)];

/**
 * What a run looked like (see the file header): shapes, states, phases, and the order of its
 * milestones as the frames arrived on the client's socket: the ACK and the final `res` of its
 * `agent` request, its first chat event of each state, its lifecycle phases, and the first answer
 * to one of `abortMethods` on that socket ("abort:res").
 */
function runObs(c, rec, { abortMethods = [], ignorePhases = [] } = {}) {
  const frames = c.frames();
  const evs = frames.filter(({ frame: f }) => f.type === "event" && (f.event === "chat" || f.event === "agent") && f.payload?.runId === rec.runId);
  const subst = [[rec.runId, "<run>"], [rec.key, "<key>"]];
  const chat = evs.filter(({ frame: f }) => f.event === "chat").map(({ frame: f }) => f.payload.state);
  const agent = evs.filter(({ frame: f }) => f.event === "agent").map(({ frame: f }) => f.payload);
  const lifecycle = agent.filter((p) => p.stream === "lifecycle" && !ignorePhases.includes(p.data?.phase)).map((p) => p.data?.phase);
  const marks = [];
  for (const { n, frame: f, answers } of frames) {
    if (f.type === "event" && f.payload?.runId === rec.runId) {
      if (f.event === "chat") marks.push({ m: `chat:${f.payload.state}`, n });
      else if (f.event === "agent" && f.payload.stream === "lifecycle" && !ignorePhases.includes(f.payload.data?.phase)) {
        marks.push({ m: `lifecycle:${f.payload.data?.phase}`, n });
      }
    } else if (f.type === "res" && answers === "agent" && f.payload?.runId === rec.runId) {
      marks.push({ m: ["accepted", "in_flight"].includes(f.payload.status) ? "ack" : "final", n });
    } else if (f.type === "res" && abortMethods.includes(answers)) {
      marks.push({ m: "abort:res", n });
    }
  }
  const order = uniq(marks.sort((a, b) => a.n - b.n).map((x) => x.m));
  const chatKeys = {};
  for (const { frame: f } of evs.filter(({ frame: f }) => f.event === "chat")) {
    chatKeys[f.payload.state] = uniq([...(chatKeys[f.payload.state] ?? []), ...keys(f.payload)]).sort();
  }
  const agentKeys = uniq(agent.flatMap((p) => keys(p))).sort();
  const end = agent.find((p) => p.stream === "lifecycle" && p.data?.phase === "end");
  const text = rec.final?.result?.payloads?.map((p) => p.text ?? "").join("\n\n") ?? "";
  const firstLine = rec.message.split("\n")[0];
  return {
    ack: rec.ack ? { keys: keys(rec.ack), status: rec.ack.status, runId: norm(rec.ack.runId, subst), sessionKey: rec.ack.sessionKey ? norm(rec.ack.sessionKey, subst) : null } : null,
    final: rec.final
      ? {
          keys: keys(rec.final),
          status: rec.final.status,
          summary: rec.final.summary ?? null,
          stopReason: rec.final.stopReason ?? null,
          echoes: rec.final.result ? text.includes(firstLine) : null,
        }
      : null,
    error: errObs(rec.error, subst),
    chat: collapse(chat),
    lifecycle: collapse(lifecycle),
    streams: uniq(agent.map((p) => p.stream)).sort(),
    order,
    chatKeys,
    agentKeys,
    lifecycleEndKeys: end ? keys(end.data) : null,
  };
}

/** agent.wait as recorded. */
async function waitObs(c, runId, timeoutMs, subst) {
  const t = Date.now();
  const r = await call(c, "agent.wait", { runId, timeoutMs });
  const out = r.ok
    ? { ok: true, keys: keys(r.payload), status: r.payload.status, stopReason: r.payload.stopReason ?? null, runId: norm(r.payload.runId, subst) }
    : { ok: false, error: errObs(r.error, subst) };
  out.elapsedMs = Date.now() - t;
  return out;
}

// ------------------------------------------------------------------ rows
const rows = [];
const row = (id, fn, { v4only = false, serial = false, last = false } = {}) => rows.push({ id, fn, v4only, serial, last });

// --- connect, through the official client
row("connect.official", async () => {
  const c = await official();
  c.stop();
  return c.hello ? { hello: helloObs(c.hello) } : { error: errObs(c.error) };
});
row("connect.range-3-4", async () => {
  const c = await official({ minProtocol: 3, maxProtocol: 4 });
  c.stop();
  return c.hello ? { protocol: c.hello.protocol } : { error: errObs(c.error) };
});
for (const [id, min, max] of [["connect.exact-other", PROTOCOL === 4 ? 3 : 4, PROTOCOL === 4 ? 3 : 4], ["connect.future", 5, 5]]) {
  row(id, async () => {
    const c = await official({ minProtocol: min, maxProtocol: max });
    await closed(c);
    c.stop();
    return c.hello ? { protocol: c.hello.protocol } : { error: errObs(c.error), reconnectPaused: !!c.paused };
  }, { serial: true });
}
row("connect.bad-token", async () => {
  const c = await official({ token: "not-the-token", deviceIdentity: null });
  await closed(c);
  c.stop();
  return c.hello ? { hello: true } : { error: errObs(c.error), reconnectPaused: !!c.paused };
}, { serial: true });
row("connect.no-token", async () => {
  const c = await official({ token: undefined, deviceIdentity: null });
  await closed(c);
  c.stop();
  return c.hello ? { hello: true } : { error: errObs(c.error), reconnectPaused: !!c.paused };
}, { serial: true });
row("connect.optional-fields", async () => {
  // Fields the schema allows and the official client sends when asked.
  const c = await official({
    clientDisplayName: "conformance suite",
    instanceId: `conf-${TAG}`,
    clientBuildId: "build-1",
    deviceFamily: "server",
    pathEnv: "/usr/bin",
    caps: ["session-scoped-events", "tool-events"],
  });
  c.stop();
  return c.hello ? { protocol: c.hello.protocol, scopes: [...(c.hello.auth?.scopes ?? [])].sort() } : { error: errObs(c.error) };
});
row("connect.no-scopes", async () => {
  const c = await official({ scopes: [] });
  if (!c.hello) {
    c.stop();
    return { error: errObs(c.error) };
  }
  const key = keyFor("noscope");
  const health = await call(c, "health", {});
  const agent = await call(c, "agent", { message: "x", agentId: "main", sessionKey: key, idempotencyKey: crypto.randomUUID() });
  const history = await call(c, "chat.history", { sessionKey: key });
  c.stop();
  const subst = [[key, "<key>"]];
  return { scopes: c.hello.auth?.scopes ?? null, health: resObs(health, subst), agent: resObs(agent, subst), history: resObs(history, subst) };
});
row("connect.read-scope", async () => {
  const c = await official({ scopes: ["operator.read"] });
  const key = keyFor("readscope");
  const agent = await call(c, "agent", { message: "x", agentId: "main", sessionKey: key, idempotencyKey: crypto.randomUUID() });
  const patch = await call(c, "sessions.patch", { key, model: "cogni/fake-model" });
  const sub = await call(c, "sessions.messages.subscribe", { key });
  const history = await call(c, "chat.history", { sessionKey: key });
  const abort = await call(c, "chat.abort", { sessionKey: key });
  c.stop();
  const subst = [[key, "<key>"]];
  return {
    scopes: c.hello?.auth?.scopes ?? null,
    agent: resObs(agent, subst), patch: resObs(patch, subst), subscribe: resObs(sub, subst), history: resObs(history, subst), abort: resObs(abort, subst),
  };
});
row("connect.twice", async () => {
  const c = await official();
  const again = await call(c, "connect", connectParams());
  await sleep(300);
  const health = await call(c, "health", {});
  c.stop();
  return { again: resObs(again), healthAfter: resObs(health) };
});

// --- connect, raw frames (what the official client never sends)
const connectReq = (params, extra = {}) => ({ type: "req", id: "c1", method: "connect", params, ...extra });
const rawRow = (id, first, opts = {}) =>
  row(id, async () => {
    const { challenge, answer, close } = await rawFirstFrame(first, opts);
    return {
      challengeKeys: challenge ? keys(challenge.payload) : null,
      answer: answer ? (answer.ok ? { ok: true, keys: listed(answer.payload, HELLO) } : { ok: false, id: answer.id, error: errObs(answer.error) }) : null,
      close: closeObs(close),
    };
  }, { serial: !!opts.serial });
rawRow("connect.raw-ok", () => connectReq(connectParams()), { waitClose: 300 });
rawRow("connect.raw-unknown-client-id", () => connectReq(connectParams({ client: { id: "cogni-rust", version: "1", platform: "linux", mode: "backend" } })));
rawRow("connect.raw-unknown-field", () => connectReq(connectParams({ bogus: true })));
rawRow("connect.raw-unknown-auth-field", () => connectReq(connectParams({ auth: { token: TOKEN, bogus: "x" } })));
rawRow("connect.raw-missing-client", () => {
  const p = connectParams();
  delete p.client;
  return connectReq(p);
});
rawRow("connect.raw-no-auth", () => {
  const p = connectParams();
  delete p.auth;
  return connectReq(p);
}, { serial: true });
rawRow("connect.raw-empty-token", () => connectReq(connectParams({ auth: { token: "" } })), { serial: true });
rawRow("connect.raw-bad-token", () => connectReq(connectParams({ auth: { token: "not-the-token" } })), { serial: true });
rawRow("connect.raw-params-not-object", () => connectReq("hello"));
rawRow("connect.raw-bad-role", () => connectReq(connectParams({ role: "superuser" })));
rawRow("connect.raw-frame-extra-field", () => connectReq(connectParams(), { bogus: 1 }));
rawRow("connect.raw-first-not-connect", () => ({ type: "req", id: "h1", method: "health", params: {} }));
rawRow("connect.raw-not-json", () => "this is not json");
rawRow("connect.raw-first-is-event", () => ({ type: "event", event: "tick", payload: { ts: 1 } }));
rawRow("connect.raw-oversize", () => connectReq(connectParams({ userAgent: "x".repeat(600 * 1024) })));
row("connect.raw-silent", async () => {
  // Nothing after the upgrade: the gateway's pre-connect timeout.
  const r = raw();
  await r.open;
  const close = await Promise.race([r.closed, sleep(40_000).then(() => null)]);
  if (!close) r.ws.terminate();
  return close ? { close: closeObs(close), afterMs: close.afterMs, frames: r.frames.map((f) => f.event ?? f.type) } : { close: "open after 40 s" };
}, { last: true });

// --- methods
row("health", async () => {
  const c = await official();
  const r = await call(c, "health", {});
  c.stop();
  return { ok: r.ok, okField: r.ok ? r.payload.ok : null };
});
row("method.unknown", async () => {
  const c = await official();
  const r = await call(c, "nope.method", {});
  c.stop();
  return resObs(r);
});
row("sessions.patch", async () => {
  const c = await official();
  const key = keyFor("patch");
  const subst = [[key, "<key>"]];
  const ok = await call(c, "sessions.patch", { key, model: "cogni/fake-model-b" });
  const bare = await call(c, "sessions.patch", { key: keyFor("patch2"), model: "fake-model-b" });
  const unknownModel = await call(c, "sessions.patch", { key, model: "cogni/no-such-model" });
  const unknownProvider = await call(c, "sessions.patch", { key: keyFor("patch3"), model: "nope/no-such-model" });
  const emptyModel = await call(c, "sessions.patch", { key, model: "" });
  const headers = await call(c, "sessions.patch", { key, model: "cogni/fake-model", outboundHeaders: { "x-a": "1" } });
  const label = await call(c, "sessions.patch", { key, label: `conformance ${TAG}` });
  const labelled = label.ok ? { entryKeys: keys(label.payload.entry), resolved: label.payload.resolved } : resObs(label, subst);
  const missingKey = await call(c, "sessions.patch", { model: "cogni/fake-model" });
  const emptyKey = await call(c, "sessions.patch", { key: "" });
  const clear = await call(c, "sessions.patch", { key, model: null });
  c.stop();
  return {
    ok: ok.ok ? { keys: keys(ok.payload), key: norm(ok.payload.key, subst), entryKeys: keys(ok.payload.entry), resolved: ok.payload.resolved } : resObs(ok, subst),
    bareModel: bare.ok ? { resolved: bare.payload.resolved } : resObs(bare, subst),
    unknownModel: unknownModel.ok ? { entryKeys: keys(unknownModel.payload.entry), resolved: unknownModel.payload.resolved } : resObs(unknownModel, subst),
    unknownProvider: resObs(unknownProvider, subst),
    emptyModel: resObs(emptyModel, subst),
    outboundHeaders: resObs(headers, subst),
    label: labelled,
    missingKey: resObs(missingKey, subst),
    emptyKey: resObs(emptyKey, subst),
    clearModel: clear.ok ? { entryKeys: keys(clear.payload.entry), resolved: clear.payload.resolved } : resObs(clear, subst),
  };
});
row("sessions.subscribe", async () => {
  const c = await official();
  const key = keyFor("sub");
  const subst = [[key, "<key>"]];
  const r = (res) => (res.ok ? { ok: true, payload: normValue(res.payload, subst) } : resObs(res, subst));
  const out = {
    plain: r(await call(c, "sessions.messages.subscribe", { key })),
    upperCase: r(await call(c, "sessions.messages.subscribe", { key: key.toUpperCase() })),
    agentId: r(await call(c, "sessions.messages.subscribe", { key, agentId: "main" })),
    includeApprovals: r(await call(c, "sessions.messages.subscribe", { key, includeApprovals: true })),
    unknownField: r(await call(c, "sessions.messages.subscribe", { key, bogus: 1 })),
    emptyKey: r(await call(c, "sessions.messages.subscribe", { key: "" })),
    unsubscribe: r(await call(c, "sessions.messages.unsubscribe", { key })),
    unsubscribeAgain: r(await call(c, "sessions.messages.unsubscribe", { key })),
  };
  c.stop();
  return out;
});
row("agent.run", async () => {
  const c = await official();
  const key = keyFor("run");
  await call(c, "sessions.messages.subscribe", { key });
  const rec = startRun(c, { key, message: MSG.short("run") });
  await rec.done;
  await sleep(500);
  const subst = [[rec.runId, "<run>"], [key, "<key>"]];
  const wait = await waitObs(c, rec.runId, 1000, subst);
  const history = await call(c, "chat.history", { sessionKey: key });
  c.stop();
  return {
    run: runObs(c, rec),
    wait: { ...wait, elapsedMs: undefined },
    history: history.ok ? { keys: keys(history.payload), roles: history.payload.messages.map((m) => m.role) } : resObs(history, subst),
  };
});
row("agent.tool-events", async () => {
  // A tool call, once with cap tool-events and once without: which tool events reach a client.
  const out = {};
  for (const caps of [["session-scoped-events"], ["session-scoped-events", "tool-events"]]) {
    const c = await official({ caps });
    const key = keyFor(`tool-${caps.length}`);
    await call(c, "sessions.messages.subscribe", { key });
    const rec = startRun(c, { key, message: MSG.tool(`tool${caps.length}`) });
    await rec.done;
    await sleep(300);
    c.stop();
    const tool = c.events.filter(({ ev }) => ev.event === "agent" && ev.payload?.runId === rec.runId && ev.payload.stream === "tool");
    out[caps.join("+")] = {
      final: rec.final?.status ?? null,
      streams: uniq(c.events.filter(({ ev }) => ev.event === "agent" && ev.payload?.runId === rec.runId).map(({ ev }) => ev.payload.stream)).sort(),
      toolPhases: collapse(tool.map(({ ev }) => ev.payload.data?.phase)),
      toolDataKeys: uniq(tool.flatMap(({ ev }) => keys(ev.payload.data))).sort(),
    };
  }
  return out;
}, { v4only: true });
row("agent.optional-fields", async () => {
  const c = await official();
  const key = keyFor("optional");
  const rec = startRun(c, { key, message: MSG.short("optional"), extra: { label: "conformance", timeout: 120, extraSystemPrompt: "Be brief.", deliver: false, lane: "main" } });
  await rec.done;
  c.stop();
  return { ack: rec.ack?.status ?? null, final: rec.final?.status ?? null, error: errObs(rec.error, [[key, "<key>"]]) };
});
row("agent.default-session", async () => {
  // No sessionKey (the schema does not require one): the agent's main session.
  const c = await official();
  const rec = startRun(c, { key: undefined, message: MSG.short("default") });
  await rec.done;
  c.stop();
  return { ackSessionKey: rec.ack?.sessionKey ?? null, final: rec.final?.status ?? null, error: errObs(rec.error) };
});
row("agent.bad-params", async () => {
  const c = await official();
  const key = keyFor("badparams");
  const base = { message: "m", agentId: "main", sessionKey: key, idempotencyKey: crypto.randomUUID() };
  const without = (k) => Object.fromEntries(Object.entries(base).filter(([x]) => x !== k));
  const subst = [[key, "<key>"], [base.idempotencyKey, "<run>"]];
  const r = async (p) => resObs(await call(c, "agent", p), subst);
  const out = {
    noIdempotencyKey: await r(without("idempotencyKey")),
    noMessage: await r(without("message")),
    emptyMessage: await r({ ...base, message: "" }),
    unknownField: await r({ ...base, outboundHeaders: { a: "b" } }),
    negativeTimeout: await r({ ...base, timeout: -1 }),
    paramsNotObject: await r("run"),
    unknownAgent: await r({ ...base, agentId: "nobody", idempotencyKey: crypto.randomUUID() }),
  };
  c.stop();
  return out;
});
row("agent.dedupe", async () => {
  const c = await official();
  const key = keyFor("dedupe");
  await call(c, "sessions.messages.subscribe", { key });
  // A short run (2026.4.12 cannot abort a SLOW one): the repeat goes out the moment the ACK is in,
  // a second or more before the run can end.
  const rec = startRun(c, { key, message: MSG.short("dedupe") });
  while (!rec.ack && !rec.error) await sleep(2);
  const subst = [[rec.runId, "<run>"], [key, "<key>"]];
  // The same key while the run is in flight: one answer (the in-flight ACK).
  const again = await call(c, "agent", { message: rec.message, agentId: "main", sessionKey: key, idempotencyKey: rec.runId });
  const stillRunning = !rec.final && !rec.error;
  await rec.done;
  // And after the final: the cached final.
  const after = await call(c, "agent", { message: rec.message, agentId: "main", sessionKey: key, idempotencyKey: rec.runId });
  c.stop();
  const brief = (r) => (r.ok ? { keys: keys(r.payload), status: r.payload.status, summary: r.payload.summary ?? null } : resObs(r, subst));
  return { inFlight: brief(again), repeatedWhileRunning: stillRunning, afterFinal: brief(after), firstFinal: rec.final?.status ?? null };
});

// --- aborts, in each phase of a run
for (const method of ["chat.abort", "sessions.abort"]) {
  row(`abort.streaming.${method}`, async () => {
    const c = await official();
    const key = keyFor(`abort-${method}`);
    await call(c, "sessions.messages.subscribe", { key });
    const rec = startRun(c, { key, message: MSG.slow(`abort-${method}`) });
    await waitEvent(c, rec, isChat("delta"));
    const params = method === "chat.abort" ? { sessionKey: key, runId: rec.runId } : { key };
    const ans = await call(c, method, params);
    await rec.done;
    await sleep(500);
    const subst = [[rec.runId, "<run>"], [key, "<key>"]];
    const wait = await waitObs(c, rec.runId, 1000, subst);
    c.stop();
    return { answer: ans.ok ? normValue(ans.payload, subst) : resObs(ans, subst), run: runObs(c, rec, { abortMethods: [method] }), wait: { ...wait, elapsedMs: undefined } };
  }, { v4only: true });
}
row("abort.before-events", async () => {
  // Right after the ACK: whatever phase the run is in then, it ends aborted.
  const c = await official();
  const key = keyFor("abort-early");
  await call(c, "sessions.messages.subscribe", { key });
  const rec = startRun(c, { key, message: MSG.slow("abort-early") });
  while (!rec.ack && !rec.error) await sleep(5);
  const ans = await call(c, "chat.abort", { sessionKey: key, runId: rec.runId });
  await rec.done;
  c.stop();
  const subst = [[rec.runId, "<run>"], [key, "<key>"]];
  return {
    answer: ans.ok ? normValue(ans.payload, subst) : resObs(ans, subst),
    final: rec.final ? { status: rec.final.status, summary: rec.final.summary ?? null, stopReason: rec.final.stopReason ?? null } : errObs(rec.error, subst),
  };
}, { v4only: true });
row("abort.queued", async () => {
  // Two runs on one session: the second waits for the first; abort the waiting one by run id.
  const c = await official();
  const key = keyFor("queued");
  await call(c, "sessions.messages.subscribe", { key });
  const first = startRun(c, { key, message: MSG.slow("queued-1") });
  await waitEvent(c, first, isChat("delta"));
  const second = startRun(c, { key, message: MSG.short("queued-2") });
  while (!second.ack && !second.error) await sleep(5);
  await sleep(300);
  const ans = await call(c, "chat.abort", { sessionKey: key, runId: second.runId });
  await Promise.race([second.done, sleep(10_000)]);
  const secondEnded = !!(second.final || second.error);
  // The first run is not touched by it: still streaming; then abort it too.
  const firstStillRunning = !first.final && !first.error;
  const ans1 = await call(c, "chat.abort", { sessionKey: key, runId: first.runId });
  await first.done;
  await second.done;
  c.stop();
  const subst = [[first.runId, "<run1>"], [second.runId, "<run2>"], [key, "<key>"]];
  return {
    answer: ans.ok ? normValue(ans.payload, subst) : resObs(ans, subst),
    secondEndedWithin10s: secondEnded,
    // Whether 2026.9.6 also sends a trailing lifecycle `error` for the queued run depends on how far
    // it got preparing the run internally (seen both ways on one machine): not recorded.
    second: runObs(c, second, { abortMethods: ["chat.abort"], ignorePhases: ["error"] }),
    firstStillRunning,
    firstAbort: ans1.ok ? normValue(ans1.payload, subst) : resObs(ans1, subst),
    first: { final: first.final?.status ?? null, summary: first.final?.summary ?? null },
  };
}, { v4only: true });
row("abort.nothing-running", async () => {
  const c = await official();
  const key = keyFor("abort-none");
  const subst = [[key, "<key>"]];
  const r = async (m, p) => {
    const x = await call(c, m, p);
    return x.ok ? normValue(x.payload, subst) : resObs(x, subst);
  };
  const out = {
    chatAbort: await r("chat.abort", { sessionKey: key }),
    chatAbortRunId: await r("chat.abort", { sessionKey: key, runId: crypto.randomUUID() }),
    sessionsAbort: await r("sessions.abort", { key }),
    chatAbortNoKey: await r("chat.abort", {}),
    chatAbortUnknownField: await r("chat.abort", { sessionKey: key, bogus: 1 }),
    sessionsAbortEmpty: await r("sessions.abort", {}),
    sessionsAbortRunIdOnly: await r("sessions.abort", { runId: crypto.randomUUID() }),
  };
  c.stop();
  return out;
});
row("abort.after-final", async () => {
  const c = await official();
  const key = keyFor("abort-after");
  const rec = startRun(c, { key, message: MSG.short("abort-after") });
  await rec.done;
  const subst = [[rec.runId, "<run>"], [key, "<key>"]];
  const byId = await call(c, "chat.abort", { sessionKey: key, runId: rec.runId });
  const bySession = await call(c, "sessions.abort", { key });
  const otherSession = await call(c, "chat.abort", { sessionKey: keyFor("abort-other"), runId: rec.runId });
  c.stop();
  const p = (x) => (x.ok ? normValue(x.payload, subst) : resObs(x, subst));
  return { final: rec.final?.status ?? null, byId: p(byId), bySession: p(bySession), otherSession: p(otherSession) };
});
row("abort.other-session", async () => {
  // chat.abort naming a running run under another session key.
  const c = await official();
  const key = keyFor("abort-wrong");
  await call(c, "sessions.messages.subscribe", { key });
  const rec = startRun(c, { key, message: MSG.slow("abort-wrong") });
  await waitEvent(c, rec, isChat("delta"));
  const other = keyFor("abort-wrong-other");
  const subst = [[rec.runId, "<run>"], [key, "<key>"], [other, "<other>"]];
  const ans = await call(c, "chat.abort", { sessionKey: other, runId: rec.runId });
  await Promise.race([rec.done, sleep(3_000)]);
  const endedByIt = !!(rec.final || rec.error);
  if (!endedByIt) await call(c, "chat.abort", { sessionKey: key, runId: rec.runId });
  await rec.done;
  c.stop();
  return {
    answer: ans.ok ? normValue(ans.payload, subst) : resObs(ans, subst),
    endedByIt,
    final: rec.final ? { status: rec.final.status, summary: rec.final.summary ?? null } : null,
  };
}, { v4only: true });

// --- agent.wait
row("agent.wait", async () => {
  const c = await official();
  const key = keyFor("wait");
  await call(c, "sessions.messages.subscribe", { key });
  const rec = startRun(c, { key, message: MSG.slow("wait") });
  await waitEvent(c, rec, isChat("delta"));
  const subst = [[rec.runId, "<run>"], [key, "<key>"]];
  const running = await waitObs(c, rec.runId, 1500, subst);
  const unknownId = crypto.randomUUID();
  const unknown = await waitObs(c, unknownId, 1500, [...subst, [unknownId, "<unknown>"]]);
  const zero = await waitObs(c, rec.runId, 0, subst);
  const bad = await call(c, "agent.wait", { runId: rec.runId, timeoutMs: -1 });
  const noRunId = await call(c, "agent.wait", { timeoutMs: 10 });
  const extra = await call(c, "agent.wait", { runId: rec.runId, timeoutMs: 10, bogus: 1 });
  await call(c, "chat.abort", { sessionKey: key, runId: rec.runId });
  await rec.done;
  c.stop();
  return { running, unknown, zeroTimeout: zero, negativeTimeout: resObs(bad, subst), noRunId: resObs(noRunId, subst), unknownField: resObs(extra, subst) };
}, { v4only: true });

// --- delivery
row("delivery.session-scoped", async () => {
  // A subscriber, a session-scoped connection that did not subscribe, and one without the cap.
  const sub = await official();
  const unsub = await official();
  const all = await official({ caps: [] });
  const key = keyFor("delivery");
  await call(sub, "sessions.messages.subscribe", { key });
  const rec = startRun(sub, { key, message: MSG.short("delivery") });
  await rec.done;
  await sleep(500);
  for (const c of [sub, unsub, all]) c.stop();
  const count = (c) => c.events.filter(({ ev }) => (ev.event === "chat" || ev.event === "agent") && ev.payload?.runId === rec.runId).length > 0;
  return { subscriber: count(sub), scopedNotSubscribed: count(unsub), noCap: count(all) };
}, { v4only: true });

// --- bad frames after the handshake (raw socket)
row("frames.after-hello", async () => {
  const out = {};
  const cases = {
    notJson: "not json at all",
    noId: { type: "req", method: "health", params: {} },
    extraField: { type: "req", id: "x1", method: "health", params: {}, bogus: 1 },
    noParams: { type: "req", id: "x2", method: "health" },
    emptyMethod: { type: "req", id: "x3", method: "", params: {} },
    resFrame: { type: "res", id: "x4", ok: true, payload: {} },
    eventFrame: { type: "event", event: "tick", payload: { ts: 1 } },
    unknownType: { type: "bogus", id: "x5" },
    numericId: { type: "req", id: 7, method: "health", params: {} },
    traceparent: { type: "req", id: "x6", method: "health", params: {}, traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" },
    longTraceparent: { type: "req", id: "x7", method: "health", params: {}, traceparent: "x".repeat(200) },
  };
  for (const [name, frame] of Object.entries(cases)) {
    const r = await rawSession();
    const from = r.frames.length;
    r.send(frame);
    // A probe after it: is the connection still served?
    r.send({ type: "req", id: "probe", method: "health", params: {} });
    const probe = await r.next((f) => f.type === "res" && f.id === "probe", 3_000, from);
    const answers = r.frames.slice(from).filter((f) => f.type === "res" && f.id !== "probe");
    const close = await Promise.race([r.closed, sleep(probe ? 200 : 3_000).then(() => null)]);
    out[name] = {
      answers: answers.map((a) => (a.ok ? { id: a.id, ok: true } : { id: a.id, ok: false, error: errObs(a.error) })),
      probeAnswered: !!probe,
      close: closeObs(close),
    };
    r.ws.terminate();
  }
  return out;
});
row("frames.oversize-after-hello", async () => {
  const r = await rawSession();
  const from = r.frames.length;
  r.send({ type: "req", id: "big", method: "health", params: { pad: "x".repeat(27 * 1024 * 1024) } });
  const close = await Promise.race([r.closed, sleep(10_000).then(() => null)]);
  if (!close) r.ws.terminate();
  return { answers: r.frames.slice(from).filter((f) => f.type === "res").length, close: closeObs(close) };
});

// ------------------------------------------------------------------ runner
/**
 * Waits until the gateway is past its startup: a fresh gateway answers some methods `UNAVAILABLE`
 * ("chat.history unavailable during gateway startup", retryable) for a while after /readyz. The
 * first connect also pairs the suite's device on protocol 3. At most 60 s.
 */
async function warmUp() {
  const c = await official();
  if (!c.hello) {
    c.stop();
    throw new Error(`cannot connect to warm up: ${c.error?.message}`);
  }
  const deadline = Date.now() + 60_000;
  for (;;) {
    const r = await call(c, "chat.history", { sessionKey: keyFor("warmup") });
    if (r.ok || (r.error?.gatewayCode ?? r.error?.code) !== "UNAVAILABLE" || Date.now() > deadline) break;
    await sleep(Math.min(1_000, r.error?.retryAfterMs ?? 500));
  }
  c.stop();
}

await warmUp();
say("gateway ready");
const selected = rows.filter((r) => (!ONLY || r.id.includes(ONLY)) && (PROTOCOL === 4 || !r.v4only));
const results = new Map();
async function runRow(r) {
  const t = Date.now();
  try {
    results.set(r.id, await r.fn());
  } catch (e) {
    results.set(r.id, { suiteError: String(e?.stack ?? e).split("\n").slice(0, 3).join(" | ") });
  }
  say(`${r.id} (${Date.now() - t} ms)`);
}
// Serial rows (failed handshakes: the gateway rate-limits failed auth per client) one by one,
// the rest concurrently, a few at a time; rows that time the gateway's own timers last, on a
// gateway no longer busy with the others (a busy Node event loop fires timers seconds late).
const serial = selected.filter((r) => r.serial);
const parallel = selected.filter((r) => !r.serial && !r.last);
const serialDone = (async () => {
  for (const r of serial) await runRow(r);
})();
const LIMIT = 6;
let next = 0;
await Promise.all(
  Array.from({ length: LIMIT }, async () => {
    while (next < parallel.length) await runRow(parallel[next++]);
  }),
);
await serialDone;
for (const r of selected.filter((r) => r.last)) await runRow(r);
for (const r of selected) process.stdout.write(`${JSON.stringify({ row: r.id, observed: results.get(r.id) })}\n`);
if (frameLog) fs.closeSync(frameLog);
say(`${selected.length} rows`);
process.exit(0);
