"""`dflash data prepare`: chat / text JSONL -> tokenized JSONL {id, input_ids, loss_mask} for
`dflash data import`, with the model's own chat template and tokenizer (HF transformers).

Run through `dflash data prepare` (which also handles --out DIR by importing into shards), or as
`python -m dflash_tools.data prepare --tokenizer DIR --input a.jsonl --out prepared.jsonl`.
Writes OUT (atomically) and OUT.meta.json (the stats and provenance below), prints the same JSON
on stdout and a progress line on stderr. Exit codes: 0 ok; 1 anything unexpected (one line, no
traceback); 2 usage/config (bad flag, missing tokenizer files, a chat template that is not a
string or does not compile, no chat template, OUT exists, an OUT that cannot be written,
--thinking on a template without enable_thinking); 4 bad data (a bad record without --skip-bad,
an unloadable tokenizer, no document written).
"""

import argparse
import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..errors import EXIT_CONFIG, EXIT_DATA, EXIT_FAILURE, Fatal, guard, os_error_text, short
from .formats import DEFAULT_MAX_RECORD_BYTES, FORMATS, BadRecord, parse_line, read_lines, record_messages
from .spans import (Renderer, TemplateConfigError, assistant_spans, check_template_config, compile_template,
                    mask_from_offsets, template_file, template_text)

MAX_BAD_EXAMPLES = 20
# The data contract (core/data/contract.h): the keys of the meta JSON that say how the token ids were
# made; `dflash data import` carries them to the shards, the run ledger and the export.
CONTRACT_KEYS = ("tokenizer_sha256", "chat_template_sha256", "thinking", "system_sha256", "last_turn_only",
                 "max_seq_len", "format")


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dflash data prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="model directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--input", required=True, help="a.jsonl[,b.jsonl...]")
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    p.add_argument("--out", required=True, help="output JSONL (must not exist)")
    p.add_argument("--thinking", default="keep", choices=("on", "off", "keep"))
    p.add_argument("--last-turn-only", action="store_true")
    p.add_argument("--max-seq-len", type=int, default=0, help="truncate documents to N tokens (0 = no limit)")
    p.add_argument("--system", default=None, help="system prompt added to chats that have none")
    p.add_argument("--skip-bad", action="store_true")
    p.add_argument("--workers", type=int, default=1, help="processes that render and tokenize (default 1)")
    p.add_argument("--prompts-only", action="store_true",
                   help="write {id, input_ids} prompts (the chat before its last reply + generation prompt) for "
                        "dflash eval / generate instead of training documents")
    p.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES,
                   help=f"a longer input line is a bad record, skipped unread (default {DEFAULT_MAX_RECORD_BYTES})")
    a = p.parse_args(argv)
    if a.max_record_bytes < 1:
        p.error(f"--max-record-bytes must be >= 1, got {a.max_record_bytes}")
    if a.system is not None and not encodable(a.system):
        p.error("--system: not valid UTF-8 text")
    if a.max_seq_len < 0:
        p.error(f"--max-seq-len must be >= 0, got {a.max_seq_len}")
    if a.workers < 1:
        p.error(f"--workers must be >= 1, got {a.workers}")
    a.inputs = [x for x in a.input.split(",") if x]
    if not a.inputs:
        p.error("--input names no file")
    return a


def encodable(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def model_dir_problem(flag, model_dir):
    """None when model_dir is a folder; else the message: a name like ORG/NAME is taken for what it
    likely is, a Hugging Face model id, with the download that gives the folder (the tools read
    local files only)."""
    if os.path.isdir(model_dir):
        return None
    msg = f"{flag} {model_dir}: not a directory"
    if os.path.exists(model_dir):
        return msg
    parts = model_dir.split("/")
    if len(parts) == 2 and all(parts) and not model_dir.startswith((".", "~")):
        local = parts[1]
        msg += (f"; it looks like a Hugging Face model id, and this command reads local files only: download "
                f"it first (`hf download {model_dir} --local-dir {local}`, or only the tokenizer: add --include "
                f"'tokenizer*' '*.jinja') and pass {flag} {local}")
    return msg


def load_tokenizer(model_dir, thinking):
    tok_json = os.path.join(model_dir, "tokenizer.json")
    problem = model_dir_problem("--tokenizer", model_dir)
    if problem:
        raise Fatal(EXIT_CONFIG, problem)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(model_dir, name)):
            raise Fatal(EXIT_CONFIG, f"--tokenizer {model_dir}: missing {name}")
    try:
        check_template_config(model_dir)
    except TemplateConfigError as e:
        raise Fatal(EXIT_CONFIG, str(e))
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise Fatal(EXIT_DATA, f"{model_dir}: cannot load the tokenizer: {type(e).__name__}: {str(e)[:500]}")
    template = template_text(tok)
    try:
        compile_template(template, template_file(model_dir))
    except TemplateConfigError as e:
        raise Fatal(EXIT_CONFIG, str(e))
    if thinking != "keep" and (template is None or "enable_thinking" not in template):
        raise Fatal(EXIT_CONFIG, f"--thinking {thinking}: the chat template of {model_dir} has no enable_thinking "
                    "switch (use --thinking keep)")
    return tok, template, sha256_file(tok_json)


