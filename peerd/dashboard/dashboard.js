// The peerd dashboard: polls this peer's dashboard.json every 2 s and draws it. Plain DOM and
// hand-made SVG charts, no libraries and no fetch but dashboard.json. Every string that came from
// the network (peer IDs, reasons) goes in as text, never as markup.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const W = 480, H = 170, LEFT = 46, RIGHT = 8, TOP = 8, BOTTOM = 20;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const node = tag === "svg" || ["path", "line", "text", "circle", "g"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

const isNum = (v) => typeof v === "number" && isFinite(v);

function fmtNum(v, digits = 3) {
  if (!isNum(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Number(v.toPrecision(digits)));
}

function fmtBytes(v) {
  if (!isNum(v)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return `${i ? v.toFixed(1) : v.toFixed(0)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (!isNum(s)) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

const ago = (now, t) => (isNum(t) && t > 0 ? `${fmtSeconds(Math.max(0, now - t))} ago` : "–");
const shortId = (id) => (typeof id === "string" && id.length > 12 ? `${id.slice(0, 6)}…${id.slice(-4)}` : String(id));

// One line chart: lines = [{xs, ys, cls}], nulls break a line. Sets data-points to the number of
// drawn points (what the browser test reads).
function drawChart(svg, lines) {
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const all = [];
  for (const line of lines) line.xs.forEach((x, i) => { if (isNum(x) && isNum(line.ys[i])) all.push([x, line.ys[i]]); });
  svg.dataset.points = String(all.length);
  if (all.length === 0) {
    svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const sx = (x) => LEFT + ((x - x0) / (x1 - x0)) * (W - LEFT - RIGHT);
  const sy = (y) => TOP + (1 - (y - y0) / (y1 - y0)) * (H - TOP - BOTTOM);
  for (const frac of [0, 0.5, 1]) {
    const y = y0 + frac * (y1 - y0);
    svg.append(el("line", { x1: LEFT, x2: W - RIGHT, y1: sy(y), y2: sy(y), class: "grid" }));
    svg.append(el("text", { x: LEFT - 4, y: sy(y) + 3, "text-anchor": "end" }, fmtNum(y)));
  }
  svg.append(el("text", { x: LEFT, y: H - 4 }, `-${fmtSeconds(x1 - x0)}`));
  svg.append(el("text", { x: W - RIGHT, y: H - 4, "text-anchor": "end" }, "now"));
  for (const line of lines) {
    let d = "", pen = "M", count = 0;
    line.xs.forEach((x, i) => {
      const y = line.ys[i];
      if (!isNum(x) || !isNum(y)) { pen = "M"; return; }
      d += `${pen}${sx(x).toFixed(1)},${sy(y).toFixed(1)} `;
      pen = "L";
      count++;
    });
    if (d) svg.append(el("path", { d, class: `series ${line.cls || ""}` }));
    if (count <= 40) {  // few points: show each one, or a lone point would not show at all
      line.xs.forEach((x, i) => {
        if (isNum(x) && isNum(line.ys[i])) svg.append(el("circle", { cx: sx(x), cy: sy(line.ys[i]), r: 2, class: "dot" }));
      });
    }
  }
}

// Bytes per second between consecutive points of a running total.
function rates(ts, totals) {
  const out = [null];
  for (let i = 1; i < ts.length; i++) {
    const dt = ts[i] - ts[i - 1];
    out.push(isNum(totals[i]) && isNum(totals[i - 1]) && dt > 0 ? (totals[i] - totals[i - 1]) / dt : null);
  }
  return out;
}

function cell(row, text, cls) {
  const td = el("td", cls ? { class: cls } : {}, text);
  row.append(td);
  return td;
}

function renderPeers(data) {
  const me = data.status.peer_id;
  const body = $("peers").querySelector("tbody");
  body.replaceChildren();
  const rows = data.peers.slice();
  if (!rows.some((p) => p.peer_id === me)) {  // not training (no progress records): still show us
    rows.unshift({ peer_id: me, epoch: data.status.epoch, samples: data.status.samples,
                   samples_per_s: data.status.samples_per_s, rounds: null, failed: null, last_seen: data.now });
  }
  for (const peer of rows) {
    const row = el("tr", { "data-peer": peer.peer_id, class: peer.peer_id === me ? "me" : "" });
    const id = cell(row, shortId(peer.peer_id) + (peer.peer_id === me ? " (this peer)" : ""), "peer");
    id.title = peer.peer_id;
    cell(row, fmtNum(peer.epoch, 9));
    cell(row, fmtNum(peer.samples, 9));
    cell(row, fmtNum(peer.samples_per_s));
    cell(row, peer.peer_id === me ? "–" : fmtNum(peer.rounds, 9));
    cell(row, peer.peer_id === me ? "–" : fmtNum(peer.failed, 9), peer.failed ? "bad" : "");
    cell(row, peer.peer_id === me ? "now" : ago(data.now, peer.last_seen));
    body.append(row);
  }
  $("peers-note").textContent = `(${rows.length}; figures are each peer's own claims)`;
}

function renderRounds(data) {
  const body = $("rounds").querySelector("tbody");
  body.replaceChildren();
  if (data.rounds.length === 0) {
    const row = el("tr");
    cell(row, "no round yet").colSpan = 8;
    body.append(row);
  }
  for (const round of data.rounds) {
    const row = el("tr", { "data-epoch": round.epoch });
    cell(row, ago(data.now, round.t));
    cell(row, fmtNum(round.epoch, 9));
    const failed = round.failed.length > 0;
    if (round.averaged) cell(row, failed ? "averaged, some failed" : "averaged", failed ? "bad" : "ok");
    else cell(row, `not averaged: ${round.reason || "?"}`, "bad");
    cell(row, round.group ? String(round.group) : "–");
    const who = cell(row, failed ? round.failed.map(shortId).join(", ") : "–", failed ? "bad peer" : "");
    who.title = round.failed.join("\n");
    cell(row, fmtSeconds(round.matchmaking_s));
    cell(row, fmtSeconds(round.allreduce_s));
    cell(row, fmtBytes(round.bytes));
    body.append(row);
  }
}

// A peer that is a machine of several ranks (peerd join --nproc-per-node) lists them; others hide it.
function renderRanks(status) {
  const ranks = status.ranks;
  $("ranks-section").hidden = !ranks;
  if (!ranks) return;
  $("ranks-note").textContent =
    `${ranks.world_size} ranks · ${ranks.backend} on ${ranks.device} · parameters shared ${ranks.parameters_shared} times`;
  const body = $("ranks").querySelector("tbody");
  body.replaceChildren();
  for (const rank of ranks.ranks) {
    const row = document.createElement("tr");
    row.dataset.rank = String(rank.rank);
    cell(row, String(rank.rank));
    cell(row, fmtNum(rank.samples, 9));
    cell(row, fmtNum(rank.loss));
    cell(row, isNum(rank.batch_ms) ? `${fmtNum(rank.batch_ms)} ms` : "–");
    body.append(row);
  }
}

function render(data) {
  const s = data.status, series = data.series;
  $("peer-id").textContent = s.peer_id;
  $("run").textContent = `run ${s.run_id} · ${s.task || "no task"}${s.address ? " · " + s.address : ""}`;
  document.title = `peerd ${shortId(s.peer_id)} · epoch ${s.epoch ?? "–"}`;
  const textTask = series.bits_per_byte.some(isNum) || isNum(s.bits_per_byte);
  const qualityKey = textTask ? "bits_per_byte" : "accuracy";
  const qualityName = textTask ? "held-out bits per byte" : "held-out accuracy";
  $("tile-epoch").textContent = fmtNum(s.epoch, 9);
  $("tile-rate").textContent = fmtNum(s.samples_per_s);
  $("tile-loss").textContent = fmtNum(s.loss);
  $("tile-quality-label").textContent = qualityName;
  $("tile-quality").textContent = fmtNum(s[qualityKey]);
  $("chart-quality-caption").textContent = qualityName;
  $("tile-peers").textContent = fmtNum(s.peers_known, 9);
  $("tile-in").textContent = fmtBytes(s.bytes_received);
  $("tile-out").textContent = fmtBytes(s.bytes_sent);
  $("tile-uptime").textContent = fmtSeconds(s.uptime_s);
  const t = series.t;
  drawChart($("chart-loss"), [{ xs: t, ys: series.loss }]);
  drawChart($("chart-quality"), [{ xs: t, ys: series[qualityKey] }]);
  drawChart($("chart-rate"), [{ xs: t, ys: series.samples_per_s }]);
  drawChart($("chart-traffic"), [
    { xs: t, ys: rates(t, series.bytes_received) },
    { xs: t, ys: rates(t, series.bytes_sent), cls: "second" },
  ]);
  renderPeers(data);
  renderRounds(data);
  renderRanks(s);
}

function setConnection(state, text) {
  const badge = $("connection");
  badge.className = `badge ${state}`;
  badge.textContent = text;
}

async function poll() {
  try {
    const response = await fetch("dashboard.json", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    setConnection("live", `live · ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    setConnection("down", `peer not answering (${error.message})`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
