"""The Python data tools against hostile input (docs/data.md#bad-input-and-exit-codes): no case ends
in a traceback, every bad record names FILE:LINE with a documented exit code, sizes are bounded
before anything is tokenized, outputs are never left looking complete.

  prepare:    lone surrogates (content, id, key; with and without --skip-bad; a valid surrogate pair
              passes), JSON nested 100,000 deep, wrong types in every field the formats read, a
              50 MB message (skipped unread: peak RSS measured), a line over --max-record-bytes,
              `chat_template: 42`, a template syntax error (tokenizer_config.json and
              chat_template.jinja), an --out on a read-only file system, under a file and on a full
              disk, SIGTERM in the middle (no temporary file left), a stale temporary file of a
              killed run (removed), a hub id as --tokenizer (the download hint);
  report:     non-UTF-8 bytes (FILE:LINE and the byte offset), wrong JSON types in metrics, ledger
              and drafter logs, deep nesting, an unwritable --out;
  regenerate --server against a fake server in this process (threads, an ephemeral port), one
              record per hostile behaviour: message a string, content 42, surrogates, missing
              fields, not JSON / not UTF-8 / nested too deeply, a connection dropped mid-body
              (IncompleteRead), a connection closed without an answer, HTTP 500 then 200 (retried
              and counted), HTTP 400 (not retried), a 1 byte/s body and 1 byte/s headers (ended
              at --server-timeout), a 300 MB answer declared and streamed (refused after the cap);
              nothing invalid written; the rerun completes every record; a rerun drops an invalid
              line that an older version left in OUT and an invalid stored answer; a failed run
              leaves no OUT.work/options.json that blocks the corrected command;
  the CLI:    the same through the `dflash` binary for a few cases (exit codes mapped as documented),
              `data import` of chat lines hints at `data prepare`, and each `data X --help` prints
              X's usage once.

usage: hostile_test.py PATH/TO/dflash WORKDIR
"""

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402

DFLASH, WORK = sys.argv[1], sys.argv[2]
check = fixtures.check
PY = sys.executable
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
ENV.pop("DFLASH_TRACEBACK", None)


def no_traceback(label, stderr):
    check("Traceback" not in stderr, f"{label}: a traceback on stderr:\n{stderr[-2000:]}")


def run(cmd, label, expect_rc, want=(), timeout=300, **kw):
    """cmd (a list) -> CompletedProcess; checks the exit code, that stderr has no traceback, and that
    each string of `want` is in stderr."""
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, **kw)
    print(f"  {label}: rc {p.returncode} in {time.time() - t:.1f}s")
    check(p.returncode == expect_rc, f"{label}: exit {p.returncode}, expected {expect_rc}\n{p.stderr[-1500:]}")
    no_traceback(label, p.stderr)
    for w in want:
        check(w in p.stderr, f"{label}: stderr lacks {w!r}:\n{p.stderr[-1500:]}")
    return p


def tool(*args):
    return [PY, "-m", "dflash_tools.data", *args]


