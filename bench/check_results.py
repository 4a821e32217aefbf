#!/usr/bin/python3
"""Checks a benchmark result (bench/run.py's latest.json) against bench/results/schema.json's rules:
well-formed, every required field, and every figure paired with its anchor -- numbers on both sides,
or a `not_measured` reason. Timings are never judged. Exit 0 if it holds, else one line per problem.
Usage: check_results.py LATEST_JSON [--groups storage,ckpt,launcher,rdzv]"""
import json
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    groups = []
    if "--groups" in sys.argv:
        groups = sys.argv[sys.argv.index("--groups") + 1].split(",")
    try:
        with open(sys.argv[1]) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"check_results: {sys.argv[1]}: not readable JSON: {e}")
    problems = []
    for key in ("schema", "time", "git_commit", "git_dirty", "mode", "runs", "machine", "raw", "figures"):
        if key not in result:
            problems.append(f"missing top-level field '{key}'")
    if result.get("schema") != "elastrun-bench/1":
        problems.append(f"schema is {result.get('schema')!r}, expected 'elastrun-bench/1'")
    for key in ("cores", "memory_gib", "kernel", "filesystems"):
        if key not in result.get("machine", {}):
            problems.append(f"machine lacks '{key}'")
    figures = result.get("figures") or []
    if not figures:
        problems.append("no figures")
    seen = set()
    for i, f in enumerate(figures):
        name = f.get("id", f"figure #{i}")
        for key in ("id", "group", "title", "unit", "better", "elastrun", "anchor", "ratio", "goal", "met"):
            if key not in f:
                problems.append(f"{name}: missing '{key}'")
        if name in seen:
            problems.append(f"{name}: duplicate id")
        seen.add(name)
        anchor = f.get("anchor") or {}
        if not anchor.get("name"):
            problems.append(f"{name}: the anchor has no name")
        if "not_measured" in f:
            if not isinstance(f["not_measured"], str) or not f["not_measured"].strip():
                problems.append(f"{name}: not_measured without a reason")
            continue
        for side in ("elastrun", "anchor"):
            s = f.get(side) or {}
            if not isinstance(s.get("median"), (int, float)) or not s.get("runs"):
                problems.append(f"{name}: no {side} number (and no not_measured reason)")
            elif not (s["min"] <= s["median"] <= s["max"]):
                problems.append(f"{name}: {side} median outside [min, max]")
        if not isinstance(f.get("ratio"), (int, float)):
            problems.append(f"{name}: no ratio")
        if f.get("goal") is not None and not isinstance(f.get("met"), bool):
            problems.append(f"{name}: a goal but no met/not met")
    for g in groups:
        if not any(f.get("group") == g for f in figures):
            problems.append(f"no figure of group '{g}'")
    for p in problems:
        print(f"check_results: {p}")
    if problems:
        sys.exit(1)
    measured = sum(1 for f in figures if "not_measured" not in f)
    print(f"check_results: {len(figures)} figures ({measured} measured, {len(figures) - measured} with a reason), "
          f"every one with its anchor")


if __name__ == "__main__":
    main()
