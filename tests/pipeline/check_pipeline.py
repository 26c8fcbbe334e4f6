#!/usr/bin/env python3
"""Checks of the pipeline tests (pipeline_shm.sh).
  scrape --out DIR --ports P... --pids PID...   poll /metrics of each port while any pid lives; keep,
                                                per port, the last scrape that saw traffic
  check --run RUN_DIR --shards DIR --scrapes DIR --drafters M --targets N --wall S --logs DIR"""
import argparse, glob, json, math, os, re, sys, time, urllib.request


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parse(text):
    """Prometheus text -> {name{labels}: value} (labels as written, sorted by prometheus-cpp)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, val = line.rsplit(" ", 1)
        out[key] = float(val)
    return out


def scrape(a):
    os.makedirs(a.out, exist_ok=True)
    n = {p: 0 for p in a.ports}
    while any(alive(p) for p in a.pids):
        for port in a.ports:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
            except Exception:
                continue
            m = parse(body)
            if any(k.endswith("_batches_total") and v > 0 for k, v in m.items()):
                with open(os.path.join(a.out, f"{port}.txt"), "w") as f:
                    f.write(body)
                n[port] += 1
        time.sleep(0.2)
    print("scrapes with traffic per port:", n)


def get(m, name, **labels):
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    key = f"{name}{{{lab}}}" if lab else name
    if key not in m:
        raise AssertionError(f"series {key} missing from /metrics")
    return m[key]


def check(a):
    fail = []

    def expect(cond, msg):
        if not cond:
            fail.append(msg)

    M, N = a.drafters, a.targets
    logs = {}
    for d in range(M):
        rows = [json.loads(l) for l in open(os.path.join(a.run, "pipeline", f"drafter-{d}.jsonl"))]
        logs[d] = {"plan": rows[0], "steps": [r for r in rows if "step" in r], "done": rows[-1]}
        assert rows[0]["event"] == "plan" and rows[-1]["event"] == "done", f"drafter {d}: log incomplete"
    manifest = json.load(open(os.path.join(a.shards, "manifest.json")))
    D = manifest["documents"]
    plan = logs[0]["plan"]
    epochs = plan["epochs"]

    # (a) every sample of each epoch exactly once (trained by one drafter, or listed unassigned).
    total_samples = 0
    for ep in epochs:
        e = ep["epoch"]
        trained = []
        for d in range(M):
            batches = [i for s in logs[d]["steps"] if s["epoch"] == e for i in s["batches"]]
            expect(batches == [k * M + d for k in range(ep["per_drafter"])],
                   f"epoch {e}: drafter {d} trained batches {batches[:6]}..., expected k*M+d in order")
            trained += [i for s in logs[d]["steps"] if s["epoch"] == e for i in s["sample_ids"]]
        un = ep["unassigned_sample_ids"]
        expect(len(trained) == len(set(trained)), f"epoch {e}: a sample trained twice")
        expect(not (set(trained) & set(un)), f"epoch {e}: a sample both trained and unassigned")
        expect(len(trained) + len(un) + ep["dropped_samples"] == D and set(trained) | set(un) <= set(range(D)),
               f"epoch {e}: {len(trained)} trained + {len(un)} unassigned + {ep['dropped_samples']} dropped != {D} documents")
        total_samples += len(trained)
        print(f"(a) epoch {e}: {ep['batches']} batches, {ep['per_drafter']} per drafter, {ep['remainder_batches']} round-robin "
              f"remainder + {ep['accum_cut_batches']} cut to whole steps; {len(trained)} samples trained once, {len(un)} unassigned "
              f"(reported), {ep['dropped_samples']} dropped; {D} documents")

    # (b) checksums verified for every batch.
    for d in range(M):
        done = logs[d]["done"]
        expect(done["checksums_verified"] == done["micro_batches"] > 0,
               f"drafter {d}: {done['checksums_verified']} checksums verified for {done['micro_batches']} batches")
    print(f"(b) checksums verified: " + ", ".join(f"drafter {d} {logs[d]['done']['checksums_verified']}/{logs[d]['done']['micro_batches']}" for d in range(M)))

    # (c) identical weights after every step.
    steps = [logs[d]["steps"] for d in range(M)]
    expect(all(len(s) == len(steps[0]) for s in steps) and len(steps[0]) == plan["total_steps"],
           f"step counts {[len(s) for s in steps]} vs planned {plan['total_steps']}")
    same = 0
    for j, s0 in enumerate(steps[0]):
        hs = {steps[d][j]["weight_hash"] for d in range(M)}
        if len(hs) == 1 and s0["weight_hash"]:
            same += 1
        else:
            fail.append(f"step {s0['step']}: weight hashes differ {hs}")
            break
    distinct = len({s["weight_hash"] for s in steps[0]})
    print(f"(c) weights identical on all {M} drafters after each of {same}/{len(steps[0])} steps ({distinct} distinct hashes)")

    # (d) loss decreases.
    losses = [s["loss"] for s in steps[0]]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    tau0 = sum(s["accept_len"] for s in steps[0][:10]) / 10
    tau1 = sum(s["accept_len"] for s in steps[0][-10:]) / 10
    expect(last < 0.9 * first, f"loss did not decrease: {first:.3f} -> {last:.3f}")
    print(f"(d) loss {first:.3f} (first 10 steps) -> {last:.3f} (last 10); tau {tau0:.2f} -> {tau1:.2f}")

    # (e) /metrics.
    files = sorted(glob.glob(os.path.join(a.scrapes, "*.txt")))
    expect(len(files) == N + M, f"only {len(files)} of {N + M} processes were scraped with traffic")
    slots = 4
    for f in files:
        m = parse(open(f).read())
        try:
            if "dflash_target_tokens_total" in m:
                role = "target"
                for st in ["read", "forward", "wait", "pack", "send"]:
                    expect(get(m, "dflash_target_stage_seconds_count", stage=st) > 0, f"{f}: no {st} observations")
                expect(get(m, "dflash_target_sent_bytes_total") > 0, f"{f}: no bytes")
                expect(0 <= get(m, "dflash_target_queue_depth_batches") <= slots * M, f"{f}: queue depth")
                expect(0 <= get(m, "dflash_target_free_credits") <= slots * M, f"{f}: free credits")
                expect(get(m, "dflash_target_gpu_memory_allocated_bytes") == 0, f"{f}: gpu memory on CPU")
            else:
                role = "drafter"
                for st in ["wait", "train", "allreduce", "step"]:
                    expect(get(m, "dflash_drafter_stage_seconds_count", stage=st) > 0, f"{f}: no {st} observations")
                expect(get(m, "dflash_drafter_received_bytes_total") > 0, f"{f}: no bytes")
                # the checksum is counted at receive, the batch after its training step: at most one apart
                ck, nb = get(m, "dflash_drafter_checksums_verified_total"), get(m, "dflash_drafter_batches_total")
                expect(nb <= ck <= nb + 1, f"{f}: {ck} checksums verified for {nb} batches")
                loss = get(m, "dflash_drafter_loss_nats")
                expect(math.isfinite(loss) and 0 < loss < 50, f"{f}: loss {loss}")
                expect(0 <= get(m, "dflash_drafter_accuracy_ratio") <= 1, f"{f}: accuracy")
                expect(1 <= get(m, "dflash_drafter_acceptance_length_tokens") <= 8, f"{f}: acceptance length")
                expect(0 < get(m, "dflash_drafter_learning_rate") <= 3e-3, f"{f}: lr")
                expect(math.isfinite(get(m, "dflash_drafter_grad_norm")), f"{f}: grad norm")
                n_steps = get(m, "dflash_drafter_steps_total")
                for fam in ["step_loss_nats", "step_accuracy_ratio", "step_acceptance_length_tokens"]:
                    # counted just after dflash_drafter_steps_total: a scrape in between sees one less
                    expect(n_steps - 1 <= get(m, f"dflash_drafter_{fam}_count") <= n_steps, f"{f}: {fam}_count vs steps {n_steps}")
                    expect(get(m, f"dflash_drafter_{fam}_sum") > 0, f"{f}: {fam}_sum")
                expect(0 <= get(m, "dflash_drafter_waiting_ratio") <= 1, f"{f}: waiting ratio")
                expect(0 <= get(m, "dflash_drafter_queue_depth_batches") <= slots * N, f"{f}: queue depth")
                expect(0 <= get(m, "dflash_drafter_free_credits") <= slots * N, f"{f}: free credits")
                expect(get(m, "dflash_drafter_gpu_memory_peak_bytes") == 0, f"{f}: gpu memory on CPU")
            expect(get(m, "dflash_process_resident_memory_bytes") > 1e6, f"{f}: resident memory")
            expect(get(m, "dflash_process_cpu_seconds_total") > 0, f"{f}: cpu seconds")
            expect(get(m, "dflash_process_start_time_seconds") > 1.6e9, f"{f}: start time")
            expect([k for k in m if k.startswith("dflash_build_info{") and m[k] == 1], f"{f}: no dflash_build_info")
            tok = get(m, f"dflash_{role}_tokens_total")
            bat = get(m, f"dflash_{role}_batches_total")
            expect(tok > 0 and bat > 0 and tok <= bat * 576, f"{f}: tokens {tok} batches {bat}")
            print(f"(e) {os.path.basename(f)} ({role}): {int(bat)} batches, {int(tok)} tokens, {len(m)} series")
        except AssertionError as e:
            fail.append(f"{f}: {e}")

    # Profile lines (coordinator.profile_interval_s) in every process's log.
    for name in [f"target{t}" for t in range(N)] + [f"drafter{d}" for d in range(M)]:
        text = open(os.path.join(a.logs, f"{name}.log")).read()
        lines = [l for l in text.splitlines() if "profile:" in l]
        expect(lines, f"{name}: no profile line in its log")
        if lines:
            print(f"    {name}: {lines[-1].split('profile:', 1)[1].strip()}")

    # Numbers.
    tokens = sum(logs[d]["done"]["tokens"] for d in range(M))
    for d in range(M):
        dn = logs[d]["done"]
        print(f"drafter {d}: {dn['steps']} steps, {dn['micro_batches']} micro-batches, {dn['samples']} samples, {dn['tokens']} tokens "
              f"in {dn['loop_s']:.1f} s, waiting {100 * dn['wait_s'] / dn['loop_s']:.0f}% of the loop")
    print(f"total: {total_samples} samples, {tokens} tokens trained in {a.wall:.1f} s wall "
          f"({tokens / a.wall:.0f} tokens/s end to end, including start-up)")
    if fail:
        print("FAIL:\n  " + "\n  ".join(fail))
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scrape")
    s.add_argument("--out", required=True)
    s.add_argument("--ports", type=int, nargs="+", required=True)
    s.add_argument("--pids", type=int, nargs="+", required=True)
    c = sub.add_parser("check")
    for k in ["run", "shards", "scrapes", "logs"]:
        c.add_argument("--" + k, required=True)
    c.add_argument("--drafters", type=int, required=True)
    c.add_argument("--targets", type=int, required=True)
    c.add_argument("--wall", type=float, required=True)
    a = ap.parse_args()
    scrape(a) if a.cmd == "scrape" else check(a)


if __name__ == "__main__":
    main()
