"""The summary rows of BENCHMARKS.md, each computed from one run_all ``results.json``.

One function per section (``ROWS``) reads that section's JSON result and returns its rows: what
is measured, hwr's value, the best peer of the same section of the same run, the ratio (> 1:
hwr ahead), and the physical limit where one applies. A section that is missing or failed yields no row; one
whose JSON lacks a field yields a row saying so: the table never shows a number that the run
did not produce. No imports beyond the standard library: rendering a report
needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import fmt_ms, fmt_ratio

MiB = 1 << 20


@dataclass
class Row:
    what: str
    hwr: str
    peer: str = "-"
    ratio: str = "-"
    limit: str = "-"
    section: str = ""

    def cells(self, anchors: dict[str, str] | None = None) -> list[str]:
        """The table cells; the section links to ``anchors[section]`` when given."""
        where = f"[{self.section}](#{anchors[self.section]})" if anchors and self.section in anchors else self.section
        return [self.what, self.hwr, self.peer, self.ratio, self.limit, where]


# The benchmarks' own formatting, so the summary reads exactly like the section tables.
ms = fmt_ms
times = fmt_ratio  # ``peer / hwr`` as ``12.3x``: how many times hwr is ahead (lower is better for both)


PEER_NAMES = {"safe_open": "safetensors safe_open (mmap)", "load_file": "safetensors load_file (0.8: mmap)",
              "load_file-pread": "safetensors load_file, pread copy", "runai": "Run:ai Model Streamer",
              "fastsafetensors": "fastsafetensors", "vllm-omni": "vLLM-Omni store lookup",
              "copy": "load_file, pread copy"}
COPYING = ("load_file-pread", "runai", "fastsafetensors")


def peers(r: dict[str, Any]) -> list[Row]:
    modes, size = r["modes"], r["artifact_bytes"] / MiB
    hwr = modes["hwrd"]["touch_ms"]["median"]

    def best(names: list[str]) -> tuple[str, float]:
        name = min(names, key=lambda n: modes[n]["touch_ms"]["median"])
        return name, modes[name]["touch_ms"]["median"]

    rows = []
    others = [n for n in modes if n != "hwrd"]
    if others:
        name, value = best(others)
        rows.append(Row(f"fresh worker, every tensor usable and touched ({size:.0f} MiB), any loader",
                        ms(hwr), f"{PEER_NAMES.get(name, name)}: {ms(value)}", times(value, hwr),
                        "mmap of the page cache (the mmap loaders: no final layout)"))
    copying = [n for n in COPYING if n in modes]
    if copying:
        name, value = best(copying)
        rows.append(Row(f"fresh worker, every tensor usable and touched ({size:.0f} MiB), loaders that copy",
                        ms(hwr), f"{PEER_NAMES.get(name, name)}: {ms(value)}", times(value, hwr)))
    return rows


def warm_start(r: dict[str, Any]) -> list[Row]:
    lat = r["lease_latency"]
    paced = [x for x in lat if x.get("interval_ms") and x.get("op") != "ping" and x["artifact"].startswith("small")]
    floor = [x for x in lat if x.get("op") == "ping"]
    if not paced:
        return []
    top = max(paced, key=lambda x: x["clients"])
    p99 = max(top["acquire_ms"]["p99"], top["release_ms"]["p99"])
    floors = sorted(x["acquire_ms"]["p99"] for x in floor if x["clients"] == top["clients"])
    limit = "-" if not floors else f"bare round trip p99 {ms(floors[0])}" if len(floors) == 1 else \
        f"bare round trips p99 {ms(floors[0])} and {ms(floors[-1])} (before and after)"
    rate = 1e3 / top["interval_ms"]
    return [Row(f"lease acquire/release p99, {top['clients']} client processes paced at {rate:g}/s each "
                "(goal < 5 ms)", ms(p99), "-", "-", limit)]


def scaling(r: dict[str, Any]) -> list[Row]:
    s = r["scaling"]
    n = max(x["workers"] for x in s["hwrd"])
    at = {mode: next(x for x in rows if x["workers"] == n) for mode, rows in s.items()}
    one = r["artifact_bytes"] / MiB
    hwr = at["hwrd"]["weights_pss_mib"]
    others = {m: x for m, x in at.items() if m != "hwrd"}
    rows = []
    if others:
        small = min(others, key=lambda m: others[m]["weights_pss_mib"])
        peer = "; ".join(f"{PEER_NAMES.get(m, m)}: {others[m]['weights_pss_mib'] / one:.2f}x"
                         for m in sorted(others, key=lambda m: others[m]["weights_pss_mib"]))
        rows.append(Row(f"aggregate weight memory (PSS) of {n} workers on one {one:.0f} MiB artifact",
                        f"{hwr / one:.2f}x one copy", peer, times(others[small]["weights_pss_mib"], hwr),
                        "1.00x (one copy)"))
        name, best = min(others.items(), key=lambda kv: kv[1]["touch_ms_median"])
        mine = at["hwrd"]["touch_ms_median"]
        rows.append(Row(f"{n} workers at once, per-worker time to usable + touched (median)", ms(mine),
                        f"{PEER_NAMES.get(name, name)}: {ms(best['touch_ms_median'])}",
                        times(best["touch_ms_median"], mine)))
    return rows


def vllm_omni_store(r: dict[str, Any]) -> list[Row]:
    rows = []
    top = max(x["workers"] for x in r["rows"])
    for x in r["rows"]:
        if x["workers"] != top:
            continue
        hw, fs = x["hwrd_ms"]["p50"], x["vllm_omni_fs_ms"]["p50"]
        rows.append(Row(f"warm model lookup through vLLM-Omni's runtime, {x['level']}, {top} workers (p50)",
                        ms(hw), f"vLLM-Omni filesystem store: {ms(fs)}", times(fs, hw)))
    return rows


def demo(r: dict[str, Any]) -> list[Row]:
    cold, warm = r["cold"]["first_forward_s"] * 1e3, r["warm"]["first_forward_s"] * 1e3
    mib = r["model_mib"]
    n = r["with_hwrd"]["workers"]
    return [Row(f"demo DiT ({mib:.0f} MiB bf16): start to first forward, warm (lease) vs cold (checkpoint)",
                ms(warm), f"cold start: {ms(cold)}", times(cold, warm)),
            Row(f"demo DiT: weight memory of {n} workers", f"{r['with_hwrd']['weights_pss_mib'] / mib:.2f}x one copy",
                f"without hwrd: {r['without_hwrd']['weights_pss_mib'] / mib:.2f}x",
                times(r["without_hwrd"]["weights_pss_mib"], r["with_hwrd"]["weights_pss_mib"]), "1.00x (one copy)")]


def startup(r: dict[str, Any]) -> list[Row]:
    rows = []
    for n, run in r["runs"].items():
        warm, cold = run["warm"]["first_forward_ms"], run["cold"]["first_forward_ms"]
        rows.append(Row(f"worker startup to first forward, {n} worker(s) at once, warm vs cold (goal at 2 GiB: >= 10x)",
                        ms(warm), f"cold start: {ms(cold)}", times(cold, warm),
                        f"the forward itself: {ms(run['warm']['compute_ms'])}"))
    return rows


def publish(r: dict[str, Any]) -> list[Row]:
    m = r["median_s"]
    hwr = m["hwrd publish"]
    vo = m.get("vLLM-Omni publish")
    return [Row(f"publish {r['gib'] * 1024:.0f} MiB: hashed, durable (median)", f"{hwr:.2f} s",
                f"vLLM-Omni store: {vo:.2f} s" if vo else "vLLM-Omni not installed", times(vo, hwr),
                f"save_file + fsync: {m['save_file + fsync']:.2f} s" if "save_file + fsync" in m else "-")]


def prewarm(r: dict[str, Any]) -> list[Row]:
    gib = r["source_gib"]
    best = min(r["baseline_s"], r["baseline_durable_s"])  # plain (not durable) or with sha256 + fsync
    return [Row(f"prewarm: fp32 checkpoint ({gib:.2f} GiB) to a bf16 artifact, hashed and durable",
                f"{r['prewarm_s']:.2f} s", f"load_file + cast + save_file: {r['baseline_s']:.2f} s "
                f"(+ sha256 + fsync: {r['baseline_durable_s']:.2f} s)", times(best, r["prewarm_s"])),
            Row("prewarm: producer peak RSS (goal < 1 GiB)", f"{r['producer_peak_rss_bytes'] / MiB:,.0f} MiB",
                f"load_file + cast + save_file: {r['baseline_peak_rss_bytes'] / MiB:,.0f} MiB",
                times(r["baseline_peak_rss_bytes"], r["producer_peak_rss_bytes"]))]


def churn(r: dict[str, Any]) -> list[Row]:
    g = r["goal"]
    rows = [Row(f"churn under eviction, {r['clients']} clients: capacity, closed loop (goal >= 1,000 ops/s)",
                f"{r['ops_per_s']:,.0f} ops/s")]
    if r.get("paced"):
        rows.append(Row(f"churn: p99 of all operations paced at {g['paced_of_capacity']:.0%} of that capacity "
                        "(goal < 10 ms)", ms(r["paced"]["all_ms"]["p99"]), "-", "-",
                        f"served {g['paced_served_fraction']:.1%} of the offered rate"))
    return rows


def load(r: dict[str, Any]) -> list[Row]:
    return [Row(f"mixed load (acquire, publish, list), {r['clients']} clients, closed loop: throughput, p99",
                f"{r['ops_per_s']:,.0f} ops/s, p99 {ms(r['all_ms']['p99'])}")]


def soak(r: dict[str, Any]) -> list[Row]:
    return [Row("soak: every invariant after mixed concurrent load under eviction", "held" if r["clean"] else "BROKEN")]


def gpu_dlo(r: dict[str, Any]) -> list[Row]:
    if "direct_gbps" not in r:
        return []
    return [Row("layerwise offload block copy from lease memory (CPU, goal >= 80 % of memcpy)",
                f"{r['direct_gbps']:.2f} GB/s", "-", "-",
                f"memcpy {r['direct_reference_gbps']:.2f} GB/s ({r['direct_of_peak']:.0%} of it)")]


ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "peers": peers, "warm_start": warm_start, "scaling": scaling, "vllm_omni_store": vllm_omni_store,
    "demo": demo, "startup": startup, "publish": publish, "prewarm": prewarm, "churn": churn, "load": load,
    "soak": soak, "gpu_dlo": gpu_dlo}


def summary_rows(results: dict[str, Any]) -> list[Row]:
    """Every row this run's sections yield, in ``ROWS`` order (sections without a rule: none)."""
    rows = []
    for name, rule in ROWS.items():
        entry = results.get("sections", {}).get(name)
        if not entry or entry.get("rc") != 0 or not isinstance(entry.get("result"), dict):
            continue
        try:
            made = rule(entry["result"])
        except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError) as e:
            # The JSON lacks what the row needs (the script changed): say so, never guess a number.
            made = [Row(f"{name}: no summary row ({type(e).__name__}: {e}; see its tables)", "-")]
        for row in made:
            row.section = name
        rows += made
    return rows
