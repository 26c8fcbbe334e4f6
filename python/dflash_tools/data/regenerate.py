"""`dflash data regenerate`: the target rewrites every assistant reply of a dataset, turn by turn,
with the C++ engine (`dflash generate`, token ids in / out), so that a drafter learns the target's
own distribution.

Input lines (--input), per line:
  - a chat (sharegpt / openai / prompt-response, as `dflash data prepare` reads them): reply k is
    generated from the chat template's generation prompt after the conversation up to it, with the
    replies before it already regenerated; the output line is {"id", "messages": [...], ...}
    (OpenAI form, every assistant content replaced), to be tokenized by `dflash data prepare`.
  - a tokenized line {"input_ids", "loss_mask"} (e.g. the output of prepare): every run of trained
    tokens is a reply; reply k is generated after the regenerated tokens before it plus the original
    context between the replies; the output line is {"id", "input_ids", "loss_mask", ...} with the
    generated tokens (stop token included) as the trained runs, ready for `dflash data import`.
Every output line has "regenerated": {"turns", "hit_max_tokens"}; a reply that reached
--max-new-tokens without a stop token is kept as it is and counted. The printed stats' "turns" and
"hit_max_tokens" are totals over every record in OUT (a resumed run's earlier records included);
"regenerated" counts the records this run added, "already_done" those it found in OUT.

Rounds: round k generates reply k of every record that has one, in one `dflash generate` call
(batched). Resumable: OUT is append-only and a record is appended as soon as its last reply is
generated; a rerun skips ids already in OUT (an incomplete last line is cut off), and rebuilds the
others from the round files in OUT.work/ (`dflash generate` itself skips requests it finished), so
kill -9 at any point and a rerun give every input id exactly once. OUT.work/ is removed when every
record is in OUT.

With --server URL (an OpenAI-compatible chat endpoint) the replies of chat lines come from it
instead (server.py: every answer is checked before it is kept); tokenized lines are skipped.

OUT.work/options.json is written when the first round starts, so a command that fails before
(a bad flag value, a bad line, a missing target) leaves nothing that blocks the corrected one.

Exit codes: 0 ok; 2 usage/config; 4 bad data (a bad line without --skip-bad, names FILE:LINE);
1 when some records got no answer from --server (a rerun asks again), or anything unexpected (one
line, no traceback); others from `dflash generate` as it returns them.
"""

import argparse
import difflib
import json
import os
import subprocess
import sys
import time

from ..errors import EXIT_CONFIG, EXIT_DATA, Fatal, guard
from .formats import DEFAULT_MAX_RECORD_BYTES, BadRecord, lone_surrogate, parse_line, read_lines, record_messages
from .prepare import (CONTRACT_KEYS, MAX_BAD_EXAMPLES, model_dir_problem, remove_quietly, sha256_file,
                      write_json_atomic)
