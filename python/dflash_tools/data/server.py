"""`dflash data regenerate --server URL`: replies from an OpenAI-compatible chat endpoint (vLLM,
SGLang, ...) instead of the C++ engine. The server applies the chat template; token ids are not
exchanged, so this path is for chat lines only.

Per round, the requests of every record run concurrently (--batch-size at a time); each answer is
appended to OUT.work/round-K.server.jsonl as it arrives, so a rerun asks only for the missing ones.

The server is not trusted:
  - each request has one deadline, --server-timeout seconds from its start to the last byte of
    the answer (a server that trickles bytes cannot hold it longer);
  - the answer's size is capped (--server-max-response-bytes, default 1 MiB + 256 bytes per
    --max-new-tokens): a longer answer is refused as soon as its Content-Length or its bytes say
    so, without being kept in memory;
  - the answer must be a JSON object with choices[0].message an object whose content is a string
    (or null), reasoning a string (or null), finish_reason a string (or null), all valid Unicode
    (no lone surrogates); anything else is a malformed answer, never written anywhere;
  - connection errors, a connection dropped mid-answer, timeouts, HTTP 429 and 5xx and malformed
    answers are retried, up to --server-retries attempts with a bounded exponential backoff
    (--server-backoff S: S, 2S, 4S, ... at most 30 s); other HTTP errors and an answer over the
    size cap are not.
A request that still fails drops its record from this run (counted as `server_error`, with the
reason); a rerun asks again. Retries are counted in the stats (`server_retries`).
"""

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from .formats import lone_surrogate

BACKOFF_CAP_S = 30.0
CHUNK = 1 << 16


class ServerError(Exception):
    """A request that failed; retryable or not."""

    def __init__(self, message, retryable):
        super().__init__(message)
        self.retryable = retryable


def max_response_bytes(a):
    return a.server_max_response_bytes or (1 << 20) + 256 * a.max_new_tokens


def chat_request(a, messages):
    body = {"model": a.server_model, "messages": messages, "max_tokens": a.max_new_tokens,
            "temperature": a.temperature}
    for key, value in (("top_p", a.top_p), ("top_k", a.top_k), ("seed", a.seed)):
        if value is not None:
            body[key] = value
    if a.thinking != "keep":
        body["chat_template_kwargs"] = {"enable_thinking": a.thinking == "on"}
    return body


def validate_answer(answer):
    """A parsed answer -> {"content", "reasoning_content", "finish_reason"}; ServerError (retryable:
    a server may answer well next time) naming what is wrong."""
    def bad(what):
        return ServerError(f"malformed answer: {what}", retryable=True)

    if not isinstance(answer, dict):
        raise bad(f"expected a JSON object, got {type(answer).__name__}")
    if "error" in answer and "choices" not in answer:
        raise bad(f"the server returned an error: {json.dumps(answer['error'])[:300]}")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad("no 'choices' list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise bad(f"choices[0] is a {type(choice).__name__}, not an object")
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise bad(f"choices[0].message is {'missing' if msg is None else 'a ' + type(msg).__name__}, not an object")
    out = {}
    for key, names in (("content", ("content",)), ("reasoning_content", ("reasoning_content", "reasoning"))):
        value = None
        for name in names:
            v = msg.get(name)
            if v is not None and not isinstance(v, str):
                raise bad(f"choices[0].message.{name} is a {type(v).__name__}, not a string")
            value = value or v
        out[key] = value or ""
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise bad(f"choices[0].finish_reason is a {type(finish).__name__}, not a string")
    out["finish_reason"] = finish or "stop"
    where = lone_surrogate(out)
    if where is not None:
        raise bad(where)
    return out


class _Deadline:
    """Closes the connection's socket when the request's deadline passes, so that a read blocked on
    a trickling server returns; `expired` tells the caller why it returned."""

    def __init__(self, conn, seconds):
        self.conn = conn
        self.expired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self):
        self.expired = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self):
        self.timer.cancel()


def _connection(url, timeout):
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ServerError(f"--server {url}: not an http(s) URL", retryable=False)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return cls(u.hostname, u.port, timeout=timeout), path


