"use strict";
// What the runs page and a run's page share: the token, calls to /v1/*, and building the page
// from data. Data only ever becomes text (textContent, text nodes) or a checked attribute; no
// string of data is ever parsed as HTML.

const Clawmux = (() => {
  const TOKEN_KEY = "clawmux.token";

  // The token lives in this tab only (sessionStorage): not in a cookie, a URL or localStorage.
  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  function setToken(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const t = token();
    if (t) h.Authorization = "Bearer " + t;
    return h;
  }

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message || "HTTP " + status);
      this.status = status;
      this.code = code || "";
    }
  }

  // Calls the API; answers its JSON, or throws an ApiError with the error shape's code and message.
  async function api(path, options) {
    const opts = options || {};
    const init = { method: opts.method || "GET", headers: headers(opts.headers), cache: "no-store", credentials: "omit" };
    if (opts.body !== undefined) {
      init.body = JSON.stringify(opts.body);
      init.headers["Content-Type"] = "application/json";
    }
    const resp = await fetch(path, init);
    let body = null;
    try {
      body = await resp.json();
    } catch (_) {
      body = null;
    }
    if (!resp.ok) {
      const e = (body && body.error) || {};
      if (resp.status === 401) askForToken(e.message);
      throw new ApiError(resp.status, e.code, e.message);
    }
    return body;
  }

  // el("a", {href: "/ui/", class: "x", text: "label"}, child, "more text"): strings become text.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "text") node.textContent = String(v);
      else if (k === "class") node.className = v;
      else if (k === "data") Object.assign(node.dataset, v);
      else node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c !== undefined && c !== null) node.append(c);
    }
    return node;
  }

  // Only http(s) URLs become links (a `javascript:` URL in a relay result must stay text).
  function safeUrl(value) {
    try {
      const u = new URL(String(value));
      return u.protocol === "https:" || u.protocol === "http:" ? u.href : null;
    } catch (_) {
      return null;
    }
  }

  function runLink(runId) {
    return el("a", { href: "/ui/run?id=" + encodeURIComponent(runId), class: "run-id", text: runId });
  }

  function fmtTime(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleString();
  }

  function fmtDuration(ms) {
    if (ms === null || ms === undefined || isNaN(ms) || ms < 0) return "";
    if (ms < 1000) return ms + " ms";
    const s = ms / 1000;
    if (s < 60) return s.toFixed(1) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min " + Math.round(s % 60) + " s";
    return Math.floor(m / 60) + " h " + (m % 60) + " min";
  }

  // A run's duration: to its end, or so far.
  function runDuration(doc) {
    const start = Date.parse(doc.createdAt);
    const end = doc.finishedAt ? Date.parse(doc.finishedAt) : Date.now();
    return fmtDuration(end - start);
  }

  function statusBadge(status) {
    return el("span", { class: "status status-" + String(status).replace(/[^a-z_]/g, ""), text: status });
  }

  function showError(message) {
    const box = document.getElementById("error");
    if (!box) return;
    box.textContent = message || "";
    box.hidden = !message;
  }

  let onToken = null;

  function askForToken(message) {
    const form = document.getElementById("token-form");
    if (!form) return;
    form.hidden = false;
    const why = document.getElementById("token-why");
    if (why) why.textContent = message || "";
    document.getElementById("token").focus();
  }

  // Wires the token form and the "forget token" button; `reload` runs once a token is entered.
  function initAuth(reload) {
    onToken = reload;
    const form = document.getElementById("token-form");
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = document.getElementById("token");
      setToken(input.value.trim());
      input.value = "";
      form.hidden = true;
      showError("");
      updateAuthState();
      if (onToken) onToken();
    });
    document.getElementById("forget-token").addEventListener("click", () => {
      setToken("");
      updateAuthState();
      askForToken("");
    });
    updateAuthState();
  }

  function updateAuthState() {
    const forget = document.getElementById("forget-token");
    if (forget) forget.hidden = !token();
  }

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  return { api, headers, ApiError, el, safeUrl, runLink, fmtTime, fmtDuration, runDuration, statusBadge, showError, initAuth, sleep };
})();
