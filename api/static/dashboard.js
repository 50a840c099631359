// fedweave node dashboard.
//
// Data comes from GET /v1/dashboard (one JSON snapshot) and, live, from the run's
// server-sent events GET /v1/runs/{id}/events, read with fetch() and a streamed body
// so that the bearer token travels in the Authorization header (EventSource cannot
// send headers). Every string from the server may come from a peer: it is only ever
// set with textContent or as an SVG text node, never parsed as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "fedweave.dashboard.token";
  const POLL_MS = 3000;
  const TERMINAL = new Set(["completed", "failed", "aborted", "declined", "cancelled"]);
  const ROUND_TEXT = {
    completed: "done", running: "running", paused: "paused", failed: "failed",
    aborted: "aborted", not_run: "not reached", upcoming: "to come",
  };
  const SVG_NS = "http://www.w3.org/2000/svg";

  let stream = null; // {runId, controller}
  let pollTimer = null;
  let refreshTimer = null;
  let shownRun = null; // the run the banner's links point at: {key, href}

  // -- DOM helpers (text only) -------------------------------------------------------

  function $(id) {
    return document.getElementById(id);
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function facts(dl, pairs) {
    dl.replaceChildren();
    for (const [k, v] of pairs) {
      dl.append(el("dt", k), el("dd", v === null || v === undefined ? "—" : v));
    }
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return "—";
    return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
  }

  function fmtBytes(b) {
    if (b === null || b === undefined) return "—";
    if (b >= 1 << 20) return (b / (1 << 20)).toFixed(1) + " MiB";
    if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + " KiB";
    return b + " B";
  }

  // -- authentication ----------------------------------------------------------------

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  class Unauthorized extends Error {}

  async function api(path) {
    const t = token();
    if (!t) throw new Unauthorized("no token");
    const res = await fetch(path, {
      headers: { Authorization: "Bearer " + t, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
    if (res.status === 401 || res.status === 403) throw new Unauthorized("HTTP " + res.status);
    if (!res.ok) throw new Error(path + " answered HTTP " + res.status);
    return res.json();
  }

  function showLogin(message) {
    stopStream();
    if (pollTimer) clearInterval(pollTimer);
    pollTimer = null;
    $("dashboard").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    setLive("off", "offline");
  }

  function showDashboard() {
    $("login").hidden = true;
    $("dashboard").hidden = false;
    $("logout").hidden = false;
    if (!pollTimer) pollTimer = setInterval(() => refresh(), POLL_MS);
  }

  function setLive(state, text) {
    const pill = $("live-status");
    pill.dataset.state = state;
    pill.textContent = text;
  }

  // -- snapshot ----------------------------------------------------------------------

  async function refresh() {
    let data;
    try {
      data = await api("/v1/dashboard");
    } catch (err) {
      if (err instanceof Unauthorized) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin(err.message === "no token" ? "" : "That token was not accepted.");
        return;
      }
      setLive("error", "connection lost");
      return;
    }
    showDashboard();
    render(data);
    follow(data.run);
  }

  function scheduleRefresh() {
    if (refreshTimer) return;
    refreshTimer = setTimeout(() => {
      refreshTimer = null;
      refresh();
    }, 250);
  }

  function render(d) {
    const node = d.node;
    $("node-name").textContent = node.org_id + (node.display_name ? " · " + node.display_name : "");
    facts($("node-facts"), [
      ["Org", node.org_id],
      ["Name", node.display_name],
      ["Version", node.version],
      ["Ready", node.ready ? "yes" : "no"],
      ["Federation", d.federation ? d.federation.name + " v" + d.federation.version : "none"],
      ["Members", d.federation ? d.federation.members : null],
    ]);
    const run = d.run;
    facts($("run-facts"), run ? [
      ["Name", run.name],
      ["Key", run.run_key],
      ["Origin", run.origin],
      ["State", run.state],
      ["Round", run.current_round + (run.rounds ? " / " + run.rounds : "")],
      ["ε budget", run.epsilon],
      ["Consents", consentText(run)],
    ] : [["Run", "none yet"]]);
    $("run-facts").dataset.round = run ? String(run.current_round) : "";
    $("run-facts").dataset.state = run ? run.state : "";
    $("run-facts").dataset.key = run && run.run_key ? run.run_key : "";
    renderRunBanner(run);
    renderRoundStates(run);
    const a = d.audit;
    facts($("audit-facts"), [
      ["Entries", a.events],
      ["Chain", a.ok ? "intact" : "BROKEN" + (a.first_bad_entry ? " at entry " + a.first_bad_entry : "")],
      ["Head", a.head ? a.head.slice(0, 16) + "…" : null],
      ["Checked", a.checked + " newest entries"],
    ]);
    $("audit-facts").dataset.ok = a.ok ? "true" : "false";
    renderCulprit(d.culprit);
    renderPeers(d.node, d.peers);
    renderTimeline(d.timeline);
    renderCharts(d.metrics);
    renderCheckpoints(d.checkpoints);
  }

  function consentText(run) {
    const decided = new Map((run.consents || []).map((c) => [c.org_id, c.decision]));
    const orgs = (run.participants || []).slice();
    for (const org of decided.keys()) if (!orgs.includes(org)) orgs.push(org);
    if (!orgs.length) return null;
    return orgs.map((org) => org + ": " + (decided.get(org) || "pending")).join(", ");
  }

  function renderRunBanner(run) {
    const box = $("run-banner");
    if (!run) {
      box.hidden = true;
      shownRun = null;
      return;
    }
    const key = run.run_key || run.id;
    if (!shownRun || shownRun.key !== key) {
      $("run-json").hidden = true;
      $("run-json").textContent = "";
    }
    shownRun = { key, href: run.href };
    box.hidden = false;
    box.dataset.tone = run.tone || "info";
    box.dataset.state = run.state;
    $("run-banner-state").textContent = "Run " + run.name + (run.run_key ? " (" + run.run_key.slice(0, 12) + ")" : "") + ":";
    $("run-banner-text").textContent = run.headline;
    const reason = run.state_reason || run.decision_reason || "";
    const waiting = run.waiting;
    const lines = [];
    if (reason) lines.push(reason);
    if (waiting && waiting.what === "round") {
      lines.push(waiting.detail + (waiting.since ? " (since " + new Date(waiting.since).toLocaleString() + ")" : ""));
    } else if (waiting) {
      lines.push("Waiting for " + waiting.what + (waiting.orgs.length ? " of " + waiting.orgs.join(", ") : "") +
        (waiting.until ? " until " + new Date(waiting.until).toLocaleString() : "") +
        (waiting.detail ? ": " + waiting.detail : ""));
    }
    $("run-reason-text").textContent = lines.length ? lines.join("\n") : "No reason recorded.";
    $("run-reason-link").hidden = !reason && !waiting;
    $("run-json-link").setAttribute("href", run.href);
  }

  async function showRunJson() {
    if (!shownRun) return;
    const want = shownRun.key;
    $("run-reason").open = true;
    const pre = $("run-json");
    pre.hidden = false;
    pre.textContent = "loading…";
    try {
      const data = await api(shownRun.href);
      if (shownRun && shownRun.key === want) pre.textContent = JSON.stringify(data, null, 2);
    } catch (err) {
      pre.textContent = "Could not load the run record: " + err.message;
    }
  }

  function renderRoundStates(run) {
    const box = $("run-rounds");
    const states = run && run.round_states ? run.round_states : [];
    box.replaceChildren(...states.map((r) => {
      const span = el("span", r.round + " " + (ROUND_TEXT[r.state] || r.state), "rs rs-" + r.state.replace(/[^a-z_]/g, ""));
      span.dataset.round = String(r.round);
      span.dataset.state = r.state;
      span.title = "round " + r.round + ": " + (ROUND_TEXT[r.state] || r.state);
      return span;
    }));
  }

  function renderCulprit(c) {
    const box = $("culprit");
    if (!c) {
      box.hidden = true;
      box.dataset.org = "";
      return;
    }
    box.hidden = false;
    box.dataset.org = c.org;
    $("culprit-text").textContent =
      c.org + " (score " + c.score + ") in round " + (c.label || c.round) + (c.run ? " of " + c.run : "");
    const ul = $("culprit-evidence");
    ul.replaceChildren(...c.evidence.map((e) => el("li", e)));
  }

  function renderPeers(me, peers) {
    const body = $("peers-table").tBodies[0];
    body.replaceChildren();
    for (const p of peers) {
      const tr = el("tr");
      tr.dataset.org = p.org_id;
      tr.dataset.status = p.status;
      tr.append(
        el("td", p.org_id, "mono"),
        el("td", p.display_name),
        el("td", p.status, "status status-" + p.status.replace(/[^a-z]/g, "")),
        el("td", p.latency_ms === null ? "—" : p.latency_ms.toFixed(1) + " ms"),
        el("td", p.last_seen_s_ago === null ? "—" : p.last_seen_s_ago.toFixed(1) + " s ago"),
        el("td", fmtBytes(p.bytes_received)),
        el("td", p.score ? p.score.toFixed(1) : "0"),
      );
      body.append(tr);
    }
    drawTopology(me, peers);
  }

  function drawTopology(me, peers) {
    const W = 420, H = 300, cx = W / 2, cy = H / 2, r = 110;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H });
    const n = Math.max(peers.length, 1);
    const spots = peers.map((p, i) => {
      const angle = -Math.PI / 2 + (2 * Math.PI * i) / n;
      return { p, x: cx + r * Math.cos(angle), y: cy + r * Math.sin(angle) };
    });
    for (const s of spots) {
      root.append(svg("line", { x1: cx, y1: cy, x2: s.x, y2: s.y, class: "link link-" + s.p.status }));
      const label = (s.p.latency_ms === null ? "" : s.p.latency_ms.toFixed(1) + " ms ") + fmtBytes(s.p.bytes_received);
      root.append(svg("text", { x: (cx + s.x) / 2, y: (cy + s.y) / 2 - 4, class: "link-label" }, label));
    }
    root.append(svg("circle", { cx, cy, r: 22, class: "node node-self" }));
    root.append(svg("text", { x: cx, y: cy + 38, class: "node-label" }, me.org_id));
    for (const s of spots) {
      const g = svg("g", { class: "peer", "data-org": s.p.org_id });
      g.append(svg("circle", { cx: s.x, cy: s.y, r: 16, class: "node node-" + s.p.status }));
      g.append(svg("text", { x: s.x, y: s.y + 30, class: "node-label" }, s.p.org_id));
      g.append(svg("title", {}, s.p.org_id + ": " + s.p.status));
      root.append(g);
    }
    $("topology").replaceChildren(root);
  }

  function renderTimeline(rounds) {
    const box = $("timeline");
    if (!rounds || !rounds.length) {
      box.replaceChildren(el("p", "No round observed yet.", "muted"));
      return;
    }
    const parts = [];
    for (const rd of rounds.slice().reverse()) {
      const card = el("div", null, "round round-" + rd.state);
      card.dataset.round = String(rd.round);
      card.dataset.state = rd.state;
      const head = el("h3", "Round " + (rd.label || rd.round) + " · " + rd.state +
        (rd.seconds !== null ? " · " + fmtSeconds(rd.seconds) : "") +
        (rd.bytes_sent ? " · " + fmtBytes(rd.bytes_sent) + " sent" : ""));
      card.append(head);
      if (rd.failure) card.append(el("p", "Failed at " + rd.failure, "error"));
      if (rd.note) card.append(el("p", "Not finished: " + rd.note, "warn"));
      if (rd.culprit) card.append(el("p", "Likely culprit: " + rd.culprit.org + " — " + rd.culprit.evidence.join("; "), "warn"));
      if (rd.dropped.length) card.append(el("p", "Dropped: " + rd.dropped.join(", ")));
      card.append(stageBar(rd.stages));
      card.append(peerGrid(rd));
      parts.push(card);
    }
    box.replaceChildren(...parts);
  }

  function stageBar(stages) {
    const W = 640, H = 26;
    const total = stages.reduce((acc, s) => acc + s.seconds, 0) || 1;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "stagebar" });
    let x = 0;
    stages.forEach((s, i) => {
      const w = Math.max(1, (s.seconds / total) * W);
      const rect = svg("rect", { x, y: 0, width: w, height: H, class: "stage stage-" + (i % 6) });
      rect.append(svg("title", {}, s.stage + ": " + fmtSeconds(s.seconds) + ", " + fmtBytes(s.bytes) + " sent"));
      root.append(rect);
      if (w > 50) root.append(svg("text", { x: x + 4, y: 17, class: "stage-label" }, s.stage));
      x += w;
    });
    return root;
  }

  function peerGrid(rd) {
    const stages = [];
    for (const cells of Object.values(rd.peers)) {
      for (const s of Object.keys(cells)) if (!stages.includes(s)) stages.push(s);
    }
    const table = el("table", null, "grid");
    const hr = el("tr");
    hr.append(el("th", "Peer"), ...stages.map((s) => el("th", s)));
    table.append(el("thead"));
    table.tHead.append(hr);
    const body = el("tbody");
    for (const peer of Object.keys(rd.peers).sort()) {
      const tr = el("tr");
      tr.dataset.org = peer;
      tr.append(el("td", peer, "mono"));
      for (const s of stages) {
        const c = rd.peers[peer][s];
        if (!c) {
          tr.append(el("td", ""));
          continue;
        }
        const text = c.status === "ok" ? (c.at !== undefined ? "+" + fmtSeconds(c.at) : "ok") : c.status;
        const td = el("td", text, "cell cell-" + c.status);
        if (c.detail) td.title = c.detail;
        tr.append(td);
      }
      body.append(tr);
    }
    table.append(body);
    return table;
  }

  // -- charts ------------------------------------------------------------------------

  function series(metrics, test) {
    const out = new Map();
    for (const m of metrics) {
      if (!test(m.name)) continue;
      if (!out.has(m.name)) out.set(m.name, []);
      out.get(m.name).push([m.round, m.value]);
    }
    return out;
  }

  function lineChart(target, named, bars) {
    const W = 320, H = 180, P = 30;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H });
    const all = [...named.values()].flat();
    if (!all.length) {
      root.append(svg("text", { x: W / 2, y: H / 2, class: "empty" }, "no data yet"));
      $(target).replaceChildren(root);
      return;
    }
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    const y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
    const sx = (x) => P + ((x - x0) / (x1 - x0)) * (W - 2 * P);
    const sy = (y) => H - P - ((y - y0) / (y1 - y0)) * (H - 2 * P);
    root.append(svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, class: "axis" }));
    root.append(svg("line", { x1: P, y1: P, x2: P, y2: H - P, class: "axis" }));
    root.append(svg("text", { x: 2, y: P - 6, class: "tick" }, y1.toPrecision(3)));
    root.append(svg("text", { x: W - P, y: H - 8, class: "tick" }, "round " + x1));
    let k = 0;
    for (const [name, pts] of named) {
      pts.sort((a, b) => a[0] - b[0]);
      if (bars) {
        const w = Math.max(4, (W - 2 * P) / (pts.length * 1.5));
        for (const [x, y] of pts) {
          const rect = svg("rect", { x: sx(x) - w / 2, y: sy(y), width: w, height: H - P - sy(y), class: "bar" });
          rect.append(svg("title", {}, "round " + x + ": " + fmtBytes(y)));
          root.append(rect);
        }
      } else {
        const d = pts.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
        root.append(svg("path", { d, class: "series series-" + (k % 4) }));
        root.append(svg("text", { x: W - P - 90, y: P + 12 * k, class: "legend series-" + (k % 4) }, name));
      }
      k += 1;
    }
    $(target).replaceChildren(root);
  }

  function renderCharts(metrics) {
    lineChart("chart-quality", series(metrics, (n) => /loss|acc/i.test(n)), false);
    lineChart("chart-epsilon", series(metrics, (n) => n === "epsilon_spent"), false);
    lineChart("chart-bytes", series(metrics, (n) => n === "bytes_sent"), true);
  }

  function renderCheckpoints(cps) {
    const body = $("checkpoints-table").tBodies[0];
    body.replaceChildren();
    if (!cps.length) {
      const tr = el("tr");
      const td = el("td", "No checkpoint yet.", "muted");
      td.colSpan = 5;
      tr.append(td);
      body.append(tr);
      return;
    }
    for (const c of cps) {
      const tr = el("tr");
      const shards = el("td");
      if (!c.shards.length) shards.textContent = "placement unknown";
      for (const s of c.shards) {
        shards.append(el("span", "#" + s.index + " " + s.holder + ": " + s.status, "shard shard-" + s.status));
      }
      tr.append(
        el("td", c.checkpoint_id, "mono"),
        el("td", c.round),
        el("td", c.data_shards + " + " + c.parity_shards),
        shards,
        el("td", c.restorable === null ? "unknown" : c.restorable ? "yes" : c.at_risk ? "at risk (holders suspect)" : "NO"),
      );
      body.append(tr);
    }
  }

  // -- live events (fetch-streamed SSE) ----------------------------------------------

  function stopStream() {
    if (stream) stream.controller.abort();
    stream = null;
  }

  function follow(run) {
    if (!run || TERMINAL.has(run.state)) {
      if (stream) stopStream();
      setLive("idle", run ? "run " + run.state : "no run");
      return;
    }
    if (stream && stream.runId === run.id) return;
    stopStream();
    const controller = new AbortController();
    stream = { runId: run.id, controller };
    readEvents(run.id, controller).catch(() => {
      if (stream && stream.controller === controller) {
        stream = null;
        setLive("error", "stream lost");
      }
    });
  }

  async function readEvents(runId, controller) {
    const res = await fetch("/v1/runs/" + encodeURIComponent(runId) + "/events", {
      headers: { Authorization: "Bearer " + token(), Accept: "text/event-stream" },
      cache: "no-store",
      credentials: "omit",
      signal: controller.signal,
    });
    if (res.status === 401 || res.status === 403) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("That token was not accepted.");
      return;
    }
    if (!res.ok || !res.body) throw new Error("events answered HTTP " + res.status);
    setLive("live", "live");
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        onFrame(frame);
      }
    }
    if (stream && stream.controller === controller) stream = null;
    scheduleRefresh();
  }

  function onFrame(frame) {
    let kind = "message";
    const data = [];
    for (const line of frame.split("\n")) {
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") kind = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return;
    let payload;
    try {
      payload = JSON.parse(data.join("\n"));
    } catch (e) {
      return;
    }
    const li = el("li", new Date().toLocaleTimeString() + " " + kind + " " + summarize(kind, payload));
    li.dataset.kind = kind;
    const list = $("events");
    list.prepend(li);
    while (list.children.length > 50) list.lastChild.remove();
    scheduleRefresh();
  }

  function summarize(kind, p) {
    if (kind === "round") return "round " + p.round + " done, survivors " + (p.survivors || []).join(", ");
    if (kind === "state") return "→ " + p.state;
    if (kind === "metric") return "round " + p.round;
    if (kind === "error") return String(p.message || "");
    return JSON.stringify(p).slice(0, 200);
  }

  // -- start -------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("token").value.trim();
      $("token").value = "";
      if (!value) return;
      sessionStorage.setItem(TOKEN_KEY, value);
      $("login-error").textContent = "";
      refresh();
    });
    $("run-json-link").addEventListener("click", (ev) => {
      ev.preventDefault(); // the record needs the token: fetch it and show it as text
      showRunJson();
    });
    $("run-reason-link").addEventListener("click", () => {
      $("run-reason").open = true;
    });
    $("logout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("");
    });
    if (token()) refresh();
    else showLogin("");
  });
})();
