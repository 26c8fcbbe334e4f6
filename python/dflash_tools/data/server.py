"""`dflash data regenerate --server URL`: replies from an OpenAI-compatible chat endpoint (vLLM,
SGLang, ...) instead of the C++ engine. The server applies the chat template; token ids are not
exchanged, so this path is for chat lines only.

Per round, the requests of every record run concurrently (--batch-size at a time); each answer is
appended to OUT.work/round-K.server.jsonl as it arrives, so a rerun asks only for the missing ones.
A request that still fails after --server-retries attempts (connection error, HTTP 429 / 5xx, or at
once for another HTTP error or a malformed answer) drops its record from this run (counted as
`server_error`); a rerun asks again.
"""

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


class ServerError(Exception):
    pass


def chat_request(a, messages):
    body = {"model": a.server_model, "messages": messages, "max_tokens": a.max_new_tokens,
            "temperature": a.temperature}
    for key, value in (("top_p", a.top_p), ("top_k", a.top_k), ("seed", a.seed)):
        if value is not None:
            body[key] = value
    if a.thinking != "keep":
        body["chat_template_kwargs"] = {"enable_thinking": a.thinking == "on"}
    return body


def post(url, body, timeout, retries):
    """-> {"content", "reasoning_content", "finish_reason"}; raises ServerError."""
    data = json.dumps(body).encode("utf-8")
    last = None
    for attempt in range(retries):
        if attempt:
            time.sleep(min(2 ** attempt, 30))
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                answer = json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:300].decode('utf-8', 'replace')}"
            if e.code != 429 and e.code < 500:
                break
            continue
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
            continue
        try:
            choice = answer["choices"][0]
            msg = choice["message"]
            return {"content": msg.get("content") or "",
                    "reasoning_content": msg.get("reasoning_content") or msg.get("reasoning") or "",
                    "finish_reason": choice.get("finish_reason") or "stop"}
        except (KeyError, IndexError, TypeError):
            last = f"malformed answer: {json.dumps(answer)[:300]}"
            break
    raise ServerError(last)


def server_round(a, work, k, batch, messages_for, log):
    """-> ({id: answer}, {id: error message}) for the records of round k."""
    path = os.path.join(work, f"round-{k}.server.jsonl")
    results = {}
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):  # a line cut by a kill: ask again
            os.truncate(path, complete)
        for line in data[:complete].splitlines():
            obj = json.loads(line)
            results[obj["id"]] = obj
    todo = [rec for rec in batch if rec.id not in results]
    url = a.server.rstrip("/") + "/v1/chat/completions"
    errors, lock = {}, threading.Lock()
    t0 = time.monotonic()
    with open(path, "a", encoding="utf-8") as out:
        def one(rec):
            try:
                answer = post(url, chat_request(a, messages_for(rec, k)), a.server_timeout, a.server_retries)
            except ServerError as e:
                with lock:
                    errors[rec.id] = str(e)
                return
            answer["id"] = rec.id
            with lock:
                out.write(json.dumps(answer, ensure_ascii=False) + "\n")
                out.flush()
                results[rec.id] = answer

        with ThreadPoolExecutor(max_workers=a.batch_size) as pool:
            list(pool.map(one, todo))
        os.fsync(out.fileno())
    log(f"regenerate: round {k}: {len(todo)} requests to {url} in {time.monotonic() - t0:.1f}s "
        f"({len(batch) - len(todo)} from an earlier run, {len(errors)} failed)")
    return results, errors
