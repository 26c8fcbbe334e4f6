"""Assistant spans of a chat rendered with the model's own template, found by rendering prefixes.

The document is R = apply_chat_template(messages, tokenize=False) (what HF's
apply_chat_template(tokenize=True) tokenizes). For assistant message i:

  P  = render(messages[:i])                          history before the turn (must be a prefix of R)
  G  = render(messages[:i], add_generation_prompt)[len(P):]   the generation prompt (header)
  X  = the turn as R renders it:
         last message:   R[len(P):]
         otherwise:      render(messages[:i+1])[len(P):] when R continues with it (most templates);
                         else (the turn renders differently when more messages follow)
                         A = render(messages[:i+2]), B = render(messages[:i] + [messages[i+1]]),
                         X = A[len(P) : len(A) - (len(B) - len(P))]   (the turn between P and the
                         next message; R must continue with X)
  trained characters = X[h : len(X.rstrip())] where h = len(G) when X starts with G, else the length
  of the header the template writes before a reply in that position: the common prefix of the turn
  rendered with two replies that differ in their first character (Qwen3-style templates render
  history turns without the empty <think> block that their generation prompt carries).

The trained span is what the model produces after its generation prompt: the reply and its
end-of-turn token; trailing whitespace after that token is not trained. Tokens are mapped to
spans by their character offsets (a token is trained when it starts inside a span).
"""

import json
import os
import re

from .formats import BadRecord

THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.S)


class TemplateError(BadRecord):
    pass


class TemplateConfigError(Exception):
    """The chat template itself is broken (not a string, a Jinja syntax error): a config error of the
    model folder, not of the record being rendered (exit 2)."""


def template_file(model_dir):
    """The file the chat template comes from: chat_template.jinja when the folder has one (HF's newer
    layout, which wins over the config's key), else tokenizer_config.json."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    return jinja if os.path.isfile(jinja) else os.path.join(model_dir, "tokenizer_config.json")


def check_template_config(model_dir):
    """Before HF loads the folder: tokenizer_config.json must be a JSON object whose chat_template,
    when present, is a string or a list of {"name", "template"} strings. TemplateConfigError naming
    the file otherwise."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TemplateConfigError(f"{path}: not UTF-8 text at byte {e.start}")
    except (ValueError, RecursionError) as e:
        raise TemplateConfigError(f"{path}: not valid JSON ({str(e)[:200]})")
    if not isinstance(cfg, dict):
        raise TemplateConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    t = cfg.get("chat_template")
    named = isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                        and isinstance(x.get("template"), str) for x in t)
    if t is not None and not isinstance(t, str) and not named:
        raise TemplateConfigError(f"{path}: chat_template must be a string (a Jinja template) or a list of "
                                  f"{{\"name\", \"template\"}} objects, got {type(t).__name__}")


def compile_template(text, source):
    """Compiles the template as HF does; TemplateConfigError naming `source` on a syntax error."""
    if text is None:
        return
    if not isinstance(text, str):
        raise TemplateConfigError(f"{source}: the chat template is a {type(text).__name__}, not a string")
    if not text.strip():
        raise TemplateConfigError(f"{source}: the chat template is empty")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the first render reports it
        return
    try:
        _compile_jinja_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and what a broken template raises
        raise TemplateConfigError(_syntax_message(e, source))


def _syntax_message(e, source):
    line = getattr(e, "lineno", None)
    msg = getattr(e, "message", None) or str(e)
    return f"{source}: chat template syntax error{f' at line {line}' if line else ''}: {msg}"


def _is_syntax_error(e):
    try:
        import jinja2
    except ImportError:
        return False
    return isinstance(e, jinja2.exceptions.TemplateSyntaxError)


class Renderer:
    """apply_chat_template(tokenize=False) with the run's template and switches. The span search renders
    the same prefixes several times per conversation; renderings are memoised until clear()."""

    def __init__(self, tokenizer, template, thinking, source="the chat template"):
        self.tok = tokenizer
        self.source = source  # the file the template came from, for config errors
        self.template = template
        # Qwen3-style templates read `enable_thinking`; "keep" passes nothing (the template's default).
        self.kwargs = {} if thinking == "keep" else {"enable_thinking": thinking == "on"}
        self.thinking = thinking
        self.cache = {}

    def clear(self):
        self.cache.clear()

    def render(self, messages, generation_prompt=False):
        key = (json.dumps(messages, sort_keys=True, ensure_ascii=False), generation_prompt)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                chat_template=self.template, **self.kwargs)
        except RecursionError:
            raise TemplateError("chat template render failed: the record is nested too deeply", "template_error")
        except Exception as e:  # jinja2 errors, raise_exception() in templates, type errors
            if _is_syntax_error(e):  # the template's fault, whatever the record (exit 2)
                raise TemplateConfigError(_syntax_message(e, self.source)) from e
            raise TemplateError(f"chat template render failed: {type(e).__name__}: {e}", "template_error") from e
        self.cache[key] = text
        return text


