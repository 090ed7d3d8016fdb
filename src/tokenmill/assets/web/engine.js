// The live engine view: /stats and /metrics read every second while the view is open; gauges for now, plots of
// the last five minutes, and TTFT/TPOT percentiles over the last minute (from the histograms' buckets).

import { getJSON, getText } from "./api.js";
import { buckets, quantile, since } from "./metrics.js";
import { format, plot } from "./plot.js";

const PERIOD_MS = 1000;
const KEEP = 300; // samples plotted: five minutes
const WINDOW = 60; // samples the percentiles cover: one minute
const TTFT = "tokenmill:time_to_first_token_seconds";
const TPOT = "tokenmill:request_time_per_output_token_seconds";
const PLOTS = [
  ["Requests", (s) => [["running", s.stats.running], ["waiting", s.stats.waiting]]],
  ["KV cache use %", (s) => [["used", 100 * s.stats.kv_cache_usage]]],
  ["Throughput tok/s", (s) => [["generated", s.genRate], ["prompt", s.promptRate]]],
  ["Latency ms", (s) => [["TTFT p50", s.ttft[0.5]], ["TPOT p50", s.tpot[0.5]]]],
];

const history = [];
let timer = null;
let busy = false;
let onError = () => {};

export function start(reportError) {
  onError = reportError;
  if (timer) return;
  tick();
  timer = setInterval(tick, PERIOD_MS);
}

export function stop() {
  clearInterval(timer);
  timer = null;
}

async function tick() {
  if (busy) return; // a slow server: skip a beat rather than pile up requests
  busy = true;
  try {
    const [stats, text] = await Promise.all([getJSON("/stats"), getText("/metrics")]);
    history.push(sample(stats, text, performance.now()));
    if (history.length > KEEP) history.shift();
    draw(history.at(-1));
  } catch (e) {
    onError(`Engine view: ${e.message}`);
  } finally {
    busy = false;
  }
}

function sample(stats, text, now) {
  const prev = history.at(-1);
  const old = history.length ? history[Math.max(0, history.length - WINDOW)] : null;
  const seconds = prev ? (now - prev.now) / 1000 : 0;
  const rate = (key) => (prev && seconds > 0 ? (stats[key] - prev.stats[key]) / seconds : null);
  const hists = { ttft: buckets(text, TTFT), tpot: buckets(text, TPOT) };
  const pct = (key) => {
    const recent = since(hists[key], old?.hists[key]);
    return Object.fromEntries([0.5, 0.9, 0.99].map((q) => [q, ms(quantile(recent, q))]));
  };
  return { now, stats, hists, genRate: rate("generation_tokens"), promptRate: rate("prompt_tokens"),
    ttft: pct("ttft"), tpot: pct("tpot") };
}

const ms = (seconds) => (seconds === null ? null : seconds * 1000);

function draw(s) {
  const st = s.stats;
  const gauges = [
    ["running", "Running", st.running],
    ["waiting", "Waiting", st.waiting],
    ["kv", "KV pool use", `${format(100 * st.kv_cache_usage)} % (${st.kv_blocks_used} / ${st.kv_blocks_total} blocks)`],
    ["prefix", "Prefix-cache hit rate", `${format(100 * st.prefix_cache_hit_rate)} %`],
    ["throughput", "Generated tok/s", format(s.genRate)],
    ["ttft", "TTFT p50 / p90 / p99 (ms)", [0.5, 0.9, 0.99].map((q) => format(s.ttft[q])).join(" / ")],
    ["tpot", "TPOT p50 / p90 / p99 (ms)", [0.5, 0.9, 0.99].map((q) => format(s.tpot[q])).join(" / ")],
    ["requests", "Completed / aborted", `${st.completed_requests} / ${st.aborted_requests}`],
  ];
  document.getElementById("gauges").replaceChildren(...gauges.map(([key, label, value]) => {
    const row = document.createElement("div");
    row.dataset.gauge = key;
    row.append(Object.assign(document.createElement("dt"), { textContent: label }),
      Object.assign(document.createElement("dd"), { textContent: String(value) }));
    return row;
  }));
  const box = document.getElementById("plots");
  if (box.childElementCount !== PLOTS.length) {
    box.replaceChildren(...PLOTS.map(() => Object.assign(document.createElement("canvas"), { role: "img" })));
  }
  const span = `last ${Math.round((history.length * PERIOD_MS) / 1000)} s`;
  PLOTS.forEach(([title, read], i) => {
    const names = read(s).map(([label]) => label);
    const series = names.map((label, k) => ({ label, values: history.map((h) => read(h)[k][1]) }));
    plot(box.children[i], title, series, span);
  });
}
