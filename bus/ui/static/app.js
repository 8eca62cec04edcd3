// agent-bus live view: plain JavaScript, no dependencies. Events arrive as Server-Sent Events
// (`/events`, id = the event's seq), are folded into `state`, and the page is redrawn at most
// every REDRAW_MS, so a fast stream costs one redraw per interval, not one per event.
"use strict";

const REDRAW_MS = 200;
const MAX_DETAILED_RUNS = 300;
const MAX_LANES = 100; // older finished runs keep their lane but drop bars and transcript
// Past this many runs the oldest finished top-level runs (with their sub-agent runs) are
// forgotten: the totals keep counting them, so a page left open for hours stays the same size.
const MAX_KEPT_RUNS = 1000;
const MAX_SESSIONS = 5000; // per agent; past it the set restarts (the count goes on)

const state = {
  lastSeq: 0, lastTs: 0, shownSeq: 0, shownTs: 0, peers: new Map(), services: new Map(), agents: new Map(), runs: new Map(),
  order: [], totals: { runs: 0, input: 0, output: 0, cost: 0, stops: {} }, experiments: new Map(),
  status: null, selected: null, filter: { agent: "", experiment: "", run: "", type: "" },
  types: new Set(), // every event type seen: the type filter's suggestions

};

function text(content) {
  return (content || []).filter((p) => p.type === "text").map((p) => p.text).join("");
}

function run(ev) {
  let r = state.runs.get(ev.run_id);
  if (!r) {
    r = { id: ev.run_id, agent: ev.agent, parent: ev.parent || "", start: ev.ts, end: null,
          stop: "", experiment: ev.experiment || "", session: "", chats: [], tools: new Map(),
          transcript: [], children: [], detailed: true, types: new Set() };
    state.runs.set(r.id, r);
    state.order.push(r.id);
    const parent = state.runs.get(r.parent);
    if (parent) parent.children.push(r.id);
  }
  return r;
}

function noteType(ev) {
  // The type filter shows runs with an event of the type; a run keeps the set of its types.
  if (!state.types.has(ev.type)) {
    state.types.add(ev.type);
    document.getElementById("event-types").append(el("option", { value: ev.type }));
  }
  const r = ev.run_id ? state.runs.get(ev.run_id) : null;
  if (r) r.types.add(ev.type);
}

// The event types behind each kind of drawn item: the type filter keeps the items whose events
// match it (a model call's bar: message_* and llm_retry; a tool call's: tool_execution_*).
// Every billed model call counts in the totals, as in `busctl export` (bus/events.py `billed`).
function bill(r, u) {
  for (const t of [state.totals, experiment(r.experiment)]) {
    t.input += u.input || 0; t.output += u.output || 0; t.cost += u.cost || 0;
  }
}

const CHAT_TYPES = ["message_start", "message_update", "message_end", "llm_retry"];
const TOOL_TYPES = ["tool_execution_start", "tool_execution_update", "tool_execution_end"];
const TRANSCRIPT_TYPES = { user: ["message_start"], assistant: ["message_end"],
                           tool: ["tool_execution_end"] };

function typeMatches(types) {
  const f = state.filter.type;
  return !f || [...types].some((t) => t.includes(f));
}

function experiment(name) {
  const key = name || "(none)";
  if (!state.experiments.has(key)) {
    state.experiments.set(key, { runs: 0, input: 0, output: 0, cost: 0 });
  }
  return state.experiments.get(key);
}

