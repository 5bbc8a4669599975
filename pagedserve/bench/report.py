"""Text tables for the bench results, JSON output, and the README "Performance" section.

Regenerate the README table from result files:

    python -m pagedserve.bench.report --readme README.md bench/results/*.json

The table replaces whatever lies between ``<!-- perf:start -->`` and ``<!-- perf:end -->``;
without the markers a "## Performance" section with them is appended at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from pagedserve.bench.machine import describe

START, END = "<!-- perf:start -->", "<!-- perf:end -->"


def write_json(path: str, result: dict[str, Any]) -> None:
    result.setdefault("date", datetime.date.today().isoformat())  # the README's stamp
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, allow_nan=False)
            f.write("\n")
    except OSError as e:  # one line on stderr (the CLI's ValueError), not a traceback
        raise ValueError(f"--json {path}: {e.strerror or e}") from None


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    cells = [list(header)] + [[_fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(stats: dict[str, Any], key: str) -> Any:
    return stats.get(key) if stats else None


def format_throughput(r: dict[str, Any]) -> str:
    out = [f"== bench throughput: {r['workload']} ({r['description']}"
           + (f"; overrides {r['overrides']}" if r["overrides"] else "") + ")",
           f"model {r['model']}, {r['dtype']}, {r['device']}, {r['threads']} threads, "
           f"torch {r['torch']}"]
    probe = r["probe"]
    best = max(probe["shapes"], key=lambda s: s["gflops"])
    rates = ", ".join(f"{s['name']} {s['gflops']:.0f}" for s in probe["shapes"])
    out.append(f"matmul probe ({probe['rows']} rows, median of {probe['reps']}): peak "
               f"{probe['peak_gflops']:.1f} GFLOP/s at {best['name']} "
               f"[{rates}]")
    header = ["run", "reqs", "wall s", "req/s", "out tok/s", "total tok/s", "TTFT p50 ms",
              "prefill tok", "prefix hits", "peak blocks", "preempt", "bound s", "roofline"]
    rows = []
    for run in r["runs"]:
        s, roof = run["stats"], run["roofline"]
        rows.append([run["label"], run["num_requests"], run["wall_s"], run["requests_per_s"],
                     run["output_tokens_per_s"], run["total_tokens_per_s"],
                     _ms(run["ttft_ms"], "median"), s["prefill_tokens_computed"],
                     s["prefix_cache_hit_tokens"], s["peak_kv_blocks_used"], s["preemptions"],
                     f"{roof['bound_s']:.2f}", f"{roof['achieved_fraction']:.1%}"])
    out += ["", table(header, rows)]
    for run in r["runs"]:
        f = run["roofline"]["flops"]
        out.append(f"{run['label']}: {f['total'] / 1e9:,.1f} GFLOP (linear "
                   f"{f['linear'] / 1e9:,.1f}, attention {f['attention'] / 1e9:,.1f}, lm_head "
                   f"{f['lm_head'] / 1e9:,.1f}); {f['prefill_tokens']} prefill + "
                   f"{f['decode_tokens']} decode tokens, {f['logit_rows']} logit rows; "
                   f"{run['output_tokens']} output tokens; model execute (host) "
                   f"{run['model_execute_s']:.2f} s of {run['wall_s']:.2f} s")
        if len(run.get("repeats", ())) > 1:  # not in results written before --repeats
            out.append(f"{run['label']}: the median of {len(run['repeats'])} timed parts, "
                       "out tok/s " + ", ".join(f"{x:,.0f}" for x in run["repeats"]))
    if r.get("comparison"):
        c = r["comparison"]
        out.append(f"\nratios {c['ratio_is']}:")
        for key in ("prefill_tokens_computed", "ttft_p50_ms", "wall_s"):
            value = c[key]["ratio"]
            out.append(f"  {key}: {'-' if value is None else f'{value:.2f}x'}")
    hf = r.get("hf_baseline")
    if hf:
        rows = [[str(h["batch_size"]), h["rows"], h["wall_s"], h["output_tokens_per_s"],
                 h["total_tokens_per_s"], h["estimated_full_wall_s"]] for h in hf["runs"]]
        out += ["", f"HF transformers generate, same weights ({hf['rows_total']} rows; "
                    f"subset per batch size, see hf_baseline.py):",
                table(["batch", "rows run", "wall s", "out tok/s", "total tok/s", "est. full s"],
                      rows),
                f"pagedserve / HF best (batch {hf['best']['batch_size']}): output tok/s "
                f"{hf['ratio_output_tokens_per_s']:.2f}x, total tok/s "
                f"{hf['ratio_total_tokens_per_s']:.2f}x; first row tokens agree: "
                f"{_agreement(hf['first_row_agrees'])}"]
        if hf.get("best_roofline_fraction") is not None:  # absent in older result files
            out.append(f"HF best reaches {hf['best_roofline_fraction']:.1%} of the same "
                       f"roofline bound")
    return "\n".join(out)


def _agreement(agrees: bool | None) -> str:
    return "not checked (no batch size 1)" if agrees is None else str(agrees)


def format_serve(r: dict[str, Any]) -> str:
    out = [f"== bench serve: {r['base_url']} model={r['model']} endpoint={r['endpoint']} "
           f"dataset={r['dataset']} rate={r['request_rate']} "
           f"concurrency={r['max_concurrency'] or '-'}",
           table(["metric", "value"], [
               ["completed / failed", f"{r['completed']} / {r['failed']}"],
               ["duration s", r["duration_s"]],
               ["client CPU s", r.get("client_cpu_s")],  # not in older results
               ["input / output tokens", f"{r['total_input_tokens']} / "
                                         f"{r['total_output_tokens']}"],
               ["request throughput req/s", f"{r['request_throughput']:.2f}"],
               ["output token throughput tok/s", r["output_throughput"]],
               ["total token throughput tok/s", r["total_token_throughput"]],
           ]), "",
           table(["ms", "mean", "median", "p90", "p99"],
                 [[name, *(r[key][k] for k in ("mean", "median", "p90", "p99"))]
                  for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                                    ("E2E", "e2el_ms"))])]
    if r["errors"]:
        out.append("errors: " + "; ".join(r["errors"]))
    if r["usage_missing"]:
        out.append(f"{r['usage_missing']} responses had no usage chunk: tokens counted by chunks")
    return "\n".join(out)


def performance_section(results: list[dict[str, Any]]) -> str:
    """Markdown tables for the README from throughput and serve results."""
    # The results' own dates, not today's: a regenerated section dates them as measured.
    dates = sorted({r["date"] for r in results if "date" in r})
    when = f" ({dates[0]})" if len(dates) == 1 else \
        f" ({dates[0]} to {dates[-1]})" if dates else ""
    lines = [f"Generated by `make bench`{when}; regenerate with "
             "`python -m pagedserve.bench.report --readme README.md bench/results/*.json`. "
             "Absolute numbers drift on shared machines; compare the ratios measured in the "
             "same run.", ""]
    thr = [r for r in results if r.get("bench") == "throughput"]
    if thr:
        first = thr[0]
        machine = f" on {describe(first['machine'])}" if "machine" in first else ""
        lines.append(f"Offline (`pagedserve bench throughput`): {first['model']}, "
                     f"{first['dtype']}, {first['device']}, {first['threads']} threads"
                     f"{machine}.")
        lines.append("")
        rows = []
        for r in thr:
            hf = r.get("hf_baseline")
            for i, run in enumerate(r["runs"]):
                vs_hf = "-"
                if hf and i == 0:
                    hf_roof = hf.get("best_roofline_fraction")
                    vs_hf = (f"{hf['ratio_output_tokens_per_s']:.2f}x (HF b="
                             f"{hf['best']['batch_size']} {hf['best']['output_tokens_per_s']:.0f}"
                             f" tok/s" + (f", {hf_roof:.1%} roofline)" if hf_roof else ")"))
                rows.append([r["workload"], run["label"], run["num_requests"], run["wall_s"],
                             run["output_tokens_per_s"], run["total_tokens_per_s"],
                             _ms(run["ttft_ms"], "median"),
                             run["stats"]["prefill_tokens_computed"],
                             f"{run['roofline']['achieved_fraction']:.1%}", vs_hf])
        lines.append(table(["workload", "run", "reqs", "wall s", "out tok/s", "total tok/s",
                            "TTFT p50 ms", "prefill tok", "roofline", "vs HF (out tok/s)"],
                           rows, markdown=True))
        lines.append("")
    srv = [r for r in results if r.get("bench") == "serve"]
    if srv:
        lines.append("Online (`pagedserve bench serve` against `pagedserve serve`):")
        lines.append("")
        # The serving target: online output throughput over the offline engine's on the
        # same (mixed) workload.
        offline = next((r["runs"][0]["output_tokens_per_s"] for r in thr
                        if r["workload"] == "mixed" and r["runs"]), None)
        rows = [[r["dataset"], f"{r['completed']}/{r['num_prompts']}",
                 str(r["max_concurrency"] or "-"), f"{r['request_throughput']:.2f}",
                 r["output_throughput"],
                 f"{r['output_throughput'] / offline:.0%}" if offline else "-",
                 _ms(r["ttft_ms"], "median"), _ms(r["ttft_ms"], "p99"),
                 _ms(r["tpot_ms"], "median"), _ms(r["tpot_ms"], "p99"),
                 _ms(r["e2el_ms"], "median")] for r in srv]
        lines.append(table(["dataset", "done", "concurrency", "req/s", "out tok/s",
                            "vs offline mixed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                            "TPOT p99 ms", "E2E p50 ms"], rows, markdown=True))
        lines.append("")
    lines += _peer_lines([r for r in results if r.get("bench") == "peer"])
    if not thr and not srv:
        lines.append("No results yet: run `make bench`.")
    return "\n".join(lines)


def _peer_lines(peers: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table (scripts/ab_peer.sh): same client, same machine, one sitting."""
    lines = []
    for r in peers:
        held = (f", both held to {r['held_to']} (`AB_HOLD_AVX2=1`, as on an AVX2-only CPU)"
                if r.get("held_to") else "")
        lines.append(f"Side by side with {r['peer']} (`scripts/ab_peer.sh`: the same `bench "
                     "serve` client and workload, servers alternated, medians of the rounds) "
                     f"on {describe(r['machine'])}{held}:")
        lines.append("")
        rows = [[w["workload"], w["rounds"], w["pagedserve"]["median_output_throughput"],
                 w["peer"]["median_output_throughput"], f"{w['ratio']:.2f}x",
                 w["pagedserve"]["median_ttft_p50_ms"], w["peer"]["median_ttft_p50_ms"]]
                for w in r["workloads"]]
        lines.append(table(["workload", "rounds", "pagedserve out tok/s", "peer out tok/s",
                            "ratio", "pagedserve TTFT p50 ms", "peer TTFT p50 ms"],
                           rows, markdown=True))
        lines.append("")
    return lines


def update_readme(path: str, section: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(START), text.find(END)
    block = f"{START}\n{section.rstrip()}\n{END}"
    if 0 <= start < end:
        text = text[:start] + block + text[end + len(END):]
    else:
        text = text.rstrip("\n") + f"\n\n## Performance\n\n{block}\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default=None, help="update this file (default: print)")
    p.add_argument("results", nargs="*", help="bench result JSON files")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            results.append(json.load(f))
    section = performance_section(results)
    if args.readme:
        update_readme(args.readme, section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
