// The page: translate with POST /v1/translate, then draw POST /v1/attention weights as a heatmap.
"use strict";

const $ = (id) => document.getElementById(id);
let attention = null;  // the last /v1/attention response
let pairs = [];        // [source, translation] per input line

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const response = await fetch(path, init);
  const data = await response.json();
  if (!response.ok) {
    const err = data.error || {};
    throw new Error(`${response.status} ${err.code || ""}: ${err.message || "request failed"}`);
  }
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function loadModelInfo() {
  try {
    const info = await api("/v1/model");
    const m = info.model;
    $("model-info").textContent = `${info.name} · ${info.src_lang} → ${info.tgt_lang} · ` +
      `N=${m.n_layers}, d_model=${m.d_model}, h=${m.n_heads} · ` +
      `${(info.parameters / 1e6).toFixed(2)}M parameters · ${info.dtype}`;
    $("src-lang").textContent = `[${info.src_lang}]`;
    $("tgt-lang").textContent = `[${info.tgt_lang}]`;
    $("beam").value = info.decode.beam_size;
    $("alpha").value = info.decode.length_penalty;
  } catch (e) {
    $("model-info").textContent = `model info unavailable: ${e.message}`;
  }
}

function renderOutput(results) {
  const out = $("output");
  out.replaceChildren();
  for (const r of results) {
    const line = document.createElement("div");
    line.className = "line";
    const best = document.createElement("span");
    best.className = "translation";
    best.textContent = r.translations[0].text;
    line.append(best);
    r.translations.slice(1).forEach((t, i) => {
      const alt = document.createElement("div");
      alt.className = "alt";
      alt.textContent = `${i + 2}. ${t.text}`;
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = t.score.toFixed(3);
      alt.append(score);
      line.append(alt);
    });
    out.append(line);
  }
}

async function translate() {
  const lines = $("source").value.split("\n").filter((l) => l.trim());
  if (!lines.length) { showError("Type a sentence first."); return; }
  const beam = Number($("beam").value);
  const body = {
    texts: lines, beam_size: beam, length_penalty: Number($("alpha").value),
    n_best: Math.min(Number($("nbest").value), beam),
  };
  $("translate").disabled = true;
  $("status").textContent = "translating…";
  showError("");
  try {
    const data = await api("/v1/translate", body);
    renderOutput(data.results);
    $("status").textContent = `${data.elapsed_ms.toFixed(0)} ms`;
    pairs = data.results.map((r) => [r.source, r.translations[0].text]);
    $("sentence").replaceChildren(...pairs.map((p, i) => new Option(`${i + 1}: ${p[0].slice(0, 40)}`, i)));
    await loadAttention(0);
  } catch (e) {
    showError(e.message);
    $("status").textContent = "";
  } finally {
    $("translate").disabled = false;
  }
}

async function loadAttention(index) {
  const [source, target] = pairs[index];
  try {
    attention = await api("/v1/attention", { source, target });
  } catch (e) {
    $("attention-panel").hidden = true;
    showError(`attention: ${e.message}`);
    return;
  }
  const layers = attention.encoder.length, heads = attention.encoder[0].length;
  const keepLayer = Math.min(Number($("layer").value || layers), layers);
  $("layer").replaceChildren(...Array.from({ length: layers }, (_, i) => new Option(`${i + 1}`, i + 1)));
  $("layer").value = keepLayer;
  const keepHead = $("head").value || "mean";
  $("head").replaceChildren(new Option("mean of heads", "mean"),
    ...Array.from({ length: heads }, (_, i) => new Option(`${i + 1}`, i + 1)));
  $("head").value = keepHead === "mean" || Number(keepHead) <= heads ? keepHead : "mean";
  $("attention-panel").hidden = false;
  draw();
}

function selectedMatrix() {
  const kind = $("kind").value;
  const perHead = attention[kind][Number($("layer").value) - 1];  // H x rows x cols
  const head = $("head").value;
  const matrix = head === "mean"
    ? perHead[0].map((row, i) => row.map((_, j) => perHead.reduce((s, h) => s + h[i][j], 0) / perHead.length))
    : perHead[Number(head) - 1];
  const src = attention.source_pieces, out = attention.target_pieces, inp = attention.target_input_pieces;
  const labels = { encoder: [src, src], decoder: [out, inp], cross: [out, src] }[kind];
  return { matrix, rows: labels[0], cols: labels[1] };
}

function draw() {
  const { matrix, rows, cols } = selectedMatrix();
  const canvas = $("heatmap"), ctx = canvas.getContext("2d");
  const font = "13px system-ui, sans-serif";
  ctx.font = font;
  const textWidth = (labels) => Math.max(...labels.map((l) => ctx.measureText(l).width), 10);
  const cell = Math.max(14, Math.min(30, Math.floor(760 / Math.max(cols.length, rows.length))));
  const left = textWidth(rows) + 14, top = textWidth(cols) * 0.72 + 18;
  const ratio = window.devicePixelRatio || 1;
  const width = left + cols.length * cell + 10, height = top + rows.length * cell + 10;
  canvas.width = width * ratio; canvas.height = height * ratio;
  canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
  ctx.scale(ratio, ratio);
  ctx.font = font;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, width, height);
  const top1 = Math.max(...matrix.map((row) => Math.max(...row)), 1e-6);
  matrix.forEach((row, i) => row.forEach((w, j) => {
    const v = Math.max(0, Math.min(1, w / top1));  // colour scaled to the largest weight
    const shade = (a, b) => Math.round(a + (b - a) * v);
    ctx.fillStyle = `rgb(${shade(247, 16)},${shade(250, 52)},${shade(255, 140)})`;
    ctx.fillRect(left + j * cell, top + i * cell, cell - 1, cell - 1);
  }));
  ctx.fillStyle = "#1d2330";
  ctx.textBaseline = "middle"; ctx.textAlign = "right";
  rows.forEach((label, i) => ctx.fillText(label, left - 6, top + i * cell + cell / 2));
  ctx.textAlign = "left";
  cols.forEach((label, j) => {
    ctx.save();
    ctx.translate(left + j * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 4);
    ctx.fillText(label, 0, 0);
    ctx.restore();
  });
  canvas.onmousemove = (ev) => {
    const r = canvas.getBoundingClientRect();
    const j = Math.floor((ev.clientX - r.left - left) / cell), i = Math.floor((ev.clientY - r.top - top) / cell);
    $("cell").textContent = i >= 0 && j >= 0 && i < rows.length && j < cols.length
      ? `${rows[i]} → ${cols[j]}: ${matrix[i][j].toFixed(3)}` : "\u00a0";
  };
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate();
});
$("sentence").addEventListener("change", () => loadAttention(Number($("sentence").value)));
for (const id of ["kind", "layer", "head"]) $(id).addEventListener("change", draw);
loadModelInfo();
