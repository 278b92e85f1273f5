"""Summarise Nsight Compute's per-instruction warp-stall samples (SourceCounters).

Input: the CSV of ``ncu -i <report> --page source --csv --print-source sass`` (gzipped or
not), one block per profiled launch. Per launch it prints the samples' split by stall
reason and by opcode (the SASS mnemonic before its first dot), and the instructions with
the most samples::

    python3 bench/ncu_source_summary.py bench/results/h200/ncu/ncu_src_sass_4k_16d0b84.csv.gz

The page of ``--print-source cuda,sass`` (kernels built with line information) gives the
samples per CUDA source line instead::

    python3 bench/ncu_source_summary.py \
        bench/results/h200/ncu/ncu_src_cuda_sass_prepare_4k_ca24fef.csv.gz

and with ``--bank-conflicts`` each function's shared-memory wavefronts, the share of them
that bank conflicts added ("L1 Wavefronts Shared Excessive"), and the lines with the most
of those::

    python3 bench/ncu_source_summary.py --bank-conflicts \
        bench/results/h200/ncu/ncu_src_cuda_sass_16k_89268cd.csv.gz

A sample is charged to the instruction a warp was stalled on (or issuing), so the
opcode split says where the warps wait: a load's latency shows up on the first
instruction that reads its register.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re
import sys
import zlib

from _common import non_negative_int, readable_file
from ncu_summary import number as parse_number

SAMPLES = "Warp Stall Sampling (All Samples)"
WAVEFRONTS = "L1 Wavefronts Shared"
EXCESSIVE = "L1 Wavefronts Shared Excessive"


def launches(text: str) -> list[dict]:
    """``[{name, header, rows}]``, one per profiled launch, in the file's order."""
    out: list[dict] = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append({"name": row[1], "header": None, "rows": []})
        elif row[0] == "Address" and out:
            out[-1]["header"] = row
        elif out and out[-1]["header"]:
            out[-1]["rows"].append(row)
    return out


def opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def number(x: str) -> float:
    """A cell as a float (ncu_summary's parse: thousands separators, empty or n/a as 0)."""
    return parse_number(x) or 0.0


def summarise(launch: dict, top: int) -> list[str]:
    col = {c: i for i, c in enumerate(launch["header"])}
    rows = launch["rows"]
    total = sum(number(r[col[SAMPLES]]) for r in rows)
    if not total:
        return [f"{launch['name']}: no samples"]
    reasons = collections.Counter()
    for c, i in col.items():
        if c.startswith("stall_") and "(Not" not in c:
            reasons[c[6:]] = sum(number(r[i]) for r in rows)
    rsum = sum(reasons.values()) or 1.0
    ops = collections.Counter()
    for r in rows:
        ops[opcode(r[col["Source"]])] += number(r[col[SAMPLES]])
    lines = [
        f"{launch['name']}: {int(total)} samples, {len(rows)} instructions",
        "  by stall reason: "
        + ", ".join(f"{k} {v / rsum * 100:.0f}%" for k, v in reasons.most_common(8)),
        "  by opcode: " + ", ".join(f"{k} {v / total * 100:.1f}%" for k, v in ops.most_common(12)),
    ]
    for r in sorted(rows, key=lambda r: -number(r[col[SAMPLES]]))[:top]:
        share = number(r[col[SAMPLES]]) / total * 100
        lines.append(f"  {share:5.1f}%  {r[col['Source']].strip()[:72]}")
    return lines


def source_lines(text: str, column: str = SAMPLES) -> list[dict]:
    """``[{name, lines: [(line number, source, value)]}]`` of the page that ``ncu -i
    <report> --page source --csv --print-source cuda,sass`` prints (kernels built with
    line information: ``CHUNKSCAN_CUDA_LINEINFO=1``): per function, each CUDA source
    line with ``column`` summed over its instructions (default the warp samples; the
    SASS rows under it, which carry no line number, are not counted again)."""
    out: list[dict] = []
    col = None
    for row in map(_source_row, text.splitlines()):
        if not row:
            continue
        if row[0] == "Function Name":
            out.append({"name": row[1], "lines": []})
        elif row[0] == "Line No":
            col = row.index(column)
        elif out and col is not None and row[0].strip().isdigit():
            out[-1]["lines"].append((int(row[0]), row[1], number(row[col])))
    return out


