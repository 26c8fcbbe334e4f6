"""Input record formats of `dflash data prepare` -> a list of chat messages (or plain text).

Every function raises BadRecord with a message that names the offending field; the caller prefixes
FILE:LINE. Formats (one JSON object per line):

  sharegpt         {"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant"|"tool",
                                       "value": "..."}, ...]}
  openai           {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str |
                                  [{"type": "text", "text": str}, ...] | null,
                                  "tool_calls": [...], "reasoning_content": str, ...}, ...]}
  prompt-response  {"prompt": "...", "response": "...", "system": "..." (optional)}
  text             {"text": "..."}                      (plain text, loss on every token)

`auto` picks the format per record from its keys, in the order above.

read_lines() and parse_line() are the one way the data tools read a JSONL line: bounded in size
before anything is decoded (--max-record-bytes), and every way a line can be broken (not UTF-8,
not JSON, nested too deeply, lone surrogates that no tokenizer or JSON writer takes) is a
BadRecord, which the caller prefixes with FILE:LINE.
"""

import json

FORMATS = ("sharegpt", "openai", "prompt-response", "text")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
OPENAI_ROLES = ("system", "user", "assistant", "tool")


# The default of --max-record-bytes: the longest JSONL line the tools take (a longer one is a bad
# record, skipped without being read into memory). Tokenizing with offsets costs about 100-200
# bytes of memory per input byte, so the default keeps one record under about 1 GB.
DEFAULT_MAX_RECORD_BYTES = 4 << 20


class BadRecord(ValueError):
    """A record that cannot be turned into a training document (exit 4 unless --skip-bad)."""

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason  # a short key for the stats' "bad" counts


class TooLong(bytes):
    """read_lines()'s stand-in for a line longer than the limit: its first bytes only; .length is
    the line's whole length (its newline excluded)."""

    length = 0


def read_lines(f, max_bytes):
    """(line number, raw bytes) for each line of the binary file f; a line longer than max_bytes is
    yielded as a TooLong holding its first 64 bytes (the rest is read in chunks and dropped, so
    memory stays bounded whatever the input)."""
    line_no = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) <= max_bytes or raw.endswith(b"\n"):
            yield line_no, raw
            continue
        length = len(raw)
        head = raw[:64]
        while True:  # the rest of the line, dropped
            chunk = f.readline(1 << 20)
            length += len(chunk)
            if not chunk or chunk.endswith(b"\n"):
                break
        t = TooLong(head)
        t.length = length - (1 if chunk.endswith(b"\n") else 0)
        yield line_no, t


def too_long(raw, max_bytes, flag="--max-record-bytes"):
    return BadRecord(f"a line of {raw.length} bytes, longer than {flag} {max_bytes}", "record_too_large")


def lone_surrogate(obj):
    """'PATH: ...' naming the first string (or key) of obj that holds a lone surrogate (a \\ud800-
    \\udfff escape without its pair: not Unicode text, so no tokenizer or UTF-8 writer takes it);
    None when there is none. Iterative: the depth of obj is not bounded here."""
    stack = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                return (f"{path or 'the record'}: a lone surrogate (\\u{ord(node[e.start]):04x}) at character "
                        f"{e.start}, not valid Unicode text")
        elif isinstance(node, dict):
            for k, v in node.items():
                name = k.encode("utf-8", "backslashreplace").decode("utf-8")
                sub = f"{path}.{name}" if path else name
                stack.append((k, f"{path or 'the record'}: key"))
                stack.append((v, sub))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def parse_line(raw, max_bytes=None):
    """One JSONL line (bytes) -> the parsed value; BadRecord for every way it can be broken."""
    if isinstance(raw, TooLong):
        raise too_long(raw, max_bytes)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 text at byte {e.start}", "not_utf8")
    if not line.strip():
        raise BadRecord("empty line", "empty_line")
    try:
        obj = json.loads(line)
    except RecursionError:
        raise BadRecord("JSON nested too deeply to parse", "too_deep")
    except ValueError as e:
        raise BadRecord(f"invalid JSON: {str(e)[:200]}", "invalid_json")
    # Lone surrogates can only come from \\u escapes (the bytes decoded as UTF-8): look only then.
    if b"\\ud" in raw or b"\\uD" in raw:
        where = lone_surrogate(obj)
        if where is not None:
            raise BadRecord(where, "invalid_unicode")
    return obj