def _common_prefix_len(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _split_turn(r, messages, i, full):
    """(offset of assistant message i in `full` = render(messages), the turn's text X there)."""
    prefix = r.render(messages[:i])
    if not full.startswith(prefix):
        raise TemplateError(f"messages[{i}]: the template renders the history before this turn differently "
                            "from the whole conversation", "template_inconsistent")
    if i == len(messages) - 1:
        return len(prefix), full[len(prefix):]
    through = r.render(messages[:i + 1])
    if through.startswith(prefix) and full.startswith(through):
        return len(prefix), through[len(prefix):]
    # The template renders the turn differently when more messages follow (Qwen3 drops the <think>
    # block of earlier turns): cut it from the rendering with the next message, which without the
    # turn renders as `tail` after the same history.
    a = r.render(messages[:i + 2])
    b = r.render(messages[:i] + [messages[i + 1]])
    tail = b[len(prefix):]
    if not (b.startswith(prefix) and a.startswith(prefix) and a.endswith(tail) and len(a) - len(tail) >= len(prefix)):
        raise TemplateError(f"messages[{i}]: cannot separate this turn from the next one in the rendering",
                            "template_inconsistent")
    turn = a[len(prefix):len(a) - len(tail)]
    if not full.startswith(turn, len(prefix)):
        raise TemplateError(f"messages[{i}]: the template renders this turn differently in the whole conversation",
                            "template_inconsistent")
    return len(prefix), turn


# Two replies that differ in their first character: the common prefix of their renderings is the
# turn's header as the template writes it in this position (private-use code points, no template
# treats them specially).
_PROBES = ("\ue000", "\ue001")


def _reply_start(r, messages, i, turn):
    """Where the reply starts in `turn`: after the generation prompt when the turn starts with it, else
    (a history turn rendered without the prompt's extras, e.g. Qwen3's empty <think> block) after the
    header the template writes for a reply in this position."""
    with_prompt = r.render(messages[:i], generation_prompt=True)
    prefix = r.render(messages[:i])
    if not with_prompt.startswith(prefix):
        raise TemplateError(f"messages[{i}]: the generation prompt does not extend the rendered history",
                            "template_inconsistent")
    gen = with_prompt[len(prefix):]
    if turn.startswith(gen):
        return len(gen)
    probes = []
    for text in _PROBES:
        probe = messages[:i] + [{"role": "assistant", "content": text}] + messages[i + 1:i + 2]
        probes.append(_split_turn(r, probe, i, r.render(probe))[1])
    header = probes[0][:_common_prefix_len(*probes)]
    if not turn.startswith(header):
        raise TemplateError(f"messages[{i}]: cannot find where the reply starts in the rendered turn",
                            "template_inconsistent")
    return len(header)


def check_thinking(thinking, turn, trained, i):
    """--thinking on|off: the rendered turn must match the mode (Qwen3-style <think> blocks). With
    `trained` None only the part that needs no span is checked (off: no reasoning in the turn)."""
    if thinking == "off":
        for m in THINK_BLOCK.finditer(turn):
            if m.group(1).strip():
                raise BadRecord(f"messages[{i}]: a non-empty <think> block under --thinking off", "thinking_mismatch")
        if trained is not None and "<think>" in trained:
            raise BadRecord(f"messages[{i}]: the trained reply holds a <think> block under --thinking off "
                            "(the template did not put the empty block into the prompt)", "thinking_mismatch")
    elif thinking == "on" and trained is not None:
        m = THINK_BLOCK.match(trained.lstrip())
        if m is None:
            raise BadRecord(f"messages[{i}]: the reply is rendered without a <think>...</think> block under "
                            "--thinking on (Qwen3-style templates drop reasoning from turns before the last user "
                            "message: use --last-turn-only)", "thinking_mismatch")
        if not m.group(1).strip():
            raise BadRecord(f"messages[{i}]: an empty <think> block under --thinking on (a reply without "
                            "reasoning)", "thinking_mismatch")


def assistant_spans(r, messages, full, last_turn_only):
    """Character spans [start, end) of the trained assistant turns in `full`."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not idx:
        return []
    if idx[0] == 0:
        raise BadRecord("messages[0]: the conversation starts with an assistant turn (no prompt)",
                        "assistant_first")
    if last_turn_only:
        idx = idx[-1:]
    spans = []
    for i in idx:
        off, turn = _split_turn(r, messages, i, full)
        check_thinking(r.thinking, turn, None, i)
        start = _reply_start(r, messages, i, turn)
        end = len(turn.rstrip())
        if end <= start:
            raise TemplateError(f"messages[{i}]: the rendered reply is empty", "empty_turn")
        check_thinking(r.thinking, turn, turn[start:end], i)
        spans.append((off + start, off + end))
    return spans


def mask_from_offsets(offsets, spans):
    """1 for tokens whose first character lies inside a span."""
    mask = [0] * len(offsets)
    k = 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
            mask[t] = 1
    return mask


def template_text(tokenizer):
    """The chat template HF's apply_chat_template uses for this tokenizer (from tokenizer_config.json or
    chat_template.jinja, as loaded by from_pretrained); a dict of named templates -> "default"."""
    t = tokenizer.chat_template
    if isinstance(t, dict):
        t = t.get("default")
    return t