def request_once(url, data, timeout, max_bytes):
    """One POST; -> the validated answer. ServerError otherwise. The whole request, connect to the
    last byte, ends within `timeout` seconds; at most max_bytes of answer are read."""
    start = time.monotonic()
    conn, path = _connection(url, timeout)
    deadline = _Deadline(conn, timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                       "Content-Length": str(len(data))})
        resp = conn.getresponse()
        if resp.status != 200:
            head = resp.read(300) if resp.status >= 400 else b""
            text = head.decode("utf-8", "replace")
            raise ServerError(f"HTTP {resp.status}: {text}".rstrip(": "),
                              retryable=resp.status == 429 or resp.status >= 500)
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise ServerError(f"an answer of {int(length)} bytes (Content-Length), over the cap of {max_bytes} "
                              "(--server-max-response-bytes)", retryable=False)
        chunks, size = [], 0
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise socket.timeout()
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(CHUNK) if hasattr(resp, "read1") else resp.read(CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ServerError(f"an answer of more than {max_bytes} bytes, over the cap "
                                  "(--server-max-response-bytes)", retryable=False)
            chunks.append(chunk)
        if length is not None and length.strip().isdigit() and size < int(length):
            raise http.client.IncompleteRead(b"", int(length) - size)
        body = b"".join(chunks)
    except ServerError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if deadline.expired or isinstance(e, socket.timeout):
            raise ServerError(f"no complete answer within --server-timeout {timeout:g} s", retryable=True)
        raise ServerError(f"{type(e).__name__}: {str(e)[:200] or 'connection closed'}", retryable=True)
    finally:
        deadline.cancel()
        conn.close()
    if deadline.expired:
        raise ServerError(f"no complete answer within --server-timeout {timeout:g} s", retryable=True)
    try:
        answer = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ServerError(f"malformed answer: not UTF-8 at byte {e.start}", retryable=True)
    except RecursionError:
        raise ServerError("malformed answer: JSON nested too deeply", retryable=True)
    except ValueError as e:
        raise ServerError(f"malformed answer: not JSON ({str(e)[:100]}): {body[:200]!r}", retryable=True)
    return validate_answer(answer)


def post(url, body, a, on_retry=None):
    """-> the validated answer; ServerError after --server-retries attempts (or at once when not
    retryable)."""
    data = json.dumps(body, ensure_ascii=True).encode("ascii")
    last = None
    for attempt in range(a.server_retries):
        if attempt:
            if on_retry:
                on_retry(last)
            time.sleep(min(a.server_backoff * 2 ** (attempt - 1), BACKOFF_CAP_S))
        try:
            return request_once(url, data, a.server_timeout, max_response_bytes(a))
        except ServerError as e:
            last = e
            if not e.retryable:
                break
    raise ServerError(f"{last} (after {attempt + 1} attempt{'s' if attempt else ''})", retryable=False)


def stored_answer(line):
    """A line of round-K.server.jsonl -> (id, answer) when it is a valid stored answer, else None (it
    is asked again: a line written by an older version, a hand edit or a torn write)."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return None
    try:
        answer = validate_answer({"choices": [{"message": {"content": obj.get("content"),
                                                           "reasoning_content": obj.get("reasoning_content")},
                                               "finish_reason": obj.get("finish_reason")}]})
    except ServerError:
        return None
    return obj["id"], answer


def server_round(a, work, k, batch, messages_for, log):
    """-> ({id: answer}, {id: error message}, retries) for the records of round k."""
    path = os.path.join(work, f"round-{k}.server.jsonl")
    results = {}
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):  # a line cut by a kill: ask again
            os.truncate(path, complete)
        dropped = 0
        for line in data[:complete].splitlines():
            got = stored_answer(line)
            if got is None:
                dropped += 1
                continue
            results[got[0]] = got[1]
        if dropped:
            log(f"regenerate: round {k}: {dropped} invalid stored answers in {path} are asked again")
    todo = [rec for rec in batch if rec.id not in results]
    url = a.server.rstrip("/") + "/v1/chat/completions"
    errors, lock = {}, threading.Lock()
    retries = [0]
    t0 = time.monotonic()

    def count_retry(_):
        with lock:
            retries[0] += 1

    with open(path, "a", encoding="utf-8") as out:
        def one(rec):
            try:
                answer = post(url, chat_request(a, messages_for(rec, k)), a, count_retry)
            except ServerError as e:
                with lock:
                    errors[rec.id] = str(e)
                return
            line = json.dumps(dict(answer, id=rec.id), ensure_ascii=False) + "\n"
            with lock:
                out.write(line)
                out.flush()
                results[rec.id] = answer

        with ThreadPoolExecutor(max_workers=a.batch_size) as pool:
            list(pool.map(one, todo))
        os.fsync(out.fileno())
    log(f"regenerate: round {k}: {len(todo)} requests to {url} in {time.monotonic() - t0:.1f}s "
        f"({len(batch) - len(todo)} from an earlier run, {len(errors)} failed, {retries[0]} retried)")
    return results, errors, retries[0]
