// agent-bus live view: plain JavaScript, no dependencies. Events arrive as Server-Sent Events
// (`/events`, id = the event's seq), are folded into `state`, and the page is redrawn at most
// every REDRAW_MS, so a fast stream costs one redraw per interval, not one per event.
"use strict";

const REDRAW_MS = 200;
const MAX_DETAILED_RUNS = 300;
// Past this many runs the oldest finished top-level runs (with their sub-agent runs) are
// forgotten: the totals keep counting them, so a page left open for hours stays the same size.
const MAX_KEPT_RUNS = 1000;
const MAX_SESSIONS = 5000; // per agent; past it the set restarts (the count goes on)

const state = {
  lastSeq: 0, lastTs: 0, shownSeq: 0, shownTs: 0, peers: new Map(), services: new Map(), agents: new Map(), runs: new Map(),
  order: [], totals: { runs: 0, input: 0, output: 0, cost: 0, stops: {} }, experiments: new Map(),
  status: null, selected: null, filter: { agent: "", experiment: "", run: "", type: "" },
  types: new Set(), // every event type seen: the type filter's suggestions
  page: 0, zoom: new Map(), anyLive: false,
  hub: null, // the hub as `busctl ui` sees it: {ok, since}
  stream: { ok: false, since: 0 }, // this page's link to `busctl ui`
  journaled: [], // the experiments `busctl experiment run` journaled: [{name, version, done, ...}]
  // the experiment page open (`#experiment=E`): its data as `/experiment?name=E` served it
  // (`open`: the samples whose cells are shown; `sort`: the variant the samples are sorted by)
  exp: { name: "", data: null, fetching: false, missing: false, drawn: null, page: 0,
         open: new Set(), sort: "" },

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

// A cell of `busctl experiment run` tags its runs `E.<variant>.r<repeat>`
// (agents/experiment/pages.py CELL_TAG): its totals are the experiment's, one row, not a row a tag.
const CELL_TAG = /^([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+\.r[0-9]+$/;

function experiment(tag) {
  const cellOf = CELL_TAG.exec(tag || "");
  const key = cellOf ? cellOf[1] : tag || "(none)";
  if (!state.experiments.has(key)) {
    state.experiments.set(key, { runs: 0, input: 0, output: 0, cost: 0, live: 0, failed: 0,
                                 tags: new Set() });
  }
  const x = state.experiments.get(key);
  if (cellOf) x.tags.add(tag);
  return x;
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
    const x = experiment(r.experiment);
    x.runs += 1; x.live += 1;
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
  turn_start(ev) { run(ev).turn = ev.turn; },
  tool_execution_start(ev) {
    // the arguments, clipped: the bar's tooltip shows a preview, the transcript has them whole
    run(ev).tools.set(ev.tool_call_id, { name: ev.tool_name, start: ev.ts, end: null, error: false,
                                         args: clip(JSON.stringify(ev.args ?? null), 300) });
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
    const x = experiment(r.experiment);
    x.live = Math.max(0, x.live - 1);
    if (r.stop === "error" || r.stop === "aborted") x.failed += 1;
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
  for (const id of gone) { state.runs.delete(id); state.zoom.delete(id); }
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

const MIN_BAR_PX = 4;   // a 1 ms call stays visible and hoverable
const PAGE = 20;        // finished runs per page: the DOM stays small however many ran

function money(v) {
  // dollars with 3 significant digits under $1 ($0.00004, not $0.0000), cents above
  if (v === null || v === undefined) return "-";
  if (v === 0 || Math.abs(v) >= 1) return "$" + v.toFixed(2);
  const digits = Math.min(20, 2 - Math.floor(Math.log10(Math.abs(v))));
  return "$" + v.toFixed(digits).replace(/(\.\d\d\d*?)0+$/, "$1");
}

function clip(t, n) {
  t = String(t || "").replace(/\s+/g, " ");
  return t.length <= n ? t : t.slice(0, n - 1) + "…";
}

function secs(d) {
  // a duration for a person: 0.42 ms, 38 ms, 3.2 s, 2 m 05 s
  if (d < 0.01) return (d * 1000).toFixed(2) + " ms";
  if (d < 1) return (d * 1000).toFixed(0) + " ms";
  if (d < 60) return d.toFixed(1) + " s";
  return `${Math.floor(d / 60)} m ${String(Math.floor(d % 60)).padStart(2, "0")} s`;
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
}

function workersOf(tool) {
  // Tool events do not name the worker: the hub's status says which peers serve `tool.NAME`,
  // and which of them are busy now.
  if (!state.status) return "";
  const offer = state.status.peers.map((p) => [p, (p.services || []).find((s) =>
    s.name === "tool." + tool)]).filter(([, s]) => s);
  const busy = offer.filter(([, s]) => s.load > 0);
  return (busy.length ? busy : offer).map(([p]) => p.name).join(", ");
}

function bar(kind, item, scale, label, row, tip) {
  const end = item.end === null ? Date.now() / 1000 : item.end;
  const left = ((item.start - scale.t0) / scale.span) * 100;
  const width = ((end - item.start) / scale.span) * 100;
  const cls = `bar ${kind}${item.error ? " error" : ""}${item.end === null ? " open" : ""}`;
  const node = el("div", { class: cls, title: tip + `\n${secs(end - item.start)}`,
                           "data-row": String(row), "data-start": String(item.start),
                           "data-end": String(end) }, label);
  // At least MIN_BAR_PX wide, and never past the track's right edge.
  node.style.left = `min(${left}%, calc(100% - ${MIN_BAR_PX}px))`;
  node.style.width = `max(${width}%, ${MIN_BAR_PX}px)`;
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

function treeEnd(r, now) {
  let end = r.end === null ? now : r.end;
  for (const id of r.children) {
    const c = state.runs.get(id);
    if (c) end = Math.max(end, treeEnd(c, now));
  }
  return end;
}

function niceStep(span) {
  // ~6 ticks at 1, 2 or 5 × 10^k seconds
  const raw = span / 6;
  const pow = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * pow).find((s) => s >= raw);
}

function axis(scale) {
  const node = el("div", { class: "axis" });
  const step = niceStep(scale.span);
  const first = Math.ceil((scale.t0 - scale.start) / step) * step;
  // the label's precision follows the step: +0.25 ms, +1.5 s, +2 m 00 s
  const digits = Math.max(0, -Math.floor(Math.log10(step < 1 ? step * 1000 : step) + 1e-9));
  for (let t = first; t <= scale.t0 - scale.start + scale.span * 0.93; t += step) {
    const left = ((scale.start + t - scale.t0) / scale.span) * 100;
    const tick = el("span", { class: "tick" }, "+" + (step < 1 ? `${(t * 1000).toFixed(digits)} ms`
      : t < 60 ? `${t.toFixed(digits)} s` : secs(t)));
    tick.style.left = left + "%";
    node.append(tick);
  }
  return node;
}

function waiting(r, now) {
  // What a live run waits for now: its open tool calls (by worker), else the model, else its
  // sub-agent's wait.
  const open = [...r.tools.values()].filter((t) => t.end === null);
  const parts = open.map((t) => {
    const w = t.worker || workersOf(t.name);
    if (w) t.worker = w; // seen once, kept: the worker may be idle again by the next redraw
    return `tool ${t.name}${w ? " on " + w : ""} for ${secs(now - t.start)}`;
  });
  const chat = r.chats.at(-1);
  if (!parts.length && chat && chat.end === null) {
    parts.push(`model ${chat.model || ""} ${chat.text ? "streaming" : "thinking"} for `
               + secs(now - chat.start));
  }
  for (const id of r.children) {
    const c = state.runs.get(id);
    if (c && c.end === null) parts.push(`${c.agent}: ${waiting(c, now)}`);
  }
  return parts.join(" · ") || "between steps";
}

function titleOf(r, now) {
  const bits = [r.agent];
  if (r.experiment) bits.push("exp " + r.experiment);
  if (r.turn) bits.push("turn " + r.turn);
  bits.push(r.id.slice(0, 8));
  const dur = secs((r.end === null ? now : r.end) - r.start);
  const full = `${r.agent} · run ${r.id} · experiment ${r.experiment || "-"} · session `
    + `${r.session || "-"} · started ${clock(r.start)} · ${dur}`;
  const kids = [el("span", { class: "name", title: full }, bits.join(" · ")),
                el("span", { class: "stop" }, r.end === null ? "running" : r.stop),
                el("span", { class: "dur" }, dur)];
  if (r.end === null && !r.parent) {
    const wait = waiting(r, now);
    kids.push(el("span", { class: "wait", title: wait }, "waits for " + wait));
  }
  return el("div", { class: "lane-title" }, ...kids);
}

function lane(r, scale, now) {
  const node = el("div", { class: "lane" + (state.selected === r.id ? " selected" : "")
                           + (r.end === null ? " live" : ""),
                           "data-run": r.id, "data-agent": r.agent, "data-parent": r.parent },
                  titleOf(r, now));
  if (!r.parent || !scale.nested) node.append(axis(scale));
  const chats = el("div", { class: "track chats" });
  if (typeMatches(CHAT_TYPES)) r.chats.forEach((c) => {
    // the text streams into the bar as it arrives; retries of the call are marked ↻N
    const label = (c.retries ? `↻${c.retries} ` : "") + (c.model || "model")
      + (c.text ? ": " + c.text.slice(-60) : "");
    const b = bar("chat" + (c.retries ? " retry" : ""), c, scale, label, 0,
                  `model ${c.model || "?"}${c.retries ? ` (${c.retries} retries)` : ""}\n`
                  + clip(c.text, 300));
    if (c.retries) b.setAttribute("data-retries", String(c.retries));
    chats.append(b);
  });
  node.append(chats);
  toolRows(typeMatches(TOOL_TYPES) ? r.tools : new Map()).forEach((row, i) => {
    const track = el("div", { class: "track tools" });
    for (const [id, t] of row.items) {
      const w = t.worker || workersOf(t.name);
      const b = bar("tool", t, scale, t.name, i, `${t.name}${w ? " on " + w : ""}\n`
                    + clip(t.args, 300));
      b.setAttribute("data-tool", t.name); b.setAttribute("data-call", id);
      track.append(b);
    }
    node.append(track);
  });
  const kids = el("div", { class: "children" });
  const inner = { ...scale, nested: true }; // a sub-agent on its caller's axis: they line up
  r.children.forEach((id) => { if (state.runs.has(id)) kids.append(lane(state.runs.get(id), inner, now)); });
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

function scaleOf(r, now) {
  // Each run on its own axis, from its start to its end (a live run: to now).
  const span = Math.max(treeEnd(r, now) - r.start, 1e-3);
  const z = state.zoom.get(r.id);  // [from, to] as fractions of the run, set by the wheel
  return z ? { start: r.start, t0: r.start + z[0] * span, span: (z[1] - z[0]) * span }
    : { start: r.start, t0: r.start, span };
}

function renderTimeline() {
  const now = Date.now() / 1000;
  const live = [];
  const done = [];
  for (const id of state.order) {
    const r = state.runs.get(id);
    if ((r.parent && state.runs.has(r.parent)) || !shown(r)) continue;
    (r.end === null ? live : done).push(r);
  }
  live.sort((a, b) => b.start - a.start); // newest first
  done.sort((a, b) => b.end - a.end);
  const pages = Math.max(1, Math.ceil(done.length / PAGE));
  state.page = Math.min(state.page, pages - 1);
  const from = state.page * PAGE;
  const older = el("button", { id: "older" }, "older ›");
  const newer = el("button", { id: "newer" }, "‹ newer");
  older.disabled = state.page >= pages - 1; newer.disabled = state.page === 0;
  older.onclick = () => { state.page += 1; redraw(); };
  newer.onclick = () => { state.page -= 1; redraw(); };
  const box = document.getElementById("timeline");
  box.replaceChildren(
    el("h3", { class: "group", id: "live-head" }, `Running now: ${live.length}`),
    ...(live.length ? live.map((r) => lane(r, scaleOf(r, now), now))
      : [el("div", { class: "none" }, "nothing is running")]),
    el("h3", { class: "group", id: "finished-head" }, `Finished: ${done.length} `
       + (done.length ? `(${from + 1}–${Math.min(from + PAGE, done.length)}, newest first) ` : ""),
       newer, " ", older),
    ...done.slice(from, from + PAGE).map((r) => lane(r, scaleOf(r, now), now)));
  state.anyLive = live.length > 0;
}

function renderList(id, items) {
  document.getElementById(id).replaceChildren(...items.map((t) => el("li", {}, t)));
}

const ROLES = ["gateway", "worker", "coordinator", "supervisor", "watcher"]; // drawn in this order

function renderTopology(peers) {
  // The hub and what hangs off it, by role: each peer with its services' load/capacity and, for
  // a tool worker, its sandbox (the `sandbox` key its services' meta carries).
  const groups = new Map();
  for (const p of peers) {
    const role = p.role || "peer";
    if (!groups.has(role)) groups.set(role, []);
    groups.get(role).push(p);
  }
  const order = [...groups.keys()].sort((a, b) => (ROLES.indexOf(a) + 1 || 99) - (ROLES.indexOf(b) + 1 || 99));
  const items = order.map((role) => el("li", { class: "role", "data-peer-role": role },
    el("span", { class: "role-name" }, `${role}s (${groups.get(role).length})`),
    el("ul", {}, ...groups.get(role).map(peerItem))));
  document.getElementById("peers").replaceChildren(
    el("li", { class: "hub" }, `hub · ${peers.length} peers`, el("ul", {}, ...items)));
}

function peerItem(p) {
  const services = p.services || [];
  const load = services.reduce((n, s) => n + (s.load || 0), 0);
  const cap = services.reduce((n, s) => n + (s.capacity || 0), 0);
  const sandbox = services.map((s) => (s.meta || {}).sandbox).find((x) => x);
  const head = el("div", { class: "peer-head", title: `${p.name} · ${p.role || "peer"} · `
                  + `${p.host || ""} pid ${p.pid || "?"}` }, p.name,
                  el("span", { class: "load" }, cap ? ` ${load}/${cap} busy` : ""));
  const kids = [head];
  if (sandbox) kids.push(el("div", { class: "sandbox", title: String(sandbox) }, "sandbox: " + sandbox));
  if (services.length) {
    kids.push(el("div", { class: "svcs", title: services.map((s) => s.name).join("\n") },
                 services.map((s) => `${s.name} ${s.load || 0}/${s.capacity}`).join(", ")));
  }
  return el("li", { class: "peer", "data-peer": p.name }, ...kids);
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
                            + ` ${money(m.usage.cost || 0)}]`);
    return el("div", { class: "msg", "data-role": m.role }, ...parts);
  });
  body.replaceChildren(head, ...msgs);
}

function renderTotals() {
  const t = state.totals;
  const rows = [["runs", t.runs], ["input", t.input], ["output", t.output], ["cost", money(t.cost)],
                ...Object.entries(t.stops).map(([k, v]) => ["stop:" + k, v]),
                ...[...state.experiments.entries()].map(([k, e]) => ["exp:" + k,
                  `${e.runs} runs, ${e.input}/${e.output} tok, ${money(e.cost)}; `
                  + `${e.runs - e.live - e.failed} done, ${e.live} running, ${e.failed} failed`])];
  document.querySelector("#totals tbody").replaceChildren(...rows.map(([k, v]) => {
    const row = el("tr", { "data-key": k }, el("th", {}, k.replace(/^exp:/, "")),
                   el("td", {}, String(v)));
    if (k.startsWith("exp:") && k !== "exp:(none)") { // the experiment view: a click filters by it
      const name = k.slice(4);
      const tags = state.experiments.get(name).tags;
      row.className = "exp" + (state.filter.experiment === name ? " chosen" : "");
      row.title = (tags.size ? `${name}: ${tags.size} cell tags (${[...tags].sort().join(", ")})\n`
        : "") + "show only this experiment's runs (click again: all)";
      row.onclick = () => setFilter("experiment", state.filter.experiment === name ? "" : name);
    }
    return row;
  }));
}

function renderConnection() {
  // True, not hopeful: "live" only while this page hears `busctl ui` and it hears the hub.
  const node = document.getElementById("status");
  let text = "live";
  if (state.stream.refused) {
    text = "busctl ui refuses this page (restarted with a new token?): open the link it printed";
  } else if (!state.stream.ok) {
    // `busctl down` stops the page's server with the hub: from here neither answers
    text = state.stream.since ? `hub unreachable since ${clock(state.stream.since)} (busctl ui `
      + "does not answer either)" : "connecting…";
  } else if (state.hub && !state.hub.ok) {
    text = `hub unreachable since ${clock(state.hub.since)}`;
  } else if (!state.hub) {
    text = "connecting…";
  }
  node.textContent = text;
  const down = text !== "live";
  node.className = down ? "down" : "up";
  document.getElementById("side").classList.toggle("stale", down); // last known, greyed
}

// --- the experiment page ---------------------------------------------------------------------
// Its numbers are computed by the server (agents/experiment/pages.py) with the very function
// `busctl experiment report --json` uses; this draws them. Each value of the report is also kept
// whole in its cell's data-value (the report's keys in data-key), so what the page shows can be
// checked against the report exactly.

function num(v, digits) { return v === null || v === undefined ? "-" : v.toFixed(digits); }
function secsOrDash(v) { return v === null || v === undefined ? "-" : secs(v); }

function renderExperimentList() {
  document.getElementById("experiments").replaceChildren(...state.journaled.map((x) => el("li",
    { "data-experiment": x.name }, el("a", { href: "#experiment=" + encodeURIComponent(x.name) },
      x.name), ` ${x.done}/${x.planned ?? "?"}` + (x.failed ? `, ${x.failed} in error` : "")
      + (x.running ? `, ${x.running} running` : ""))));
}

function fetchExperiment() {
  const x = state.exp;
  if (!x.name || x.fetching) return;
  x.fetching = true;
  const name = x.name;
  let fresh = false;
  fetch("/experiment?name=" + encodeURIComponent(name)).then((r) => {
    if (r.status === 404) return null;
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    return r.json();
  }).then((data) => {
    if (state.exp.name !== name) return; // another page was opened meanwhile
    x.data = data; x.missing = data === null; fresh = data !== null;
  }).catch(() => {}).finally(() => {
    x.fetching = false;
    // the experiment may have moved on while this was in flight (and no status may follow)
    if (fresh) maybeRefetch();
    schedule();
  });
}

function maybeRefetch() {
  // the status snapshot carries each experiment's version: refetch the open one when it moved
  const x = state.exp;
  if (!x.name) return;
  const listed = state.journaled.find((e) => e.name === x.name);
  if (listed && (!x.data || x.data.version !== listed.version)) fetchExperiment();
}

function cell(value, attrs) { return el("td", attrs || {}, value); }

function renderProgress(p) {
  const planned = p.planned || 0;
  const pct = (n) => `${planned ? (100 * n) / planned : 0}%`;
  const meter = el("div", { class: "meter" }, el("span", { class: "ok" }), el("span",
    { class: "failed" }), el("span", { class: "running" }));
  [p.done, p.failed, p.running].forEach((n, i) => { meter.children[i].style.width = pct(n); });
  const eta = p.eta !== null ? `, ETA ${secs(p.eta)}` : p.left ? ", stopped (resume runs the rest)" : "";
  // the report's failure rule: timed out and limited cells are done (scored 0); cells in error
  // are what a resume runs again
  const scored0 = [["timed out", p.timed_out], ["limited", p.limited]].filter(([, n]) => n)
    .map(([what, n]) => `${n} ${what}`).join(", ");
  const node = el("div", {}, `${p.done} / ${p.planned ?? "?"} done${scored0 ? ` (${scored0}, scored 0)` : ""}, `
                  + `${p.running} running, ${p.failed} in error${eta}`, meter);
  for (const k of ["planned", "done", "running", "failed"]) node.setAttribute("data-" + k, String(p[k]));
  document.getElementById("exp-progress").replaceChildren(node);
}

// One colour a variant, the same in every table and plot of the page (by its place in the plan).
const VARIANT_COLOURS = ["#3b6fd4", "#d9822b", "#2a9d6f", "#a64fb5", "#c0392b", "#6b7a8f",
                         "#b59a2a", "#1f9bb5"];

function colourOf(report, name) {
  const i = Math.max(0, report.variants.findIndex((v) => v.name === name));
  return VARIANT_COLOURS[i % VARIANT_COLOURS.length];
}

function swatch(colour) {
  const node = el("span", { class: "swatch" });
  node.style.background = colour;
  return node;
}

function reported(keys, from, shown, attrs) {
  // A cell showing report values: the text for a person, the values whole (JSON, in report
  // order of `keys`) for a check against `busctl experiment report --json`. A key the report
  // does not have is shown as "-" and kept as null.
  return el("td", { ...(attrs || {}), "data-key": keys.join(" "),
                    "data-value": JSON.stringify(keys.map((k) => from[k] ?? null)) }, shown);
}

function interval(ci, method) {
  return ci ? `[${num(ci[0], 3)}, ${num(ci[1], 3)}]${method ? " " + method : ""}` : "-";
}

const SVG = "http://www.w3.org/2000/svg";
const PLOT_W = 160;
const PLOT_H = 14;

function svg(tag, attrs, ...kids) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  for (const kid of kids) node.append(kid);
  return node;
}

function plotDomain(report) {
  // One scale for every plot of the page, so their dots compare: [0, 1] (scores usually are),
  // widened where a mean or an interval leaves it (a t interval may).
  let [lo, hi] = [0, 1];
  for (const v of report.variants) {
    const stats = [{ mean: v.score, ci95: v.ci95 }, ...Object.values(v.scores || {})];
    for (const x of stats.flatMap((s) => [s.mean, ...(s.ci95 || [])])) {
      if (typeof x === "number") { lo = Math.min(lo, x); hi = Math.max(hi, x); }
    }
  }
  return [lo, hi];
}

function scorePlot(mean, ci, domain, colour) {
  // the mean as a dot, its 95% interval as a whisker, on the page's scale
  const [lo, hi] = domain;
  const x = (v) => 4 + ((v - lo) / (hi - lo || 1)) * (PLOT_W - 8);
  const y = PLOT_H / 2;
  const kids = [svg("line", { x1: x(lo), x2: x(hi), y1: y, y2: y, class: "rail" }),
                svg("line", { x1: x((lo + hi) / 2), x2: x((lo + hi) / 2), y1: 2, y2: PLOT_H - 2,
                              class: "rail" })];
  if (ci) {
    kids.push(svg("line", { x1: x(ci[0]), x2: x(ci[1]), y1: y, y2: y, stroke: colour,
                            "stroke-width": 2 }));
    for (const end of ci) {
      kids.push(svg("line", { x1: x(end), x2: x(end), y1: y - 4, y2: y + 4, stroke: colour,
                              "stroke-width": 2 }));
    }
  }
  if (typeof mean === "number") kids.push(svg("circle", { cx: x(mean), cy: y, r: 3.5, fill: colour }));
  return svg("svg", { width: PLOT_W, height: PLOT_H, class: "plot" }, ...kids);
}

function plotHead(domain) {
  // the plot column's heading: its scale's ends and middle, where the plot puts them
  const [lo, hi] = domain;
  return el("th", { class: "plot-head", title: "the mean (dot) and its 95% interval" },
            ...[lo, (lo + hi) / 2, hi].map((v) => el("span", {}, String(+v.toFixed(2)))));
}

function head(table, ...columns) {
  // a column: its name, [its name's lines] (a heading no wider than its values), or a <th>
  const th = (c) => (Array.isArray(c) ? el("th", {}, ...c.flatMap((line, i) =>
    (i ? [el("br"), line] : [line]))) : el("th", {}, c));
  document.querySelector(`#${table} thead`).replaceChildren(el("tr", {},
    ...columns.map((c) => (c instanceof Node && c.tagName === "TH" ? c : th(c)))));
}

function sharedMethod(stats, key) {
  // the interval method, when every row has the same one: said once, in the heading
  const methods = new Set(stats.map((st) => st[key] || ""));
  return methods.size === 1 ? [...methods][0] : "";
}

function renderVariants(report) {
  const domain = plotDomain(report);
  const method = sharedMethod(report.variants, "ci_method");
  head("exp-variants", "variant", ["samples", "× repeats"], "cells", "score",
       method ? ["95% interval", `(${method})`] : "95% interval",
       plotHead(domain), ["timed out ·", "errors · limited"], "tokens", "cost", "turns",
       ["time", "p50 · p95"], "stop reasons");
  document.querySelector("#exp-variants tbody").replaceChildren(...report.variants.map((v) => {
    const colour = colourOf(report, v.name);
    const count = (k) => reported([k], v, String(v[k] ?? "-"));
    return el("tr", { "data-variant": v.name },
      el("td", { class: "variant" }, swatch(colour), v.name),
      reported(["samples", "repeats"], v, `${v.samples ?? "-"} × ${v.repeats ?? "-"}`),
      reported(["cells", "planned"], v, `${v.cells ?? "-"}/${v.planned ?? "-"}`),
      reported(["score"], v, num(v.score, 3), { class: "score" }),
      reported(["ci95", "ci_method"], v, interval(v.ci95, method ? "" : v.ci_method),
               { title: "95% interval of the score: " + (v.ci_method || "-") }),
      el("td", { class: "plot-cell" }, scorePlot(v.score, v.ci95, domain, colour)),
      reported(["timed_out", "errors", "limited"], v, ["timed_out", "errors", "limited"]
        .map((k) => String(v[k] ?? "-")).join(" · ")),
      count("tokens"), reported(["cost"], v, money(v.cost)),
      reported(["turns_mean"], v, num(v.turns_mean, 1)),
      reported(["time_p50", "time_p95"], v, `${secsOrDash(v.time_p50)} · `
               + secsOrDash(v.time_p95)),
      reported(["stop_reasons"], v, Object.entries(v.stop_reasons || {}).sort()
        .map(([k, n]) => `${k} ${n}`).join(", "), { class: "stops" }));
  }));
}

function renderScorers(report) {
  // Every scorer reported the same way, beside each other: drawn when there is more than one
  // (with one, the variant table's score is it).
  const many = report.scorers.length > 1;
  document.getElementById("exp-scorers").parentElement.hidden = !many;
  if (!many) return;
  const domain = plotDomain(report);
  const stats = report.variants.flatMap((v) => Object.values(v.scores || {}));
  const method = sharedMethod(stats, "method");
  head("exp-scorers", "scorer", "variant", "mean", method ? ["95% interval", `(${method})`]
    : "95% interval", plotHead(domain), "samples", "cells");
  document.querySelector("#exp-scorers tbody").replaceChildren(...report.scorers.flatMap((s, i) =>
    report.variants.map((v) => {
      const st = (v.scores || {})[s] || {};
      return el("tr", { "data-scorer": s, "data-variant": v.name },
        el("td", {}, s + (i === 0 ? " (the score)" : "")),
        el("td", { class: "variant" }, swatch(colourOf(report, v.name)), v.name),
        reported(["mean"], st, num(st.mean, 3)),
        reported(["ci95", "method"], st, interval(st.ci95, method ? "" : st.method)),
        el("td", { class: "plot-cell" }, scorePlot(st.mean, st.ci95, domain,
                                                   colourOf(report, v.name))),
        reported(["samples"], st, String(st.samples ?? "-")),
        reported(["cells"], st, String(st.cells ?? "-")));
    })));
}

function outcome(r) {
  // a cell's end in one word: the results row's status is its outcome by the failure rule
  // (ok, timed_out, limited, error)
  return r.status;
}

function renderFailed(rows) {
  // the cells that ended without a normal answer, folded: the counts are in the tables
  const bad = rows.filter((r) => outcome(r) !== "ok");
  const box = document.getElementById("exp-failed-box");
  box.hidden = !bad.length;
  const counts = {};
  for (const r of bad) counts[outcome(r)] = (counts[outcome(r)] || 0) + 1;
  box.querySelector("summary").textContent = `${bad.length} cells ended without a normal answer `
    + `(${Object.entries(counts).sort().map(([k, n]) => `${k} ${n}`).join(", ")})`;
  document.getElementById("exp-failed").replaceChildren(...bad.map((r) => el("li", {},
    `${r.variant} ${r.sample} r${r.repeat}: ${outcome(r)}${r.error ? " — " + r.error : ""}`)));
}

function runLink(id) {
  if (!id) return "-";
  return el("a", { href: "#run=" + encodeURIComponent(id), "data-run-link": id }, id.slice(0, 8));
}

const SAMPLE_PAGE = 100; // samples per page: the DOM stays small however many there are

function samplePager(total) {
  const pages = Math.max(1, Math.ceil(total / SAMPLE_PAGE));
  state.exp.page = Math.min(state.exp.page || 0, pages - 1);
  const p = state.exp.page;
  const go = (d) => () => { state.exp.page = p + d; state.exp.drawn = null; redraw(); };
  const prev = el("button", {}, "‹ previous");
  const next = el("button", {}, "next ›");
  prev.disabled = p === 0; next.disabled = p >= pages - 1;
  prev.onclick = go(-1); next.onclick = go(1);
  document.getElementById("exp-pager").replaceChildren(...(pages > 1 ? [`${p * SAMPLE_PAGE + 1}`
    + `–${Math.min((p + 1) * SAMPLE_PAGE, total)} of ${total} samples `, prev, " ", next] : []));
  return (rows) => rows.slice(p * SAMPLE_PAGE, (p + 1) * SAMPLE_PAGE);
}

function rollup(report, by) {
  // [sample, {variant: its `per_sample` entry}] in natural order of the ids (q2 before q10);
  // `by` a variant: its worst samples first (no score at all before a 0), ties by id
  const bySample = new Map();
  for (const v of report.variants) {
    for (const s of v.per_sample || []) {
      if (!bySample.has(s.sample)) bySample.set(s.sample, {});
      bySample.get(s.sample)[v.name] = s;
    }
  }
  const mean = (e) => (e[by] && typeof e[by].mean === "number" ? e[by].mean : -Infinity);
  return [...bySample.entries()].sort(([a, x], [b, y]) => (by ? mean(x) - mean(y) : 0)
    || a.localeCompare(b, undefined, { numeric: true }));
}

function marks(entry) {
  // One mark a repeat: an answer shaded by its score (red 0 .. green 1), else the letter of
  // what stopped it (T timed out, E error, L limited); a repeat not run yet: an empty mark.
  return el("span", { class: "marks" }, ...entry.statuses.map((outcome, i) => {
    const status = outcome ?? "pending";
    const score = entry.scores[i];
    const mark = el("span", { class: `mark ${status}`, title: `repeat ${i + 1}: ${status}`
                              + (score === null ? "" : ` ${num(score, 3)}`) },
                    status === "ok" || status === "pending" ? "" : status[0].toUpperCase());
    if (status === "ok" && score !== null) {
      mark.style.background = `hsl(${Math.round(120 * Math.min(1, Math.max(0, score)))} 55% 50%)`;
    }
    return mark;
  }));
}

function sampleRow(report, sample, entries, open) {
  const total = (k) => Object.values(entries).reduce((n, e) => n + (e[k] || 0), 0);
  const row = el("tr", { class: "sample" + (open ? " open" : ""), "data-sample": sample },
    el("td", { class: "sample-id", title: sample }, el("span", { class: "toggle" },
                                                       open ? "▾" : "▸"), sample),
    ...report.variants.map((v) => {
      const e = entries[v.name];
      return e ? reported(["per_sample"], { per_sample: e }, "", { "data-variant": v.name })
        : el("td", { "data-variant": v.name }, "-");
    }),
    cell(money(total("cost"))), cell(String(total("tokens"))));
  report.variants.forEach((v, i) => {
    const e = entries[v.name];
    if (e) row.children[i + 1].append(el("span", { class: "mean" }, num(e.mean, 3)), marks(e));
  });
  row.onclick = () => {
    const opened = state.exp.open;
    if (opened.has(sample)) opened.delete(sample); else opened.add(sample);
    state.exp.drawn = null; redraw();
  };
  return row;
}

function cellRows(scorers, rows, width) {
  // an opened sample: its cells, every variant and repeat
  const table = el("table", { class: "cells" }, el("thead", {}, el("tr", {}, ...["variant",
    "repeat", ...scorers, "end", "tokens", "cost", "turns", "time", "run"].map((c) =>
    el("th", {}, c)))), el("tbody", {}, ...rows.map((r) => el("tr", {
    class: "cell" + (outcome(r) === "ok" ? "" : " error"), "data-sample": r.sample,
    "data-variant": r.variant, "data-repeat": String(r.repeat), "data-status": r.status,
    "data-score": String(r.score),
    title: r.error ? `${r.status}: ${r.error} (attempts ${r.attempts})` : clip(r.answer, 300) },
    cell(r.variant), cell(String(r.repeat)),
    ...scorers.map((s) => cell(num(r["score_" + s], 3), { "data-scorer": s })),
    cell(r.status === "ok" || r.stop_reason === r.status ? r.stop_reason || r.status
      : `${r.status} (${r.stop_reason || "-"})`),
    cell(String(r.tokens)), cell(money(r.cost)), cell(String(r.turns)), cell(secs(r.wall)),
    cell(runLink(r.run_id))))));
  return el("tr", { class: "cells-row" }, el("td", { colspan: String(width) }, table));
}

function sampleHead(report) {
  // a click on a variant sorts the samples by its mean, worst first; on "sample", by id
  const sortBy = (name) => () => { state.exp.sort = name; state.exp.drawn = null; redraw(); };
  const sorted = (name) => (state.exp.sort === name ? " ▴" : "");
  const id = el("th", { class: "sortable", title: "sort by id" }, "sample" + sorted(""));
  id.onclick = sortBy("");
  head("exp-samples", id, ...report.variants.map((v) => {
    const th = el("th", { class: "variant sortable", "data-variant": v.name, title: `${v.name}: `
      + "the sample's mean score over its repeats, and each repeat (click: worst first)" },
      swatch(colourOf(report, v.name)), `${v.name}: mean · repeats${sorted(v.name)}`);
    th.onclick = sortBy(v.name);
    return th;
  }), el("th", { title: "of the sample's cells, every variant" }, "cost"),
  el("th", { title: "of the sample's cells, every variant" }, "tokens"));
}

function renderSamples(report, cells) {
  const all = rollup(report, state.exp.sort);
  const shown = samplePager(all.length)(all);
  const bySample = new Map();
  for (const r of cells) {
    if (!bySample.has(r.sample)) bySample.set(r.sample, []);
    bySample.get(r.sample).push(r);
  }
  sampleHead(report);
  const open = state.exp.open;
  const width = report.variants.length + 3;
  document.querySelector("#exp-samples tbody").replaceChildren(...shown.flatMap(([s, e]) =>
    open.has(s) ? [sampleRow(report, s, e, true), cellRows(report.scorers, bySample.get(s) || [],
                                                            width)]
      : [sampleRow(report, s, e, false)]));
  if (!all.length) {
    document.querySelector("#exp-samples tbody").append(el("tr", {}, el("td", {
      colspan: String(width), class: "none" }, "no sample finished yet")));
  }
  const button = document.getElementById("exp-expand");
  const allOpen = shown.length > 0 && shown.every(([s]) => open.has(s));
  button.textContent = allOpen ? "collapse all" : "expand all";
  button.onclick = () => {
    for (const [s] of shown) { if (allOpen) open.delete(s); else open.add(s); }
    state.exp.drawn = null; redraw();
  };
}

function renderExperiment() {
  const x = state.exp;
  const onPage = !!x.name;
  document.getElementById("runs-view").hidden = onPage;
  document.getElementById("experiment-view").hidden = !onPage;
  // the experiment page takes the transcript's column too: its tables need the width
  document.querySelector("main").classList.toggle("experiment", onPage);
  if (!onPage) return;
  document.getElementById("exp-name").textContent = x.name;
  if (x.drawn === x.data && x.data) return; // a new fetch draws; the 5 Hz redraws do not
  x.drawn = x.data;
  if (!x.data) {
    document.getElementById("exp-progress").textContent = x.missing
      ? `no experiment ${x.name} journaled in the hub's log (yet)` : "loading…";
    for (const id of ["exp-variants", "exp-scorers", "exp-samples"]) {
      document.querySelector(`#${id} thead`).replaceChildren();
      document.querySelector(`#${id} tbody`).replaceChildren();
    }
    document.getElementById("exp-failed-box").hidden = true;
    return;
  }
  renderProgress(x.data.progress);
  renderVariants(x.data.report);
  renderScorers(x.data.report);
  renderFailed(x.data.samples);
  renderSamples(x.data.report, x.data.samples);
}

function route() {
  // `#experiment=E`: its page; `#run=ID`: the runs, filtered to that one, its transcript shown
  const [key, value] = location.hash.slice(1).split("=");
  const name = key === "experiment" ? decodeURIComponent(value || "") : "";
  if (name !== state.exp.name) {
    state.exp = { name, data: null, fetching: false, missing: false, drawn: null, page: 0,
                  open: new Set(), sort: "" };
    if (name) fetchExperiment();
  }
  if (key === "run" && value) {
    const id = decodeURIComponent(value);
    state.selected = id;
    setFilter("run", id);
  }
  redraw();
}

let pending = false;
function redraw() {
  pending = false;
  renderConnection();
  renderExperiment();
  renderExperimentList();
  renderTimeline();
  renderTranscript();
  renderTotals();
  if (state.status) { // the hub's polled status: load and queues per service, peers by role
    renderList("services", state.status.services.map((s) =>
      `${s.name}: ${s.load || 0}/${s.capacity} busy, ${s.queued || 0} queued, ${s.peers} peers`));
    renderTopology(state.status.peers);
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
  source.onopen = () => { state.stream = { ok: true, since: 0 }; renderConnection(); };
  source.onerror = () => { // the browser retries by itself; the page says since when
    if (state.stream.ok || !state.stream.since) state.stream = { ok: false, since: Date.now() / 1000 };
    // CLOSED: the server answered, but not with the stream (401: a restarted busctl ui has a
    // new token, which this page's cookie does not hold): the browser gives up, so does the page
    state.stream.refused = source.readyState === EventSource.CLOSED;
    renderConnection();
  };
  source.addEventListener("status", (msg) => {
    const s = JSON.parse(msg.data);
    state.hub = s.hub || { ok: true };
    if (s.peers) state.status = s; // while the hub is away the last known peers stay, greyed
    if (s.experiments) { state.journaled = s.experiments; maybeRefetch(); }
    renderConnection(); schedule();
  });
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

function setFilter(key, value) {
  document.getElementById("filter-" + key).value = value;
  state.filter[key] = value; state.page = 0;
  redraw();
}

for (const key of Object.keys(state.filter)) {
  document.getElementById("filter-" + key).addEventListener("input", (e) => {
    state.filter[key] = e.target.value.trim(); state.page = 0;
    redraw();
  });
}
// Wheel over a run's lane: zoom its axis around the pointer; shift+wheel pans; double click
// resets. The zoom is kept per run, so the redraws (every REDRAW_MS) keep it.
document.getElementById("timeline").addEventListener("wheel", (e) => {
  const track = e.target.closest(".axis, .track"); // elsewhere the wheel scrolls the page
  const laneNode = track && track.closest(".lane");
  if (!laneNode) return;
  e.preventDefault();
  const root = laneNode.closest("#timeline > .lane") || laneNode;
  const id = root.dataset.run;
  const [a, b] = state.zoom.get(id) || [0, 1];
  const box = track.getBoundingClientRect();
  const at = a + ((e.clientX - box.left) / box.width) * (b - a);
  let [na, nb] = e.shiftKey ? [a + (e.deltaY / 1000) * (b - a), b + (e.deltaY / 1000) * (b - a)]
    : [at - (at - a) * Math.exp(e.deltaY / 500), at + (b - at) * Math.exp(e.deltaY / 500)];
  if (nb - na >= 1) { state.zoom.delete(id); redraw(); return; }
  if (na < 0) { nb -= na; na = 0; }
  if (nb > 1) { na -= nb - 1; nb = 1; }
  state.zoom.set(id, [Math.max(0, na), Math.min(1, nb)]);
  redraw();
}, { passive: false });
document.getElementById("timeline").addEventListener("dblclick", (e) => {
  const root = e.target.closest("#timeline > .lane");
  if (root) { state.zoom.delete(root.dataset.run); redraw(); }
});
// Live runs' durations and waits move on without events: redraw once a second while any runs.
setInterval(() => { if (state.anyLive) schedule(); }, 1000);
window.addEventListener("hashchange", route);
connect();
route();
