"""The append-only chat / tool-call token format: rendering and parsing in one place.

An episode's context is one token list that only grows:

  <|system|>{rules}<|end_turn|><|user|>{task}<|end_turn|><|assistant|>      (environment)
  <|think|>...<|/think|> text <|tool_call|>{"name": .., "arguments": {..}}<|/tool_call|>
  <|tool_call|>{...}<|/tool_call|><|end_turn|>                            (model)
  <|tool_result|>{"call": 0, "name": .., "status": "ok"}\n...output...<|/tool_result|>
  <|tool_result|>{"call": 1, ...}\n...<|/tool_result|><|assistant|>       (environment)
  final answer text<|end_turn|>                                           (model, no calls)

Several calls per turn are allowed (they run together). A message without tool calls is the
final message. An injected user message is `<|user|>...<|end_turn|><|assistant|>`; a summary
is `<|summary|>...<|/summary|>`. Environment text is escaped so that file contents or tool
output can never forge a special token.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from c2jax import special_tokens as st

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in sorted(st.ALL, key=len, reverse=True)))
_ZWSP = "\u200b"
ALLOWED_CALL_KEYS = frozenset({"name", "arguments", "id"})


def escape_env_text(text: str) -> str:
    """Breaks any special-token string inside environment text ("<|" -> "<\u200b|").

    Also replaces lone surrogates (e.g. from JSON "\\ud800" in a model's call) so the text
    always encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    if "<|" not in text:
        return text
    return _SPECIAL_RE.sub(lambda m: m.group(0)[0] + _ZWSP + m.group(0)[1:], text)


def escape_free(text: str) -> str:
    """Decoded context text with the environment escapes removed (for scripted policies)."""
    return text.replace("<" + _ZWSP + "|", "<|")


# ----- rendering (environment segments) ---------------------------------------------------
def render_system(text: str) -> str:
    return f"{st.SYSTEM}{escape_env_text(text)}{st.END_TURN}"


def render_user(text: str) -> str:
    return f"{st.USER}{escape_env_text(text)}{st.END_TURN}"


def assistant_prefix() -> str:
    return st.ASSISTANT


def render_tool_call(name: str, arguments: dict) -> str:
    """How a model (or a scripted policy) writes one call."""
    return f"{st.TOOL_CALL}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{st.END_TOOL_CALL}"


def render_assistant(content: str = "", calls: list[dict] | None = None, thinking: str | None = None) -> str:
    """A complete assistant message (as a scripted policy would emit it), ending in END_TURN."""
    out = f"{st.THINK}{thinking}{st.END_THINK}" if thinking else ""
    out += content
    for c in calls or []:
        out += render_tool_call(c["name"], c.get("arguments", {}))
    return out + st.END_TURN


def render_tool_result(index: int, name: str, ok: bool, output: str) -> str:
    head = json.dumps({"call": index, "name": name, "status": "ok" if ok else "error"})
    return f"{st.TOOL_RESULT}{head}\n{escape_env_text(output)}{st.END_TOOL_RESULT}"


def render_summary(text: str) -> str:
    return f"{st.SUMMARY}{escape_env_text(text)}{st.END_SUMMARY}"


# ----- parsing (model output) -------------------------------------------------------------
@dataclasses.dataclass
class ToolCall:
    index: int
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class CallError:
    index: int
    name: str          # best guess ("" when unknown)
    message: str
    raw: str


@dataclasses.dataclass
class ParsedMessage:
    content: str                       # visible text with thinking and calls removed
    thinking: str
    calls: list[ToolCall]
    errors: list[CallError]            # malformed calls, in call order with `calls`
    ended: bool                        # saw END_TURN or EOS
    summary: str | None = None

    @property
    def num_calls(self) -> int:
        return len(self.calls) + len(self.errors)

    @property
    def is_final(self) -> bool:
        return self.num_calls == 0


def parse_assistant(text: str, *, max_calls: int = 16, max_call_chars: int = 64_000) -> ParsedMessage:
    """Parses one assistant message. Never raises: malformed calls become CallErrors."""
    ended = False
    for stop in (st.END_TURN, st.EOS):
        i = text.find(stop)
        if i >= 0:
            text, ended = text[:i], True
    thinking_parts: list[str] = []
    summary = None
    # thinking blocks (an unterminated one swallows the rest of the message)
    out, pos = [], 0
    while True:
        i = text.find(st.THINK, pos)
        if i < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:i])
        j = text.find(st.END_THINK, i)
        if j < 0:
            thinking_parts.append(text[i + len(st.THINK):])
            break
        thinking_parts.append(text[i + len(st.THINK):j])
        pos = j + len(st.END_THINK)
    text = "".join(out)
    si = text.find(st.SUMMARY)
    if si >= 0:
        sj = text.find(st.END_SUMMARY, si)
        summary = text[si + len(st.SUMMARY):sj if sj >= 0 else len(text)]
        text = text[:si] + (text[sj + len(st.END_SUMMARY):] if sj >= 0 else "")
    calls: list[ToolCall] = []
    errors: list[CallError] = []
    content, pos, index = [], 0, 0
    while True:
        i = text.find(st.TOOL_CALL, pos)
        if i < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:i])
        start = i + len(st.TOOL_CALL)
        j = text.find(st.END_TOOL_CALL, start)
        k = text.find(st.TOOL_CALL, start)
        if j < 0 or (0 <= k < j):
            end = k if k >= 0 else len(text)
            raw = text[start:end]
            errors.append(CallError(index, _guess_name(raw), "unterminated tool call: missing "
                                    f"{st.END_TOOL_CALL}", raw[:200]))
            index += 1
            pos = end
            continue
        raw = text[start:j]
        pos = j + len(st.END_TOOL_CALL)
        if index >= max_calls:
            errors.append(CallError(index, _guess_name(raw), f"too many tool calls in one turn "
                                    f"(at most {max_calls}); this call was not run", raw[:200]))
        else:
            call_or_err = _parse_call(raw, index, max_call_chars)
            (calls if isinstance(call_or_err, ToolCall) else errors).append(call_or_err)
        index += 1
    for stray in (st.END_TOOL_CALL,):
        content = [c.replace(stray, "") for c in content]
    return ParsedMessage(content="".join(content).strip(), thinking="\n".join(thinking_parts).strip(),
                         calls=calls, errors=errors, ended=ended, summary=summary)


