"""Side by side with a peer server (vLLM's CPU build): the same `bench serve` client and
workloads against both servers on one machine in one sitting, the servers alternated
(A B, B A, A B, ...) so that drift hits both, summarized as medians and their ratio.

    python -m pagedserve.bench.peer args WORKLOAD      # the bench serve flags of a workload
    python -m pagedserve.bench.peer summarize --json OUT [--peer-name NAME] FILE...

``scripts/ab_peer.sh`` runs the servers and names each result ``WORKLOAD--SERVER--rK.json``
(SERVER: ``pagedserve`` or ``peer``), which is how ``summarize`` reads them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pagedserve.bench.machine import machine_facts
from pagedserve.bench.stats import ratio
from pagedserve.bench.workloads import SPECS

SERVERS = ("pagedserve", "peer")
PEER_WORKLOADS = ("mixed", "decode-heavy", "shared-prefix")


def serve_args(workload: str, vocab_size: int = 49152) -> list[str]:
    """`bench serve` flags for an offline workload of bench/workloads.py, sent all at once
    (every request in flight, as the offline run admits them)."""
    spec = SPECS[workload]
    lo, hi = spec.input_len
    common = ["--num-prompts", str(spec.num_prompts), "--output-len", str(spec.output_len),
              "--ignore-eos", "--max-concurrency", str(spec.num_prompts),
              "--vocab-size", str(vocab_size)]
    if spec.prefix_len:
        return ["--dataset", "shared-prefix", "--prefix-len", str(spec.prefix_len),
                "--input-len", str(lo), *common]
    # serve_dataset draws lengths in [L(1-R), L(1+R)]: L and R that span [lo, hi].
    mid = (lo + hi) / 2
    return ["--dataset", "random", "--input-len", str(round(mid)),
            "--range-ratio", f"{(hi - lo) / (hi + lo):.4f}", *common]


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_ms"]["median"] for r in runs if r["ttft_ms"]["median"] is not None]
    return {
        "output_throughput": [r["output_throughput"] for r in runs],
        "median_output_throughput": statistics.median(r["output_throughput"] for r in runs),
        "median_ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "failed": sum(r["failed"] for r in runs),
    }


def read_result(path: str) -> tuple[str, str, dict[str, Any]]:
    """(workload, server, result) of one result file; ValueError saying why it cannot count
    (a misnamed file, not a bench serve result, or a run in which nothing completed: no
    throughput to take a ratio of)."""
    parts = Path(path).stem.split("--")
    if len(parts) != 3 or not parts[0] or parts[1] not in SERVERS:
        raise ValueError(f"not named WORKLOAD--SERVER--rK.json, SERVER one of {SERVERS}")
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable ({e})") from None
    if not isinstance(result, dict) or result.get("bench") != "serve":
        raise ValueError("not a bench serve result")
    fields = ("completed", "failed", "output_throughput", "ttft_ms")
    if any(k not in result for k in fields) or not isinstance(result["ttft_ms"], dict):
        raise ValueError(f"not a bench serve result (one of {fields} missing)")
    if not result["completed"] or not result["output_throughput"]:
        raise ValueError(f"no request completed ({result['failed']} failed)")
    return parts[0], parts[1], result


def summarize(files: list[str], peer_name: str, held_to: str | None = None) -> dict[str, Any]:
    """Medians and ratios per workload; ``held_to`` names the ISA cap both engines ran
    under (scripts/ab_peer.sh's AB_HOLD_AVX2), None for the machine as it is. A file that
    cannot count, or a workload without both servers, is listed in ``skipped``."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    skipped: list[str] = []
    for path in sorted(files):
        try:
            workload, server, result = read_result(path)
        except ValueError as e:
            skipped.append(f"{path}: {e}")
            continue
        by_key.setdefault((workload, server), []).append(result)
    if not by_key:
        raise ValueError("no result file to summarize: " + "; ".join(skipped))
    rows = []
    for workload in dict.fromkeys(w for w, _ in by_key):
        ours, theirs = by_key.get((workload, "pagedserve")), by_key.get((workload, "peer"))
        if not ours or not theirs:
            skipped.append(f"{workload}: no {'peer' if ours else 'pagedserve'} result to "
                           "compare with")
            continue
        a, b = _side(ours), _side(theirs)
        rows.append({"workload": workload, "rounds": min(len(ours), len(theirs)),
                     "pagedserve": a, "peer": b,
                     "ratio": a["median_output_throughput"] / b["median_output_throughput"],
                     "ttft_ratio": ratio(a["median_ttft_p50_ms"], b["median_ttft_p50_ms"])})
    first = next(iter(by_key.values()))[0]
    return {"bench": "peer", "peer": peer_name, "machine": first.get("machine") or
            machine_facts(), "held_to": held_to, "workloads": rows, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.bench.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("args", help="print the bench serve flags of a workload")
    a.add_argument("workload", choices=PEER_WORKLOADS)
    s = sub.add_parser("summarize", help="medians and ratios of the A/B result files")
    s.add_argument("--json", required=True)
    s.add_argument("--peer-name", default="vLLM (CPU build)")
    s.add_argument("--held-to", help="the ISA cap both servers ran under, e.g. 'AVX2, float32'")
    s.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.command == "args":
        print(" ".join(serve_args(args.workload)))
        return 0
    try:
        result = summarize(args.files, args.peer_name, args.held_to)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    result.setdefault("date", datetime.date.today().isoformat())  # the README's stamp
    Path(args.json).write_text(json.dumps(result, indent=1))
    for line in result["skipped"]:
        print(f"skipped {line}", file=sys.stderr)
    for row in result["workloads"]:
        ttft = "-" if row["ttft_ratio"] is None else f"{row['ttft_ratio']:.2f}"
        print(f"{row['workload']}: pagedserve {row['pagedserve']['median_output_throughput']:.1f}"
              f" / {result['peer']} {row['peer']['median_output_throughput']:.1f} out tok/s ="
              f" {row['ratio']:.2f}x; TTFT p50 ratio {ttft} ({row['rounds']} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
