"use strict";
// The runs table: GET /v1/runs with the filters and cursor of this page's URL (so a filtered
// view or a page can be linked and the back button works).

(() => {
  const { api, el, safeUrl, runLink, fmtTime, runDuration, statusBadge, showError, initAuth } = Clawmux;
  const FILTERS = ["status", "billingAccountId", "stateKey", "since", "limit"];
  // While the page shows a live run, it re-reads the page this often (and stops when none is).
  const LIVE_REFRESH_MS = 3000;
  let timer = null;

  function query() {
    return new URLSearchParams(location.search);
  }

  // datetime-local shows local time; the API takes RFC 3339.
  function toLocalInput(iso) {
    const d = new Date(iso);
    if (isNaN(d)) return "";
    const pad = (n) => String(n).padStart(2, "0");
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + "T" + pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  function fillForm(q) {
    const form = document.getElementById("filters");
    for (const name of FILTERS) {
      const v = q.get(name);
      if (v === null) continue;
      form.elements[name].value = name === "since" ? toLocalInput(v) : v;
    }
  }

  function go(params) {
    const s = params.toString();
    location.assign("/ui/" + (s ? "?" + s : ""));
  }

  function applyFilters(ev) {
    ev.preventDefault();
    const form = document.getElementById("filters");
    const p = new URLSearchParams();
    for (const name of FILTERS) {
      let v = form.elements[name].value.trim();
      if (!v) continue;
      if (name === "since") v = new Date(v).toISOString();
      if (name === "limit" && v === "50") continue;
      p.set(name, v);
    }
    go(p);
  }

  function tokens(doc) {
    const u = doc.usage;
    if (!u) return "";
    return u.inputTokens + " / " + u.outputTokens + (u.source === "gateway" ? " (gateway)" : "");
  }

  function branchCell(doc) {
    const td = el("td", { class: "branch" });
    const relay = doc.relay || {};
    const branch = relay.branch || doc.branch;
    if (branch) td.append(el("code", { text: branch }));
    const pr = safeUrl(relay.prUrl);
    if (pr) {
      td.append(" ", el("a", { href: pr, rel: "noopener noreferrer", target: "_blank", class: "pr", text: relay.prNumber ? "PR #" + relay.prNumber : "PR" }));
    }
    if (relay.error) td.append(" ", el("span", { class: "relay-error", title: String(relay.error.message || ""), text: "relay failed" }));
    return td;
  }

  function row(doc) {
    const model = doc.model ? el("code", { text: doc.model }) : el("span", { class: "muted", text: "default" });
    return el(
      "tr",
      { data: { runId: doc.runId, status: doc.status } },
      el("td", {}, statusBadge(doc.status)),
      el("td", {}, runLink(doc.runId)),
      el("td", { class: "account", text: doc.billingAccountId }),
      el("td", { text: doc.agentId }),
      el("td", {}, model),
      el("td", { title: doc.createdAt, text: fmtTime(doc.createdAt) }),
      el("td", { class: "num", text: runDuration(doc) }),
      el("td", { class: "num", text: tokens(doc) }),
      el("td", { class: "num", text: doc.usage ? doc.usage.llmCalls : "" }),
      branchCell(doc),
    );
  }

  async function load() {
    const q = query();
    const p = new URLSearchParams();
    for (const name of FILTERS.concat(["cursor"])) {
      if (q.get(name)) p.set(name, q.get(name));
    }
    const tbody = document.querySelector("#runs tbody");
    try {
      const page = await api("/v1/runs" + (p.toString() ? "?" + p : ""));
      tbody.replaceChildren(...page.runs.map(row));
      document.getElementById("empty").hidden = page.runs.length > 0;
      const next = document.getElementById("next-page");
      next.disabled = !page.nextCursor;
      next.dataset.cursor = page.nextCursor || "";
      document.getElementById("first-page").disabled = !q.get("cursor");
      document.getElementById("page-info").textContent = page.runs.length + " run" + (page.runs.length === 1 ? "" : "s") + (q.get("cursor") ? " (later page)" : "");
      showError("");
      clearTimeout(timer);
      if (page.runs.some((r) => r.status === "queued" || r.status === "running")) timer = setTimeout(load, LIVE_REFRESH_MS);
    } catch (e) {
      tbody.replaceChildren();
      showError(e.status === 401 ? "" : "Cannot list runs: " + e.message);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    fillForm(query());
    initAuth(load);
    document.getElementById("filters").addEventListener("submit", applyFilters);
    document.getElementById("reset").addEventListener("click", () => go(new URLSearchParams()));
    document.getElementById("refresh").addEventListener("click", load);
    document.getElementById("next-page").addEventListener("click", (ev) => {
      const p = query();
      p.set("cursor", ev.target.dataset.cursor);
      go(p);
    });
    document.getElementById("first-page").addEventListener("click", () => {
      const p = query();
      p.delete("cursor");
      go(p);
    });
    load();
  });
})();
