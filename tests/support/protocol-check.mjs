// Checks gateway frames against OpenClaw's own protocol.schema.json (from @openclaw/gateway-protocol,
// installed by tests/support/install-gateway-protocol.sh), validated with the package's own
// validator engine (TypeBox, a pinned dependency of the package; it compiles standard JSON Schema).
//
//   CLAWMUX_GATEWAY_PROTOCOL_DIR=<prefix> node tests/support/protocol-check.mjs < frames.jsonl
//
// Input: one JSON line per frame, {"dir":"client"|"server","frame":{...},"answers":"<method>"?}
// (the format tests/support/conformance.mjs --frames writes; a line with "raw" instead of "frame"
// is a frame that was not JSON and is reported as such).
// Output: one JSON line per input line, in order:
//   {"ok":true|false,"checked":["RequestFrame","AgentParams",...],"unchecked":[...],
//    "errors":[{"def","instancePath","keyword","message","params","departure"?}]}
// What is checked:
//   client `req`: RequestFrame, and `params` against <Method>Params (connect: ConnectParams; the
//                 definition named after the method, e.g. sessions.messages.subscribe ->
//                 SessionsMessagesSubscribeParams); a method without one is listed as unchecked
//   server `res`: ResponseFrame; the payload of a successful `connect` against HelloOk
//   server `event`: EventFrame, and the payload of chat (by state: ChatDeltaEvent, ChatFinalEvent,
//                 ChatAbortedEvent, ChatErrorEvent, ChatStatusEvent), agent (AgentEvent), tick
//                 (TickEvent), shutdown (ShutdownEvent); other events are listed as unchecked
// Known departures of the REAL gateway from its own schema live in schema-departures.json next to
// this file, each with the reason: an error that matches one is marked with its id ("departure"),
// never dropped. Whoever reads the output decides what a departure means (tests/conformance.rs:
// the real gateway must show each listed one, nothing else may fail).
import { createRequire } from "node:module";
import { pathToFileURL, fileURLToPath } from "node:url";
import fs from "node:fs";
import path from "node:path";
import readline from "node:readline";

const DIR = process.env.CLAWMUX_GATEWAY_PROTOCOL_DIR || "";
if (!DIR) {
  console.error("CLAWMUX_GATEWAY_PROTOCOL_DIR is not set (tests/support/install-gateway-protocol.sh)");
  process.exit(2);
}
const pkg = createRequire(`${DIR}/package.json`);
// The validator engine the protocol package itself depends on, from the package's own tree.
const protoPkg = createRequire(pkg.resolve("@openclaw/gateway-protocol"));
const Schema = (await import(pathToFileURL(protoPkg.resolve("typebox/schema")).href)).default;
// The schema ships at the package root (not an exported subpath): next to dist/.
const schemaPath = path.join(path.dirname(pkg.resolve("@openclaw/gateway-protocol")), "..", "protocol.schema.json");
const doc = JSON.parse(fs.readFileSync(schemaPath, "utf8"));
const here = path.dirname(fileURLToPath(import.meta.url));
const departures = JSON.parse(fs.readFileSync(path.join(here, "schema-departures.json"), "utf8")).departures;

const validators = new Map();
function validator(def) {
  if (!doc.definitions[def]) return null;
  let v = validators.get(def);
  if (!v) {
    // The whole document, rooted at the definition: every $ref resolves inside it.
    const root = { $schema: doc.$schema, definitions: doc.definitions, $ref: `#/definitions/${def}` };
    v = Schema.Compile(root);
    validators.set(def, v);
  }
  return v;
}

const pascal = (method) =>
  method
    .split(/[.\-_]/)
    .filter(Boolean)
    .map((p) => p[0].toUpperCase() + p.slice(1))
    .join("");
const paramsDef = (method) => (method === "connect" ? "ConnectParams" : `${pascal(method)}Params`);
const CHAT_STATES = { delta: "ChatDeltaEvent", final: "ChatFinalEvent", aborted: "ChatAbortedEvent", error: "ChatErrorEvent", status: "ChatStatusEvent" };
const EVENTS = { agent: "AgentEvent", tick: "TickEvent", shutdown: "ShutdownEvent" };

/** The value at a JSON pointer ("/payload/stream"), or undefined. */
function at(value, pointer) {
  let v = value;
  for (const part of pointer.split("/").slice(1)) {
    if (v === null || typeof v !== "object") return undefined;
    v = v[part.replace(/~1/g, "/").replace(/~0/g, "~")];
  }
  return v;
}

/** The id of the listed departure this error is, if any (see schema-departures.json). */
function departureOf(dir, def, err, frame) {
  for (const d of departures) {
    if (d.dir !== dir || d.def !== def || d.keyword !== err.keyword) continue;
    if (d.instancePath !== undefined && d.instancePath !== err.instancePath) continue;
    if (d.property !== undefined) {
      const props = [].concat(err.params?.additionalProperties ?? err.params?.additionalProperty ?? []);
      if (!props.includes(d.property)) continue;
    }
    if (d.where && !Object.entries(d.where).every(([ptr, want]) => at(frame, ptr) === want)) continue;
    return d.id;
  }
  return undefined;
}

/** Validates `value` against `def`; one error per offending additional property (so each can be matched). */
function check(out, dir, def, value, frame) {
  const v = validator(def);
  if (!v) {
    out.unchecked.push(def);
    return;
  }
  out.checked.push(def);
  const [ok, errors] = v.Errors(value);
  if (ok) return;
  for (const e of errors) {
    const props = [].concat(e.params?.additionalProperties ?? []);
    const split = e.keyword === "additionalProperties" && props.length > 1 ? props.map((p) => ({ ...e, params: { additionalProperties: [p] } })) : [e];
    for (const one of split) {
      const err = { def, instancePath: one.instancePath, keyword: one.keyword, message: one.message, params: one.params };
      const dep = departureOf(dir, def, err, frame);
      if (dep) err.departure = dep;
      out.errors.push(err);
    }
  }
}

function checkLine(entry) {
  const out = { ok: true, checked: [], unchecked: [], errors: [] };
  if (entry.raw !== undefined || !entry.frame || typeof entry.frame !== "object") {
    out.errors.push({ def: "GatewayFrame", instancePath: "", keyword: "json", message: "not a JSON object" });
  } else {
    const f = entry.frame;
    if (entry.dir === "client") {
      check(out, "client", "RequestFrame", f, f);
      if (f.type === "req" && typeof f.method === "string" && f.method) check(out, "client", paramsDef(f.method), f.params, f);
    } else if (f.type === "res") {
      check(out, "server", "ResponseFrame", f, f);
      if (f.ok === true && entry.answers === "connect") check(out, "server", "HelloOk", f.payload, f);
    } else if (f.type === "event") {
      check(out, "server", "EventFrame", f, f);
      const name = f.event;
      if (name === "chat") check(out, "server", CHAT_STATES[f.payload?.state] ?? "ChatEvent", f.payload, f);
      else if (EVENTS[name]) check(out, "server", EVENTS[name], f.payload, f);
      else out.unchecked.push(`event ${name}`);
    } else {
      check(out, "server", "GatewayFrame", f, f);
    }
  }
  out.ok = out.errors.length === 0;
  return out;
}

const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of rl) {
  if (!line.trim()) continue;
  let entry;
  try {
    entry = JSON.parse(line);
  } catch {
    entry = { raw: line };
  }
  process.stdout.write(`${JSON.stringify(checkLine(entry))}\n`);
}
