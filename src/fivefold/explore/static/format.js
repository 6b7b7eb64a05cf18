// Number formats of the page (mirrored by tests/explore/formatting.py).

export const fmt = {
  time(s) {
    if (s === null || s === undefined) return "—";
    if (s === 0) return "0";
    if (s >= 1) return `${s.toFixed(3)} s`;
    if (s >= 1e-3) return `${(s * 1e3).toFixed(1)} ms`;
    return `${(s * 1e6).toFixed(1)} µs`;
  },
  pct(x) { return x === null || x === undefined ? "—" : `${(x * 100).toFixed(1)} %`; },
  gib(x) { return x === null || x === undefined ? "—" : `${x.toFixed(2)} GiB`; },
  int(x) { return x === null || x === undefined ? "—" : Math.round(x).toLocaleString("en-US"); },
  bytes(b) {
    if (b === null || b === undefined) return "—";
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, size] of units) if (b >= size) return `${(b / size).toFixed(2)} ${unit}`;
    return `${Math.round(b)} B`;
  },
  count(n) {
    if (n >= 1e12) return `${(n / 1e12).toFixed(2)}T`;
    if (n >= 1e9) return `${(n / 1e9).toFixed(2)}B`;
    if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
    return n.toLocaleString("en-US");
  },
};
