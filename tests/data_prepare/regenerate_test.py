"""`dflash data regenerate` against HF: on a tiny random Qwen3 target (made here, with the Qwen3 chat
template on a small BPE tokenizer), every greedy regenerated reply, turn by turn with the replies
before it regenerated, must equal HF `generate` run on the same prompts (each alone, batch 1); chat
lines and tokenized lines; skips counted; then a run killed with SIGKILL in the middle and rerun
must give every id exactly once, equal to the uninterrupted run.

usage: regenerate_test.py PATH/TO/dflash WORKDIR
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402

DFLASH, WORK = sys.argv[1], sys.argv[2]
MAX_NEW = 10
check = fixtures.check


def make_target(out_dir):
    """A 2-layer random Qwen3 whose vocabulary is the test tokenizer's; the stop token's output row
    is scaled up so that some replies stop before MAX_NEW tokens and some do not."""
    import torch
    import transformers
    tok_dir = fixtures.make_tokenizer_dir("qwen3", out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=stop,
                                   bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        model.lm_head.weight[stop] *= 16.0
    model.save_pretrained(out_dir)
    return tok, model, stop


def hf_reply(model, prompt, stop):
    import torch
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                         do_sample=False, eos_token_id=[stop], pad_token_id=stop)
    gen = [int(t) for t in out[0, len(prompt):]]
    return gen, ("stop" if gen and gen[-1] == stop else "length")


def reference_chat(tok, model, stop, messages):
    """HF: reply k from apply_chat_template(messages[:i], add_generation_prompt=True) with earlier
    replies replaced by their regenerated text."""
    msgs = [dict(m) for m in messages]
    lengths = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=True, return_dict=False,
                                         enable_thinking=False)
        gen, finish = hf_reply(model, prompt, stop)
        lengths += finish == "length"
        msgs[i] = {"role": "assistant", "content": tok.decode(gen[:-1] if finish == "stop" else gen,
                                                              skip_special_tokens=False)}
    return msgs, lengths


def reference_tokens(model, stop, segments):
    """segments: [("ctx", ids), ("reply", ids), ...] -> (input_ids, loss_mask, lengths)."""
    ids, mask, lengths = [], [], 0
    for kind, seg in segments:
        if kind == "ctx":
            ids += seg
            mask += [0] * len(seg)
        else:
            gen, finish = hf_reply(model, ids, stop)
            lengths += finish == "length"
            ids += gen
            mask += [1] * len(gen)
    return ids, mask, lengths


def server_check(tok, model, stop, inp, engine_out):
    import contextlib
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from dflash_tools.data.regenerate import main as regenerate_main

    state = {"fail": "Numbers?", "lock": threading.Lock()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = (self.path == "/v1/chat/completions" and body["model"] == "tiny" and body["max_tokens"] == MAX_NEW
                  and body["chat_template_kwargs"] == {"enable_thinking": False})
            if not ok or body["messages"][-1]["content"] == state["fail"]:
                self.send_response(500 if ok else 400)
                self.end_headers()
                self.wfile.write(b"no")
                return
            prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False, enable_thinking=False)
            with state["lock"]:
                gen, finish = hf_reply(model, prompt, stop)
            text = tok.decode(gen[:-1] if finish == "stop" else gen, skip_special_tokens=False)
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                            "finish_reason": finish}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    out3 = os.path.join(WORK, "out_server.jsonl")
    args = ["--input", inp, "--max-new-tokens", str(MAX_NEW), "--thinking", "off", "--skip-bad", "--server", url, "--server-model", "tiny", "--server-retries", "1", "--batch-size", "2", "--out", out3]
    t = time.time()
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        rc = regenerate_main(args)
    stats = json.loads(captured.getvalue())
    check(rc == 1 and stats["skipped"].get("server_error") == 1, f"--server with a failing request: rc {rc}, {stats}")
    check(stats["skipped"].get("tokenized_line_with_server") == 1, f"--server skips: {stats['skipped']}")
    first = {d["id"] for d in read_out(out3)}
    check(first == {"sg", "oa", "pr"}, f"--server first run wrote {sorted(first)}")
    state["fail"] = None
    with contextlib.redirect_stdout(io.StringIO()):
        rc = regenerate_main(args)
    check(rc == 0, f"--server rerun: rc {rc}")
    answers = read_out(out3)
    check(sorted(d["id"] for d in answers) == ["oa", "oa3", "pr", "sg"], "--server rerun: ids")
    for d in answers:
        check(d["messages"] == engine_out[d["id"]]["messages"], f"{d['id']}: --server replies differ from the engine's")
    check(not os.path.exists(out3 + ".work"), "--server: round files left after a complete run")
    httpd.shutdown()
    print(f"  --server (two runs, in process) in {time.time() - t:.1f}s")


def processes_naming(text):
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().decode("utf-8", "replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            pids.append(int(d))
    return pids


def read_out(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def regenerate(args, out, **popen):
    cmd = [DFLASH, "data", "regenerate", *args, "--out", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def main():
    if os.path.exists(WORK):
        shutil.rmtree(WORK)
    os.makedirs(WORK)
    target = os.path.join(WORK, "target")
    tok, model, stop = make_target(target)

    chats = [
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
         {"role": "user", "content": "And two plus two?"}, {"role": "assistant", "content": "Four."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A poem about the sea?"},
         {"role": "assistant", "content": "The wind and the stars."}],
        [{"role": "user", "content": "Quick brown fox?"}, {"role": "assistant", "content": "Lazy dog."},
         {"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
         {"role": "user", "content": "Numbers?"}, {"role": "assistant", "content": "0123456789"}],
    ]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    segments = [("ctx", enc("<|im_start|>user\nTwo plus two?<|im_end|>\n<|im_start|>assistant\n")),
                ("reply", enc("Four.<|im_end|>")), ("ctx", enc("\n<|im_start|>user\nAnd the sea?<|im_end|>\n"
                                                              "<|im_start|>assistant\n")),
                ("reply", enc("Blue.<|im_end|>")), ("ctx", enc("\n"))]
    tokenized = {"id": "tok-1", "input_ids": [t for _, s in segments for t in s],
                 "loss_mask": [int(k == "reply") for k, s in segments for _ in s]}
    lines = [json.dumps({"id": "sg", "conversations": [
                 {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in chats[0]]}),
             json.dumps({"id": "oa", "messages": chats[1]}),
             json.dumps({"id": "pr", "prompt": "Quick brown fox?", "response": "Lazy dog."}),
             json.dumps({"id": "oa3", "messages": chats[2]}),
             json.dumps(tokenized),
             json.dumps({"id": "txt", "text": "plain text is not regenerated"}),
             json.dumps({"id": "tool", "messages": [{"role": "user", "content": "Weather?"},
                                                    {"role": "assistant", "content": "Let me check."},
                                                    {"role": "tool", "content": "21 C"},
                                                    {"role": "assistant", "content": "21 C."}]}),
             "{garbage"]
    inp = os.path.join(WORK, "in.jsonl")
    with open(inp, "w") as f:
        f.write("\n".join(lines) + "\n")
    def options(max_new=MAX_NEW):
        return ["--target", target, "--input", inp, "--max-new-tokens", str(max_new), "--thinking", "off",
                "--skip-bad"]
    common = options()

    t = time.time()
    out1 = os.path.join(WORK, "out1.jsonl")
    p = regenerate(common + ["--batch-size", "3"], out1)
    stdout, stderr = p.communicate()
    print(f"  regenerate: rc {p.returncode} in {time.time() - t:.1f}s")
    check(p.returncode == 0, f"regenerate exited {p.returncode}\n{stderr[-3000:]}")
    if p.returncode != 0:
        return 1
    got = {d["id"]: d for d in read_out(out1)}
    check(sorted(got) == ["oa", "oa3", "pr", "sg", "tok-1"], f"regenerated ids: {sorted(got)}")

    t = time.time()
    want_len = 0
    pr_chat = [{"role": "user", "content": "Quick brown fox?"}, {"role": "assistant", "content": "Lazy dog."}]
    for rid, msgs in (("sg", chats[0]), ("oa", chats[1]), ("pr", pr_chat), ("oa3", chats[2])):
        ref, n_len = reference_chat(tok, model, stop, msgs)
        want_len += n_len
        check(got.get(rid, {}).get("messages") == ref,
              f"{rid}: regenerated messages differ from HF generate\n got  {got.get(rid, {}).get('messages')}\n"
              f" want {ref}")
        check(got.get(rid, {}).get("regenerated", {}).get("hit_max_tokens") == n_len, f"{rid}: hit_max_tokens")
    ids, mask, n_len = reference_tokens(model, stop, segments)
    want_len += n_len
    check(got.get("tok-1", {}).get("input_ids") == ids, f"tok-1: input_ids differ from HF generate\n got  "
          f"{got.get('tok-1', {}).get('input_ids')}\n want {ids}")
    check(got.get("tok-1", {}).get("loss_mask") == mask, "tok-1: loss_mask differs")
    print(f"  HF reference in {time.time() - t:.1f}s")
    stats = json.loads(stdout)
    check(stats["hit_max_tokens"] == want_len and 0 < want_len < stats["turns"],
          f"hit_max_tokens {stats['hit_max_tokens']}, HF {want_len} of {stats['turns']} replies (want some of each)")
    check(stats["skipped"] == {"plain_text": 1, "tool_turns": 1, "invalid_json": 1}, f"skipped: {stats['skipped']}")
    check(stats["turns"] == 2 + 1 + 1 + 3 + 2, f"turns {stats['turns']}")
    check(not os.path.exists(out1 + ".work"), "the round files were not removed after a complete run")

    # Kill -9 in the middle of round 0 (batch size 1: outputs appear one by one), then rerun.
    out2 = os.path.join(WORK, "out2.jsonl")
    args2 = common + ["--batch-size", "1"]
    p = regenerate(args2, out2)
    round0 = os.path.join(out2 + ".work", "round-0.out.jsonl")
    killed = False
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline:
        if os.path.exists(round0) and os.path.getsize(round0) > 0:
            os.kill(p.pid, signal.SIGKILL)  # dflash only: its Python and that one's generate must follow
            killed = True
            break
        time.sleep(0.02)
    p.communicate()
    check(killed, "the run finished before it could be killed (nothing was tested)")
    left = processes_naming(out2)
    for _ in range(100):
        if not left:
            break
        time.sleep(0.05)
        left = processes_naming(out2)
    # (A generate orphaned by a missing PDEATHSIG would mostly finish on its own within these 5 s on
    # this tiny model, so this only catches one that keeps running, e.g. hung.)
    check(not left, f"processes of the killed run still running 5 s after kill -9 of dflash: {left}")
    for pid in left:  # our own descendants: do not let them disturb the rerun
        os.kill(pid, signal.SIGKILL)
    p = regenerate(options(MAX_NEW + 1) + ["--batch-size", "1"], out2)
    _, stderr = p.communicate()
    check(p.returncode == 2 and "max_new_tokens" in stderr,
          f"a rerun with other options: exit {p.returncode}, expected 2 naming max_new_tokens\n{stderr[-500:]}")
    p = regenerate(args2, out2)
    stdout, stderr = p.communicate()
    check(p.returncode == 0, f"resumed regenerate exited {p.returncode}\n{stderr[-3000:]}")
    if p.returncode == 0:
        resumed = read_out(out2)
        ids2 = [d["id"] for d in resumed]
        check(sorted(ids2) == sorted(got), f"resumed ids {sorted(ids2)} (duplicates or missing)")
        for d in resumed:
            check(d == got.get(d["id"]), f"{d['id']}: the resumed run differs from the uninterrupted one")
        # The stats' totals cover every record in OUT: after the resumed run, and after one more
        # run that finds everything done (nothing regenerated, the same totals).
        for again in (False, True):
            if again:
                p = regenerate(args2, out2)
                stdout, stderr = p.communicate()
                check(p.returncode == 0, f"a rerun of a finished regenerate exited {p.returncode}\n{stderr[-2000:]}")
            st2 = json.loads(stdout)
            print(f"  {'rerun' if again else 'resumed'}: {st2['already_done']} records found in OUT, "
                  f"{st2['regenerated']} added; totals {st2['turns']} turns, {st2['hit_max_tokens']} at the cap")
            check((st2["turns"], st2["hit_max_tokens"]) == (stats["turns"], stats["hit_max_tokens"])
                  and st2["already_done"] + st2["regenerated"] == len(got) and (st2["regenerated"] == 0) == again,
                  f"{'rerun' if again else 'resumed'} stats {st2} vs the uninterrupted run's {stats} (totals over OUT)")
    # --server: an OpenAI-compatible endpoint in this process, answering with HF generate; one
    # conversation's third turn fails (HTTP 500) in the first run and is asked again by the rerun.
    server_check(tok, model, stop, inp, got)

    return fixtures.result()


if __name__ == "__main__":
    sys.exit(main())