class Dropped(Exception):
    """A valid record that yields no document (counted under stats.dropped.<reason>)."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class Preparer:
    def __init__(self, a, tok, template):
        self.a = a
        self.tok = tok
        self.template = template
        self.renderer = (Renderer(tok, template, a.thinking, template_file(a.tokenizer)) if template is not None
                         else None)
        self.renders_tool_calls = template is not None and "tool_calls" in template
        self.stats = {"records": 0, "documents": 0, "tokens": 0, "assistant_tokens": 0, "truncated": 0,
                      "formats": {}, "skipped_bad": {}, "dropped": {}, "bad_examples": []}
        self.ids = set()
        self.out_hash = hashlib.sha256()  # of the JSONL written (the data hash an export records)

    def document(self, obj, source):
        """-> (record dict, format, truncated); raises Dropped or BadRecord. Touches no shared state
        (it runs in worker processes with --workers): counting and the id check are the caller's."""
        if self.renderer is not None:
            self.renderer.clear()
        fmt, kind, payload = record_messages(obj, self.a.format, self.renders_tool_calls)
        if kind == "text":
            ids = list(self.tok(payload)["input_ids"])
            mask = None if self.a.prompts_only else [1] * len(ids)
        else:
            if self.renderer is None:
                raise Fatal(EXIT_CONFIG, f"{source}: a chat record, but the tokenizer has no chat template")
            messages = payload
            if self.a.system is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.a.system}] + messages
            if self.a.prompts_only:
                ids, mask = self.prompt_ids(messages), None
            elif not any(m["role"] == "assistant" for m in messages):
                raise Dropped("no_assistant_turn")
            else:
                full = self.renderer.render(messages)
                spans = assistant_spans(self.renderer, messages, full, self.a.last_turn_only)
                enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
                ids = list(enc["input_ids"])
                mask = mask_from_offsets(enc["offset_mapping"], spans)
        if not ids:
            raise BadRecord("no tokens", "empty_document")
        truncated = False
        if self.a.max_seq_len and len(ids) > self.a.max_seq_len:
            if self.a.prompts_only:  # a cut prompt is another prompt: leave it out
                raise Dropped("prompt_longer_than_max_seq_len")
            ids, mask = ids[:self.a.max_seq_len], mask[:self.a.max_seq_len]
            truncated = True
        if mask is not None and not any(mask):
            raise Dropped("no_assistant_tokens_after_truncation" if kind == "chat" else "empty_document")
        rid = obj.get("id")
        rid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else source
        doc = {"id": rid, "input_ids": ids}
        if mask is not None:
            doc["loss_mask"] = mask
        elif isinstance(obj.get("group"), str) and obj["group"]:
            doc["group"] = obj["group"]  # a prompt's group in the eval report (docs/eval.md)
        doc["source"] = source
        return doc, fmt, truncated

    def outcome(self, item):
        """(where, raw line) -> ("doc", line text, doc stats) | ("bad", reason, message) |
        ("dropped", reason) | ("fatal", code, message); what a worker sends back."""
        where, raw = item
        try:
            obj = parse_line(raw, self.a.max_record_bytes)
            try:
                doc, fmt, truncated = self.document(obj, where)
            except RecursionError:
                raise BadRecord("nested too deeply to process", "too_deep")
        except BadRecord as e:
            return ("bad", e.reason, f"{where}: {e}")
        except Dropped as e:
            return ("dropped", e.reason)
        except TemplateConfigError as e:
            return ("fatal", EXIT_CONFIG, f"{e} (while rendering {where})")
        except Fatal as e:
            return ("fatal", e.code, str(e))
        return ("doc", doc["id"], json.dumps(doc, separators=(",", ":")) + "\n",
                (fmt, truncated, len(doc["input_ids"]), sum(doc.get("loss_mask", ()))))

    def prompt_ids(self, messages):
        """--prompts-only: the conversation before its last reply (the whole conversation when it does
        not end with one) and the generation prompt, as HF apply_chat_template(add_generation_prompt=True)
        tokenizes it."""
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise BadRecord("nothing before the reply to prompt with", "assistant_first")
        text = self.renderer.render(messages, generation_prompt=True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _count(self, table, reason):
        self.stats[table][reason] = self.stats[table].get(reason, 0) + 1

    def bad(self, msg, reason):
        if not self.a.skip_bad:
            raise Fatal(EXIT_DATA, msg + " (use --skip-bad to count and skip bad records)")
        self._count("skipped_bad", reason)
        if len(self.stats["bad_examples"]) < MAX_BAD_EXAMPLES:
            self.stats["bad_examples"].append(msg)

    def lines(self, path):
        try:
            f = open(path, "rb")
        except OSError as e:
            raise Fatal(EXIT_CONFIG, f"--input {path}: cannot open: {e.strerror}")
        with f:
            for line_no, raw in read_lines(f, self.a.max_record_bytes):
                yield f"{path}:{line_no}", raw

    def take(self, result, out, progress):
        """Counts one outcome and writes its document (in input order)."""
        self.stats["records"] += 1
        if result[0] == "fatal":
            raise Fatal(result[1], result[2])
        if result[0] == "dropped":
            self._count("dropped", result[1])
            return
        if result[0] == "doc" and result[1] in self.ids:
            where = json.loads(result[2])["source"]
            result = ("bad", "duplicate_id", f"{where}: duplicate id {result[1]!r}")
        if result[0] == "bad":
            self.bad(result[2], result[1])
            return
        _, rid, text, (fmt, truncated, n_tokens, n_trained) = result
        self.ids.add(rid)
        out.write(text)
        self.out_hash.update(text.encode("utf-8"))
        self._count("formats", fmt)
        self.stats["truncated"] += truncated
        self.stats["documents"] += 1
        self.stats["tokens"] += n_tokens
        self.stats["assistant_tokens"] += n_trained
        progress()


# --workers N: the worker processes' own Preparer (each loads the tokenizer itself).
_WORKER = None
# Chunks of input lines submitted to the workers ahead of the writer, per worker: the lines held in
# memory stay bounded (WINDOW_PER_WORKER x workers x CHUNK_LINES) whatever the input's size.
CHUNK_LINES = 16
WINDOW_PER_WORKER = 4


def _init_worker(a):
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker
    tok, template, _ = load_tokenizer(a.tokenizer, a.thinking)
    _WORKER = Preparer(a, tok, template)


def _worker_chunk(chunk):
    """The outcomes of a chunk of lines; an unexpected exception comes back as a value (an exception
    object whose class cannot be rebuilt from its pickled arguments would otherwise be lost)."""
    out = []
    for item in chunk:
        try:
            out.append(_WORKER.outcome(item))
        except Exception as e:
            out.append(("fatal", EXIT_FAILURE, f"{item[0]}: internal error: {type(e).__name__}: {short(str(e))}"))
    return out


def parallel_outcomes(a, items):
    """The outcomes of `items` in input order, computed by a.workers processes. The workers start from
    a fresh interpreter (forkserver: nothing of this process's threads or locks is inherited, which
    a fork after the tokenizer is loaded does not guarantee), and a worker that dies (killed, out of
    memory) is a Fatal naming it instead of a wait that never ends."""
    ctx = multiprocessing.get_context("forkserver")
    ex = ProcessPoolExecutor(a.workers, mp_context=ctx, initializer=_init_worker, initargs=(a,))
    it = iter(items)
    pending = collections.deque()

    def submit_next():
        chunk = list(itertools.islice(it, CHUNK_LINES))
        if chunk:
            pending.append(ex.submit(_worker_chunk, chunk))
        return bool(chunk)

    try:
        more = True
        while more and len(pending) < WINDOW_PER_WORKER * a.workers:
            more = submit_next()
        while pending:
            try:
                results = pending.popleft().result()
            except BrokenProcessPool:
                raise Fatal(EXIT_FAILURE, f"a --workers process ended unexpectedly (killed, or out of memory?); "
                            f"nothing was written to {a.out}")
            if more:
                more = submit_next()
            yield from results
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def write_json_atomic(path, obj):
    """path <- obj as JSON, through a temporary file in the same folder (fsynced, renamed); the
    temporary file is removed when anything fails."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def remove_stale_tmps(path):
    """Removes PATH.tmp-PID and PATH.meta.json.tmp-PID left by a run that was killed (PID no longer
    alive), so that nothing half-written stays next to the output."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        for stem in (base + ".tmp-", base + ".meta.json.tmp-"):
            pid = name[len(stem):] if name.startswith(stem) else ""
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                remove_quietly(os.path.join(folder, name))


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def open_out(path):
    """The temporary output file next to `path`, created before any work so that an --out that
    cannot be written fails at once (exit 2), not after the whole dataset."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise Fatal(EXIT_CONFIG, f"--out {path}: cannot create the folder {folder}: {os_error_text(e)}")
    remove_stale_tmps(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        return tmp, OutFile(path, open(tmp, "w", encoding="utf-8"))
    except OSError as e:
        raise Fatal(EXIT_CONFIG, f"--out {path}: cannot write there: {os_error_text(e)}")


class OutFile:
    """The output being written: an OSError (disk full, I/O error) is a Fatal naming --out."""

    def __init__(self, path, f):
        self.path, self.f = path, f

    def _fail(self, e):
        return Fatal(EXIT_CONFIG, f"--out {self.path}: cannot write there: {os_error_text(e)}")

    def write(self, text):
        try:
            self.f.write(text)
        except OSError as e:
            raise self._fail(e)

    def sync(self):
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        except OSError as e:
            raise self._fail(e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.f.close()
        except OSError as e:
            if exc[0] is None:
                raise self._fail(e)


def run(argv, extra_meta=None):
    """prepare ARGS -> 0, or raises Fatal; extra_meta: keys added to (or replacing) the meta JSON's."""
    a = parse_args(argv)
    if os.path.exists(a.out):
        raise Fatal(EXIT_CONFIG, f"--out {a.out}: exists; refusing to overwrite it")
    for path in a.inputs:
        if not os.path.isfile(path):
            raise Fatal(EXIT_CONFIG, f"--input {path}: no such file")
    tok, template, tok_hash = load_tokenizer(a.tokenizer, a.thinking)
    p = Preparer(a, tok, template)
    t0 = last = time.monotonic()

    def progress(final=False):
        nonlocal last
        now = time.monotonic()
        if final or now - last >= 2.0:
            last = now
            s = p.stats
            bad = sum(s["skipped_bad"].values())
            print(f"prepare: {s['records']} records, {s['documents']} documents, {s['tokens']} tokens, "
                  f"{bad} bad, {now - t0:.1f}s", file=sys.stderr, flush=True)

    tmp, out_file = open_out(a.out)
    try:
        with out_file as out:
            items = (item for path in a.inputs for item in p.lines(path))
            if a.workers == 1:
                for item in items:
                    p.take(p.outcome(item), out, progress)
            else:
                with contextlib.closing(parallel_outcomes(a, items)) as results:
                    for result in results:
                        p.take(result, out, progress)
            out.sync()
        progress(final=True)
        s = p.stats
        if s["documents"] == 0:
            raise Fatal(EXIT_DATA, f"no document written ({s['records']} records, skipped bad: {s['skipped_bad']}, "
                        f"dropped: {s['dropped']})")
        s["assistant_token_fraction"] = s["assistant_tokens"] / s["tokens"]
        meta = {
            "kind": "dflash-prepared-jsonl",
            "inputs": a.inputs,
            "out": a.out,
            "format": a.format,
            "tokenizer": os.path.abspath(a.tokenizer),
            "tokenizer_sha256": tok_hash,
            "chat_template_sha256": sha256_text(template) if template is not None else None,
            "thinking": a.thinking,
            "last_turn_only": a.last_turn_only,
            "max_seq_len": a.max_seq_len,
            "prompts_only": a.prompts_only,
            "system_sha256": sha256_text(a.system) if a.system is not None else None,
            "out_sha256": p.out_hash.hexdigest(),
            "stats": s,
        }
        meta.update(extra_meta or {})
        try:  # the sidecar first: OUT itself appears last, complete
            write_json_atomic(a.out + ".meta.json", meta)
        except OSError as e:
            raise Fatal(EXIT_CONFIG, f"--out {a.out}: cannot write there: {os_error_text(e)}")
        try:
            os.replace(tmp, a.out)
        except OSError as e:
            remove_quietly(a.out + ".meta.json")
            raise Fatal(EXIT_CONFIG, f"--out {a.out}: cannot write there: {os_error_text(e)}")
    finally:
        remove_quietly(tmp)
    print(json.dumps(meta, indent=2))
    return 0


def main(argv):
    """`dflash data prepare` ARGS -> exit code; never raises (errors.guard)."""
    return guard("data prepare", run, argv)
