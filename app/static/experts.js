// Colibri's expert cache page: plain JavaScript, no build step. Polls /v1/expert_cache
// every second and draws each layer's routed experts as one row of cells (the colour says
// where the expert is: on disk, loading, in RAM, pinned in RAM, or on the GPU; the shade,
// how often it was chosen lately), the cache's and the GPU tier's numbers, and the last
// minutes of hit rate, tokens/s and batch size.
"use strict";

const $ = (id) => document.getElementById(id);
const WINDOW_S = 300; // the history the server keeps
// where an expert is: the cache's states (the server's numbers 0 to 3), then the GPU
const PLACES = ["on disk (absent)", "loading", "in RAM (resident)", "pinned in RAM",
  "on the GPU"];
const RESIDENT = 2;
const ON_GPU = 4;
// per place: the colour of a cold expert and of the hottest one
const COLOURS = [
  [[236, 236, 236], [150, 150, 150]],
  [[255, 233, 179], [232, 150, 0]],
  [[207, 224, 255], [25, 90, 210]],
  [[204, 236, 208], [20, 135, 60]],
  [[233, 215, 250], [125, 40, 180]],
];
// the GPU tier's counters drawn in the fixed numbers; any other it reports gets its own
const TIER_SHOWN = new Set(["hits", "misses", "uploads", "upload_bytes", "evictions"]);
window.expertData = null; // the last answer (the browser test reads it)
window.gridGeometry = null; // where each cell was drawn, in canvas pixels

function headers() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

// The server answered 401: unfold the key field (folded away until now) and say what it
// wants. The field takes the focus once, when it unfolds, not on every poll.
function askForKey() {
  const box = $("api-key").closest("details");
  if (!box.open) {
    box.open = true;
    $("api-key").focus();
  }
  $("status").textContent = $("api-key").value.trim()
    ? "the server refused this API key: check it in the API key field"
    : "this server needs an API key: enter it in the API key field";
}

function mb(bytes) {
  return (bytes / 1e6).toFixed(bytes < 1e7 ? 2 : 1) + " MB";
}

function seconds(ns) {
  const s = ns / 1e9;
  return s < 10 ? s.toFixed(3) + " s" : s.toFixed(1) + " s";
}

function percent(x) {
  return (100 * x).toFixed(1) + "%";
}

// A canvas sized to its box at the screen's pixel density; returns its 2D context.
function sized(canvas, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.floor(canvas.clientWidth));
  const h = Math.max(1, Math.floor(cssHeight ?? canvas.clientHeight));
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  if (cssHeight !== undefined) canvas.style.height = h + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h, dpr };
}

// Where expert e of layer l is: on the GPU when the GPU tier holds it there, else the
// cache's state; without the cache every expert the GPU does not hold is in RAM.
function placeOf(d, l, e) {
  const onGpu = d.gpu_tier && d.gpu_tier.on_device[l];
  if (onGpu && onGpu[e]) return ON_GPU;
  return d.state ? d.state[l][e] : RESIDENT;
}

// The heat of each [layer][expert]: the cache's, else the GPU tier's.
function heatOf(d) {
  return d.heat || (d.gpu_tier && d.gpu_tier.heat) || [];
}

