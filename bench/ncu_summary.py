"""One line per kernel (or per kernel name) from an Nsight Compute raw CSV.

    python3 bench/ncu_summary.py out.csv [--by-name] [--top N] [--json rows.json]

``out.csv``: ``ncu --csv --page raw ... --log-file out.csv`` (``bench/ncu_op.py``), or
that file gzipped (a name ending in ``.gz``, as the committed ``bench/results/h200/ncu/``).
Columns printed where the CSV holds them: time (``gpu__time_duration.sum``), grid and
block, registers per thread, dynamic shared memory per block, theoretical and achieved
occupancy, SM and memory throughput (% of peak), issue-slot use, and the three largest
warp stall reasons (warps stalled per issued instruction). ``--by-name`` sums the time
of the kernels that share a name (the hash suffix of chunkscan's names dropped) and
keeps the other columns of the longest one.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
import sys

from _common import check_outputs, meta, non_negative_int, readable_file, write_json

COLUMNS = {
    "us": "gpu__time_duration.sum",
    "regs": "launch__registers_per_thread",
    "smem_kib": "launch__shared_mem_per_block_dynamic",
    "occ_theory": "sm__maximum_warps_per_active_cycle_pct",
    "occ_achieved": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
}
STALL = re.compile(
    r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio"
)


def read_rows(path: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The kernels' rows and the units row of ``ncu --csv --page raw`` output (a path
    ending in ``.gz`` is read through gzip)."""
    if str(path).endswith(".gz"):
        f = gzip.open(path, "rt", newline="")
    else:
        f = open(path, newline="")
    with f:
        lines = [line for line in f if line.startswith('"')]
    reader = csv.DictReader(lines)
    rows = list(reader)
    units, rows = rows[0], rows[1:]
    return rows, units


def number(text: str | None) -> float | None:
    if text in (None, "", "n/a"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def scaled(value: float | None, unit: str) -> float | None:
    """``value`` in ``unit`` converted to this script's units: times to us, sizes to
    KiB."""
    if value is None:
        return None
    # ncu 2025.3 writes "ns" and "byte/block"; older releases spell them out
    factors = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
               "msecond": 1e3, "s": 1e6, "second": 1e6, "byte": 1 / 1024,
               "Kbyte": 1000 / 1024, "Mbyte": 1e6 / 1024}  # fmt: skip
    unit = unit.split("/")[0]
    if unit not in factors:
        raise ValueError(f"ncu_summary: unknown unit {unit!r}; add it to scaled()")
    return value * factors[unit]


def summarise(row: dict[str, str], units: dict[str, str]) -> dict[str, object]:
    name = row.get("Kernel Name", "?")
    out: dict[str, object] = {
        "kernel": re.sub(r"_[0-9a-f]{16}$", "", name.split("(")[0]),
        "grid": row.get("Grid Size"),
        "block": row.get("Block Size"),
    }
    for key, metric in COLUMNS.items():
        val = number(row.get(metric))
        if key in ("us", "smem_kib"):
            val = scaled(val, units.get(metric, ""))
        out[key] = val
    stalls = []
    for metric, text in row.items():
        m = STALL.fullmatch(metric or "")
        if m and number(text):
            stalls.append((number(text), m.group(1)))
    stalls.sort(reverse=True)
    out["stalls"] = {name: round(v, 2) for v, name in stalls[:4]}
    return out


def by_name(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per kernel name: its launches' times summed, its other columns those of
    its longest launch. (The longest was compared with the running sum from the third
    launch on, so an earlier launch's columns were kept; found by probing.)"""
    merged: dict[str, dict[str, object]] = {}
    longest: dict[str, float] = {}
    for r in rows:
        name, us = r["kernel"], r["us"] or 0
        m = merged.get(name)
        if m is None:
            merged[name], longest[name] = dict(r, launches=1), us
            continue
        total = (m["us"] or 0) + us
        if us > longest[name]:
            longest[name] = us
            m = merged[name] = dict(r, launches=m["launches"])
        m["us"] = total
        m["launches"] += 1
    return sorted(merged.values(), key=lambda r: -(r["us"] or 0))


def fmt(v: object, width: int, digits: int = 1) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:{width}.{digits}f}"
    return str(v).rjust(width)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=readable_file)
    p.add_argument("--by-name", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--top", type=non_negative_int, default=0,
                   help="print the N longest rows only")  # fmt: skip
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json}, optional=("--json",), inputs=(args.csv,))
    try:
        raw, units = read_rows(args.csv)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error, IndexError) as e:
        raw, units = [], {}  # not gzip, not text, no rows: said below
        why = f" ({type(e).__name__}: {e})"
    else:
        why = ""
    # Another page (the source page's warp samples) printed "23534 kernels, 0.00 ms in
    # all" with rows named "?", exit status 0; an empty file or a .gz that was not gzip
    # a traceback (found by probing).
    if not raw or COLUMNS["us"] not in units or "Kernel Name" not in units:
        print(f"ncu_summary.py: {args.csv}: no kernel rows with {COLUMNS['us']}{why}; pass "
              f"Nsight Compute's raw page (ncu --csv --page raw, as bench/ncu_op.py writes)",
              file=sys.stderr)  # fmt: skip
        return 1
    rows = [summarise(r, units) for r in raw]
    if args.by_name:
        rows = by_name(rows)
    if args.json:  # before printing: a closed pipe (| head) stopped it being written
        write_json(args.json, meta(__file__, argv, input=args.csv), rows)
    total = sum(r["us"] or 0 for r in rows)
    print(f"{len(raw)} kernels, {total / 1e3:.2f} ms in all")
    head = "  ".join(h.rjust(w) for h, w in
                     [("us", 9), ("%", 5), ("regs", 4), ("smemK", 6), ("occT", 5), ("occA", 5),
                      ("sm%", 5), ("mem%", 5), ("iss%", 5)])  # fmt: skip
    print(f"{'kernel':40s} {'n':>3s}  {head}  stalls (per issue)")
    shown = sorted(rows, key=lambda r: -(r["us"] or 0))[: args.top] if args.top else rows
    for r in shown:
        pct = 100 * (r["us"] or 0) / total if total else 0
        cells = [fmt(r["us"], 9), fmt(pct, 5), fmt(r["regs"], 4, 0), fmt(r["smem_kib"], 6),
                 fmt(r["occ_theory"], 5), fmt(r["occ_achieved"], 5), fmt(r["sm_pct"], 5),
                 fmt(r["mem_pct"], 5), fmt(r["issue_pct"], 5)]  # fmt: skip
        stalls = " ".join(f"{k}={v}" for k, v in r["stalls"].items())
        name, n = str(r["kernel"])[:40], r.get("launches", 1)
        print(f"{name:40s} {n:>3}  {'  '.join(cells)}  {stalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