from .server import server_round
from .spans import Renderer, TemplateConfigError, check_template_config, compile_template, template_file, template_text


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dflash data regenerate", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--target", default=None, help="HF model directory (weights, tokenizer, chat template)")
    p.add_argument("--input", required=True, help="chat JSONL or tokenized JSONL (output of prepare)")
    p.add_argument("--out", required=True, help="regenerated JSONL (appended to; resumable)")
    p.add_argument("--dflash", default=None, help="the dflash binary (set by `dflash data regenerate`)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="passed to dflash generate (default: its own)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--thinking", default="keep", choices=("on", "off", "keep"))
    p.add_argument("--stop-token-ids", default=None, help="a,b (default: the model's eos_token_id)")
    p.add_argument("--skip-bad", action="store_true")
    p.add_argument("--server", default=None, help="URL of an OpenAI-compatible server (chat lines only)")
    p.add_argument("--server-model", default=None, help="the model name the server knows (default: --target)")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds per request, from its start to the answer's last byte")
    p.add_argument("--server-retries", type=int, default=3, help="attempts per request")
    p.add_argument("--server-backoff", type=float, default=1.0,
                   help="seconds before the first retry, doubled for each next one (at most 30)")
    p.add_argument("--server-max-response-bytes", type=int, default=0,
                   help="the largest answer taken (default 1 MiB + 256 bytes per --max-new-tokens)")
    p.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES,
                   help=f"a longer input line is a bad record, skipped unread (default {DEFAULT_MAX_RECORD_BYTES})")
    flags = sorted(p._option_string_actions)
    for word in argv:  # an unknown flag: exit 2 naming the closest known one (as the dflash CLI does)
        name = word.split("=", 1)[0]
        if name.startswith("--") and name not in flags:
            near = difflib.get_close_matches(name, flags, n=1)
            p.error(f"unknown flag {name}" + (f"; did you mean {near[0]}?" if near else ""))
    a = p.parse_args(argv)
    if a.server is None and (a.target is None or a.dflash is None):
        p.error("--target (and --dflash, which `dflash data regenerate` sets) are required without --server")
    if a.server is not None:
        a.server_model = a.server_model or a.target
        if not a.server_model:
            p.error("--server needs --server-model (or --target)")
        if a.server_retries < 1:
            p.error(f"--server-retries must be >= 1, got {a.server_retries}")
        if not a.server_timeout > 0:
            p.error(f"--server-timeout must be > 0, got {a.server_timeout}")
        if not 0 <= a.server_backoff <= 30:
            p.error(f"--server-backoff must be in [0, 30], got {a.server_backoff}")
        if a.server_max_response_bytes < 0:
            p.error(f"--server-max-response-bytes must be >= 0, got {a.server_max_response_bytes}")
    if a.max_record_bytes < 1:
        p.error(f"--max-record-bytes must be >= 1, got {a.max_record_bytes}")
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {a.batch_size}")
    return a


def stop_tokens(a, tok):
    if a.stop_token_ids:
        try:
            return [int(x) for x in a.stop_token_ids.split(",") if x]
        except ValueError:
            raise Fatal(EXIT_CONFIG, f"--stop-token-ids {a.stop_token_ids!r}: expected integers a,b,...")
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(a.target, name)
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    cfg = json.loads(f.read().decode("utf-8"))
            except (ValueError, RecursionError) as e:
                raise Fatal(EXIT_CONFIG, f"{path}: not valid JSON ({str(e)[:200]})")
            eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            if isinstance(eos, int):
                return [eos]
            if isinstance(eos, list) and eos and all(isinstance(x, int) for x in eos):
                return eos
    tok = tok()
    if tok.eos_token_id is not None:
        return [tok.eos_token_id]
    raise Fatal(EXIT_CONFIG, f"{a.target}: no eos_token_id in generation_config.json, config.json or the "
                "tokenizer; pass --stop-token-ids")


