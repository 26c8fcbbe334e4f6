#!/usr/bin/env python3
"""Checks a finished `dflash run` (tests/coordinator/fault_matrix.sh).

  check_run.py RUN_DIR --samples N [--reference RUN_DIR] [--expect-restarts N] [--expect-oom]
               [--expect-skipped-checkpoint] [--differs-from-reference]

Independent of the coordinator's code: replays ledger.jsonl itself (rollbacks discard later steps
and checkpoints), recomputes which samples each epoch must train from the drafters' own plan lines
(pipeline/drafter-0.jsonl, last "plan" record: unassigned ids per epoch) and the shard index, and
checks that
  (1) the ledger ends with "finished", every schedule step 1..total is committed by every rank;
  (2) every sample of each epoch is trained exactly once: the committed samples of an epoch are
      unique and equal all samples minus those the plan leaves unassigned;
  (3) each drafter's own log (pipeline/drafter-R.jsonl, the last record of each step) has the same
      sample ids per step as the ledger;
  (4) restarts / OOM packing changes / skipped checkpoints are as expected;
  (5) the exported weights equal --reference's byte for byte (or differ, --differs-from-reference).
"""
import argparse, collections, filecmp, json, os, struct, sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--reference")
    ap.add_argument("--expect-restarts", type=int, default=0)
    ap.add_argument("--expect-oom", action="store_true")
    ap.add_argument("--expect-skipped-checkpoint", action="store_true")
    ap.add_argument("--differs-from-reference", action="store_true")
    ap.add_argument("--expect-rank-changes", type=int, default=0)
    a = ap.parse_args()

    recs = [json.loads(l) for l in open(os.path.join(a.run, "ledger.jsonl"))]
    run = recs[0]
    assert run["type"] == "run", run
    steps, ckpts, restarts, packing, launches = {}, [], [], [], []
    for r in recs:
        t = r["type"]
        if t == "step":
            steps.setdefault(r["step"], {})[r["rank"]] = (r["epoch"], r["samples"])
        elif t == "checkpoint":
            ckpts.append(r)
        elif t == "rollback":
            steps = {s: v for s, v in steps.items() if s <= r["to_step"]}
            ckpts = [c for c in ckpts if c["step"] <= r["to_step"]]
        elif t == "restart":
            restarts.append(r)
        elif t == "packing":
            packing.append(r)
        elif t == "launch":
            launches.append(r)
    if recs[-1]["type"] != "finished":
        fail(f"the ledger does not end with 'finished' but {recs[-1]}")
    # The schedule of the final launch (its plan line covers the whole run, all generations).
    plans = [json.loads(l) for l in open(os.path.join(a.run, "pipeline", "drafter-0.jsonl"))]
    plan = [p for p in plans if p.get("event") == "plan"][-1]
    total = plan["total_steps"]
    ranks = {}  # schedule step -> drafter ranks of its generation
    for seg in plan["epochs"]:
        for s in range(seg["first_step"] + 1, seg["first_step"] + seg["steps"] + 1):
            ranks[s] = seg.get("drafters", run["drafters"])
    M = max(ranks.values())
    # (1)
    missing = [s for s in range(1, total + 1) if s not in steps or len(steps[s]) != ranks[s]]
    if missing:
        fail(f"steps not committed by all their ranks: {missing[:10]} ({len(missing)})")
    if max(steps) != total:
        fail(f"steps beyond the schedule: {max(steps)} > {total}")
    # (2)
    per_epoch = collections.defaultdict(list)
    for s in sorted(steps):
        for r in range(ranks[s]):
            e, ids = steps[s][r]
            per_epoch[e] += ids
    unassigned = collections.defaultdict(set)
    for seg in plan["epochs"]:
        unassigned[seg["epoch"]] |= set(seg.get("unassigned_sample_ids", []))
        if seg.get("dropped_samples"):
            fail("the test data should drop no sample")
    epochs = run["epochs"]
    if sorted(per_epoch) != list(range(epochs)):
        fail(f"epochs trained {sorted(per_epoch)} != 0..{epochs - 1}")
    for e, ids in per_epoch.items():
        if len(ids) != len(set(ids)):
            dup = [i for i, c in collections.Counter(ids).items() if c > 1]
            fail(f"epoch {e}: samples trained more than once: {dup[:10]}")
        expected = set(range(a.samples)) - unassigned[e]
        if set(ids) != expected:
            fail(f"epoch {e}: {len(expected - set(ids))} samples never trained, {len(set(ids) - expected)} unexpected")
    # (3)
    for r in range(M):
        own = {}
        for l in open(os.path.join(a.run, "pipeline", f"drafter-{r}.jsonl")):
            j = json.loads(l)
            if "step" in j and "sample_ids" in j:
                own[j["step"]] = j["sample_ids"]
        for s in range(1, total + 1):
            if r >= ranks[s]:
                continue
            if own.get(s) != steps[s][r][1]:
                fail(f"drafter {r} step {s}: own log {own.get(s)} != ledger {steps[s][r][1]}")
    # (4)
    if len(restarts) != a.expect_restarts:
        fail(f"{len(restarts)} restarts, expected {a.expect_restarts}: {restarts}")
    if a.expect_oom:
        if not packing:
            fail("no packing change after the OOM")
        p = [x for x in packing if "OOM" in x.get("reason", "")][-1]
        if not (p["token_budget"] < run["token_budget"] and p["max_anchors"] == run["max_anchors"]
                and p["block_size"] == run["block_size"]):
            fail(f"OOM response {p} vs run {run}: token_budget must drop, max_anchors/block_size stay")
        print(f"  OOM: token_budget {run['token_budget']} -> {p['token_budget']} from step {p['start_step']}; "
              f"max_anchors {p['max_anchors']}, block_size {p['block_size']} unchanged")
    elif any("OOM" in x.get("reason", "") for x in packing):
        fail(f"unexpected OOM packing change {packing}")
    rank_changes = [x for x in packing if "drafter ranks" in x.get("reason", "")]
    if len(rank_changes) != a.expect_rank_changes:
        fail(f"{len(rank_changes)} drafter-rank changes in the ledger, expected {a.expect_rank_changes}")
    for x in rank_changes:
        print(f"  from step {x['start_step']}: {x['reason']}")
    if a.expect_skipped_checkpoint:
        resumed = [l["resume"] for l in launches[1:]]
        committed = [r for r in recs if r["type"] == "checkpoint"]
        newest_before = max((c for c in committed if c["time"] < launches[1]["time"]), key=lambda c: c["step"])
        if resumed[0] == newest_before["dir"]:
            fail(f"the restart resumed from the corrupted checkpoint {resumed[0]}")
        print(f"  corrupted {newest_before['dir']} skipped; resumed from {resumed[0] or '(start)'}")
    # (5)
    if a.reference:
        same = filecmp.cmp(os.path.join(a.run, "export", "model.safetensors"),
                           os.path.join(a.reference, "export", "model.safetensors"), shallow=False)
        if a.differs_from_reference and same:
            fail("weights equal the fault-free run's although the schedule changed")
        if not a.differs_from_reference and not same:
            fail("final weights differ from the fault-free run with the same schedule")
    print(f"OK {a.run}: {total} steps committed once by all their ranks (up to {M}); every epoch's samples exactly once "
          f"({sum(len(v) for v in per_epoch.values())} sample-epochs); {len(restarts)} restart(s)"
          + (": " + "; ".join(f"{r['role']} {r['rank']}: {r['reason'][:80]}" for r in restarts) if restarts else "")
          + ("; weights " + ("differ from" if a.differs_from_reference else "identical to") + " the fault-free run"
             if a.reference else ""))


if __name__ == "__main__":
    main()