def detect_format(obj):
    if "conversations" in obj:
        return "sharegpt"
    if "messages" in obj:
        return "openai"
    if "prompt" in obj and "response" in obj:
        return "prompt-response"
    if "text" in obj:
        return "text"
    raise BadRecord(
        "cannot detect the format: no 'conversations', 'messages', 'prompt'+'response' or 'text' key "
        f"(keys: {sorted(obj)[:8]})",
        "unknown_format",
    )


def _text(value, where):
    """A message's text: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRecord(f"{where}[{k}]: only text content parts are supported", "non_text_content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRecord(f"{where}: expected a string, got {type(value).__name__}", "bad_content")


def tool_calls_as_text(calls, where):
    """Tool calls as text for templates that do not render `tool_calls` themselves: one
    <tool_call>{"name": ..., "arguments": ...}</tool_call> block per call (the Hermes/Qwen form)."""
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecord(f"{where}[{k}]: a tool call needs function.name", "bad_tool_call")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # kept as the string the dataset holds
        out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
                   + "\n</tool_call>")
    return "\n".join(out)


def _check_roles(messages, where):
    if not messages:
        raise BadRecord(f"{where}: empty conversation", "empty_conversation")
    for i, m in enumerate(messages):
        if m["role"] == "system" and i != 0:
            raise BadRecord(f"{where}[{i}]: a system message must come first", "misplaced_system")
        has_calls = bool(m.get("tool_calls"))
        if not m["content"].strip() and not has_calls:
            raise BadRecord(f"{where}[{i}]: empty {m['role']} turn", "empty_turn")


def _turns(obj, key):
    """(index, "key[i]", turn) for each turn of the list obj[key]; BadRecord when it is not a list."""
    turns = obj.get(key)
    if not isinstance(turns, list):
        raise BadRecord(f"'{key}' must be a list", "bad_structure")
    return [(i, f"{key}[{i}]", t) for i, t in enumerate(turns)]


def sharegpt_messages(obj):
    messages = []
    for i, where, turn in _turns(obj, "conversations"):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise BadRecord(f"{where}: expected an object with 'from' and 'value'", "bad_structure")
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise BadRecord(f"{where}.from: unknown role {turn['from']!r} (known: {sorted(SHAREGPT_ROLES)})",
                            "unknown_role")
        messages.append({"role": role, "content": _text(turn["value"], where + ".value")})
    _check_roles(messages, "conversations")
    return messages


def openai_messages(obj, template_renders_tool_calls):
    messages = []
    for i, where, m in _turns(obj, "messages"):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRecord(f"{where}: expected an object with 'role'", "bad_structure")
        role = m["role"]
        if role not in OPENAI_ROLES:
            raise BadRecord(f"{where}.role: unknown role {role!r} (known: {list(OPENAI_ROLES)})", "unknown_role")
        content = m.get("content")
        content = "" if content is None else _text(content, where + ".content")
        out = {"role": role, "content": content}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRecord(f"{where}.tool_calls: a list, on assistant messages only", "bad_tool_call")
            if template_renders_tool_calls:
                out["tool_calls"] = calls
            else:
                text = tool_calls_as_text(calls, where + ".tool_calls")
                out["content"] = content + ("\n" if content else "") + text
        for key in ("reasoning_content", "tool_call_id", "name"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        messages.append(out)
    _check_roles(messages, "messages")
    return messages


def prompt_response_messages(obj):
    for key in ("prompt", "response"):
        if not isinstance(obj.get(key), str):
            raise BadRecord(f"'{key}' must be a string", "bad_structure")
    messages = []
    if "system" in obj:
        messages.append({"role": "system", "content": _text(obj["system"], "system")})
    messages += [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
    _check_roles(messages, "prompt/response")
    return messages


def record_messages(obj, fmt, template_renders_tool_calls):
    """-> (format, "chat", messages) or ("text", "text", str)."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}", "not_an_object")
    if fmt == "auto":
        fmt = detect_format(obj)
    if fmt == "sharegpt":
        return fmt, "chat", sharegpt_messages(obj)
    if fmt == "openai":
        return fmt, "chat", openai_messages(obj, template_renders_tool_calls)
    if fmt == "prompt-response":
        return fmt, "chat", prompt_response_messages(obj)
    text = obj.get("text")
    if not isinstance(text, str):
        raise BadRecord("'text' must be a string", "bad_structure")
    if not text.strip():
        raise BadRecord("empty 'text'", "empty_turn")
    return "text", "text", text
