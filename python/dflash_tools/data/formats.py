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


class BadRecord(ValueError):
    """A record that cannot be turned into a training document (exit 4 unless --skip-bad)."""

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason  # a short key for the stats' "bad" counts


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
