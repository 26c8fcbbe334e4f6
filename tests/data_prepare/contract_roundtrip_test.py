"""The data contract follows the data, and the export says where it came from (docs/data.md#the-data-contract):

  prepare (Qwen3 template, --thinking off) -> `dflash run` straight from the prepared JSONL (config
  data.jsonl: imported into the run dir once, reused on a rerun, refused when the dir holds other
  inputs) -> the ledger's run record, every checkpoint's run_info and the export's config.json carry
  the same contract, target and data hashes; the export has the model card, `dtype` (no
  `torch_dtype`) and the mask token id of the tokenizer rule; `dflash export` of a checkpoint
  writes the same provenance; z-lab's DFlashDraftModel loads both exports (dtype "auto" reads
  `dtype`). `dflash eval` with prompts prepared with --thinking on refuses (exit 2, naming both
  values) unless --allow-mismatch; prompts prepared like the data pass. `dflash data import` takes
  prepared and regenerated JSONL as they are, with the contract in the manifest.

usage: contract_roundtrip_test.py PATH/TO/dflash WORKDIR
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402

DFLASH, WORK = sys.argv[1], sys.argv[2]
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_tools.data.prepare import CONTRACT_KEYS  # noqa: E402  (the build links python/ into the venv)

check = fixtures.check
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dflash(*args, timeout=600):
    p = subprocess.run([DFLASH, *args], capture_output=True, text=True, env=ENV, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def make_target(out_dir):
    """A 4-layer random Qwen3 with the test tokenizer; its embedding table has 8 padding rows past the
    tokenizer's ids (as Qwen3's 151936 rows past 151669 ids), so the mask token rule picks len(tok)."""
    import torch
    import transformers
    fixtures.make_tokenizer_dir("qwen3", out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    cfg = transformers.Qwen3Config(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, tie_word_embeddings=False,
                                   eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(out_dir)
    return tok


def write_chats(path, n):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            c = fixtures.CORPUS
            reply = " ".join([c[i % 9], c[(i + 3) % 9], c[(i + 5) % 9]])
            f.write(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": c[(i + 1) % 9]},
                                                                 {"from": "gpt", "value": reply}]}) + "\n")


def run_config(path, target, jsonl, out_dir):
    import yaml
    with open(os.path.join(SRC, "configs", "tiny-cpu.yaml"), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["run"].update({"output_dir": out_dir, "epochs": 2, "save_interval_steps": 2, "resume": "auto"})
    cfg["target"]["model_dir"] = target
    cfg["drafter"]["mask_token_id"] = -1  # from the tokenizer
    del cfg["data"]["shard_dir"]          # data.jsonl: <output_dir>/shards
    cfg["data"]["jsonl"] = [jsonl]
    cfg["topology"]["hosts"][0].update({"target_gpus": [0], "drafter_gpus": [1]})
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)


def check_export(export, expect_contract, expect_provenance, mask_id, what):
    cfg = json.load(open(os.path.join(export, "config.json")))
    prov = cfg["dflash_config"]["provenance"]
    check(prov["data_contract"] == expect_contract, f"{what}: data_contract {prov['data_contract']} != {expect_contract}")
    for key in ("target", "data"):
        check(prov[key] == expect_provenance[key], f"{what}: provenance.{key} {prov[key]} != the ledger's")
    check(isinstance(prov["steps"], int) and prov["steps"] > 0, f"{what}: steps {prov['steps']}")
    check(prov["dflash_version"] and prov["dflash_commit"], f"{what}: no version / commit")
    check("dtype" in cfg and "torch_dtype" not in cfg, f"{what}: dtype keys {[k for k in cfg if 'dtype' in k]}")
    check(cfg["dflash_config"]["mask_token_id"] == mask_id, f"{what}: mask_token_id {cfg['dflash_config']['mask_token_id']}")
    card = open(os.path.join(export, "README.md"), encoding="utf-8").read()
    for want in ('"method": "dflash"', '"num_speculative_tokens": 7', "--speculative-algorithm DFLASH",
                 "--speculative-num-draft-tokens 8", "thinking mode `off`", expect_contract["chat_template_sha256"],
                 "---\nlicense: apache-2.0\nbase_model: " + json.dumps(expect_provenance["target"]["name"] or
                                                                    expect_provenance["target"]["model_dir"]),
                 "library_name: transformers\npipeline_tag: text-generation\n"):
        check(want in card, f"{what}: model card lacks {want!r}")
    return cfg


def zlab_loads(export, mask_id, dtype_name, what):
    import torch
    from dflash.model import DFlashDraftModel
    m, info = DFlashDraftModel.from_pretrained(export, dtype="auto", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    check(not bad, f"{what}: z-lab loading info {bad}")
    check(int(m.mask_token_id) == mask_id, f"{what}: z-lab mask_token_id {m.mask_token_id}")
    check(m.dtype == getattr(torch, dtype_name), f"{what}: z-lab loaded {m.dtype}, config says {dtype_name}")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    target = os.path.join(WORK, "target")
    tok = make_target(target)
    chats = os.path.join(WORK, "chats.jsonl")
    write_chats(chats, 24)

    prepared = os.path.join(WORK, "prepared.jsonl")
    rc, _, err = dflash("data", "prepare", "--tokenizer", target, "--input", chats, "--out", prepared, "--thinking", "off")
    check(rc == 0, f"prepare: exit {rc}: {err[-500:]}")
    meta = json.load(open(prepared + ".meta.json"))
    contract = {k: meta[k] for k in CONTRACT_KEYS}
    check(meta["out_sha256"] == sha256(prepared), "prepare: out_sha256 is not the sha256 of the JSONL written")
    prompts = {}
    for mode in ("off", "on"):
        prompts[mode] = os.path.join(WORK, f"prompts_{mode}.jsonl")
        rc, _, err = dflash("data", "prepare", "--tokenizer", target, "--input", chats, "--out", prompts[mode],
                            "--thinking", mode, "--prompts-only")
        check(rc == 0, f"prepare --prompts-only --thinking {mode}: exit {rc}: {err[-500:]}")

    # `dflash run` straight from the prepared JSONL.
    run_dir, cfg_path = os.path.join(WORK, "run"), os.path.join(WORK, "run.yaml")
    run_config(cfg_path, target, prepared, run_dir)
    rc, _, err = dflash("run", cfg_path, "--quiet")
    check(rc == 0, f"dflash run: exit {rc}: {err[-2000:]}")
    if rc != 0:
        return fixtures.result()
    record = json.loads(open(os.path.join(run_dir, "ledger.jsonl")).readline())
    prov = record["provenance"]
    check(prov["data_contract"] == contract, f"ledger: data_contract {prov['data_contract']} != prepare's {contract}")
    # name: the target config's _name_or_path (the model card's base_model); this one saves none.
    name = json.load(open(os.path.join(target, "config.json"))).get("_name_or_path") or None
    check(prov["target"] == {"model_dir": target, "name": name,
                             "config_sha256": sha256(os.path.join(target, "config.json"))},
          f"ledger: target {prov['target']}")
    check(prov["data"]["inputs"] == [{"file": prepared, "sha256": meta["out_sha256"]}], f"ledger: inputs {prov['data']['inputs']}")
    check(prov["data"]["shard_dir"] == os.path.join(run_dir, "shards"), f"ledger: shard_dir {prov['data']['shard_dir']}")
    check(prov["data"]["manifest_sha256"] == sha256(os.path.join(run_dir, "shards", "manifest.json")), "ledger: manifest hash")
    check(record["data_import"] is not None and record["data_import"]["documents"] > 0,
          f"ledger: data_import {record.get('data_import')}")
    ckpts = sorted(d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.startswith("step-"))
    check(bool(ckpts), "no checkpoint")
    state = json.load(open(os.path.join(run_dir, "checkpoints", ckpts[-1], "state.json")))
    check(state["run_info"].get("provenance") == prov, "checkpoint run_info.provenance differs from the ledger's")

    mask_id = len(tok)  # the tokenizer has no mask token: its size, the first unused row
    check_export(os.path.join(run_dir, "export"), contract, prov, mask_id, "run export")
    exp2 = os.path.join(WORK, "export_ckpt")
    rc, out, err = dflash("export", "--checkpoint", os.path.join(run_dir, "checkpoints", ckpts[-1]), "--out", exp2)
    check(rc == 0, f"dflash export: exit {rc}: {err[-500:]}")
    if rc == 0:
        c2 = check_export(exp2, contract, prov, mask_id, "dflash export")
        check(c2["dflash_config"]["provenance"]["steps"] == state["step"], "dflash export: steps != the checkpoint's")
        zlab_loads(exp2, mask_id, "bfloat16", "dflash export")
    zlab_loads(os.path.join(run_dir, "export"), mask_id, "float32", "run export")

    # A rerun reuses the imported shards (the run is finished); other inputs in the same dir are refused.
    rc, _, err = dflash("run", cfg_path, "--quiet")
    check(rc == 0 and "already holds these files" in err, f"rerun: exit {rc}: {err[-500:]}")
    other = os.path.join(WORK, "other.yaml")
    run_config(other, target, prompts["off"], run_dir)
    rc, _, err = dflash("run", other, "--quiet")
    check(rc == 2 and "holds a dataset imported from" in err, f"other data.jsonl in the same dir: exit {rc}: {err[-500:]}")

    # dflash eval: the contract of the export against the prompts'.
    base = ["eval", "--target", target, "--drafter", os.path.join(run_dir, "export"), "--max-new-tokens", "4"]
    rc, _, err = dflash(*base, "--input", prompts["on"])
    check(rc == 2, f"eval, prompts with thinking on: exit {rc}, expected 2: {err[-500:]}")
    want = f"thinking is on in {prompts['on']}.meta.json but off in {run_dir}/export/config.json"
    check(want in err and "--allow-mismatch" in err, f"eval refusal does not name both values: {err[-800:]}")
    rc, _, err = dflash(*base, "--input", prompts["on"], "--allow-mismatch")
    check(rc == 0 and want in err, f"eval --allow-mismatch: exit {rc}: {err[-500:]}")
    rc, _, err = dflash(*base, "--input", prompts["off"])
    check(rc == 0 and "prepared differently" not in err, f"eval, prompts like the data: exit {rc}: {err[-500:]}")

    # `dflash data import` takes prepared and regenerated JSONL as they are.
    regen = os.path.join(WORK, "regenerated.jsonl")
    rc, _, err = dflash("data", "regenerate", "--target", target, "--input", prepared, "--out", regen,
                        "--max-new-tokens", "24", "--batch-size", "8")
    check(rc == 0, f"regenerate: exit {rc}: {err[-500:]}")
    rmeta = json.load(open(regen + ".meta.json"))
    check({k: rmeta.get(k) for k in CONTRACT_KEYS} == contract, f"regenerate meta: contract {rmeta}")
    check(rmeta["regenerate_thinking"] == "keep", "regenerate meta: its own --thinking")
    for name, path in (("prepared", prepared), ("regenerated", regen)):
        ds = os.path.join(WORK, f"shards_{name}")
        rc, _, err = dflash("data", "import", "--input", path, "--out", ds, "--block-size", "8")
        check(rc == 0, f"import of {name} JSONL: exit {rc}: {err[-500:]}")
        if rc == 0:
            m = json.load(open(os.path.join(ds, "manifest.json")))
            got = {k: m["import"]["input_meta"][path].get(k) for k in CONTRACT_KEYS}
            check(got == contract, f"import of {name} JSONL: manifest contract {got}")
    return fixtures.result()


if __name__ == "__main__":
    sys.exit(main())