def _parse_call(raw: str, index: int, max_call_chars: int) -> ToolCall | CallError:
    if len(raw) > max_call_chars:
        return CallError(index, _guess_name(raw[:500]), f"tool call is {len(raw)} characters; the "
                         f"limit is {max_call_chars}", raw[:200])
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return CallError(index, _guess_name(raw), f"tool call is not valid JSON: {str(e)[:200]}", raw[:200])
    if not isinstance(obj, dict):
        return CallError(index, "", 'tool call must be a JSON object {"name": ..., "arguments": {...}}',
                         raw[:200])
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return CallError(index, "", 'tool call needs a string "name"', raw[:200])
    extra = set(obj) - ALLOWED_CALL_KEYS
    if extra:
        return CallError(index, name, f"unexpected keys in tool call: {sorted(extra)}; use "
                         '{"name": ..., "arguments": {...}}', raw[:200])
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return CallError(index, name, '"arguments" must be a JSON object', raw[:200])
    return ToolCall(index, name, args)


_NAME_RE = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


def _guess_name(raw: str) -> str:
    m = _NAME_RE.search(raw)
    return m.group(1) if m else ""


# ----- tokenizers ------------------------------------------------------------------------
class ByteTokenizer:
    """Lossless fallback: one id per special token, then one id per UTF-8 byte.

    Used for scripted policies so their Trajectories still carry tokens.
    """

    def __init__(self):
        self.special_to_id = {t: i for i, t in enumerate(st.ALL)}
        self.id_to_special = {i: t for t, i in self.special_to_id.items()}
        self.offset = len(st.ALL)
        self.vocab_size = self.offset + 256

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(b + self.offset for b in text[pos:m.start()].encode("utf-8", "replace"))
            ids.append(self.special_to_id[m.group(0)])
            pos = m.end()
        ids.extend(b + self.offset for b in text[pos:].encode("utf-8", "replace"))
        return ids

    def decode(self, ids) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i in self.id_to_special:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append(self.id_to_special[i])
            elif self.offset <= i < self.vocab_size:
                buf.append(i - self.offset)
            else:
                buf.extend("\ufffd".encode())
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)


class TokenCodec:
    """Adapts a tokenizer (HF `tokenizers`, transformers, or encode/decode lists) to
    encode(str) -> list[int] and decode(list[int]) -> str that keeps special tokens."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._stop_ids: set[int] | None = None
        self._special: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Special-token strings become the tokenizer's special ids (even for tokenizers that
        spell them out in raw text, like c2jax's); the text between them is encoded as is."""
        ids: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids += self._encode_raw(text[pos:m.start()]) + self._special_ids(m.group(0))
            pos = m.end()
        return ids + self._encode_raw(text[pos:])

    def _encode_raw(self, text: str) -> list[int]:
        if not text:
            return []
        try:
            r = self.tok.encode(text, add_special_tokens=False)
        except TypeError:
            r = self.tok.encode(text)
        ids = getattr(r, "ids", r)
        return [int(i) for i in ids]

    def _special_ids(self, token: str) -> list[int]:
        if token not in self._special:
            i = None
            for attr in ("token_id", "token_to_id"):  # c2jax Tokenizer, HF tokenizers.Tokenizer
                fn = getattr(self.tok, attr, None)
                if callable(fn):
                    try:
                        i = fn(token)
                    except (KeyError, ValueError):
                        i = None
                    if i is not None:
                        break
            self._special[token] = [int(i)] if i is not None else self._encode_raw(token)
        return self._special[token]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        try:
            return self.tok.decode(ids, skip_special_tokens=False)
        except TypeError:
            return self.tok.decode(ids)

    def single_id(self, token: str) -> int | None:
        ids = self.encode(token)
        return ids[0] if len(ids) == 1 else None

    def cut_at_stop(self, ids, limit: int) -> list[int]:
        """The first `limit` ids as ints, cut after the first stop id (kept)."""
        ids = [int(i) for i in ids][:limit]
        stop = self.stop_ids
        for k, i in enumerate(ids):
            if i in stop:
                return ids[:k + 1]
        return ids

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end a model turn (END_TURN, EOS) when they are single tokens."""
        if self._stop_ids is None:
            self._stop_ids = {i for i in (self.single_id(st.END_TURN), self.single_id(st.EOS)) if i is not None}
        return self._stop_ids


def as_codec(tokenizer: Any | None) -> TokenCodec:
    if isinstance(tokenizer, TokenCodec):
        return tokenizer
    return TokenCodec(tokenizer if tokenizer is not None else ByteTokenizer())