const handlers = {
  peer_joined(ev) { state.peers.set(ev.peer, ev.name || ev.peer); },
  peer_left(ev) { state.peers.delete(ev.peer); },
  service_registered(ev) { state.services.set(ev.service + "@" + ev.peer, ev); },
  service_removed(ev) { state.services.delete(ev.service + "@" + ev.peer); },
  agent_start(ev) {
    const r = run(ev);
    r.start = ev.ts; r.session = ev.session || "";
    state.totals.runs += 1;
    experiment(r.experiment).runs += 1;
    const a = state.agents.get(ev.agent) || { runs: 0, live: 0, sessions: new Set(), nsessions: 0 };
    a.runs += 1; a.live += 1;
    if (r.session && !a.sessions.has(r.session)) {
      a.nsessions += 1; a.sessions.add(r.session);
      if (a.sessions.size > MAX_SESSIONS) a.sessions.clear();
    }
    state.agents.set(ev.agent, a);
  },
  message_start(ev) {
    const r = run(ev);
    if (ev.message.role === "assistant") {
      r.chats.push({ start: ev.ts, end: null, model: ev.message.model || "", text: "" });
    } else if (ev.message.role !== "tool_result") { // results are shown from tool_execution_end
      r.transcript.push({ role: ev.message.role, text: text(ev.message.content) });
    }
  },
  message_update(ev) {
    const chat = run(ev).chats.at(-1);
    if (chat && chat.end === null && ev.delta && ev.delta.kind === "text") chat.text += ev.delta.delta;
  },
  message_end(ev) {
    const r = run(ev);
    const m = ev.message;
    if (m.role !== "assistant") return;
    const chat = r.chats.findLast((c) => c.end === null);
    if (chat) { chat.end = ev.ts; chat.error = !!m.error; }
    const calls = (m.content || []).filter((p) => p.type === "tool_call");
    const u = m.usage || {};
    r.transcript.push({ role: "assistant", text: text(m.content), calls, usage: u, model: m.model });
    bill(r, u);
  },
  llm_retry(ev) {
    const chat = run(ev).chats.at(-1);
    if (chat && chat.end === null) { chat.retries = (chat.retries || 0) + 1; chat.text = ""; }
    bill(run(ev), ev.usage || {});  // the failed attempt was billed too
  },
  compaction_complete(ev) {
    bill(run(ev), ev.usage || {});  // the summary call (its text is not the run's)
  },
  tool_execution_start(ev) {
    run(ev).tools.set(ev.tool_call_id, { name: ev.tool_name, start: ev.ts, end: null, error: false });
  },
  tool_execution_end(ev) {
    const r = run(ev);
    const t = r.tools.get(ev.tool_call_id);
    if (t) { t.end = ev.ts; t.error = ev.is_error; }
    r.transcript.push({ role: "tool", name: ev.tool_name, error: ev.is_error,
                        text: text(ev.result && ev.result.content) });
  },
  agent_end(ev) {
    const r = run(ev);
    r.end = ev.ts; r.stop = ev.stop_reason || "stop";
    state.totals.stops[r.stop] = (state.totals.stops[r.stop] || 0) + 1;
    const a = state.agents.get(ev.agent);
    if (a) a.live = Math.max(0, a.live - 1);
    collapseOld();
  },
};

function collapseOld() {
  const finished = state.order.filter((id) => {
    const r = state.runs.get(id);
    return r.end !== null && r.detailed;
  });
  for (const id of finished.slice(0, Math.max(0, finished.length - MAX_DETAILED_RUNS))) {
    const r = state.runs.get(id);
    r.detailed = false; r.chats = []; r.tools = new Map(); r.transcript = [];
  }
  if (state.order.length > MAX_KEPT_RUNS * 1.25) forgetOld();
}

function forgetOld() {
  // Whole trees only, oldest first, and only finished ones: a live run is never forgotten.
  const gone = new Set();
  const drop = (id) => {
    const r = state.runs.get(id);
    if (!r || gone.has(id)) return;
    gone.add(id);
    r.children.forEach(drop);
  };
  for (const id of state.order) {
    if (state.order.length - gone.size <= MAX_KEPT_RUNS) break;
    const r = state.runs.get(id);
    if (r.end !== null && (!r.parent || !state.runs.has(r.parent))) drop(id);
  }
  for (const id of gone) state.runs.delete(id);
  state.order = state.order.filter((id) => !gone.has(id));
  state.forgotten = (state.forgotten || 0) + gone.size;
}

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const kid of kids) node.append(kid);
  return node;
}

