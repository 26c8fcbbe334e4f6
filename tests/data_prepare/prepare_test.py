"""`dflash data prepare` against HF: input_ids must equal apply_chat_template(tokenize=True) of the
same messages, and loss_mask must equal assistant spans found here by a different method (locating
each assistant header and end-of-turn marker in the rendered text), for three real chat templates
(Qwen3 with thinking off and on, Llama-3, SmolLM2/ChatML), the four input formats, multi-turn,
system prompts, tool calls, --last-turn-only, --max-seq-len, bad lines (exit 4 naming FILE:LINE, or
counted with --skip-bad), and prepare -> import -> shards read back.

usage: prepare_test.py PATH/TO/dflash WORKDIR
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402

DFLASH, WORK = sys.argv[1], sys.argv[2]
check = fixtures.check


# What the test expects of each template: the header before a reply and the end-of-turn marker.
HEADER = {"qwen3": "<|im_start|>assistant\n", "smollm2": "<|im_start|>assistant\n",
          "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "mistral": " [/INST]"}
END = {"qwen3": "<|im_end|>", "smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}
EMPTY_THINK = "<think>\n\n</think>\n\n"

TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
# The documented text form of a tool call for templates without tool_calls support (docs/data.md).
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (input record, messages as the test expects them, or ("text", str)). The expected messages are
# written out here, not derived by the code under test.
CHAT = [
    ({"id": "sg-multi", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "The capital of France is Paris."},
        {"from": "human", "value": "And two plus two?"},
        {"from": "gpt", "value": "Two plus two is four."}]},
     [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is the capital of France?"},
      {"role": "assistant", "content": "The capital of France is Paris."},
      {"role": "user", "content": "And two plus two?"},
      {"role": "assistant", "content": "Two plus two is four."}]),
    ({"conversations": [
        {"from": "user", "value": "Please write a short poem about the sea."},
        {"from": "assistant", "value": "The wind and the stars,\nthe sea at night."}]},
     [{"role": "user", "content": "Please write a short poem about the sea."},
      {"role": "assistant", "content": "The wind and the stars,\nthe sea at night."}]),
    ({"id": 7, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C in Paris."}]},
     None),  # depends on the template (tool calls), built in expected_messages()
    ({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You write code."}]},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b\n"},
        {"role": "user", "content": "Très bien, merci. Ça va?"},
        {"role": "assistant", "content": "Bonjour! Ça va très bien."},
        {"role": "user", "content": "Numbers 0123456789?"},
        {"role": "assistant", "content": "0123456789 {}[]()"}]},
     [{"role": "system", "content": "You write code."},
      {"role": "user", "content": "def add(a, b):"},
      {"role": "assistant", "content": "    return a + b\n"},
      {"role": "user", "content": "Très bien, merci. Ça va?"},
      {"role": "assistant", "content": "Bonjour! Ça va très bien."},
      {"role": "user", "content": "Numbers 0123456789?"},
      {"role": "assistant", "content": "0123456789 {}[]()"}]),
    ({"prompt": "What is speculative decoding?",
      "response": "It drafts several tokens and verifies them with the target model."},
     [{"role": "user", "content": "What is speculative decoding?"},
      {"role": "assistant", "content": "It drafts several tokens and verifies them with the target model."}]),
    ({"text": "The quick brown fox jumps over the lazy dog. Let me think step by step."},
     ("text", "The quick brown fox jumps over the lazy dog. Let me think step by step.")),
]

THINK = [
    ({"messages": [
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "<think>\nFirst, two plus two is four.\n</think>\n\nFour."}]},
     [{"role": "user", "content": "Two plus two?"},
      {"role": "assistant", "content": "<think>\nFirst, two plus two is four.\n</think>\n\nFour."}]),
    ({"messages": [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital of France is Paris."},
        {"role": "user", "content": "And two plus two?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "Let me think step by step."}]},
     [{"role": "user", "content": "Capital of France?"},
      {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital of France is Paris."},
      {"role": "user", "content": "And two plus two?"},
      {"role": "assistant", "content": "Four.", "reasoning_content": "Let me think step by step."}]),
    ({"conversations": [
        {"from": "human", "value": "Quick brown fox?"},
        {"from": "gpt", "value": "<think>\nThe lazy dog.\n</think>\n\nJumps."},
        {"from": "human", "value": "Poem?"},
        {"from": "gpt", "value": "<think>\nThe sea.\n</think>\n\nThe wind and the stars."}]},
     [{"role": "user", "content": "Quick brown fox?"},
      {"role": "assistant", "content": "<think>\nThe lazy dog.\n</think>\n\nJumps."},
      {"role": "user", "content": "Poem?"},
      {"role": "assistant", "content": "<think>\nThe sea.\n</think>\n\nThe wind and the stars."}]),
]
# Under --thinking on, a reply without a <think> block is a mismatch; under off, one with reasoning.
THINK_MISMATCH = {"messages": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]}
OFF_MISMATCH = THINK[0][0]


def expected_messages(name, record, msgs):
    if msgs is not None:
        return msgs
    call = ({"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]} if name == "qwen3"
            else {"role": "assistant", "content": TOOL_CALL_TEXT})
    return [{"role": "user", "content": "Weather in Paris?"}, call, {"role": "tool", "content": "21 C"},
            {"role": "assistant", "content": "It is 21 C in Paris."}]


def located_spans(name, rendered, n_assistant, thinking, last_only):
    """Assistant spans by locating each header and the end-of-turn marker after it."""
    spans, cursor = [], 0
    for k in range(n_assistant):
        h = rendered.find(HEADER[name], cursor)
        assert h >= 0, f"assistant header {k} not found"
        start = h + len(HEADER[name])
        if thinking == "off" and rendered.startswith(EMPTY_THINK, start):
            start += len(EMPTY_THINK)  # part of the prompt under enable_thinking=False
        end = rendered.find(END[name], start) + len(END[name])
        cursor = end
        if not last_only or k == n_assistant - 1:
            spans.append((start, end))
    return spans


def expected_doc(tok, name, messages, thinking="keep", last_only=False, system=None, max_len=0):
    """(input_ids, loss_mask) from HF apply_chat_template and located spans."""
    if isinstance(messages, tuple):
        ids = tok(messages[1])["input_ids"]
        mask = [1] * len(ids)
    else:
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        kw = {} if thinking == "keep" else {"enable_thinking": thinking == "on"}
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
        rendered = tok.apply_chat_template(messages, tokenize=False, **kw)
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == ids, "HF tokenization of the rendered text differs from apply_chat_template"
        n_asst = sum(m["role"] == "assistant" for m in messages)
        spans = located_spans(name, rendered, n_asst, thinking, last_only)
        for (s, e), m in zip(spans, [m for m in messages if m["role"] == "assistant"][-len(spans):]):
            visible = m["content"].split("</think>")[-1].strip()
            assert visible in rendered[s:e], f"located span {rendered[s:e]!r} lacks the reply {visible!r}"
        mask = [int(any(s <= a < e for s, e in spans) and b > a) for a, b in enc["offset_mapping"]]
    if max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for line in raw_lines:
            f.write(line + "\n")


def prepare(*args, expect_rc=0):
    t = time.time()
    p = subprocess.run([DFLASH, "data", "prepare", *args], capture_output=True, text=True)
    print(f"  dflash data prepare {' '.join(args[:6])}... -> rc {p.returncode} in {time.time() - t:.1f}s")
    check(p.returncode == expect_rc, f"prepare {args}: exit {p.returncode}, expected {expect_rc}\n{p.stderr[-2000:]}")
    return p


def prepare_in_process(*args):
    """The package's main() in this process (transformers is loaded already): the Python side
    without the CLI around it, for the runs whose CLI path other runs cover."""
    import contextlib
    import io
    from dflash_tools.data.prepare import main as prepare_main
    t = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = prepare_main(list(args))
    print(f"  python -m dflash_tools.data prepare {' '.join(args[:6])}... -> rc {rc} in {time.time() - t:.1f}s")
    return rc


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def compare(label, got, want_ids, want_mask):
    check(got["input_ids"] == want_ids,
          f"{label}: input_ids differ from HF apply_chat_template\n got  {got['input_ids']}\n want {want_ids}")
    check(got["loss_mask"] == want_mask,
          f"{label}: loss_mask differs from the located assistant spans\n got  {got['loss_mask']}\n want {want_mask}")


def sha256(path_or_text, is_path=True):
    data = open(path_or_text, "rb").read() if is_path else path_or_text.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def main():
    if os.path.exists(WORK):
        shutil.rmtree(WORK)
    os.makedirs(WORK)
    from transformers import AutoTokenizer
    toks, dirs = {}, {}
    for name in fixtures.TEMPLATES:
        dirs[name] = fixtures.make_tokenizer_dir(name, os.path.join(WORK, name))
        toks[name] = AutoTokenizer.from_pretrained(dirs[name])
    chat_in = os.path.join(WORK, "chat.jsonl")
    write_jsonl(chat_in, [r for r, _ in CHAT])

    # 1. Qwen3, thinking off, all formats, two worker processes (documents in input order); a reply
    #    with reasoning is a per-record mismatch (skipped).
    print("qwen3 --thinking off")
    off_bad = os.path.join(WORK, "off_bad.jsonl")
    write_jsonl(off_bad, [OFF_MISMATCH])
    out = os.path.join(WORK, "qwen3_off.jsonl")
    p = prepare("--tokenizer", dirs["qwen3"], "--input", f"{chat_in},{off_bad}", "--out", out,
                "--thinking", "off", "--skip-bad", "--workers", "2")
    if p.returncode == 0:
        got = read_jsonl(out)
        check(len(got) == len(CHAT), f"qwen3 off: {len(got)} documents, expected {len(CHAT)}")
        for k, ((rec, msgs), doc) in enumerate(zip(CHAT, got)):
            compare(f"qwen3 off record {k}", doc, *expected_doc(toks["qwen3"], "qwen3",
                                                                expected_messages("qwen3", rec, msgs), "off"))
        check([d["id"] for d in got[:3]] == ["sg-multi", f"{chat_in}:2", "7"], f"ids: {[d['id'] for d in got]}")
        meta = json.load(open(out + ".meta.json"))
        check(meta["stats"]["skipped_bad"] == {"thinking_mismatch": 1}, f"qwen3 off skipped: {meta['stats']}")
        check(f"{off_bad}:1" in meta["stats"]["bad_examples"][0], f"bad example lacks FILE:LINE: {meta['stats']}")
        check(meta["thinking"] == "off", "meta thinking")
        check(meta["tokenizer_sha256"] == sha256(os.path.join(dirs["qwen3"], "tokenizer.json")), "tokenizer hash")
        check(meta["chat_template_sha256"] == sha256(fixtures.template_text("qwen3"), False), "template hash")
        check(meta["stats"]["formats"] == {"sharegpt": 2, "openai": 2, "prompt-response": 1, "text": 1},
              f"formats: {meta['stats']['formats']}")
        check(json.loads(p.stdout) == meta, "stdout JSON differs from the .meta.json sidecar")
        check(sum(sum(d["loss_mask"]) for d in got) > 0, "nothing trained")
        check("prepare: 7 records, 6 documents" in p.stderr, f"progress line: {p.stderr[-300:]}")
        # `dflash data import` of that file records its .meta.json sidecar in the shard manifest.
        ds = os.path.join(WORK, "ds_import")
        q = subprocess.run([DFLASH, "data", "import", "--input", out, "--out", ds, "--block-size", "2"],
                           capture_output=True, text=True)
        check(q.returncode == 0, f"data import of the prepared file: exit {q.returncode}\n{q.stderr[-1000:]}")
        if q.returncode == 0:
            manifest = json.load(open(os.path.join(ds, "manifest.json")))
            check(manifest["import"].get("input_meta", {}).get(out) == meta,
                  "data import did not record the prepare sidecar in the manifest")

    # 2. Qwen3, thinking on, last turn only; a reply without a think block is a mismatch.
    print("qwen3 --thinking on --last-turn-only")
    think_in = os.path.join(WORK, "think.jsonl")
    write_jsonl(think_in, [r for r, _ in THINK] + [THINK_MISMATCH])
    out = os.path.join(WORK, "qwen3_on.jsonl")
    rc = prepare_in_process("--tokenizer", dirs["qwen3"], "--input", think_in, "--out", out, "--thinking", "on",
                            "--last-turn-only", "--skip-bad", "--format", "auto")
    check(rc == 0, f"qwen3 on: rc {rc}")
    if rc == 0:
        got = read_jsonl(out)
        check(len(got) == len(THINK), f"qwen3 on: {len(got)} documents")
        for k, ((rec, msgs), doc) in enumerate(zip(THINK, got)):
            compare(f"qwen3 on record {k}", doc, *expected_doc(toks["qwen3"], "qwen3", msgs, "on", last_only=True))
        meta = json.load(open(out + ".meta.json"))
        check(meta["stats"]["skipped_bad"] == {"thinking_mismatch": 1}, f"qwen3 on skipped: {meta['stats']}")
        check(meta["thinking"] == "on" and meta["last_turn_only"], "meta thinking on / last_turn_only")

    # 2b. --prompts-only: the chat before its last reply + the generation prompt (eval / generate input).
    print("qwen3 --prompts-only")
    out = os.path.join(WORK, "prompts.jsonl")
    rc = prepare_in_process("--tokenizer", dirs["qwen3"], "--input", chat_in, "--out", out, "--thinking", "off",
                            "--prompts-only")
    check(rc == 0, f"prompts-only: rc {rc}")
    if rc == 0:
        got = read_jsonl(out)
        check(len(got) == len(CHAT), f"prompts-only: {len(got)} prompts")
        for k, ((rec, msgs), doc) in enumerate(zip(CHAT, got)):
            msgs = expected_messages("qwen3", rec, msgs)
            if isinstance(msgs, tuple):
                want = toks["qwen3"](msgs[1])["input_ids"]
            else:
                want = toks["qwen3"].apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False, enable_thinking=False)
            check(doc["input_ids"] == want and "loss_mask" not in doc,
                  f"prompt {k} differs from HF apply_chat_template(add_generation_prompt=True)\n got  {doc}\n"
                  f" want {want}")

    # 3. Llama-3: --system for chats without one, truncation to 48 tokens.
    print("llama3 --system --max-seq-len 48")
    out = os.path.join(WORK, "llama3.jsonl")
    rc = prepare_in_process("--tokenizer", dirs["llama3"], "--input", chat_in, "--out", out, "--system",
                            "You are terse.", "--max-seq-len", "48")
    check(rc == 0, f"llama3: rc {rc}")
    if rc == 0:
        got = read_jsonl(out)
        want = [expected_doc(toks["llama3"], "llama3", expected_messages("llama3", r, m), system="You are terse.")
                for r, m in CHAT]
        kept = [(k, w) for k, w in enumerate(want) if any(w[1][:48])]
        check(len(got) == len(kept), f"llama3: {len(got)} documents, expected {len(kept)}")
        for (k, (ids, mask)), doc in zip(kept, got):
            compare(f"llama3 record {k}", doc, ids[:48], mask[:48])
        stats = json.load(open(out + ".meta.json"))["stats"]
        n_trunc = sum(len(w[0]) > 48 for _, w in kept)  # a dropped document counts only as dropped
        check(n_trunc > 0 and stats["truncated"] == n_trunc, f"llama3 truncated {stats['truncated']}, want {n_trunc}")
        n_drop = len(want) - len(kept)
        check(stats["dropped"] == ({"no_assistant_tokens_after_truncation": n_drop} if n_drop else {}),
              f"llama3 dropped {stats['dropped']}, want {n_drop}")
        check(stats["tokens"] == sum(len(d["input_ids"]) for d in got), "llama3 token count")
        check(abs(stats["assistant_token_fraction"] - sum(sum(d["loss_mask"]) for d in got) / stats["tokens"]) < 1e-12,
              "llama3 assistant fraction")

    # 4. Bad lines: exit 4 naming FILE:LINE, nothing written; counted and skipped with --skip-bad.
    print("bad lines")
    bad_in = os.path.join(WORK, "bad.jsonl")
    write_jsonl(bad_in, [], [json.dumps(CHAT[1][0]), "", "{not json", json.dumps(
        {"conversations": [{"from": "robot", "value": "hi"}]}), json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}),
        json.dumps(CHAT[4][0])])
    out = os.path.join(WORK, "bad_out.jsonl")
    p = prepare("--tokenizer", dirs["smollm2"], "--input", bad_in, "--out", out, expect_rc=4)
    check(f"{bad_in}:2: empty line" in p.stderr, f"exit-4 message does not name {bad_in}:2: {p.stderr[-500:]}")
    check(not os.path.exists(out) and not os.path.exists(out + ".meta.json"), "a failed prepare left output behind")
    p = prepare("--tokenizer", os.path.join(WORK, "nowhere"), "--input", bad_in, "--out", out, expect_rc=2)
    check("nowhere: not a directory" in p.stderr, f"missing tokenizer message: {p.stderr[-300:]}")

    # 5. End to end: SmolLM2 (template in chat_template.jinja) -> shards via --out DIR, with --skip-bad.
    print("smollm2 --out DIR (prepare -> import -> shards)")
    ds = os.path.join(WORK, "ds")
    p = prepare("--tokenizer", dirs["smollm2"], "--input", f"{chat_in},{bad_in}", "--out", ds,
                "--skip-bad", "--block-size", "2")
    if p.returncode == 0:
        summary = json.loads(p.stdout)
        want = [expected_doc(toks["smollm2"], "smollm2", expected_messages("smollm2", r, m)) for r, m in CHAT]
        want += [want[1], want[4]]  # the two good lines of bad.jsonl
        prep = summary["prepare"]["stats"]
        check(prep["skipped_bad"] == {"empty_line": 1, "invalid_json": 1, "unknown_role": 1, "empty_turn": 1},
              f"smollm2 skipped: {prep['skipped_bad']}")
        check(summary["import"]["documents"] == len(want), f"import documents {summary['import']}")
        manifest = json.load(open(os.path.join(ds, "manifest.json")))
        source = manifest["import"]["input_meta"]["prepare"]
        check(source["chat_template_sha256"] == sha256(fixtures.template_text("smollm2"), False),
              "manifest lacks the template hash")
        check(source["tokenizer_sha256"] == sha256(os.path.join(dirs["smollm2"], "tokenizer.json")),
              "manifest lacks the tokenizer hash")
        ids, mask = [], []
        for s in manifest["shards"]:
            raw = open(os.path.join(ds, s["file"]), "rb").read()
            t = struct.unpack_from("<Q", raw, 24)[0]
            ids += list(struct.unpack_from(f"<{t}i", raw, 64))
            mask += list(raw[64 + 4 * t:64 + 5 * t])
        check(ids == [i for w in want for i in w[0]], "shard token ids differ from the expected documents")
        check(mask == [m for w in want for m in w[1]], "shard loss mask differs from the expected documents")
        check(not [f for f in os.listdir(WORK) if ".prepare-" in f], "temporary prepare folder left behind")

    # 6. Mistral v0.1 (roles must alternate, so no render may drop a turn); records with system or
    #    tool turns are template errors.
    print("mistral")
    out = os.path.join(WORK, "mistral.jsonl")
    rc = prepare_in_process("--tokenizer", dirs["mistral"], "--input", chat_in, "--out", out, "--skip-bad")
    check(rc == 0, f"mistral prepare returned {rc}")
    if rc == 0:
        got = read_jsonl(out)
        kept = [1, 4, 5]
        check(len(got) == len(kept), f"mistral: {len(got)} documents, expected {len(kept)}")
        for k, doc in zip(kept, got):
            compare(f"mistral record {k}", doc, *expected_doc(toks["mistral"], "mistral",
                                                              expected_messages("mistral", *CHAT[k])))
        stats = json.load(open(out + ".meta.json"))["stats"]
        check(stats["skipped_bad"] == {"template_error": 3}, f"mistral skipped: {stats['skipped_bad']}")
    multi = os.path.join(WORK, "alternating.jsonl")
    convo = [m for m in CHAT[0][1] if m["role"] != "system"]
    write_jsonl(multi, [{"messages": convo}])
    out = os.path.join(WORK, "mistral_multi.jsonl")
    rc = prepare_in_process("--tokenizer", dirs["mistral"], "--input", multi, "--out", out)
    check(rc == 0, f"mistral multi-turn prepare returned {rc}")
    if rc == 0:
        compare("mistral multi-turn", read_jsonl(out)[0], *expected_doc(toks["mistral"], "mistral", convo))

    worker_killed(dirs["qwen3"])
    return fixtures.result()


def descendants(pid):
    """Every process below `pid` (from /proc), children first."""
    kids = [int(e) for e in os.listdir("/proc") if e.isdigit() and parent(int(e)) == pid]
    return kids + [d for k in kids for d in descendants(k)]


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def worker_killed(tok_dir):
    """7. --workers 2 with its worker processes killed mid-run: exit 1 naming the workers and no
    output, not a wait that never ends. The input is far longer than the run lasts before the kill."""
    print("--workers 2, workers killed")
    src = os.path.join(WORK, "long.jsonl")
    write_jsonl(src, [{"text": f"line {i} " + "word " * 50} for i in range(200000)])
    out = os.path.join(WORK, "killed.jsonl")
    proc = subprocess.Popen([DFLASH, "data", "prepare", "--tokenizer", tok_dir, "--input", src, "--out", out,
                             "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    # The workers are forked by the forkserver process: both run its command line.
    workers = []
    while time.time() < deadline and proc.poll() is None:
        below = descendants(proc.pid)
        server = [d for d in below if "multiprocessing.forkserver" in cmdline(d)]
        workers = [d for d in below if d in server and parent(d) in server]
        if len(workers) >= 2:
            break
        time.sleep(0.2)
    check(proc.poll() is None, f"prepare ended before its workers were seen: exit {proc.poll()}")
    for w in workers:
        try:
            os.kill(w, 9)
        except ProcessLookupError:
            pass
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        check(False, "prepare did not end within 60 s of its workers being killed")
        return
    check(proc.returncode == 1, f"killed workers: exit {proc.returncode}, expected 1\n{err[-1500:]}")
    check("--workers process ended unexpectedly" in err, f"killed workers: message {err[-800:]}")
    check(not os.path.exists(out), "killed workers: the output exists")
    check(not [f for f in os.listdir(WORK) if f.startswith("killed.jsonl.tmp-")], "temporary output left behind")


if __name__ == "__main__":
    sys.exit(main())
