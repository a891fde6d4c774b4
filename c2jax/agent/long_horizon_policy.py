"""`LongHorizonPolicy`: a deterministic scripted agent for the long_horizon tasks
(c2jax.tasks.long_horizon) that decides *only from its current context* (so what a summary keeps is what it knows): list settings/,
read the modules one per turn in listing order (each turn's think is two lines of the listing,
the module read last and the one after it: `after:\nbeacon.py\ncobalt.py`; `first:\nalpha.py`),
write registry.py from the LEGACY values it can see, answer.
Asked for a self-summary (the SUMMARIZE_QUERY), it writes read up to (the last module read) / found
(the LEGACY source lines verbatim, in reading order) / one TODO line, and after the restart lists
settings/ again to read on after that module; given a prompt-based compaction request, it acts as a generic query-focused extractive
compactor (keeps the task, the previous summary, every call, each tool output's header and the
output lines that name an identifier of the task prompt; lines deduplicated).
"""
from __future__ import annotations

import json
import os
import re

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import policy_protocol as pp
from c2jax.agent.chat_format import escape_free
from c2jax.agent.policy_protocol import TextPolicy
from c2jax.tasks.long_horizon import REGISTRY_LINE

_FACT_RE = re.compile(r"\b(LEGACY_[A-Z0-9_]+) ?= ?(-?\d+)")
_SPECIAL_RE = re.compile(r"<\|/?[a-z_]+\|>")
_READ_HEAD_RE = re.compile(r"^(settings/[A-Za-z0-9_]+\.py) \((?:lines \d+-\d+ of \d+|empty)\)", re.M)
# a summary's "read up to:" line (the last module read), matched on the text with special tokens
# turned into line breaks
_CURSOR_RE = re.compile(r"^read up to:\n([A-Za-z0-9_]+\.py)$", re.M)


def _tool_blocks(text: str):
    """(header json, body) of every tool result in decoded context text."""
    out = []
    for m in re.finditer(re.escape(st.TOOL_RESULT) + r"(.*?)" + re.escape(st.END_TOOL_RESULT), text, re.S):
        head, _, body = m.group(1).partition("\n")
        try:
            h = json.loads(head)
        except ValueError:
            h = {}
        out.append((h, body))
    return out