def in_process(main, args):
    """main(args) in this process -> (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    no_traceback(f"in process {args[:2]}", err.getvalue())
    return rc, out.getvalue(), err.getvalue()


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def leftovers(folder, stem):
    return [n for n in os.listdir(folder) if n.startswith(stem) and (".tmp" in n or n.endswith(".work"))]


GOOD = {"prompt": "What is the capital of France?", "response": "The capital of France is Paris."}


def try_mount(where, options):
    """A tmpfs at `where` (root in a fresh mount namespace is not needed: the test runs as root in
    CI); False when mounting is not allowed here."""
    os.makedirs(where, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", where], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------- prepare

def prepare_cases(tok):
    from dflash_tools.data.prepare import main as prepare_main
    print("prepare: hostile records")
    surrogate_lines = [
        '{"messages": [{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", "content": "ok"}]}',
        '{"id": "x\\udfff", "prompt": "a", "response": "b"}',
        '{"prompt": "a", "response": "b", "system": "\\uD834"}',
        '{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "\\ud800": 1}]}',
    ]
    typed = [
        {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": {"a": 1}}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": 42, "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": ["user"], "content": "a"}]},
        {"messages": ["hi", "there"]},
        {"messages": "hi"},
        {"conversations": "hi"},
        {"conversations": [{"from": 7, "value": "a"}]},
        {"conversations": [{"from": "human", "value": None}]},
        {"prompt": 42, "response": "b"},
        {"prompt": "a", "response": "b", "system": 42},
        {"text": ["a"]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": 42}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                                         "tool_calls": [{"function": "f"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
        [1, 2, 3], 42, "text", None,
    ]
    deep = '{"messages": ' + "[" * 100000 + "]" * 100000 + "}"
    huge_int = '{"id": ' + "9" * 5000 + ', "prompt": "a", "response": "b"}'
    pair = {"prompt": "smile \U0001F600", "response": "ok \U0001F600"}  # a valid surrogate pair in JSON
    inp = os.path.join(WORK, "hostile.jsonl")
    with open(inp, "w", encoding="utf-8") as f:
        f.write(json.dumps(GOOD) + "\n")
        for line in surrogate_lines:
            f.write(line + "\n")
        for rec in typed:
            f.write(json.dumps(rec) + "\n")
        f.write(deep + "\n" + huge_int + "\n" + json.dumps(pair, ensure_ascii=True) + "\n")
    n_bad = len(surrogate_lines) + len(typed) + 2
    out = os.path.join(WORK, "hostile_out.jsonl")
    rc, _, err = in_process(prepare_main, ["--tokenizer", tok, "--input", inp, "--out", out])
    check(rc == 4 and f"{inp}:2: messages[0].content: a lone surrogate" in err,
          f"prepare, a surrogate without --skip-bad: rc {rc}: {err[-500:]}")
    check(not os.path.exists(out) and not leftovers(WORK, "hostile_out"), "a failed prepare left output behind")
    rc, stdout, err = in_process(prepare_main, ["--tokenizer", tok, "--input", inp, "--out", out, "--skip-bad"])
    check(rc == 0, f"prepare --skip-bad over hostile records: rc {rc}: {err[-800:]}")
    if rc == 0:
        stats = json.loads(stdout)["stats"]
        check(sum(stats["skipped_bad"].values()) == n_bad and stats["documents"] == 2,
              f"prepare --skip-bad: {stats['documents']} documents, skipped {stats['skipped_bad']} (want {n_bad} bad)")
        check(stats["skipped_bad"].get("invalid_unicode") == len(surrogate_lines)
              and stats["skipped_bad"].get("too_deep") == 1, f"reasons: {stats['skipped_bad']}")
        check(all(ex.startswith(f"{inp}:") for ex in stats["bad_examples"]), "a bad example without FILE:LINE")
        docs = [json.loads(x) for x in open(out, encoding="utf-8")]
        check(len(docs) == 2, f"documents: {len(docs)}")

    # A line over --max-record-bytes is bad, skipped unread; a 50 MB message costs no GBs.
    print("prepare: sizes bounded before tokenizing")
    big = os.path.join(WORK, "big.jsonl")
    with open(big, "w", encoding="utf-8") as f:
        f.write(json.dumps(GOOD) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "the quick brown fox " * (50 << 16)}]}) + "\n")
        f.write(json.dumps(GOOD) + "\n")
    out = os.path.join(WORK, "big_out.jsonl")
    t = time.time()
    p = subprocess.Popen(tool("prepare", "--tokenizer", tok, "--input", big, "--out", out, "--skip-bad"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    _, status, usage = os.wait4(p.pid, 0)
    stdout, stderr = p.stdout.read().decode(), p.stderr.read().decode()
    rc = os.waitstatus_to_exitcode(status)
    peak_mb = usage.ru_maxrss / 1024
    print(f"  a 50 MB message: rc {rc}, peak RSS {peak_mb:.0f} MB, {time.time() - t:.1f}s")
    no_traceback("50 MB message", stderr)
    check(rc == 0 and json.loads(stdout)["stats"]["skipped_bad"] == {"record_too_large": 1},
          f"a 50 MB message: rc {rc}: {stderr[-500:]}")
    check(peak_mb < 1500, f"a 50 MB message took {peak_mb:.0f} MB (bounded: under 1.5 GB)")
    rc, _, err = in_process(prepare_main, ["--tokenizer", tok, "--input", big, "--out", out + "2",
                                           "--max-record-bytes", "100"])
    check(rc == 4 and f"{big}:2: a line of" in err and "--max-record-bytes 100" in err,
          f"--max-record-bytes 100: rc {rc}: {err[-400:]}")

    # The chat template: config errors (exit 2) naming the file, not the record.
    print("prepare: broken chat templates")
    good_in = write_lines(os.path.join(WORK, "good.jsonl"), [GOOD])
    for name, edit, want in (
            ("t42", lambda c: c.update(chat_template=42), "tokenizer_config.json: chat_template must be a string"),
            ("tsyntax", lambda c: c.update(chat_template="{% for m in messages %}{{ m.content }"),
             "tokenizer_config.json: chat template syntax error at line 1"),
            ("tjinja", None, "chat_template.jinja: chat template syntax error at line 2"),
            ("tjson", "garbage", "tokenizer_config.json: not valid JSON")):
        d = os.path.join(WORK, name)
        shutil.copytree(tok, d)
        cfg_path = os.path.join(d, "tokenizer_config.json")
        if edit == "garbage":
            open(cfg_path, "w").write("{not json")
        elif edit is None:
            with open(os.path.join(d, "chat_template.jinja"), "w") as f:
                f.write("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
        else:
            cfg = json.load(open(cfg_path))
            edit(cfg)
            json.dump(cfg, open(cfg_path, "w"))
        rc, _, err = in_process(prepare_main, ["--tokenizer", d, "--input", good_in, "--out",
                                               os.path.join(WORK, f"{name}.jsonl"), "--skip-bad"])
        check(rc == 2 and want in err and d in err, f"template {name}: rc {rc}, want 2 and {want!r}: {err[-400:]}")

    # --out that cannot be written: exit 2 naming it, nothing left behind.
    print("prepare: unwritable --out")
    cases = [(os.path.join(good_in, "out.jsonl"), "cannot create the folder")]
    ro, full = os.path.join(WORK, "ro"), os.path.join(WORK, "full")
    mounted = []
    if try_mount(ro, "ro,size=1m"):
        mounted.append(ro)
        cases.append((os.path.join(ro, "out.jsonl"), "Read-only file system"))
    else:
        print("  (mounting a tmpfs is not allowed here: the read-only and full-disk cases are skipped)")
    if try_mount(full, "size=64k"):
        mounted.append(full)
        many = write_lines(os.path.join(WORK, "many.jsonl"), [GOOD] * 3000)
        cases.append((os.path.join(full, "out.jsonl"), "No space left on device", many))
    try:
        for case in cases:
            path, want = case[0], case[1]
            rc, _, err = in_process(prepare_main, ["--tokenizer", tok, "--input", case[2] if len(case) > 2 else good_in,
                                                   "--out", path])
            check(rc == 2 and f"--out {path}" in err and want in err, f"--out {path}: rc {rc}: {err[-400:]}")
            folder = os.path.dirname(path)
            if os.path.isdir(folder):
                check(os.listdir(folder) == [], f"{folder} holds {os.listdir(folder)}")
    finally:
        for m in mounted:
            subprocess.run(["umount", m])

    # SIGTERM in the middle: no output, no temporary file; a stale one of a killed run is removed.
    print("prepare: SIGTERM, stale temporary files")
    many = write_lines(os.path.join(WORK, "many2.jsonl"), [GOOD] * 40000)
    out = os.path.join(WORK, "term", "out.jsonl")
    os.makedirs(os.path.dirname(out))
    p = subprocess.Popen(tool("prepare", "--tokenizer", tok, "--input", many, "--out", out),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        tmps = [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]
        if tmps and os.path.getsize(os.path.join(os.path.dirname(out), tmps[0])) > 0:
            break
        time.sleep(0.05)
    killed = p.poll() is None
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate()
    check(killed, "prepare finished before SIGTERM (nothing tested)")
    no_traceback("SIGTERM", err)
    check(os.listdir(os.path.dirname(out)) == [], f"after SIGTERM: {os.listdir(os.path.dirname(out))}")
    stale = out + ".tmp-999999999"
    open(stale, "w").write("half a file")
    rc, _, err = in_process(prepare_main, ["--tokenizer", tok, "--input", good_in, "--out", out])
    check(rc == 0 and not os.path.exists(stale), f"a stale temporary file was not removed: rc {rc} {err[-300:]}")

    rc, _, err = in_process(prepare_main, ["--tokenizer", "Qwen/Qwen3-8B", "--input", good_in, "--out",
                                           os.path.join(WORK, "hub.jsonl")])
    check(rc == 2 and "not a directory" in err and "hf download Qwen/Qwen3-8B" in err, f"hub id: rc {rc}: {err}")


# ---------------------------------------------------------------------------------------------- report

def report_cases():
    print("report: hostile run directories")
    good = os.path.join(WORK, "run")
    os.makedirs(os.path.join(good, "pipeline"))
    rows = [{"step": s, "epoch": 0, "loss": 2.0 / s, "ce": None, "accept_len": 1.5, "acc_k": [0, 0.5, 0.25],
             "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100} for s in range(1, 6)]
    write_lines(os.path.join(good, "metrics.jsonl"), rows)
    write_lines(os.path.join(good, "ledger.jsonl"), [{"type": "run", "name": "r", "time": 1.0},
                                                     {"type": "step", "step": 5, "time": 2.0}])
    write_lines(os.path.join(good, "pipeline", "drafter-0.jsonl"),
                [{"step": s, "wait_s": 0.1, "train_s": 0.2, "allreduce_s": 0.0, "step_s": 0.1} for s in range(1, 6)])
    report = [PY, "-m", "dflash_tools.report"]
    run(report + [good, "--out", os.path.join(WORK, "report_ok")], "report of a good run", 0)

    def variant(name, file, line_bytes):
        d = os.path.join(WORK, name)
        shutil.copytree(good, d)
        with open(os.path.join(d, file), "ab") as f:
            f.write(line_bytes + b"\n")
        return d, os.path.join(d, file)

    utf8_line = b'{"step": 6, "loss": "\xff\xfe"}'
    for name, file, line, want in (
            ("r_utf8", "metrics.jsonl", utf8_line,
             f"metrics.jsonl:{len(rows) + 1}: not UTF-8 text at byte {utf8_line.index(bytes([255]))}"),
            ("r_step", "metrics.jsonl", json.dumps(dict(rows[0], step="six")).encode(), "step must be an integer"),
            ("r_acc", "metrics.jsonl", json.dumps(dict(rows[0], acc_k="abc")).encode(), "acc_k must be a list"),
            ("r_loss", "metrics.jsonl", json.dumps(dict(rows[0], loss=[1])).encode(), "loss must be a number"),
            ("r_bool", "metrics.jsonl", json.dumps(dict(rows[0], lr=True)).encode(), "lr must be a number"),
            ("r_deep", "metrics.jsonl", b"[" * 100000 + b"]" * 100000, "not JSON (nested too deeply)"),
            ("r_list", "metrics.jsonl", b"[1, 2]", "not a JSON object"),
            ("r_ledger", "ledger.jsonl", json.dumps({"type": "step", "step": "x"}).encode(), "ledger.jsonl:3: step"),
            ("r_ltype", "ledger.jsonl", json.dumps({"type": 5}).encode(), "ledger.jsonl:3: type must be a string"),
            ("r_ledger8", "ledger.jsonl", b'{"type": "\xc3"}', "ledger.jsonl:3: not UTF-8"),
            ("r_drafter", os.path.join("pipeline", "drafter-0.jsonl"),
             json.dumps({"step": 6, "wait_s": "slow"}).encode(), "drafter-0.jsonl:6: wait_s must be a number")):
        d, path = variant(name, file, line)
        run(report + [d], f"report {name}", 4, [f"{path}:", want])
        check(not os.path.exists(os.path.join(d, "report", "index.html")), f"report {name}: a page was written")
    run(report + [good, "--out", os.path.join(WORK, "good.jsonl", "rep")], "report --out under a file", 2,
        ["cannot write there"])
    ro = os.path.join(WORK, "ro_report")
    if try_mount(ro, "ro,size=1m"):
        try:
            run(report + [good, "--out", os.path.join(ro, "rep")], "report --out read-only", 2,
                ["Read-only file system"])
        finally:
            subprocess.run(["umount", ro])


# ------------------------------------------------------------------------------------ regenerate --server

HOSTILE = {  # behaviour -> what the run must do with its record: "ok" written, "error" left out
    "ok": "ok", "message_string": "error", "content_int": "error", "surrogate": "error",
    "no_choices": "error", "choices_empty": "error", "choice_string": "error", "no_message": "error",
    "reasoning_int": "error", "finish_int": "error", "not_json": "error", "not_utf8": "error",
    "deep": "error", "array": "error", "incomplete_once": "ok", "drop_once": "ok", "http500_once": "ok",
    "http400": "error", "trickle_body": "error", "trickle_headers": "error", "huge_declared": "error",
    "huge_streamed": "error", "error_object": "error",
}
SERVER_TIMEOUT = 2.0


class FakeServer:
    """An OpenAI-compatible endpoint whose answer to a conversation depends on its last user message
    (the behaviour's name); `fixed` makes every answer a good one."""

    def __init__(self):
        self.fixed = False
        self.attempts = {}
        self.sent = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = body["messages"][-1]["content"]
                with server.lock:
                    n = server.attempts[key] = server.attempts.get(key, 0) + 1
                server.answer(self, key if not server.fixed else "ok", n, body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that went away mid-answer is what these cases do

        self.httpd = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, h, key, n, body):
        def send(status, data, length=None, extra=()):
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data) if length is None else length))
            for k, v in extra:
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()

        def good():
            text = f"reply to {body['messages'][-1]['content']}"
            return json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                            "finish_reason": "stop"}]}).encode()

        def msg(m):
            return json.dumps({"choices": [{"message": m, "finish_reason": "stop"}]}).encode()

        if key == "ok" or (key.endswith("_once") and n > 1):
            return send(200, good())
        simple = {"message_string": msg("hi"), "content_int": msg({"role": "assistant", "content": 42}),
                  "surrogate": b'{"choices": [{"message": {"role": "assistant", "content": "a\\ud800b"}}]}',
                  "no_choices": b"{}", "choices_empty": b'{"choices": []}', "choice_string": b'{"choices": ["x"]}',
                  "no_message": b'{"choices": [{"text": "x"}]}',
                  "reasoning_int": msg({"content": "a", "reasoning_content": 5}),
                  "finish_int": json.dumps({"choices": [{"message": {"content": "a"}, "finish_reason": 7}]}).encode(),
                  "not_json": b"hello", "not_utf8": b"\xff\xfe\xfd", "deep": b"[" * 100000,
                  "array": b"[1, 2]", "error_object": b'{"error": {"message": "overloaded"}}'}
        if key in simple:
            return send(200, simple[key])
        if key == "incomplete_once":
            h.close_connection = True  # 10 of the 1000 bytes announced, then the connection closes
            return send(200, good()[:10], length=1000)
        if key == "drop_once":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if key == "http500_once":
            return send(500, b"busy")
        if key == "http400":
            return send(400, b"bad request")
        if key in ("trickle_body", "trickle_headers"):
            h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" if key == "trickle_body" else b"")
            for _ in range(60):  # 1 byte per second for at most a minute, or until the client goes
                try:
                    h.wfile.write(b" " if key == "trickle_body" else b"H")
                    h.wfile.flush()
                except OSError:
                    break
                time.sleep(1.0)
            h.close_connection = True
            return
        if key in ("huge_declared", "huge_streamed"):
            total, sent = 300 << 20, 0
            h.send_response(200)
            if key == "huge_declared":
                h.send_header("Content-Length", str(total))
            else:
                h.send_header("Connection", "close")
            h.end_headers()
            chunk = b'{"choices": [' + b" " * ((1 << 16) - 13)
            try:
                while sent < total:
                    h.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            with self.lock:
                self.sent[key] = self.sent.get(key, 0) + sent
            h.close_connection = True
            return
        raise AssertionError(key)

    def close(self):
        self.httpd.shutdown()


