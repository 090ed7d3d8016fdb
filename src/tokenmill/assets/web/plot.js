// A small line plot on a canvas: one or more series over the same samples, scaled to the largest value shown.

const COLORS = ["#1f5fbf", "#b3541e"]; // blue and orange: apart for most colour vision, dark enough on white

// `series`: [{label, values: [number|null]}]; `span` says how long the samples cover ("last 5 min").
export function plot(canvas, title, series, span) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 320;
  const height = canvas.clientHeight || 120;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && Number.isFinite(v));
  const top = Math.max(1e-9, ...all) * 1.1;
  const pad = { left: 4, right: 4, top: 18, bottom: 14 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  g.font = "12px system-ui, sans-serif";
  g.fillStyle = "#222";
  g.fillText(`${title} (max ${format(Math.max(0, ...all))})`, pad.left, 12);
  g.fillStyle = "#555";
  g.fillText(span, pad.left, height - 2);
  let x = width - pad.right; // the legend, right-aligned on the bottom line, in each series' colour
  [...series].reverse().forEach((s, k) => {
    const label = s.label;
    x -= g.measureText(label).width;
    g.fillStyle = COLORS[(series.length - 1 - k) % COLORS.length];
    g.fillText(label, x, height - 2);
    x -= 12;
  });
  g.strokeStyle = "#ccc";
  g.strokeRect(pad.left, pad.top, w, h);
  series.forEach((s, k) => {
    const n = s.values.length;
    g.strokeStyle = COLORS[k % COLORS.length];
    g.lineWidth = 2;
    g.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null || !Number.isFinite(v)) {
        drawing = false;
        return;
      }
      const x = pad.left + (n > 1 ? (i / (n - 1)) * w : w);
      const y = pad.top + h - (v / top) * h;
      if (drawing) g.lineTo(x, y);
      else g.moveTo(x, y);
      drawing = true;
    });
    g.stroke();
  });
  const latest = series.map((s) => `${s.label} ${format(s.values.at(-1))}`).join(", ");
  canvas.setAttribute("aria-label", `${title}, ${span}; now ${latest}`);
}

export function format(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
}
