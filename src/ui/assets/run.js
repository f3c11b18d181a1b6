"use strict";
// One run: its document, its output streamed live from GET /v1/runs/{id}/events (read with fetch
// so the Authorization header can be sent; after a dropped connection it re-attaches with
// Last-Event-ID, so no text is lost or repeated), its error, relay result and LLM calls, and an
// abort button while it is live.

(() => {
  const { api, headers, el, safeUrl, fmtTime, fmtDuration, runDuration, statusBadge, showError, initAuth, sleep } = Clawmux;
  const runId = new URLSearchParams(location.search).get("id") || "";
  const path = "/v1/runs/" + encodeURIComponent(runId);
  // While the run is live, its document and LLM calls are re-read this often.
  const REFRESH_MS = 3000;
  // Reconnect delays: doubling from 0.5 s up to 10 s.
  const RETRY_MIN_MS = 500;
  const RETRY_MAX_MS = 10000;

  // `text`: the text_delta events so far (what #output shows until the run's end is known).
  const stream = { lastId: 0, ended: false, running: false, reconnects: 0, text: "" };
  let finished = false;

  const $ = (id) => document.getElementById(id);

  function setText(id, value) {
    $(id).textContent = value === null || value === undefined ? "" : String(value);
  }

  function renderDoc(doc) {
    $("status").replaceChildren(statusBadge(doc.status));
    setText("account", doc.billingAccountId);
    setText("agent", doc.agentId);
    setText("model", doc.model || "default");
    setText("session-key", doc.sessionKey);
    setText("state-key", doc.stateKey || "—");
    setText("started", fmtTime(doc.createdAt));
    setText("finished", doc.finishedAt ? fmtTime(doc.finishedAt) : "—");
    setText("duration", runDuration(doc));
    const u = doc.usage;
    setText("tokens", u ? u.inputTokens + " / " + u.outputTokens + " (" + u.source + ")" : "—");
    setText("llm-call-count", u ? u.llmCalls : "—");
    finished = Boolean(doc.finishedAt);
    $("abort").hidden = finished;
    if (doc.error) renderError(doc.error.code, doc.error.message);
    if (doc.relay) renderRelay(doc.relay);
    if (finished && stream.ended && typeof doc.content === "string" && doc.content.startsWith(stream.text)) {
      // The streamed text is a prefix of (usually equal to) the final content: add the rest.
      $("output").append(doc.content.slice(stream.text.length));
      stream.text = doc.content;
    }
  }

  function renderError(code, message) {
    $("run-error").hidden = false;
    setText("error-code", code);
    setText("error-message", message);
  }

  function renderRelay(relay) {
    $("relay").hidden = false;
    setText("relay-branch", relay.branch);
    setText("relay-commits", relay.commitCount);
    setText("relay-pushed", relay.pushed ? "yes (" + relay.pushedCommits + " commits)" : "no");
    const pr = safeUrl(relay.prUrl);
    $("relay-pr").replaceChildren(pr ? el("a", { href: pr, rel: "noopener noreferrer", target: "_blank", text: relay.prNumber ? "#" + relay.prNumber + " " + pr : pr }) : "—");
    setText("relay-error", relay.error ? relay.error.stage + ": " + relay.error.message : "—");
  }

  function renderCalls(answer) {
    const rows = answer.calls.map((c) =>
      el(
        "tr",
        {},
        el("td", { title: c.time, text: fmtTime(c.time) }),
        el("td", {}, el("code", { text: c.model || "" })),
        el("td", { class: "num", text: c.status }),
        el("td", { text: c.outcome }),
        el("td", { class: "num", text: fmtDuration(c.latencyMs) }),
        el("td", { class: "num", text: (c.inputTokens ?? "–") + " / " + (c.outputTokens ?? "–") }),
        el("td", { text: c.streamed ? "yes" : "no" }),
      ),
    );
    $("llm-calls").tBodies[0].replaceChildren(...rows);
    let note = "";
    if (!answer.proxy) note = "(this clawmux has no LLM proxy, so calls are not recorded)";
    else if (answer.truncated) note = "(the first " + answer.calls.length + ")";
    else if (!answer.calls.length) note = "(none yet)";
    setText("llm-calls-note", note);
  }

  async function refresh() {
    try {
      renderDoc(await api(path));
      renderCalls(await api(path + "/llm-calls"));
      showError("");
    } catch (e) {
      if (e.status !== 401) showError("Cannot read the run: " + e.message);
    }
  }

  function setStreamState(state) {
    const s = $("stream-state");
    s.dataset.state = state;
    s.dataset.reconnects = String(stream.reconnects);
    s.textContent = state + (stream.reconnects ? " (reconnected " + stream.reconnects + "×)" : "");
  }

  function onEvent(name, id, data) {
    if (id) stream.lastId = Number(id);
    let d = null;
    try {
      d = JSON.parse(data);
    } catch (_) {
      return;
    }
    if (name === "text_delta") {
      const t = String(d.text || "");
      stream.text += t;
      $("output").append(t);
    } else if (name === "status") {
      setText("phase", d.phase ? "· " + d.phase + (d.tool ? " (" + d.tool + ")" : "") : "");
    } else if (name === "relay") {
      renderRelay(d);
    } else if (name === "final" || name === "error") {
      stream.ended = true;
      setText("phase", "");
      if (name === "error") renderError(d.code, d.message);
      refresh();
    }
  }

  // One SSE block (the lines between blank lines), as the spec reads it.
  function onBlock(block) {
    let name = "message";
    let id = "";
    const data = [];
    for (const line of block.split(/\r\n|\r|\n/)) {
      if (!line || line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      let value = i < 0 ? "" : line.slice(i + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
      else if (field === "id") id = value;
    }
    if (data.length) onEvent(name, id, data.join("\n"));
  }

  // Reads the stream until it ends; resolves normally when the server closed it, throws when the
  // connection failed.
  async function readOnce() {
    const h = headers({ Accept: "text/event-stream" });
    if (stream.lastId > 0) h["Last-Event-ID"] = String(stream.lastId);
    const resp = await fetch(path + "/events", { headers: h, cache: "no-store", credentials: "omit" });
    if (!resp.ok) {
      let e = {};
      try {
        e = (await resp.json()).error || {};
      } catch (_) {
        e = {};
      }
      throw new Clawmux.ApiError(resp.status, e.code, e.message);
    }
    setStreamState(stream.ended ? "ended" : "live");
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let m;
      while ((m = /\r\n\r\n|\n\n|\r\r/.exec(buf))) {
        onBlock(buf.slice(0, m.index));
        buf = buf.slice(m.index + m[0].length);
      }
    }
  }

  async function follow() {
    if (stream.running) return;
    stream.running = true;
    let delay = RETRY_MIN_MS;
    while (!stream.ended) {
      try {
        await readOnce();
        delay = RETRY_MIN_MS;
      } catch (e) {
        if (e.status === 401 || e.status === 403 || e.status === 404) {
          setStreamState("stopped");
          if (e.status !== 401) showError("Cannot follow the run: " + e.message);
          break;
        }
      }
      if (stream.ended) break;
      // Dropped (network, a proxy, clawmux restarting): re-attach after the last event seen.
      stream.reconnects += 1;
      setStreamState("reconnecting");
      await sleep(delay);
      delay = Math.min(delay * 2, RETRY_MAX_MS);
    }
    if (stream.ended) setStreamState("ended");
    stream.running = false;
  }

  async function abort() {
    $("abort").disabled = true;
    try {
      const r = await api(path + "/abort", { method: "POST" });
      if (!r.aborted) refresh();
    } catch (e) {
      showError("Cannot abort: " + e.message);
    } finally {
      $("abort").disabled = false;
    }
  }

  async function start() {
    await refresh();
    follow();
  }

  document.addEventListener("DOMContentLoaded", () => {
    setText("run-id", runId);
    document.title = "clawmux · run " + runId;
    initAuth(start);
    $("abort").addEventListener("click", abort);
    if (!runId) {
      showError("No run id: open a run from the runs table.");
      return;
    }
    start();
    // While the run is live: its usage, status and LLM calls move. Stops once it has ended.
    const timer = setInterval(() => {
      if (finished && stream.ended) clearInterval(timer);
      else refresh();
    }, REFRESH_MS);
  });
})();
