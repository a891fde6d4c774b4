"""The repository's files speak of the project only.

Walks the tree (file names everywhere, the contents of every text file) and fails on words
about how the project was developed rather than what it is: rounds of work ("ninth session"),
machine leases, issue and pull-request numbers, requests ("+0.05 asked"), other jobs on the
machine, and round suffixes in file names (`bench_s12.json`). Results are described by their
date, host and command instead.
"""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)

# Directories that are not the repository's own files: VCS data, environments, caches, run outputs.
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "runs", "build", "node_modules"}


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(".venv") or name.endswith(".egg-info")


# Content patterns, case-insensitive. Each is (pattern, what it catches).
CONTENT_PATTERNS = [
    (r"\bsessions?\b|\bsession's\b", "a round of work ('ninth session', 'this session')"),
    (r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
     r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
     r"\d+(?:st|nd|rd|th))\s+(?:session|sitting|iteration of work|work round)\b", "an ordinal round of work"),
    (r"\bleas(?:e|ed|es|ing)\b|\bborrowed\s+(?:gpu|tpu|machine|device|host)", "a machine lease"),
    (r"\bissues?\s*#?\d+|\bpull request\b|\bPR\s*#?\d+|(?<![\w&#/])#\d{1,4}\b(?![\w-])",
     "an issue or pull-request number"),
    (r"\bother\s+(?:agents?|jobs?|engineers?|helpers?)\b|\bagents? shared\b",
     "other jobs or agents on the machine"),
    (r"\bother issues\b|\bthe (?:lead|brief)\b", "the people or tickets behind the work"),
    (r"\d\s+asked\b|\bas asked\b|\basked (?:for )?(?:by|in) (?:the )?(?:issue|brief|lead|review)|"
     r"\b(?:issue|brief|lead|reviewer)s?\s+asked\b", "'asked' as someone's request"),
    (r"/tmp/s\d{1,2}/", "a scratch directory named for a round of work"),
]

# Legitimate uses of the words above: (pattern of the whole match's line, why it is fine).
ALLOW = [
    r"--new-session",                 # bubblewrap's flag (setsid for the sandboxed process)
    r"pytest_sessionstart\(session\)",  # pytest's hook and its argument
    r"scope=\"session\"",            # pytest fixture scope
    r"session-wide",                  # the same fixture's docstring
]

# File names: a round suffix such as `_s12`, `-s3.` or `_session`, `_issue4`.
NAME_PATTERN = re.compile(r"(?:^|[_\-.])(?:s\d{1,2}|session\d*|issue\d*|round\d+)(?=[_\-.]|$)", re.I)

_content_res = [(re.compile(p, re.I), why) for p, why in CONTENT_PATTERNS]
_allow_res = [re.compile(p) for p in ALLOW]


def _files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def _text(path: str):
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_development_words(text: str):
    """[(line number, matched text, what it is)] for every development word in `text`."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        cleaned = line
        for allow in _allow_res:
            cleaned = allow.sub(" ", cleaned)
        for rx, why in _content_res:
            for m in rx.finditer(cleaned):
                hits.append((lineno, m.group(0), why))
    return hits


def test_patterns_catch_development_words():
    caught = ["Thirteenth session (2026-12-02)", "in this session", "the session's device lease",
              "a borrowed GPU lease", "history (issue 3)", "not part of issue 10's findings", "see #12",
              "other agents shared the machine", "shared with ~6 other jobs", "+0.05 asked",
              "Other issues add suites", "(the lead merges this)",
              "--out /tmp/s18/table3.md"]
    for text in caught:
        assert find_development_words(text), text
    fine = ['bw = [self.bwrap, "--new-session"]', '@pytest.fixture(scope="session")', "release the cache",
            'colors = {"self": "#1f77b4", "full": "#777777"}', "# 1. the first step", "the first round ran 2.5 s",
            "the model is asked to summarize", "dropless dispatch asked: einsum", "please"]
    for text in fine:
        assert not find_development_words(text), text
    assert NAME_PATTERN.search("bench_cpu_2dev_s12.json") and NAME_PATTERN.search("table_s11_run1.md")
    assert not NAME_PATTERN.search("tiny_v5p_8.py") and not NAME_PATTERN.search("bench_amd_avx2_2026-12-03.json")


def test_file_names_have_no_round_suffixes():
    bad = [os.path.relpath(p, ROOT) for p in _files() if NAME_PATTERN.search(os.path.basename(p))]
    assert not bad, "file names with round suffixes (name them for what they hold):\n" + "\n".join(bad)


def test_files_have_no_development_words():
    bad = []
    for path in _files():
        if os.path.abspath(path) == THIS:
            continue
        text = _text(path)
        if text is None:
            continue
        rel = os.path.relpath(path, ROOT)
        bad += [f"{rel}:{lineno}: {word!r} ({why})" for lineno, word, why in find_development_words(text)]
    if bad:
        pytest.fail("development words in the repository's files (describe the project, its dates, "
                    "hosts and commands instead):\n" + "\n".join(bad[:200]))
