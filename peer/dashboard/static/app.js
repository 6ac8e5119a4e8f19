// swarmloco dashboard: polls /api/state and redraws every panel. Charts are plain SVG, no libraries.
"use strict";

const POLL_MS = 1000;
const SERIES_COLORS = ["#60a5fa", "#f472b6", "#34d399", "#fbbf24", "#a78bfa", "#22d3ee", "#fb923c", "#f87171"];
const KIND_COLORS = { activations: "#60a5fa", gradients: "#f472b6", eval: "#94a3b8", pseudo_gradients: "#34d399", state: "#fbbf24" };
const SVG = "http://www.w3.org/2000/svg";
let lastOk = 0, lastState = null;
let lossAxis = "tokens";  // the loss chart's x: tokens | step | time
let sortBy = { key: "stage", desc: false };  // the peers table's order
const LOSS_X = { time: 0, step: 1, tokens: 2 };  // a loss point is [time, step, tokens, loss]

// ---- formatting

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const short = (id) => id.slice(-6);
const peerName = (p) => p.name || `${p.role === "stage" ? "s" + p.stage : p.role}·${short(p.id)}`;
const labelOf = (state, id) => state.labels[id] || short(id);  // a peer's --name, also after it left
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

function human(x, digits = 1) {
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(digits) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (a >= 1e3) return (x / 1e3).toFixed(digits) + "k";
  return a >= 100 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(digits);
}

function bytes(x) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return `${x.toFixed(i && x < 100 ? 1 : 0)} ${units[i]}`;
}

const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

function duration(s) {
  if (s >= 86400) return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  if (s >= 3600) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  if (s >= 60) return `${Math.floor(s / 60)}m ${Math.floor(s % 60)}s`;
  return `${Math.floor(s)}s`;
}

// ---- charts

function niceStep(span, count) {
  const raw = span / Math.max(count, 1), mag = 10 ** Math.floor(Math.log10(raw)), r = raw / mag;
  return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
}

function niceTicks(lo, hi, count, minStep = 0) {
  if (!(hi > lo)) { const pad = Math.max(Math.abs(lo) * 0.05, minStep) || 1; lo -= pad; hi += pad; }
  const step = Math.max(niceStep(hi - lo, count), minStep);
  const start = Math.floor(lo / step) * step, end = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let v = start; v <= end + step / 2; v += step) ticks.push(+v.toPrecision(12));
  return { lo: start, hi: end, ticks };
}

function timeTicks(lo, hi, count) {
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];
  const step = steps.find((s) => (hi - lo) / s <= count) || steps[steps.length - 1];
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) ticks.push(t);
  return ticks;
}