def regenerate_cases():
    from dflash_tools.data.regenerate import main as regenerate_main
    print("regenerate --server: hostile answers")
    srv = FakeServer()
    try:
        inp = write_lines(os.path.join(WORK, "chats.jsonl"),
                          [{"id": k, "messages": [{"role": "user", "content": k}, {"role": "assistant", "content": "x"}]}
                           for k in HOSTILE])
        out = os.path.join(WORK, "regen.jsonl")
        args = ["--input", inp, "--out", out, "--server", srv.url, "--server-model", "m", "--max-new-tokens", "8",
                "--batch-size", "8", "--server-timeout", str(SERVER_TIMEOUT), "--server-retries", "2",
                "--server-backoff", "0.05"]
        t = time.time()
        rc, stdout, err = in_process(regenerate_main, args)
        wall = time.time() - t
        print(f"  first run: rc {rc} in {wall:.1f}s")
        stats = json.loads(stdout) if stdout.strip() else {}
        want_ok = sorted(k for k, v in HOSTILE.items() if v == "ok")
        got = [json.loads(x) for x in open(out, encoding="utf-8")] if os.path.exists(out) else []
        check(rc == 1, f"hostile server: rc {rc}, expected 1 (records left for a rerun)\n{err[-1500:]}")
        check(sorted(d["id"] for d in got) == want_ok, f"written: {sorted(d['id'] for d in got)}, want {want_ok}")
        for d in got:
            check(all(isinstance(m["content"], str) for m in d["messages"])
                  and d["messages"][-1]["content"] == f"reply to {d['id']}", f"written record {d}")
        n_err = len(HOSTILE) - len(want_ok)
        check(stats.get("skipped", {}).get("server_error") == n_err, f"server_error {stats.get('skipped')}, want {n_err}")
        # retried: the three *_once, and every malformed answer once more; not HTTP 400 nor an oversized one
        check(stats.get("server_retries", 0) >= 3, f"server_retries {stats.get('server_retries')}")
        check(srv.attempts.get("http400") == 1 and srv.attempts.get("huge_declared") == 1
              and srv.attempts.get("content_int") == 2, f"attempts {srv.attempts}")
        check(wall < 4 * SERVER_TIMEOUT + 10, f"the trickling answers held the run {wall:.1f}s "
              f"(--server-timeout {SERVER_TIMEOUT} per request, 2 attempts)")
        for key in ("huge_declared", "huge_streamed"):
            check(srv.sent.get(key, 0) < (64 << 20), f"{key}: the server got to send {srv.sent.get(key, 0)} bytes")
        for key, reason in (("message_string", "choices[0].message is a str"),
                            ("content_int", "message.content is a int"), ("surrogate", "lone surrogate"),
                            ("trickle_body", "within --server-timeout"), ("trickle_headers", "within --server-timeout"),
                            ("huge_declared", "over the cap"), ("huge_streamed", "over the cap"),
                            ("http400", "HTTP 400"), ("deep", "nested too deeply")):
            check(any(e.startswith(f"{key}: ") and reason in e for e in stats.get("bad_examples", [])),
                  f"{key}: no error naming {reason!r} in {stats.get('bad_examples')}")
        work = out + ".work"
        for line in open(os.path.join(work, "round-0.server.jsonl"), encoding="utf-8"):
            check(isinstance(json.loads(line)["content"], str), f"a stored answer is not text: {line[:200]}")

        # The rerun, the server fixed: every record, each once.
        srv.fixed = True
        rc, stdout, err = in_process(regenerate_main, args)
        got = [json.loads(x) for x in open(out, encoding="utf-8")]
        check(rc == 0 and sorted(d["id"] for d in got) == sorted(HOSTILE), f"rerun: rc {rc}, ids {len(got)}: {err[-500:]}")
        check(not os.path.exists(work), "rerun: OUT.work left")

        # What an older version could have left: an invalid line in OUT and an invalid stored answer.
        print("regenerate --server: a rerun keeps no bad record")
        lines = open(out, encoding="utf-8").read().splitlines()
        bad = json.loads(lines[0])
        bad["messages"][-1]["content"] = 42
        lines[0] = json.dumps(bad)
        open(out, "w", encoding="utf-8").write("\n".join(lines) + "\n")
        victim = json.loads(lines[1])["id"]
        lines = lines[:1] + lines[2:]
        open(out, "w", encoding="utf-8").write("\n".join(lines) + "\n")
        rc, _, _ = in_process(regenerate_main, args)  # the line with content 42 is dropped and asked again
        got = [json.loads(x) for x in open(out, encoding="utf-8")]
        check(rc == 0 and sorted(d["id"] for d in got) == sorted(HOSTILE), f"repair run: rc {rc}, {len(got)} ids")
        check(all(isinstance(m["content"], str) for d in got for m in d["messages"]), "a bad record was kept")
        check(any(d["id"] == victim for d in got), "the missing record was not regenerated")

        # A stored answer that is not text (an older version wrote it) is asked again.
        out2 = os.path.join(WORK, "regen2.jsonl")
        args2 = [a if a != out else out2 for a in args]
        os.makedirs(out2 + ".work")
        json.dump({"target": None, "input": os.path.abspath(inp), "thinking": "keep", "max_new_tokens": 8,
                   "temperature": 0.0, "top_p": None, "top_k": None, "seed": None, "dtype": None,
                   "stop_token_ids": None, "server": srv.url, "server_model": "m"},
                  open(os.path.join(out2 + ".work", "options.json"), "w"))
        write_lines(os.path.join(out2 + ".work", "round-0.server.jsonl"),
                    [{"id": "ok", "content": 42, "reasoning_content": "", "finish_reason": "stop"}, "{torn"])
        rc, _, err = in_process(regenerate_main, args2)
        got = {json.loads(x)["id"]: json.loads(x) for x in open(out2, encoding="utf-8")}
        check(rc == 0 and got.get("ok", {}).get("messages", [{}])[-1].get("content") == "reply to ok",
              f"an invalid stored answer was kept: rc {rc} {got.get('ok')}: {err[-300:]}")

        # A failed run leaves nothing that blocks the corrected command.
        print("regenerate: a failed run does not block the corrected one")
        bad_in = write_lines(os.path.join(WORK, "chats_bad.jsonl"),
                             [{"id": "a", "messages": [{"role": "user", "content": "ok"},
                                                       {"role": "assistant", "content": "x"}]}, "{garbage"])
        out3 = os.path.join(WORK, "regen3.jsonl")
        base = ["--input", bad_in, "--out", out3, "--server", srv.url, "--server-model", "m"]
        rc, _, err = in_process(regenerate_main, base + ["--max-new-tokens", "8"])
        check(rc == 4 and f"{bad_in}:2" in err, f"a bad line: rc {rc}: {err[-300:]}")
        check(not os.path.exists(out3 + ".work") and not os.path.exists(out3), f"left: {leftovers(WORK, 'regen3')}")
        srv.fixed = False
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
        rc, _, err = in_process(regenerate_main, ["--input", bad_in, "--out", out3, "--server", dead_url,
                                                  "--server-model", "m", "--skip-bad", "--server-retries", "1"])
        closed.close()
        check(rc == 1, f"no server: rc {rc}: {err[-300:]}")
        check(not os.path.exists(out3 + ".work"), "a run that got no reply left OUT.work behind")
        rc, _, err = in_process(regenerate_main, base + ["--skip-bad", "--max-new-tokens", "16"])
        check(rc == 0, f"the corrected command (other options) after failed runs: rc {rc}: {err[-500:]}")
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------- CLI

