#!/usr/bin/env python3
"""Every metric a Grafana dashboard queries must exist: extracts the metric names from every PromQL
expression of the dashboard (panel targets, nested row panels, templating queries) and checks each
against the series names of the given /metrics scrapes (Prometheus text format; histogram
_bucket/_sum/_count series count under their own names) plus optional name lists (one name first
on each line, # comments). Exits 1 naming every missing metric and the panel that uses it.
Usage: check_dashboard.py DASHBOARD.json [--scrapes FILE_OR_DIR...] [--names LIST.txt...]
                          [--require-prefix dflash_]"""
import argparse
import json
import os
import re
import sys

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "inf", "nan", "atan2"}


def metric_names(expr):
    """Metric names of one PromQL expression (identifiers that are not functions, keywords,
    label names of grouping clauses, label matchers, durations or strings)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)           # strings
    e = re.sub(r"\{[^}]*\}", "", e)                                             # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                                            # ranges/subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    e = re.sub(r"\$\{?\w+\}?", " ", e)                                          # Grafana variables
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(0), e[m.end():]
        if word.lower() in KEYWORDS or re.match(r"\s*\(", rest):
            continue
        if re.match(r"\d", word) or (m.start() > 0 and e[m.start() - 1].isdigit()):
            continue  # 5m, 1e3, ...
        names.add(word)
    return names


def label_values_metric(query):
    m = re.match(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query)
    return {m.group(1)} if m else metric_names(query) if "(" in query else set()


def exprs(dashboard):
    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    yield p.get("title", "?"), t["expr"], metric_names(t["expr"])
            yield from walk(p.get("panels", []))
    yield from walk(dashboard.get("panels", []))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else (q or "")
            yield "variable $" + v["name"], q, label_values_metric(q)


def scraped_names(paths):
    names = set()
    for path in paths:
        files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
        for f in files:
            for line in open(f):
                line = line.strip()
                if line and not line.startswith("#"):
                    names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dashboard")
    ap.add_argument("--scrapes", nargs="*", default=[])
    ap.add_argument("--names", nargs="*", default=[])
    ap.add_argument("--require-prefix", default="")
    a = ap.parse_args()
    dash = json.load(open(a.dashboard))
    known = scraped_names(a.scrapes)
    listed = set()
    for f in a.names:
        for line in open(f):
            line = line.split("#", 1)[0].strip()
            if line:
                listed.add(line.split()[0])
    known |= listed
    used, problems, n_exprs = {}, [], 0
    for where, expr, names in exprs(dash):
        n_exprs += 1
        if not names:
            problems.append(f"{where}: no metric name in {expr!r}")
        for n in names:
            used.setdefault(n, set()).add(where)
    for n, where in sorted(used.items()):
        if a.require_prefix and not n.startswith(a.require_prefix):
            problems.append(f"{n} (used by {', '.join(sorted(where))}) does not start with {a.require_prefix}")
        elif n not in known:
            problems.append(f"{n} (used by {', '.join(sorted(where))}) is in no scrape and no name list")
    if problems:
        print("\n".join("FAIL: " + p for p in problems))
        sys.exit(1)
    print(f"{a.dashboard}: {n_exprs} expressions, {len(used)} metrics, all exported "
          f"({len(used) - len(set(used) & listed - scraped_names(a.scrapes))} seen in scrapes, "
          f"{len(set(used) & listed - scraped_names(a.scrapes))} from name lists)")


if __name__ == "__main__":
    main()
