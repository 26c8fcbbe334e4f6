#!/usr/bin/env python3
"""Checks a bundle written by `scripts/quality/run.py fetch` (usage: check_bundle.py BUNDLE TRAIN HELDOUT):
- manifest.json: at least TRAIN training and HELDOUT held-out chats, every listed file present with
  its sha256;
- the split is the documented one: held-out and training conversations share no base id, and the
  held-out base ids are exactly the first ones in sha256 order among those used;
- data/train.jsonl: tokenized documents (input_ids, loss_mask of equal length, some trained tokens)
  rendered with ChatML (<|im_start|> ids present), ids from the training split only;
- data/heldout_prompts.jsonl: one prompt per held-out chat id that prepare kept, each ending in the
  assistant generation prompt; data/humaneval_prompts.jsonl: the 164 HumanEval tasks.
Exit 0 when all hold, 1 otherwise (each failure printed)."""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts", "quality"))
from run import base_id  # noqa: E402  the split's own rule, 'X_k.pN' -> X


def rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def main():
    bundle, n_train, n_heldout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fails = []
    m = json.load(open(os.path.join(bundle, "manifest.json")))
    if m["train_chats"] < n_train or m["heldout_chats"] < n_heldout:
        fails.append(f"manifest counts {m['train_chats']} / {m['heldout_chats']}")
    for rel, digest in m["files"].items():
        p = os.path.join(bundle, rel)
        if not os.path.isfile(p) or hashlib.sha256(open(p, "rb").read()).hexdigest() != digest:
            fails.append(f"manifest file {rel} missing or changed")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(bundle, "model"))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assistant_header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    train = rows(os.path.join(bundle, "data", "train.jsonl"))
    held = rows(os.path.join(bundle, "data", "heldout_prompts.jsonl"))
    he = rows(os.path.join(bundle, "data", "humaneval_prompts.jsonl"))
    tb, hb = {base_id(r["id"]) for r in train}, {base_id(r["id"]) for r in held}
    if tb & hb:
        fails.append(f"held-out and training share conversations: {sorted(tb & hb)[:5]}")
    key = lambda b: hashlib.sha256(b.encode()).hexdigest()  # noqa: E731
    if hb and tb and max(map(key, hb)) > min(map(key, tb)):
        fails.append("held-out base ids are not the first in sha256 order")
    for r in train:
        if len(r["input_ids"]) != len(r["loss_mask"]) or not any(r["loss_mask"]) or im_start not in r["input_ids"]:
            fails.append(f"train document {r['id']}: bad input_ids / loss_mask")
    for r in held + he:
        if r["input_ids"][-len(assistant_header):] != assistant_header:
            fails.append(f"prompt {r['id']} does not end with the assistant generation prompt")
    if len(train) < n_train * 0.9 or len(held) < n_heldout * 0.75:
        fails.append(f"prepare kept {len(train)} training documents and {len(held)} held-out prompts")
    if len(he) != 164:
        fails.append(f"{len(he)} HumanEval prompts, expected 164")
    print(f"bundle: {len(train)} training documents, {len(held)} held-out prompts, {len(he)} HumanEval prompts")
    if fails:
        print("FAIL\n  " + "\n  ".join(fails[:20]))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
