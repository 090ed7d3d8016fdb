// Reading Prometheus text (/metrics): a histogram's cumulative buckets, and a percentile from them.

// {le: cumulative count} of `name`'s buckets (summed over label sets, e.g. data-parallel replicas).
export function buckets(text, name) {
  const found = new Map();
  const prefix = `${name}_bucket{`;
  for (const line of text.split("\n")) {
    if (!line.startsWith(prefix)) continue;
    const le = /le="([^"]+)"/.exec(line)?.[1];
    const value = Number(line.slice(line.lastIndexOf(" ") + 1));
    if (le === undefined || Number.isNaN(value)) continue;
    const bound = le === "+Inf" ? Infinity : Number(le);
    found.set(bound, (found.get(bound) ?? 0) + value);
  }
  return found;
}

// The observations between two readings of one histogram: later minus earlier, bucket by bucket.
export function since(later, earlier) {
  const out = new Map();
  for (const [le, count] of later) out.set(le, count - (earlier?.get(le) ?? 0));
  return out;
}

// The q-quantile (0..1) of a histogram's observations, interpolated within its bucket; null with none.
export function quantile(hist, q) {
  const bounds = [...hist.keys()].sort((a, b) => a - b);
  const total = hist.get(Infinity) ?? 0;
  if (!total) return null;
  let lower = 0;
  let below = 0;
  for (const le of bounds) {
    const count = hist.get(le);
    if (count >= q * total) {
      if (le === Infinity) return lower; // past the last bound: the bound is all we know
      return lower + ((le - lower) * (q * total - below)) / Math.max(count - below, 1e-9);
    }
    lower = le;
    below = count;
  }
  return lower;
}