function bar(kind, item, t0, span, label, row) {
  const end = item.end === null ? Date.now() / 1000 : item.end;
  const left = ((item.start - t0) / span) * 100;
  const width = Math.max(((end - item.start) / span) * 100, 0.2);
  const cls = `bar ${kind}${item.error ? " error" : ""}${item.end === null ? " open" : ""}`;
  const node = el("div", { class: cls, title: `${label} ${(end - item.start).toFixed(3)} s`,
                           "data-row": String(row), "data-start": String(item.start),
                           "data-end": String(end) }, label);
  node.style.left = left + "%"; node.style.width = width + "%";
  return node;
}

function toolRows(tools) {
  // Parallel calls overlap in time: each goes on the first row free at its start.
  const rows = [];
  for (const [id, t] of [...tools.entries()].sort((a, b) => a[1].start - b[1].start)) {
    const end = t.end === null ? Infinity : t.end;
    let row = rows.findIndex((r) => r.free <= t.start);
    if (row < 0) { row = rows.length; rows.push({ free: end, items: [] }); }
    rows[row].free = end;
    rows[row].items.push([id, t]);
  }
  return rows;
}

function lane(r, t0, span) {
  const title = el("div", { class: "lane-title" }, `${r.agent} · ${r.id.slice(0, 8)}`,
                   el("span", { class: "stop" }, r.end === null ? "running" : r.stop));
  const node = el("div", { class: "lane" + (state.selected === r.id ? " selected" : ""),
                           "data-run": r.id, "data-agent": r.agent, "data-parent": r.parent }, title);
  const chats = el("div", { class: "track chats" });
  if (typeMatches(CHAT_TYPES)) r.chats.forEach((c) => {
    // the text streams into the bar as it arrives; retries of the call are marked ↻N
    const label = (c.retries ? `↻${c.retries} ` : "") + (c.model || "model")
      + (c.text ? ": " + c.text.slice(-60) : "");
    const b = bar("chat" + (c.retries ? " retry" : ""), c, t0, span, label, 0);
    if (c.retries) b.setAttribute("data-retries", String(c.retries));
    chats.append(b);
  });
  node.append(chats);
  toolRows(typeMatches(TOOL_TYPES) ? r.tools : new Map()).forEach((row, i) => {
    const track = el("div", { class: "track tools" });
    for (const [id, t] of row.items) {
      const b = bar("tool", t, t0, span, t.name, i);
      b.setAttribute("data-tool", t.name); b.setAttribute("data-call", id);
      track.append(b);
    }
    node.append(track);
  });
  const kids = el("div", { class: "children" });
  r.children.forEach((id) => kids.append(lane(state.runs.get(id), t0, span)));
  node.append(kids);
  node.addEventListener("click", (e) => { e.stopPropagation(); state.selected = r.id; redraw(); });
  return node;
}

function shown(r) {
  const f = state.filter;
  return (!f.agent || r.agent.includes(f.agent)) && (!f.run || r.id.startsWith(f.run))
    && (!f.experiment || r.experiment.includes(f.experiment)) && (!f.type || treeHasType(r));
}

function treeHasType(r) {
  // A top-level run is shown when it or one of its sub-agent runs had an event of the type.
  if (typeMatches(r.types)) return true;
  return r.children.some((id) => state.runs.has(id) && treeHasType(state.runs.get(id)));
}

function renderTimeline() {
  const roots = state.order.map((id) => state.runs.get(id))
    .filter((r) => (!r.parent || !state.runs.has(r.parent)) && shown(r));
  const starts = roots.slice(-MAX_LANES).map((r) => r.start);
  const t0 = Math.min(...starts, Date.now() / 1000);
  let t1 = t0 + 1e-3; // a loop, not Math.max(...all): the spread of a huge array overflows
  for (const r of state.runs.values()) t1 = Math.max(t1, r.end || Date.now() / 1000);
  // Only the newest MAX_LANES top-level runs are drawn: a redraw stays cheap however long the
  // page is open; the totals still count every run.
  const hidden = Math.max(0, roots.length - MAX_LANES);
  const box = document.getElementById("timeline");
  const lanes = roots.slice(hidden).map((r) => lane(r, t0, t1 - t0));
  if (hidden) lanes.unshift(el("div", { class: "older" }, `${hidden} older runs not drawn`));
  box.replaceChildren(...lanes);
}