# A CUDA source line's row: its number, the line as written, "-" for the address and
# the SASS, then the counters. Nsight Compute writes the line without escaping its
# quotes (asm volatile("cp.async ..." :: "r"(d) ...), so the csv module misread such a
# row: the counter it took for the samples was "-", read as 0, and an inline-asm line's
# samples (the state pass's mma and cp.async, 11609 and 1547 of them) and bank
# conflicts went uncounted (found by probing).
_LINE_ROW = re.compile(r'^"(\d+)","(.*?)","-","-",(".*)$')


def _source_row(line: str) -> list[str]:
    """One row of the cuda,sass page as its fields (see :data:`_LINE_ROW`)."""
    m = _LINE_ROW.match(line)
    if m:
        return [m.group(1), m.group(2), "-", "-", *next(csv.reader([m.group(3)]))]
    return next(csv.reader([line]), [])


def summarise_bank_conflicts(text: str, top: int) -> list[str]:
    """Per function of a cuda,sass page: shared-memory wavefronts, the excess that bank
    conflicts added, and the ``top`` lines with the most excess."""
    out = []
    for total, excess in zip(source_lines(text, WAVEFRONTS), source_lines(text, EXCESSIVE)):
        all_w = sum(v for _, _, v in total["lines"])
        if not all_w:
            continue
        extra = sum(v for _, _, v in excess["lines"])
        out.append(
            f"{total['name']}: {all_w:.3g} shared-memory wavefronts, "
            f"{extra:.3g} of them bank conflicts' ({extra / all_w:.1%})"
        )
        waves = {no: v for no, _, v in total["lines"]}
        for no, src, v in sorted(excess["lines"], key=lambda x: -x[2])[:top]:
            if v:
                out.append(f"  {v:9.3g} of {waves[no]:9.3g}  L{no:<5} {src.strip()[:72]}")
    return out


def summarise_lines(function: dict, top: int) -> list[str]:
    total = sum(s for _, _, s in function["lines"])
    if not total:
        return [f"{function['name']}: no samples"]
    lines = [f"{function['name']}: {int(total)} samples, {len(function['lines'])} source lines"]
    for no, src, s in sorted(function["lines"], key=lambda x: -x[2])[:top]:
        lines.append(f"  {s / total * 100:5.1f}%  L{no:<5} {src.strip()[:80]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=readable_file, help="the source page's CSV (.csv or .csv.gz)")
    p.add_argument("--top", type=non_negative_int, default=8,
                   help="instructions (or lines) listed per launch")  # fmt: skip
    p.add_argument(
        "--bank-conflicts",
        action="store_true",
        help="shared-memory wavefronts and bank conflicts per function (cuda,sass page)",
    )
    args = p.parse_args(argv)
    opener = gzip.open if args.csv.endswith(".gz") else open
    try:
        with opener(args.csv, "rt") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # tracebacks before
        print(f"ncu_source_summary.py: {args.csv}: cannot read it ({type(e).__name__}: {e}); "
              "pass Nsight Compute's source page (--page source --csv, .csv or .csv.gz)",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.bank_conflicts:
        lines = summarise_bank_conflicts(text, args.top)
    elif text.lstrip().startswith('"File Path"'):  # the cuda,sass page
        lines = [ln for f in source_lines(text) for ln in summarise_lines(f, args.top)]
    else:
        lines = [ln for launch in launches(text) for ln in summarise(launch, args.top)]
    if not lines:  # another kind of page: it printed nothing, exit status 0 (probing)
        print(f"ncu_source_summary.py: {args.csv}: no launch or source line found; pass "
              f"Nsight Compute's source page (--page source --csv)", file=sys.stderr)  # fmt: skip
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