function drawGrid(d) {
  const canvas = $("grid");
  const labelW = 34;
  const avail = Math.max(1, canvas.clientWidth - labelW);
  const cw = Math.max(2, Math.min(24, Math.floor(avail / d.n_expert)));
  const ch = Math.max(4, Math.min(22, cw));
  const { ctx, dpr } = sized(canvas, d.n_layer * ch + 2);
  const heat = heatOf(d);
  let hottest = 0;
  for (const row of heat) for (const h of row) hottest = Math.max(hottest, h);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  const gap = cw >= 6 ? 1 : 0;
  const dense = new Set(d.dense_layers || []);
  for (let l = 0; l < d.n_layer; l++) {
    if (ch >= 9) {
      ctx.fillStyle = "#666";
      ctx.fillText("L" + l, 0, l * ch + ch / 2);
    }
    if (dense.has(l)) {  // a dense layer: no experts, one band
      ctx.fillStyle = "#eee";
      ctx.fillRect(labelW, l * ch, d.n_expert * cw - gap, ch - gap);
      if (ch >= 9) {
        ctx.fillStyle = "#888";
        ctx.fillText("dense", labelW + 4, l * ch + ch / 2);
      }
      continue;
    }
    for (let e = 0; e < d.n_expert; e++) {
      const [cold, hot] = COLOURS[placeOf(d, l, e)] || COLOURS[0];
      const h = heat[l] ? heat[l][e] || 0 : 0;
      const t = hottest > 0 ? Math.sqrt(h / hottest) : 0;
      const c = cold.map((v, i) => Math.round(v + (hot[i] - v) * t));
      ctx.fillStyle = `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
      ctx.fillRect(labelW + e * cw, l * ch, cw - gap, ch - gap);
    }
  }
  window.gridGeometry = { x0: labelW, y0: 0, cw, ch, dpr, hottest };
}

// One line chart: points [{t, v}], v null leaves a gap; max null scales to the data.
function drawChart(canvas, points, max, format) {
  const { ctx, w, h } = sized(canvas);
  const pad = 14;
  const top = max ?? Math.max(1e-9, ...points.map((p) => p.v ?? 0)) * 1.1;
  const end = points.length ? points[points.length - 1].t : 0;
  const x = (t) => w * (1 - (end - t) / WINDOW_S);
  const y = (v) => h - 2 - (h - pad - 2) * Math.min(1, v / top);
  ctx.strokeStyle = "#ddd";
  ctx.beginPath();
  ctx.moveTo(0, y(0));
  ctx.lineTo(w, y(0));
  ctx.stroke();
  ctx.fillStyle = "#888";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textBaseline = "top";
  ctx.fillText("max " + format(top), 2, 1);
  ctx.strokeStyle = "#1f5fd0";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let open = false;
  let prev = null;
  for (const p of points) {
    // more than two seconds without a point: the engine was idle, the line breaks
    if (p.v === null || (prev !== null && p.t - prev > 2.5)) open = false;
    prev = p.t;
    if (p.v === null) continue;
    if (open) ctx.lineTo(x(p.t), y(p.v));
    else ctx.moveTo(x(p.t), y(p.v));
    open = true;
  }
  ctx.stroke();
  ctx.fillStyle = "#1f5fd0"; // a dot on each second, so a lone one shows too
  for (const p of points) if (p.v !== null) ctx.fillRect(x(p.t) - 1, y(p.v) - 1, 2, 2);
}

function series(history, key) {
  return history.map((p) => ({ t: p.t, v: p[key] }));
}

function showNumbers(d) {
  const t = d.totals;
  if (d.enabled) {
    const used = t.hits + t.misses;
    $("hit-rate").textContent = used ? percent(t.hit_rate) : "–";
    $("hit-rate").dataset.value = used ? String(t.hit_rate) : "";
    $("resident-label").textContent = "resident of budget";
    $("resident").textContent = mb(t.resident_bytes) + " of " + mb(d.budget_bytes);
    $("bytes-read").textContent = mb(t.bytes_read);
    $("stall").textContent = seconds(t.stall_ns);
    $("prefetch").textContent = t.prefetch_used + " of " + t.prefetch_issued;
    $("slots").textContent = d.slots_per_layer + " of " + d.n_expert;
  } else {
    $("resident-label").textContent = "resident";
    $("resident").textContent = mb(d.budget_bytes);
    $("slots").textContent = d.n_expert + " of " + d.n_expert;
  }
  const nDense = (d.dense_layers || []).length;
  $("reason").textContent = d.n_moe_layers + " MoE layers of " + d.n_expert + " experts, " +
    mb(d.expert_bytes) + " each" + (nDense ? ", " + nDense + " dense layers" : "") +
    (d.shared_expert_bytes ? "; shared experts " + mb(d.shared_expert_bytes) +
      ", always resident, not routed" : "") + "; size: " + d.reason;
}

// A number of the GPU tier's by its counter name, made the first time it is reported.
function tierNumber(key) {
  let value = $("tier-" + key);
  if (!value) {
    const box = document.createElement("div");
    box.className = "num";
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = key.replaceAll("_", " ");
    value = document.createElement("span");
    value.id = "tier-" + key;
    box.append(label, value);
    $("tier-numbers").append(box);
  }
  return value;
}

function showTier(t, d) {
  const used = t.hits + t.misses;
  $("tier-on-device").textContent = t.experts_on_device + " of " +
    t.layers.length * d.n_expert + " (" + mb(t.device_expert_bytes) + ")";
  $("tier-on-device").title = "routed experts of the layers that run on the GPU";
  $("tier-hit-rate").textContent = used ? percent(t.hits / used) : "–";
  $("tier-hit-rate").title = t.hits + " of " + used +
    " expert uses in the GPU's layers; the others ran on the CPU beside it";
  $("tier-uploads").textContent = t.uploads + " (" + mb(t.upload_bytes) + ")";
  $("tier-evictions").textContent = String(t.evictions);
  for (const key of t.counter_names || []) {
    if (TIER_SHOWN.has(key) || typeof t[key] !== "number") continue;
    tierNumber(key).textContent = key.endsWith("bytes") ? mb(t[key]) : String(t[key]);
  }
}

function show(d) {
  const tier = d.gpu_tier || null;
  document.body.classList.toggle("off", !d.enabled);
  document.body.classList.toggle("tier", tier !== null);
  document.body.classList.toggle("nogrid", !d.enabled && tier === null);
  $("off").hidden = d.enabled;
  $("off").textContent = d.enabled ? "" : tier
    ? "The expert cache is off: every expert is resident, in RAM or on the GPU; " + d.reason + "."
    : "The expert cache is off: every expert is resident (" + d.reason + ").";
  showNumbers(d);
  if (tier) showTier(tier, d);
  if (d.enabled || tier) drawGrid(d);
  const h = d.history;
  const last = h.length ? h[h.length - 1] : null;
  if (d.enabled) {
    drawChart($("chart-hit"), series(h, "hit_rate"), 1, percent);
    const lastRate = h.length ? [...h].reverse().find((p) => p.hit_rate !== null) : null;
    $("now-hit").textContent = lastRate ? percent(lastRate.hit_rate) : "";
  }
  drawChart($("chart-tok"), series(h, "tok_s"), null, (v) => v.toFixed(0));
  drawChart($("chart-batch"), series(h, "batch"), null, (v) => v.toFixed(1));
  $("now-tok").textContent = last ? last.tok_s.toFixed(1) : "";
  $("now-batch").textContent = last ? last.batch.toFixed(2) : "";
}

async function poll() {
  if (document.hidden) { // nobody looks: ask again later
    setTimeout(poll, 1000);
    return;
  }
  try {
    const r = await fetch("/v1/expert_cache", { headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      askForKey();
      return;
    }
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error ? body.error.message : r.status + " " + r.statusText);
    window.expertData = body;
    show(body);
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    $("status").textContent = "unavailable: " + e.message;
  } finally {
    setTimeout(poll, 1000);
  }
}

$("grid").addEventListener("mousemove", (ev) => {
  const d = window.expertData;
  const g = window.gridGeometry;
  if (!d || !(d.enabled || d.gpu_tier) || !g) return;
  const rect = $("grid").getBoundingClientRect();
  const e = Math.floor((ev.clientX - rect.left - g.x0) / g.cw);
  const l = Math.floor((ev.clientY - rect.top - g.y0) / g.ch);
  if (l < 0 || l >= d.n_layer || e < 0 || e >= d.n_expert) return;
  if ((d.dense_layers || []).includes(l)) {
    $("cell-info").textContent = "layer " + l + ": dense (no experts)";
    return;
  }
  const heat = heatOf(d);
  $("cell-info").textContent = "layer " + l + ", expert " + e + ": " + PLACES[placeOf(d, l, e)] +
    ", heat " + (heat[l] ? heat[l][e] || 0 : 0).toFixed(2);
});
window.addEventListener("resize", () => window.expertData && show(window.expertData));
$("api-key").addEventListener("change", () => { $("status").textContent = "…"; });
poll();
