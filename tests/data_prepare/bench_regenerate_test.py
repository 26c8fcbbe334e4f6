"""`dflash bench regenerate` on CPU at tiny sizes: a 2-layer random Qwen3 made here; the JSON has both
sides, every record came back, the generated tokens counted from the output equal the engine's own
count and lie in [records, records * new_tokens], the ratio is ours / HF; bad flags exit 2 (a
misspelt one with a did-you-mean).
Usage: bench_regenerate_test.py DFLASH_BIN WORK_DIR"""
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers

DFLASH, WORK = sys.argv[1], sys.argv[2]


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
target = os.path.join(WORK, "target")
cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(target)

records, new = 5, 4
cmd = [DFLASH, "bench", "regenerate", "--target", target, "--records", str(records), "--prompt-len", "6",
       "--new-tokens", str(new), "--batch-size", "3", "--device", "cpu", "--dtype", "float32", "--baseline",
       "--baseline-batch", "2", "--baseline-repeats", "1", "--work", WORK]
r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
if r.returncode != 0:
    fail(f"bench regenerate exited {r.returncode}: {r.stderr[-2000:]}")
rep = json.loads(r.stdout)
ours, base = rep["ours"], rep["baseline"]
if rep["bench"] != "regenerate" or ours["records"] != records or ours["batch_size"] != 3:
    fail(f"report header: {rep}")
if not (records <= ours["generated_tokens"] <= records * new) or ours["generated_tokens"] != ours["engine_tokens"]:
    fail(f"generated tokens {ours['generated_tokens']} vs engine {ours['engine_tokens']} (records {records}, new {new})")
if not (ours["generation_tokens_per_s"] > 0 and ours["wall_tokens_per_s"] > 0 and ours["wall_seconds"] > 0):
    fail(f"ours: {ours}")
hf = base["results"][0]
if hf["batch"] != 2 or hf["prompt"] != 6 or hf["new_tokens"] != new or hf["tokens_per_s"] <= 0:
    fail(f"baseline: {base}")
if abs(rep["ratio"] - ours["generation_tokens_per_s"] / hf["tokens_per_s"]) > 1e-9 * rep["ratio"]:
    fail(f"ratio {rep['ratio']} is not ours / HF")
if [p for p in os.listdir(WORK) if p.startswith("tmp")]:
    fail(f"the work folder was not removed: {os.listdir(WORK)}")

for bad, needle in ((["--recordsx", "3"], "did you mean"), (["--records", "0"], "--records")):
    r = subprocess.run([DFLASH, "bench", "regenerate", "--target", target] + bad, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 2 or needle not in r.stderr:
        fail(f"{bad}: exit {r.returncode}, stderr {r.stderr[-500:]}")
print(f"PASS bench regenerate: {ours['generated_tokens']} tokens, ratio {rep['ratio']:.2f} on CPU")
