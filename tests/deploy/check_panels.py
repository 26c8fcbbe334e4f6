#!/usr/bin/env python3
"""Every panel query of a Grafana dashboard, run against a live Prometheus that scrapes a run, must
return series that carry the labels the panel groups by.

  check_panels.py wait  --prometheus URL --run NAME --targets N [--settle S] [--timeout S]
      Waits until N scrape targets of run NAME are up, a drafter has counted an optimizer step and
      S more seconds of scrapes have passed with all of them up; prints that moment (Unix seconds),
      the evaluation time for `check`. Exit 1 if it does not come within the timeout.
  check --prometheus URL --dashboard JSON --run NAME --time T [--rate-interval 10s] [--range 60s]
        [--optional LIST.txt] [--only-metric NAME]
      Runs each panel target's PromQL (Grafana variables substituted: $run -> NAME,
      $__rate_interval, $__range) as an instant query at T through /api/v1/query and checks:
        - the result is not empty, unless every metric of the query is in the --optional list
          (families the dashboard charts before any process exports them; reported as SKIP);
        - every series carries each label of the query's `by (...)` clauses (but `le` under
          histogram_quantile) and each {{label}} of the panel target's legendFormat;
        - no series of a metric the query reads carries an `exported_<label>` label: Prometheus
          renames a label of the exposition that collides with a target label of the scrape
          config, and the panel then groups by the target's label instead of the metric's;
      and that each `label_values(METRIC, LABEL)` template variable lists NAME when LABEL is run.
      --only-metric: only the queries that read NAME. Exits 1 naming every failing panel.
Metric names are extracted with check_dashboard.py's parser."""
import argparse
import json
import os
import re
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_dashboard import exprs  # noqa: E402


def api(base, path, **params):
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def instant(base, query, t):
    return api(base, "query", query=query, time=f"{t:.3f}")["result"]


def wait(a):
    deadline, since = time.time() + a.timeout, None
    up_q = f'count(up{{run="{a.run}"}} == 1)'
    step_q = f'max(dflash_drafter_steps_total{{run="{a.run}"}})'
    while time.time() < deadline:
        now = time.time()
        try:
            up = instant(a.prometheus, up_q, now)
            steps = instant(a.prometheus, step_q, now)
        except OSError:
            up, steps = [], []  # Prometheus still starting
        ready = up and int(float(up[0]["value"][1])) == a.targets and steps and float(steps[0]["value"][1]) > 0
        since = (since or now) if ready else None
        if since and now - since >= a.settle:
            print(f"{now:.3f}")
            return 0
        time.sleep(0.5)
    print(f"FAIL: within {a.timeout} s, {a.targets} targets of run {a.run} were not up with steps counted for "
          f"{a.settle} s", file=sys.stderr)
    return 1


def grouped_labels(expr, legend):
    labels = set()
    for m in re.finditer(r"\bby\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    labels |= set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend or ""))
    if "histogram_quantile" in expr:
        labels.discard("le")  # grouped by, then consumed by the quantile
    return labels


def targets(dashboard):
    """(panel title, expr, legendFormat) of every panel target, rows' nested panels included."""
    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    yield p.get("title", "?"), t["expr"], t.get("legendFormat", "")
            yield from walk(p.get("panels", []))
    yield from walk(dashboard.get("panels", []))


def substitute(expr, a):
    return (expr.replace("$__rate_interval", a.rate_interval).replace("$__range", a.range)
            .replace("${run}", a.run).replace("$run", a.run))


def check(a):
    dash = json.load(open(a.dashboard))
    optional = set()
    for f in a.optional or []:
        for line in open(f):
            line = line.split("#", 1)[0].strip()
            if line:
                optional.add(line.split()[0])
    names_of = {expr: names for _, expr, names in exprs(dash)}
    problems, n_ok, n_skip, exported = [], 0, 0, {}
    for title, expr, legend in targets(dash):
        names = names_of[expr]
        if a.only_metric and a.only_metric not in names:
            continue
        where = f"{title!r}: {expr}"
        q = substitute(expr, a)
        res = instant(a.prometheus, q, a.time)
        if not res:
            if names and names <= optional:
                print(f"SKIP {where}: no series yet (optional: {', '.join(sorted(names))})")
                n_skip += 1
            else:
                problems.append(f"{where}: no series")
            continue
        want = grouped_labels(expr, legend)
        for s in res:
            missing = want - set(s["metric"])
            if missing:
                problems.append(f"{where}: series {s['metric']} lacks label(s) {', '.join(sorted(missing))}")
                break
        for n in names:
            if n not in exported:
                series = api(a.prometheus, "series", **{"match[]": f'{n}{{run="{a.run}"}}'},
                             start=f"{a.time - 300:.3f}", end=f"{a.time:.3f}")
                exported[n] = sorted({k for s in series for k in s if k.startswith("exported_")})
            if exported[n]:
                problems.append(f"{where}: {n} has label(s) {', '.join(exported[n])}: a label of the exposition "
                                f"collides with a target label of the scrape config, which Prometheus kept instead")
        n_ok += 1
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.match(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)", q)
        if v.get("type") != "query" or not m or (a.only_metric and m.group(1) != a.only_metric):
            continue
        values = api(a.prometheus, f"label/{m.group(2)}/values", **{"match[]": m.group(1)},
                     start=f"{a.time - 300:.3f}", end=f"{a.time:.3f}")
        if m.group(2) == "run" and a.run not in values:
            problems.append(f"variable ${v['name']}: {q} gives {values}, without run {a.run!r}")
    if problems:
        print("\n".join("FAIL: " + p for p in problems))
        return 1
    if n_ok == 0:
        print("FAIL: no panel query checked")
        return 1
    print(f"{a.dashboard}: {n_ok} panel queries return series with their grouping labels, {n_skip} optional skipped")
    return 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    c = sub.add_parser("check")
    for p in (w, c):
        p.add_argument("--prometheus", required=True)
        p.add_argument("--run", required=True)
    w.add_argument("--targets", type=int, required=True)
    w.add_argument("--settle", type=float, default=8)
    w.add_argument("--timeout", type=float, default=120)
    c.add_argument("--dashboard", required=True)
    c.add_argument("--time", type=float, required=True)
    c.add_argument("--rate-interval", default="10s")
    c.add_argument("--range", default="60s")
    c.add_argument("--optional", nargs="*")
    c.add_argument("--only-metric")
    a = ap.parse_args()
    sys.exit(wait(a) if a.cmd == "wait" else check(a))


if __name__ == "__main__":
    main()
