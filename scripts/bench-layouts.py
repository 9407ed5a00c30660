#!/usr/bin/env python3
"""Envoy with Tollgate in both layouts, side by side (`make bench`, BENCHMARKS.md).

Reads the results.tsv of two runs of scripts/bench-envoy.sh, the shared layout (every process on
every core) and the production one (the limiter tier on a core of its own), and prints one table:
per variant, the median ratio to no filter in each layout (each round's req/s over the no-filter
req/s of the same round) and, in the production layout, each process's CPU per request.

    scripts/bench-layouts.py bench-out/envoy bench-out/envoy-production
"""
import statistics
import sys


def load(out_dir):
    """variant -> round -> row (the columns scripts/bench-envoy.sh writes)."""
    by = {}
    with open(f"{out_dir}/results.tsv") as f:
        for line in f:
            r = line.rstrip("\n").split("\t")
            if len(r) >= 11:
                by.setdefault(r[0], {})[int(r[9])] = r
    return by


def ratio(by, v):
    base = by.get("bare-none" if v.startswith("bare-") else "none", {})
    per = [float(r[1]) / float(base[n][1]) for n, r in by[v].items() if n in base and float(base[n][1]) > 0]
    return f"{statistics.median(per):.2f}" if per else "–"


def med(by, v, col):
    return statistics.median(float(r[col]) for r in by[v].values())


def main():
    shared, prod = load(sys.argv[1]), load(sys.argv[2])
    print("| path | ratio to no filter, shared | ratio, production | req/s, production | p99 ms, production | "
          "CPU µs per request, production: Envoy | service | Redis | upstream |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in prod:
        s = ratio(shared, v) if v in shared else "–"
        print(f"| {v} | {s} | {ratio(prod, v)} | {med(prod, v, 1):.0f} | {med(prod, v, 2):.2f} | "
              f"{med(prod, v, 5):.0f} | {med(prod, v, 6):.0f} | {med(prod, v, 7):.0f} | {med(prod, v, 8):.0f} |")


if __name__ == "__main__":
    main()