class LongHorizonPolicy:
    """Scripted agent for long_horizon tasks; knows only what its current context shows.

    Use through `make_long_horizon_policy(task)` (a TextPolicy); see the module docstring.
    """

    def __init__(self, task):
        self.task = task

    # -- what the context shows
    def knowledge(self, text: str) -> dict:
        text = escape_free(text)
        files: set[str] = set()
        read: set[str] = set()
        written = False
        for h, body in _tool_blocks(text):
            if h.get("name") == "list_dir" and h.get("status") == "ok":
                files |= {f"settings/{ln.strip()}" for ln in body.splitlines()
                          if ln.strip().endswith(".py") and ln.strip() != "__init__.py"}
            if h.get("name") == "read_file" and h.get("status") == "ok":
                read |= set(_READ_HEAD_RE.findall(body))
            if h.get("name") in ("write_file", "edit_file") and h.get("status") == "ok" and "registry.py" in body:
                written = True
        for line in re.split(r"\n|" + _SPECIAL_RE.pattern, text):   # summary / carried-state lines
            s = line.strip().lstrip("-* ").strip()
            if s.startswith("list_dir (ok):"):
                files |= {f"settings/{n.strip()}" for n in s[len("list_dir (ok):"):].split("|")
                          if n.strip().endswith(".py") and n.strip() != "__init__.py"}
            elif s.startswith("called read_file"):
                read |= set(re.findall(r"settings/[A-Za-z0-9_]+\.py", s))
            elif s.startswith("status: registry.py written") or "(ok): wrote registry.py" in s:
                written = True
        plain = _SPECIAL_RE.sub("\n", text)
        cursors = _CURSOR_RE.findall(plain)   # a summary's "read up to:" (modules are read in listing order)
        if cursors:
            read |= {f for f in files if f <= f"settings/{cursors[-1]}"}
        facts = dict(_FACT_RE.findall(text))   # in the order the context shows them
        return {"files": sorted(files), "read": sorted(read & files) if files else sorted(read),
                "facts": {k: int(v) for k, v in facts.items()}, "written": written,
                "cursor": cursors[-1] if cursors else None}

    @staticmethod
    def last_read(k: dict) -> str | None:
        """The module read last (they are read in listing order), as the listing spells it; before
        the listing is back in view after a restart, the summary's read up to: name."""
        return os.path.basename(k["read"][-1]) if k["read"] else k.get("cursor")

    @staticmethod
    def plan(k: dict) -> list[str]:
        """What is left to do, as file names spelled as the listing spells them (the same BPE
        tokens): the unread modules in listing order, then registry.py; [] once it is written."""
        if k["written"] or not k["files"]:
            return []
        return [os.path.basename(f) for f in k["files"] if f not in k["read"]] + ["registry.py"]

    # -- the three kinds of requests
    def next_message(self, context, codec) -> str:
        text = codec.decode(context)
        if text.startswith(cf.render_system(pp.COMPACTION_SYSTEM)):
            return self.compaction(text)
        if text.endswith(cf.render_user(pp.SUMMARIZE_QUERY) + cf.assistant_prefix()):
            return self.self_summary(text[:-len(cf.render_user(pp.SUMMARIZE_QUERY) + cf.assistant_prefix())])
        k = self.knowledge(text)
        if k["written"]:
            return cf.render_assistant(self.task.reference_message or "Done.")
        if not k["files"]:
            return cf.render_assistant(calls=[{"name": "list_dir", "arguments": {"path": "settings"}}])
        # The think is two lines of the listing: the module read last, then the one after it
        # (this turn's file), spelled as the listing spells them; so the choice is a copy of the
        # line that follows the last-read name in the listing (or in a summary's files: list).
        plan = self.plan(k)
        if len(plan) > 1:
            last = self.last_read(k)
            think = (f"after:\n{last}\n" if last else "first:\n") + plan[0]
            return cf.render_assistant(calls=[{"name": "read_file", "arguments": {"path": f"settings/{plan[0]}"}}],
                                       thinking=think)
        # Every module read (the last one read ends the listing): no think. The constants' lines as the modules
        # spell them (a copy of tokens the model has seen), then one fixed line that gathers them:
        # literals in registry.py, nothing from settings/, and a write_file call that grows by one
        # short line per constant (a dict by name, or a think here, outgrew the tiny setting's 256
        # new tokens).
        content = ('"""Legacy constants, collected in one place."""\n\n'
                   + "".join(f"{n} = {v}\n" for n, v in k["facts"].items())
                   + "\n" + REGISTRY_LINE + "\n\n\ndef total():\n    return sum(REGISTRY.values())\n")
        return cf.render_assistant(calls=[{"name": "write_file", "arguments": {"path": "registry.py",
                                                                                "content": content}}])

    def self_summary(self, text: str) -> str:
        k = self.knowledge(text)
        plan, last = self.plan(k), self.last_read(k)
        # No copy of the listing: after the restart the agent lists settings/ again (one short call)
        # and reads on from the line after `read up to:`; found: keeps the source lines in the
        # order they were read, so it is the previous summary's block plus the new lines.
        lines = ["read up to:", last] if last else []
        lines += ["found:", *(f"{n} = {v}" for n, v in k["facts"].items())]
        if k["written"]:
            lines.append("status: registry.py written")
        elif len(plan) > 1 or not k["files"]:
            lines.append("TODO: list settings/, read the modules after it, write registry.py")
        else:
            lines.append("TODO: write registry.py")
        think = "Keep what I read up to and the LEGACY values."
        return f"{st.THINK}{think}{st.END_THINK}{st.SUMMARY}" + "\n".join(lines) + f"{st.END_SUMMARY}{st.END_TURN}"

    def compaction(self, text: str) -> str:
        """Generic query-focused extractive compaction of the transcript in the user message:
        the task, the previous summary's lines, every call, and per tool output its header plus
        the lines naming an identifier of the task prompt (LEGACY_*, REGISTRY); directory
        listings whole. Lines are deduplicated."""
        text = escape_free(text.split("TRANSCRIPT:\n", 1)[-1])
        idents = re.findall(r"[A-Za-z]+(?:_[A-Za-z*]+)+|\b[A-Z]{4,}\b", self.task.prompt)
        keywords = {w.lower().rstrip("*") for w in idents}
        out = [f"Task: {self.task.prompt}"]
        prev = [p for p in re.findall(re.escape(st.SUMMARY) + r"(.*?)" + re.escape(st.END_SUMMARY), text, re.S)
                if p.strip()]
        if prev:
            out += [ln for ln in prev[-1].strip().splitlines() if ln.strip()]
        for m in re.finditer(re.escape(st.TOOL_CALL) + r"(.*?)" + re.escape(st.END_TOOL_CALL), text, re.S):
            try:
                c = json.loads(m.group(1))
                args = ", ".join(f"{a}={v}" for a, v in c.get("arguments", {}).items() if a != "content")
                out.append(f"called {c.get('name')} {args}")
            except ValueError:
                continue
        for h, body in _tool_blocks(text):
            lines = body.splitlines()
            keep = [lines[0]] if lines else []
            keep += [ln.strip() for ln in lines[1:] if any(kw in ln.lower() for kw in keywords)]
            if h.get("name") == "list_dir":
                keep = lines
            out.append(f"{h.get('name')} ({h.get('status')}): " + " | ".join(keep))
        seen, uniq = set(), []
        for ln in out:
            if ln not in seen:
                seen.add(ln)
                uniq.append(ln)
        return f"{st.SUMMARY}" + "\n".join(uniq) + f"{st.END_SUMMARY}{st.END_TURN}"


def make_long_horizon_policy(task, **kw):
    """LongHorizonPolicy as a c2jax.agent TextPolicy."""

    class _P(LongHorizonPolicy, TextPolicy):
        def __init__(self):
            LongHorizonPolicy.__init__(self, task, **kw)

    return _P()