def cli_cases(tok):
    print("the dflash binary")
    good_in = os.path.join(WORK, "good.jsonl")
    sur = write_lines(os.path.join(WORK, "sur_cli.jsonl"),
                      [GOOD, '{"prompt": "a\\ud800", "response": "b"}'])
    run([DFLASH, "data", "prepare", "--tokenizer", tok, "--input", sur, "--out", os.path.join(WORK, "c1.jsonl")],
        "cli prepare, a surrogate", 4, [f"{sur}:2: prompt: a lone surrogate"])
    run([DFLASH, "data", "prepare", "--tokenizer", tok, "--input", sur, "--out", os.path.join(WORK, "c2.jsonl"),
         "--skip-bad", "--max-record-bytes", "1000000"], "cli prepare --skip-bad", 0)
    run([DFLASH, "data", "prepare", "--tokenizer", os.path.join(WORK, "t42"), "--input", good_in, "--out",
         os.path.join(WORK, "c3.jsonl")], "cli prepare chat_template 42", 2, ["tokenizer_config.json"])
    run([DFLASH, "data", "prepare", "--tokenizer", "Qwen/Qwen3-8B", "--input", good_in, "--out",
         os.path.join(WORK, "c4.jsonl")], "cli prepare, a hub id", 2, ["hf download Qwen/Qwen3-8B"])
    run([DFLASH, "data", "import", "--input", good_in, "--out", os.path.join(WORK, "c5")],
        "cli import of chat lines", 4, ["dflash data prepare"])
    out = os.path.join(WORK, "c6.jsonl")
    run([DFLASH, "data", "regenerate", "--target", os.path.join(WORK, "nowhere"), "--input", good_in, "--out", out],
        "cli regenerate, a missing target", 2, ["not a directory"])
    check(not os.path.exists(out + ".work") and not os.path.exists(out), "a failed regenerate left OUT or OUT.work")
    run([DFLASH, "report", os.path.join(WORK, "r_utf8")], "cli report, not UTF-8", 4, ["not UTF-8"])
    for cmd in (["data", "prepare"], ["data", "import"], ["data", "regenerate"], ["data", "benchmark"],
                ["bench", "regenerate"]):
        p = run([DFLASH, *cmd, "--help"], " ".join(cmd) + " --help", 0)
        usages = [line for line in p.stdout.splitlines() if line.startswith("usage:")]
        check(len(usages) == 1 and usages[0].startswith(f"usage: dflash {' '.join(cmd)} "),
              f"{' '.join(cmd)} --help: not its usage once: {usages}")


def guard_case():
    from dflash_tools.errors import guard
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = guard("x", lambda: {}["missing"])
    lines = err.getvalue().strip().splitlines()
    check(rc == 1 and len(lines) == 1 and lines[0].startswith("error: x: internal error: KeyError"),
          f"guard: rc {rc}, {lines}")


def main():
    for m in ("ro", "full", "ro_report"):  # mounts an interrupted earlier run left
        if os.path.ismount(os.path.join(WORK, m)):
            subprocess.run(["umount", os.path.join(WORK, m)])
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    tok = fixtures.make_tokenizer_dir("qwen3", os.path.join(WORK, "tok"))
    guard_case()
    prepare_cases(tok)
    report_cases()
    regenerate_cases()
    cli_cases(tok)
    return fixtures.result()


if __name__ == "__main__":
    sys.exit(main())
