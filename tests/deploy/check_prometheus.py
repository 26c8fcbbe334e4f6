#!/usr/bin/env python3
"""Checks a `dflash deploy prometheus` output against the run config it was made from, computed
independently here: the coordinator at coordinator.metrics_port (unless 0), worker i at
worker_metrics_port_base + i (unless the base is 0), targets first then drafters, each in host
order, with labels role/rank/host/gpu (and ctid where set).
Usage: check_prometheus.py CONFIG.yaml PROMETHEUS.yml [--address NAME=ADDR,...]"""
import sys

import yaml


def main():
    cfg_path, prom_path = sys.argv[1], sys.argv[2]
    addr = {}
    if len(sys.argv) > 4 and sys.argv[3] == "--address":
        addr = dict(kv.split("=", 1) for kv in sys.argv[4].split(","))
    cfg = yaml.safe_load(open(cfg_path))
    text = open(prom_path).read()
    prom = yaml.safe_load(text)
    co = cfg.get("coordinator", {})
    hosts = cfg["topology"]["hosts"]
    expected = []  # (port, labels)
    mport = co.get("metrics_port", 9400)
    base = co.get("worker_metrics_port_base", 9401)
    if mport:
        expected.append((mport, {"role": "coordinator", "rank": "0"}))
    else:
        assert "coordinator.metrics_port is 0" in text, "port 0 of the coordinator not explained"
    n = sum(len(h.get("target_gpus", [])) for h in hosts) + sum(len(h.get("drafter_gpus", [])) for h in hosts)
    if base:
        w = 0
        for role in ("target", "drafter"):
            rank = 0
            for h in hosts:
                for gpu in h.get(role + "_gpus", []):
                    lab = {"role": role, "rank": str(rank), "worker": str(w), "host": h["name"], "gpu": str(gpu)}
                    if h.get("ctid"):
                        lab["ctid"] = str(h["ctid"])
                    lab["_addr"] = addr.get(h["name"], h["name"])
                    expected.append((base + w, lab))
                    rank += 1
                    w += 1
    else:
        assert "worker_metrics_port_base is 0" in text, "port base 0 of the workers not explained"
    got = []
    for job in prom.get("scrape_configs") or []:
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                got.append((int(port), host, job["job_name"], sc["labels"]))
    assert len(got) == len(expected), f"{len(got)} targets, expected {len(expected)}"
    by_port = {p: (h, j, l) for p, h, j, l in got}
    assert len(by_port) == len(got), "a port appears twice"
    for port, lab in expected:
        assert port in by_port, f"port {port} ({lab}) missing"
        host, job, labels = by_port[port]
        want_addr = lab.pop("_addr", None)
        if want_addr is not None:
            assert host == want_addr, f"port {port}: address {host}, expected {want_addr}"
        assert job == "dflash-" + lab["role"], f"port {port}: job {job}"
        for k, v in lab.items():
            assert labels.get(k) == v, f"port {port}: label {k}={labels.get(k)!r}, expected {v!r}"
        assert labels.get("run") == cfg["run"]["name"], f"port {port}: run label"
    print(f"{cfg_path}: {len(expected)} scrape target(s) ok" + ("" if n and base else f" ({n} workers without a port)"))


if __name__ == "__main__":
    main()