function renderList(id, items) {
  document.getElementById(id).replaceChildren(...items.map((t) => el("li", {}, t)));
}

function renderTranscript() {
  const r = state.runs.get(state.selected);
  const body = document.getElementById("transcript-body");
  if (!r) return;
  const head = el("div", { class: "msg" }, `${r.agent} run ${r.id} · session ${r.session} · `
                  + `experiment ${r.experiment || "-"} · ${r.stop || "running"}`);
  const kept = r.transcript.filter((m) => typeMatches(TRANSCRIPT_TYPES[m.role] || ["message_start"]));
  const msgs = kept.map((m) => {
    const parts = [el("span", { class: "role" }, m.role + (m.name ? ` ${m.name}` : "") + ": "),
                   m.text || ""];
    for (const c of m.calls || []) parts.push(`\n→ ${c.name}(${c.arguments})`);
    if (m.usage) parts.push(`\n[${m.model} in ${m.usage.input || 0} out ${m.usage.output || 0}`
                            + ` $${(m.usage.cost || 0).toFixed(4)}]`);
    return el("div", { class: "msg", "data-role": m.role }, ...parts);
  });
  body.replaceChildren(head, ...msgs);
}

function renderTotals() {
  const t = state.totals;
  const rows = [["runs", t.runs], ["input", t.input], ["output", t.output],
                ["cost", "$" + t.cost.toFixed(4)],
                ...Object.entries(t.stops).map(([k, v]) => ["stop:" + k, v]),
                ...[...state.experiments.entries()].map(([k, e]) => ["exp:" + k,
                  `${e.runs} runs, ${e.input}/${e.output} tok, $${e.cost.toFixed(4)}`])];
  document.querySelector("#totals tbody").replaceChildren(...rows.map(([k, v]) =>
    el("tr", { "data-key": k }, el("th", {}, k), el("td", {}, String(v)))));
}

let pending = false;
function redraw() {
  pending = false;
  renderTimeline();
  renderTranscript();
  renderTotals();
  if (state.status) { // the hub's polled status: load and queues per service, peers by role
    renderList("services", state.status.services.map((s) =>
      `${s.name}: ${s.load || 0}/${s.capacity} busy, ${s.queued || 0} queued, ${s.peers} peers`));
    renderList("peers", state.status.peers.map((p) => `${p.name} (${p.role || "peer"})`));
  } else {
    renderList("peers", [...state.peers.values()]);
    renderList("services", [...state.services.values()].map((s) => `${s.service} ×${s.capacity || 1}`));
  }
  renderList("agents", [...state.agents.entries()].map(([n, a]) =>
    `${n}: ${a.live} live, ${a.runs} runs, ${a.nsessions} sessions`));
  document.getElementById("seq").textContent = `seq ${state.lastSeq}`;
  state.shownSeq = state.lastSeq; state.shownTs = state.lastTs; // what the page shows now
}

function schedule() {
  if (!pending) { pending = true; setTimeout(redraw, REDRAW_MS); }
}

function connect() {
  const source = new EventSource("/events");
  source.onopen = () => { document.getElementById("status").textContent = "live"; };
  source.onerror = () => { document.getElementById("status").textContent = "reconnecting…"; };
  source.addEventListener("status", (msg) => { state.status = JSON.parse(msg.data); schedule(); });
  source.onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    if (ev.seq <= state.lastSeq) return; // a replayed duplicate after a reconnect
    state.lastSeq = ev.seq; state.lastTs = ev.ts;
    const handle = handlers[ev.type];
    if (handle) handle(ev);
    noteType(ev);
    schedule();
  };
}

for (const key of Object.keys(state.filter)) {
  document.getElementById("filter-" + key).addEventListener("input", (e) => {
    state.filter[key] = e.target.value.trim();
    redraw();
  });
}
connect();