function el(name, attrs, parent, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

// series: [{name, color, points: [[x, y], ...], dashed, markers (every point, else the last), area, step}];
// x is a unix time (xTime) or any number (tokens, steps)
function lineChart(svg, series, { yTitle, yFormat = (v) => human(v, 2), yFromZero = false, yStep = 0, xTime = true }) {
  const W = svg.clientWidth || 800, H = svg.clientHeight || 200;  // drawn in CSS pixels: text keeps its size
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const m = { left: 58, right: 14, top: 10, bottom: 30 };
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = all.length;
  if (!all.length) {
    el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg, "waiting for the first records…");
    return;
  }
  const ts = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let t0 = Math.min(...ts), t1 = Math.max(...ts), xTicks;
  const xFormat = xTime ? clock : (v) => human(v, 1);
  if (xTime) {
    if (t1 - t0 < 10) t0 = t1 - 10;
    xTicks = timeTicks(t0, t1, Math.round(W / 140));
  } else {
    const x = niceTicks(t0, t1, Math.max(2, Math.round(W / 110)));
    [t0, t1, xTicks] = [x.lo, x.hi, x.ticks];
  }
  const y = niceTicks(yFromZero ? 0 : Math.min(...ys), Math.max(...ys), Math.max(2, Math.round((H - m.top - m.bottom) / 45)), yStep);
  const px = (t) => m.left + ((t - t0) / (t1 - t0)) * (W - m.left - m.right);
  const py = (v) => H - m.bottom - ((v - y.lo) / (y.hi - y.lo)) * (H - m.top - m.bottom);

  for (const v of y.ticks) {
    el("line", { x1: m.left, x2: W - m.right, y1: py(v), y2: py(v), class: "grid-line" }, svg);
    el("text", { x: m.left - 8, y: py(v) + 4, "text-anchor": "end" }, svg, yFormat(v));
  }
  for (const t of xTicks) {
    el("line", { x1: px(t), x2: px(t), y1: m.top, y2: H - m.bottom, class: "grid-line" }, svg);
    el("text", { x: px(t), y: H - m.bottom + 17, "text-anchor": "middle" }, svg, xFormat(t));
  }
  el("line", { x1: m.left, x2: m.left, y1: m.top, y2: H - m.bottom, class: "axis" }, svg);
  el("line", { x1: m.left, x2: W - m.right, y1: H - m.bottom, y2: H - m.bottom, class: "axis" }, svg);
  el("text", { transform: `translate(13 ${(m.top + H - m.bottom) / 2}) rotate(-90)`, "text-anchor": "middle", class: "axis-title" }, svg, yTitle);

  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? (s.step ? `H${px(p[0]).toFixed(1)}V` : `L${px(p[0]).toFixed(1)},`) : `M${px(p[0]).toFixed(1)},`}${py(p[1]).toFixed(1)}`).join("");
    if (s.area) {
      const base = py(y.lo);
      el("path", { d: `${d}L${px(s.points[s.points.length - 1][0]).toFixed(1)},${base}L${px(s.points[0][0]).toFixed(1)},${base}Z`,
                   fill: s.color, "fill-opacity": 0.12, stroke: "none" }, svg);
    }
    el("path", { d, class: "line", stroke: s.color, "stroke-dasharray": s.dashed ? "6 4" : "none", "data-series": s.name }, svg);
    const marked = s.markers ? s.points : [s.points[s.points.length - 1]];
    for (const p of marked) {
      const dot = el("circle", { cx: px(p[0]), cy: py(p[1]), r: s.dashed ? 3.2 : 2.4, fill: s.dashed ? "#0b1120" : s.color,
                                 stroke: s.color, "stroke-width": 1.6, class: "pt" }, svg);
      el("title", {}, dot, `${s.name}: ${yFormat(p[1])} at ${xFormat(p[0])}`);
    }
  }
}

function legend(node, items) {
  node.innerHTML = items.map((i) =>
    `<span class="item"><span class="swatch ${i.style || ""}" style="border-color:${i.color};background:${i.style === "block" ? i.color : "none"}"></span>${esc(i.name)}</span>`
  ).join("");
}

// ---- panels

function renderKpis(state) {
  const peers = state.peers, trainers = peers.filter((p) => p.role === "trainer");
  const full = peers.filter((p) => p.role === "full").length;  // whole-model replicas: no pipeline, no stage served
  const latest = (key) => trainers.map((p) => p[key]).filter((v) => v !== null);
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
  const firstLoss = Object.values(state.loss).map((pts) => pts[0] && pts[0][3]).filter((v) => v !== undefined);
  const train = mean(latest("train_loss")), val = mean(latest("val_loss"));
  const tps = trainers.reduce((a, p) => a + p.tokens_per_s, 0);
  const rate = peers.reduce((a, p) => a + sum(p.rate_sent), 0);
  const total = peers.reduce((a, p) => a + sum(p.bytes_sent), 0);
  const rounds = Object.values(state.rounds).map((points) => points[points.length - 1][1]);
  const tiles = [
    ["Peers", peers.length, `${trainers.length} trainer${trainers.length === 1 ? "" : "s"} · ${peers.length - trainers.length - full} stage servers${full ? ` · ${full} full` : ""}`],
    ["Train loss", train === null ? "–" : train.toFixed(3), firstLoss.length ? `from ${Math.max(...firstLoss).toFixed(3)}` : "mean over trainers"],
    ["Validation loss", val === null ? "–" : val.toFixed(3), "held-out split, last pass"],
    ["Throughput", `${human(tps)} tok/s`, `${trainers.length ? human(tps / trainers.length) : 0} per trainer`],
    ["Traffic", `${bytes(rate)}/s`, `${bytes(total)} sent since start`],
    ["Outer round", rounds.length ? Math.min(...rounds) : 0, `${state.swarm.outer_method}, H = ${state.swarm.inner_steps}`],
  ];
  $("kpis").innerHTML = tiles.map(([label, value, sub]) =>
    `<div class="kpi"><div class="label">${label}</div><div class="value">${esc(value)}</div><div class="sub">${esc(sub)}</div></div>`).join("");
}

function renderLoss(state) {
  const trainers = [...new Set([...Object.keys(state.loss), ...Object.keys(state.val_loss)])].sort();
  const series = [], items = [];
  const x = LOSS_X[lossAxis], points = (pts) => (pts || []).map((p) => [p[x], p[3]]);
  trainers.forEach((id, i) => {
    const color = SERIES_COLORS[i % SERIES_COLORS.length], name = labelOf(state, id);
    series.push({ name: `${name} train`, color, points: points(state.loss[id]) });
    series.push({ name: `${name} val`, color, dashed: true, markers: true, points: points(state.val_loss[id]) });
    items.push({ name: `${name} train`, color }, { name: `${name} validation`, color, style: "dashed" });
  });
  legend($("loss-legend"), items);
  $("loss-chart").setAttribute("aria-label", `loss against ${lossAxis}`);
  lineChart($("loss-chart"), series, { yTitle: "loss (nats/byte)", yFormat: (v) => v.toFixed(2), xTime: lossAxis === "time" });
}

function renderThroughput(state) {
  const color = SERIES_COLORS[2];
  legend($("throughput-legend"), [{ name: "swarm tokens/s", color }]);
  lineChart($("throughput-chart"), [{ name: "tokens/s", color, area: true, points: state.throughput }],
            { yTitle: "tokens/s", yFromZero: true, yFormat: (v) => human(v, 1) });
}

function renderRounds(state) {
  const stages = Object.keys(state.rounds).sort((a, b) => a - b);
  const series = stages.map((s, i) => {
    const points = state.rounds[s];
    return { name: `stage ${s}`, color: SERIES_COLORS[i % SERIES_COLORS.length], step: true,
             points: [...points, [state.now, points[points.length - 1][1]]] };  // the current round holds until now
  });
  legend($("rounds-legend"), series);
  lineChart($("rounds-chart"), series, { yTitle: "round", yFromZero: true, yStep: 1, yFormat: (v) => v.toFixed(0) });
}

function renderPipeline(state) {
  const S = state.swarm.num_stages, stages = [...Array(S + 1).keys()];
  const byStage = stages.map((s) => state.peers.filter((p) => p.stage === s));
  const node = $("pipeline");
  node.style.gridTemplateColumns = `repeat(${S + 1}, minmax(0, 1fr))`;
  const heads = stages.map((s) => {
    const peers = byStage[s], tps = peers.reduce((a, p) => a + p.tokens_per_s, 0);
    const what = s === 0 ? "trainers · embedding + head" : `blocks ${state.swarm.blocks[s - 1][0]}–${state.swarm.blocks[s - 1][1]}`;
    const round = (state.rounds[String(s)] || [[0, 0]]).slice(-1)[0][1];
    const inRound = peers.filter((p) => p.outer_round === round).length;
    return `<div class="stage-head${s < S ? " flows" : ""}"><div class="title">Stage ${s}</div><div class="sub">${what}</div>` +
           `<div class="sub">${peers.length} repl. · ${human(tps)} tok/s · round ${round} (${inRound}/${peers.length})</div></div>`;
  });
  const cols = stages.map((s) => {
    const cards = byStage[s].map((p) => {
      const loss = p.train_loss === null ? "" : ` · loss ${p.train_loss.toFixed(3)}`;
      // a trainer's microbatch window, and how many inner steps late its microbatches landed (mean, max)
      const stale = p.staleness_max == null ? "" : `, stale ${p.staleness_mean.toFixed(1)}/${p.staleness_max}`;
      const pipe = p.window == null ? "" : ` · window ${p.window}${stale}`;
      // the codecs its activation and gradient frames went in (an adaptive swarm picks one per link), by share
      const frames = p.frames_sent || {}, total = sum(frames);
      const codecs = total ? `<div class="stats">codecs ${Object.keys(frames).sort().map((c) =>
        `${esc(c)} ${(100 * frames[c] / total).toFixed(0)}%`).join(" · ")}</div>` : "";
      return `<div class="peer-card ${p.state}" data-peer="${esc(p.id)}" title="${esc(p.id)}">` +
        `<div class="top"><span class="peer-id">${esc(peerName(p))}</span><span class="badge ${p.state}">${p.state}</span></div>` +
        `<div class="stats">step ${p.step} · ${human(p.tokens_per_s)} tok/s${loss}${pipe}</div>` +
        `<div class="stats">↑ ${bytes(sum(p.rate_sent))}/s ↓ ${bytes(sum(p.rate_received))}/s${p.bans ? ` · ${p.bans} banned` : ""}</div>${codecs}</div>`;
    });
    if (!cards.length) cards.push(`<div class="peer-card missing">no replica: paths skip this stage</div>`);
    return `<div class="stage-col" data-stage="${s}">${cards.join("")}</div>`;
  });
  node.innerHTML = heads.join("") + cols.join("");
}

function renderBandwidth(state) {
  const kinds = [...new Set(state.peers.flatMap((p) => [...Object.keys(p.rate_sent), ...Object.keys(p.rate_received)]))].sort();
  const color = (k, i) => KIND_COLORS[k] || SERIES_COLORS[(i + 3) % SERIES_COLORS.length];
  legend($("bandwidth-legend"), kinds.map((k, i) => ({ name: k.replace("_", " "), color: color(k, i), style: "block" })));
  const max = Math.max(1, ...state.peers.flatMap((p) => [sum(p.rate_sent), sum(p.rate_received)]));
  const bar = (arrow, rates) => `<div class="bw-line"><span class="dir">${arrow}</span><div class="bw-bar">${kinds.map((k, i) => rates[k] ?
    `<span style="width:${(100 * rates[k] / max).toFixed(2)}%;background:${color(k, i)}" title="${k}: ${bytes(rates[k])}/s"></span>` : "").join("")}</div></div>`;
  $("bandwidth").innerHTML = state.peers.map((p) =>
    `<div class="bw-row" data-peer="${esc(p.id)}"><div class="bw-label mono" title="${esc(p.id)}">${esc(peerName(p))}</div>` +
    `<div class="bw-bars">${bar("↑", p.rate_sent)}${bar("↓", p.rate_received)}</div>` +
    `<div class="bw-value">↑ ${bytes(sum(p.rate_sent))}/s · ↓ ${bytes(sum(p.rate_received))}/s<br>${bytes(sum(p.bytes_sent) + sum(p.bytes_received))} in all</div></div>`
  ).join("") || `<div class="muted">no peers yet</div>`;
}

function renderEvents(state) {
  const events = state.events.slice().reverse();
  $("event-count").textContent = `the last ${events.length}`;
  $("events").innerHTML = events.map((e) =>
    `<li><time>${clock(e.time)}</time><span class="kind ${e.kind}">${e.kind}</span><span><span class="mono">${esc(labelOf(state, e.peer))}</span> ${esc(e.text)}</span></li>`
  ).join("") || `<li class="empty">nothing yet</li>`;
}

// [key, title, sort value, cell text, numeric]
const PEER_COLUMNS = [
  ["name", "name", (p) => peerName(p), (p) => peerName(p)],
  ["role", "role", (p) => p.role, (p) => p.role],
  ["stage", "stage", (p) => p.stage, (p) => p.stage, true],
  ["state", "state", (p) => p.state, (p) => p.state],
  ["uptime", "uptime", (p) => p.uptime_s, (p) => (p.uptime_s ? duration(p.uptime_s) : "–"), true],
  ["version", "version", (p) => p.version, (p) => p.version, true],
  ["device", "device", (p) => p.device || "", (p) => p.device || "–"],
  ["step", "step", (p) => p.step, (p) => p.step, true],
  ["tokens_per_s", "tokens/s", (p) => p.tokens_per_s, (p) => human(p.tokens_per_s), true],
  ["tokens", "tokens", (p) => p.tokens, (p) => human(p.tokens), true],
  ["sent", "sent", (p) => sum(p.bytes_sent), (p) => bytes(sum(p.bytes_sent)), true],
  ["received", "received", (p) => sum(p.bytes_received), (p) => bytes(sum(p.bytes_received)), true],
  ["address", "address", (p) => p.address || "", (p) => p.address || "–"],
];

function renderPeersTable(state) {
  const column = PEER_COLUMNS.find((c) => c[0] === sortBy.key) || PEER_COLUMNS[0];
  const rows = state.peers.slice().sort((a, b) => {
    const [x, y] = [column[2](a), column[2](b)];
    const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    return (sortBy.desc ? -order : order) || a.id.localeCompare(b.id);
  });
  const table = $("peers-table");
  table.tHead.rows[0].innerHTML = PEER_COLUMNS.map(([key, title, , , num]) =>
    `<th data-key="${key}" class="${num ? "num" : ""}${key === column[0] ? ` sorted${sortBy.desc ? " desc" : ""}` : ""}">${title}</th>`).join("");
  table.tBodies[0].innerHTML = rows.map((p) => `<tr data-peer="${esc(p.id)}" title="${esc(p.id)}">` +
    PEER_COLUMNS.map(([key, , , text, num]) => `<td data-key="${key}" class="${num ? "num" : ""}${key === "address" ? " addr mono" : ""}">${esc(text(p))}</td>`).join("") +
    "</tr>").join("") || `<tr><td class="muted" colspan="${PEER_COLUMNS.length}">no peers</td></tr>`;
}

function renderHealth(state) {
  $("health").className = `health ${state.health.verdict}`;
  $("health").querySelector(".verdict").textContent = state.health.verdict;
  $("health-reason").textContent = state.health.reason;
  $("health").title = state.health.reason;
}

function render(state) {
  lastState = state;
  $("swarm").textContent = `${state.swarm.id} · ${state.swarm.num_stages} stages`;
  document.title = `swarmloco · ${state.swarm.name}`;
  renderHealth(state);
  renderKpis(state);
  renderLoss(state);
  renderThroughput(state);
  renderRounds(state);
  renderPipeline(state);
  renderPeersTable(state);
  renderBandwidth(state);
  renderEvents(state);
}

function setLive(ok, text) {
  $("live").className = `live ${ok ? "ok" : "down"}`;
  $("live-text").textContent = text;
}

async function poll() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    lastOk = Date.now();
    setLive(true, `live · ${new Date().toLocaleTimeString([], { hour12: false })}`);
  } catch (e) {
    setLive(false, `dashboard unreachable${lastOk ? ` since ${new Date(lastOk).toLocaleTimeString([], { hour12: false })}` : ""}`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("peers-table").tHead.addEventListener("click", (e) => {
  const key = e.target.closest("th")?.dataset.key;
  if (!key) return;
  sortBy = { key, desc: sortBy.key === key ? !sortBy.desc : false };
  if (lastState) renderPeersTable(lastState);
});
$("loss-axis").addEventListener("click", (e) => {
  const axis = e.target.dataset.axis;
  if (!axis) return;
  lossAxis = axis;
  for (const button of $("loss-axis").children) button.classList.toggle("on", button.dataset.axis === axis);
  if (lastState) renderLoss(lastState);
});

poll();