def die_with_parent():
    """In the `dflash generate` child: SIGKILL when this process dies (Linux), so that killing the
    command never leaves a generate appending to the round files behind it."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Record:
    """One input line being regenerated: `kind` "chat" (messages) or "tokens"."""

    def __init__(self, rid, kind, payload):
        self.id = rid
        self.kind = kind
        if kind == "chat":
            self.messages = [dict(m) for m in payload]
            self.turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        else:
            ids, mask = payload
            # Alternating runs: context[0], reply[0], context[1], reply[1], ..., context[n].
            self.context, self.replies = [[]], []
            prev = 0
            for t, m in zip(ids, mask):
                if m and not prev:
                    self.replies.append([])
                elif prev and not m:
                    self.context.append([])
                (self.replies if m else self.context)[-1].append(t)
                prev = m
            if prev:
                self.context.append([])
            self.turns = list(range(len(self.replies)))
            self.tokens = []  # regenerated prefix so far
        self.hit_max = 0


def token_payload(obj, where):
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise BadRecord("input_ids must be a non-empty list of token ids", "bad_tokens")
    if "loss_mask" in obj:
        mask = obj["loss_mask"]
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise BadRecord("loss_mask must be 0/1 values, one per input id", "bad_tokens")
    elif "labels" in obj:
        labels = obj["labels"]
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise BadRecord("labels must have one value per input id", "bad_tokens")
        mask = [0 if x == -100 else 1 for x in labels]
    else:
        raise BadRecord("a tokenized line needs loss_mask or labels (which tokens are replies)", "bad_tokens")
    return ids, [int(m) for m in mask]


class Regenerator:
    def __init__(self, a):
        self.a = a
        self.work = a.out + ".work"
        self.stats = {"records": 0, "already_done": 0, "regenerated": 0, "turns": 0, "hit_max_tokens": 0,
                      "skipped": {}, "bad_examples": []}
        self.tok = None
        self.renderer = None

    def _skip(self, reason, msg=None):
        self.stats["skipped"][reason] = self.stats["skipped"].get(reason, 0) + 1
        if msg and len(self.stats["bad_examples"]) < MAX_BAD_EXAMPLES:
            self.stats["bad_examples"].append(msg)

    def load_tokenizer(self):
        if self.tok is None:
            self.tok = self.any_tokenizer()
            template = template_text(self.tok)
            try:
                compile_template(template, template_file(self.a.target))
            except TemplateConfigError as e:
                raise Fatal(EXIT_CONFIG, str(e))
            if template is None:
                raise Fatal(EXIT_CONFIG, f"{self.a.target}: chat records need a chat template; the tokenizer has none")
            if self.a.thinking != "keep" and "enable_thinking" not in template:
                raise Fatal(EXIT_CONFIG, f"--thinking {self.a.thinking}: the chat template of {self.a.target} has no "
                            "enable_thinking switch (use --thinking keep)")
            self.renderer = Renderer(self.tok, template, self.a.thinking, template_file(self.a.target))
        return self.tok

    def any_tokenizer(self):
        """The target's tokenizer without requiring a chat template (for its eos token)."""
        if self.tok is not None:
            return self.tok
        problem = model_dir_problem("--target", self.a.target)
        if problem:
            raise Fatal(EXIT_CONFIG, problem)
        try:
            check_template_config(self.a.target)
        except TemplateConfigError as e:
            raise Fatal(EXIT_CONFIG, str(e))
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(self.a.target, local_files_only=True)
        except Exception as e:
            raise Fatal(EXIT_DATA, f"{self.a.target}: cannot load the tokenizer: {type(e).__name__}: {str(e)[:500]}")
        return self.tok

    def read_done(self):
        """Ids already in OUT. A line that is not a valid output line (torn, or a record with a reply
        that is not text, written by an older version) is dropped from OUT, atomically, so that
        this run regenerates that record instead of keeping it."""
        done = set()
        if not os.path.exists(self.a.out):
            return done
        with open(self.a.out, "rb") as f:
            data = f.read()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            print(f"regenerate: {self.a.out} ends in an incomplete line ({len(data) - complete} bytes); cutting it off",
                  file=sys.stderr)
            os.truncate(self.a.out, complete)
        kept, dropped = [], []
        for ln, line in enumerate(data[:complete].splitlines(True), 1):
            problem = output_line_problem(line)
            if problem is not None:
                dropped.append(f"{self.a.out}:{ln}: {problem}")
                continue
            obj = json.loads(line)
            kept.append(line)
            done.add(obj["id"])
            # the totals cover every record in OUT, those of an interrupted earlier run too
            info = obj.get("regenerated")
            self.stats["turns"] += int(info["turns"])
            self.stats["hit_max_tokens"] += int(info["hit_max_tokens"])
        if dropped:
            print(f"regenerate: dropping {len(dropped)} invalid lines from {self.a.out} (regenerated again); first: "
                  f"{dropped[0]}", file=sys.stderr)
            self.stats["dropped_from_out"] = len(dropped)
            tmp = f"{self.a.out}.tmp-{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    f.writelines(kept)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.a.out)
            finally:
                remove_quietly(tmp)
        return done

    def read_input(self, done):
        records, seen = [], set()
        try:
            f = open(self.a.input, "rb")
        except OSError as e:
            raise Fatal(EXIT_CONFIG, f"--input {self.a.input}: cannot open: {e.strerror}")
        with f:
            for ln, raw in read_lines(f, self.a.max_record_bytes):
                where = f"{self.a.input}:{ln}"
                self.stats["records"] += 1
                try:
                    obj = parse_line(raw, self.a.max_record_bytes)
                    if not isinstance(obj, dict):
                        raise BadRecord("expected a JSON object", "not_an_object")
                    rid = obj.get("id")
                    rid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else where
                    if rid in seen:
                        raise BadRecord(f"duplicate id {rid!r}", "duplicate_id")
                    seen.add(rid)
                    if rid in done:
                        self.stats["already_done"] += 1
                        continue
                    if "input_ids" in obj:
                        if self.a.server:
                            self._skip("tokenized_line_with_server")  # the server takes no token ids
                            continue
                        rec = Record(rid, "tokens", token_payload(obj, where))
                    else:
                        fmt, kind, payload = record_messages(obj, "auto", True)
                        if kind == "text":
                            self._skip("plain_text")
                            continue
                        if any(m["role"] == "tool" for m in payload):
                            self._skip("tool_turns")  # tool results answer the original replies' calls
                            continue
                        if not self.a.server:
                            self.load_tokenizer()
                        rec = Record(rid, "chat", payload)
                        if rec.turns and rec.turns[0] == 0:
                            raise BadRecord("the conversation starts with an assistant turn", "assistant_first")
                    if not rec.turns:
                        self._skip("no_assistant_turn")
                        continue
                    rec.source = where
                    records.append(rec)
                except RecursionError:
                    self.bad_line(where, BadRecord("nested too deeply to process", "too_deep"))
                except BadRecord as e:
                    self.bad_line(where, e)
        return records

    def bad_line(self, where, e):
        """A bad input line (or a record the template cannot render): exit 4 naming FILE:LINE, or
        counted and skipped with --skip-bad."""
        msg = f"{where}: {e}"
        if not self.a.skip_bad:
            raise Fatal(EXIT_DATA, msg + " (use --skip-bad to count and skip bad records)")
        self._skip(e.reason, msg)

    def prompt(self, rec, k):
        if rec.kind == "tokens":
            return rec.tokens + rec.context[k]
        i = rec.turns[k]
        text = self.renderer.render(rec.messages[:i], generation_prompt=True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def apply(self, rec, k, out):
        if out["finish_reason"] == "length":
            rec.hit_max += 1
        if "content" in out:  # an answer of --server
            msg = {"role": "assistant", "content": out["content"]}
            if out["reasoning_content"]:
                msg["reasoning_content"] = out["reasoning_content"]
            rec.messages[rec.turns[k]] = msg
            return
        ids, finish = out["output_ids"], out["finish_reason"]
        if rec.kind == "tokens":
            rec.tokens = rec.tokens + rec.context[k]
            rec.replies[k] = ids
            rec.tokens = rec.tokens + ids
        else:
            reply = ids[:-1] if finish == "stop" else ids
            rec.messages[rec.turns[k]] = {"role": "assistant",
                                          "content": self.tok.decode(reply, skip_special_tokens=False)}

    def finished_line(self, rec):
        info = {"turns": len(rec.turns), "hit_max_tokens": rec.hit_max}
        if rec.kind == "chat":
            return {"id": rec.id, "messages": rec.messages, "source": rec.source, "regenerated": info}
        ids, mask = [], []
        for k, reply in enumerate(rec.replies):
            ids += rec.context[k] + reply
            mask += [0] * len(rec.context[k]) + [1] * len(reply)
        ids += rec.context[-1]
        mask += [0] * len(rec.context[-1])
        return {"id": rec.id, "input_ids": ids, "loss_mask": mask, "source": rec.source, "regenerated": info}

    def round_prompts(self, k, batch):
        """{id: prompt ids} of round k; a record whose prompt the template cannot render is a bad
        record (exit 4, or skipped and counted with --skip-bad)."""
        prompts = {}
        for rec in batch:
            try:
                prompts[rec.id] = self.prompt(rec, k)
            except TemplateConfigError as e:
                raise Fatal(EXIT_CONFIG, f"{e} (while rendering {rec.source})")
            except RecursionError:
                self.bad_line(rec.source, BadRecord("nested too deeply to render", "too_deep"))
            except BadRecord as e:
                self.bad_line(rec.source, e)
        return prompts

    def generate_round(self, k, batch, prompts):
        inp = os.path.join(self.work, f"round-{k}.in.jsonl")
        out = os.path.join(self.work, f"round-{k}.out.jsonl")
        tmp = inp + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in batch:
                f.write(json.dumps({"id": rec.id, "input_ids": prompts[rec.id]}) + "\n")
        os.replace(tmp, inp)
        a = self.a
        cmd = [a.dflash, "generate", "--model", a.target, "--input", inp, "--out", out, "--device", a.device,
               "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size),
               "--temperature", str(a.temperature), "--stop-token-ids", ",".join(map(str, self.stops))]
        for flag, value in (("--dtype", a.dtype), ("--top-p", a.top_p), ("--top-k", a.top_k), ("--seed", a.seed)):
            if value is not None:
                cmd += [flag, str(value)]
        t0 = time.monotonic()
        rc = subprocess.run(cmd, stdout=sys.stderr, preexec_fn=die_with_parent).returncode
        if rc != 0:
            raise Fatal(rc if rc in (EXIT_CONFIG, EXIT_DATA) else 1, f"round {k}: dflash generate exited {rc}")
        results = {}
        with open(out, encoding="utf-8") as f:
            for line in f:
                obj = json.loads(line)
                results[str(obj["id"])] = obj
        missing = [rec.id for rec in batch if rec.id not in results]
        if missing:
            raise Fatal(1, f"round {k}: dflash generate left {len(missing)} requests without output "
                        f"(first {missing[0]})")
        print(f"regenerate: round {k}: {len(batch)} replies in {time.monotonic() - t0:.1f}s", file=sys.stderr,
              flush=True)
        return results

    def check_work_options(self):
        """The round files hold replies generated with certain options; a rerun must use the same ones.
        Only replies are protected: a work folder without any (a run that failed before its first
        reply) is taken over by this run's options."""
        a = self.a
        self.opts = opts = {"target": a.target and os.path.abspath(a.target), "input": os.path.abspath(a.input), "thinking": a.thinking,
                "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p,
                "top_k": a.top_k, "seed": a.seed, "dtype": a.dtype, "stop_token_ids": a.stop_token_ids,
                "server": a.server, "server_model": a.server_model}
        path = os.path.join(self.work, "options.json")
        if not self.has_replies():
            return
        try:
            with open(path, encoding="utf-8") as f:
                before = json.load(f)
            if not isinstance(before, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise Fatal(EXIT_CONFIG, f"{path}: unreadable ({e}); remove {self.work} to start over")
        diff = sorted(k for k in opts if before.get(k) != opts[k])
        if diff:
            raise Fatal(EXIT_CONFIG, f"{self.work} was started with other options ({', '.join(diff)}: "
                        f"{[before.get(k) for k in diff]} then, {[opts[k] for k in diff]} now); rerun with the "
                        f"same options, or remove {self.work} and start over")

    def has_replies(self):
        """Whether OUT.work holds replies of an earlier run (a non-empty round output file)."""
        try:
            names = os.listdir(self.work)
        except OSError:
            return False
        for name in names:
            if name.startswith("round-") and name.endswith((".out.jsonl", ".server.jsonl")):
                try:
                    if os.path.getsize(os.path.join(self.work, name)) > 0:
                        return True
                except OSError:
                    pass
        return False

    def start_work(self):
        """Before the first round writes anything: OUT.work/ and its options.json."""
        os.makedirs(self.work, exist_ok=True)
        write_json_atomic(os.path.join(self.work, "options.json"), self.opts)

    def remove_work(self, only_without_replies):
        if not os.path.isdir(self.work) or (only_without_replies and self.has_replies()):
            return
        for name in sorted(os.listdir(self.work)):
            remove_quietly(os.path.join(self.work, name))
        try:
            os.rmdir(self.work)
        except OSError:
            pass

    def run(self):
        try:
            return self._run()
        finally:  # a run that failed before any reply leaves no work folder to block the next one
            self.remove_work(only_without_replies=True)

    def _run(self):
        a = self.a
        self.check_work_options()
        done = self.read_done()
        records = self.read_input(done)
        self.stops = None if a.server else stop_tokens(a, self.any_tokenizer)
        failed = False
        out = None  # OUT, opened (for appending) when the first record is finished
        try:
            k = 0
            while True:
                batch = [r for r in records if k < len(r.turns)]
                if not batch:
                    break
                if k == 0:
                    self.start_work()
                if a.server:
                    results, errors, retries = server_round(a, self.work, k, batch,
                                                            lambda r, j: r.messages[:r.turns[j]],
                                                            lambda m: print(m, file=sys.stderr, flush=True))
                    self.stats["server_retries"] = self.stats.get("server_retries", 0) + retries
                    for rid, msg in errors.items():  # left for a rerun
                        self._skip("server_error", f"{rid}: round {k}: {msg}")
                    failed = failed or bool(errors)
                else:
                    prompts = self.round_prompts(k, batch)
                    results = self.generate_round(k, [r for r in batch if r.id in prompts], prompts) if prompts else {}
                records = [r for r in records if k >= len(r.turns) or r.id in results]
                for rec in batch:
                    if rec.id not in results:
                        continue
                    self.apply(rec, k, results[rec.id])
                    self.stats["turns"] += 1
                    if k == len(rec.turns) - 1:
                        out = out or open(a.out, "a", encoding="utf-8")
                        out.write(json.dumps(self.finished_line(rec), ensure_ascii=False) + "\n")
                        self.stats["regenerated"] += 1
                        self.stats["hit_max_tokens"] += rec.hit_max
                if out is not None:
                    out.flush()
                    os.fsync(out.fileno())
                k += 1
        finally:
            if out is not None:
                out.close()
        if not os.path.exists(a.out):  # nothing new, nothing before: an empty OUT, as every run ends with one
            open(a.out, "a").close()
        if not failed:  # every input record is in OUT now: the round files are no longer needed
            self.remove_work(only_without_replies=False)
        meta = {"kind": "dflash-regenerated-jsonl", "target": a.target and os.path.abspath(a.target),
                "server": a.server, "input": a.input,
                "thinking": a.thinking, "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                "stop_token_ids": self.stops, "out_sha256": sha256_file(a.out), "stats": self.stats}
        contract = input_contract(a.input)
        if contract:  # "thinking" is then the data's (the input's); this run's option is kept beside it
            meta["regenerate_thinking"] = meta.pop("thinking")
            meta.update(contract)
        write_json_atomic(a.out + ".meta.json", meta)
        print(json.dumps(self.stats, indent=2))
        if failed:
            print(f"error: {self.stats['skipped']['server_error']} records got no answer from {a.server}; "
                  "rerun the same command to ask again", file=sys.stderr)
            return 1
        return 0


def input_contract(path):
    """The data contract of a prepared input (its prepare sidecar): the regenerated tokenized lines keep
    the input's context tokens, so they keep its contract. {} when the input has no sidecar (chat lines:
    their output is tokenized by `dflash data prepare`, which records the contract then)."""
    side = path + ".meta.json"
    if not os.path.isfile(side):
        return {}
    with open(side, "rb") as f:
        try:
            meta = json.loads(f.read().decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise Fatal(EXIT_DATA, f"{side}: not valid JSON ({str(e)[:200]})")
    if not isinstance(meta, dict) or "tokenizer_sha256" not in meta:
        return {}
    return {k: meta[k] for k in CONTRACT_KEYS if k in meta}


def output_line_problem(line):
    """None when `line` (bytes) is a valid output line of regenerate: a JSON object with a string id,
    "regenerated" counts, and either messages whose contents are text or token ids with a 0/1 mask;
    else what is wrong with it."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return "not a JSON object with a string id"
    info = obj.get("regenerated")
    if not (isinstance(info, dict) and all(isinstance(info.get(k), int) for k in ("turns", "hit_max_tokens"))):
        return "no regenerated.turns / hit_max_tokens counts"
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            return "a message whose role or content is not text"
        if lone_surrogate(msgs) is not None:
            return lone_surrogate(msgs)
        return None
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            and all(m in (0, 1) for m in mask)):
        return None
    return "neither messages nor input_ids with a loss_mask"


def run(argv):
    return Regenerator(parse_args(argv)).run()


def main(argv):
    """`dflash data regenerate` ARGS -> exit code; never raises (errors.guard)."""
    return guard("data regenerate", run, argv)
