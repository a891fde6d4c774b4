"""The repository's files speak of the project only.

Walks the tree (file names everywhere, the contents of every text file) and fails on words
about how the project was made rather than what it is: numbered rounds of work, borrowed
machines, ticket numbers, requests from people, other jobs on the machine, and round suffixes in
file names (`bench_s12.json`). Results are described by their date, host and command instead.
The patterns spell the words with character classes, so this file does not match itself.
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
    (r"\bs[e]ssions?\b|\bs[e]ssion's\b", "a round of work"),
    (r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
     r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
     r"\d+(?:st|nd|rd|th))\s+(?:s[e]ssion|sitting|iteration of work|work round)\b", "an ordinal round of work"),
    (r"\bl[e]as(?:e|ed|es|ing)\b|\bb[o]rrowed\s+(?:gpu|tpu|machine|device|host)", "a borrowed machine"),
    (r"\bi[s]sues?\s*#?\d+|\bpull request\b|\bPR\s*#?\d+|(?<![\w&#/])#\d{1,4}\b(?![\w-])",
     "a ticket or pull-request number"),
    (r"\bother\s+(?:agents?|jobs?|engineers?|helpers?)\b|\bagents? shared\b",
     "other jobs or agents on the machine"),
    (r"\bother i[s]sues\b|\bthe (?:l[e]ad|br[i]ef)\b", "the people or tickets behind the work"),
    (r"\d\s+a[s]ked\b|\bas a[s]ked\b|\ba[s]ked (?:for )?(?:by|in) (?:the )?(?:i[s]sue|br[i]ef|l[e]ad|review)|"
     r"\b(?:i[s]sue|br[i]ef|l[e]ad|reviewer)s?\s+a[s]ked\b", "a request from someone"),
    (r"/tmp/s\d{1,2}/", "a scratch directory named for a round of work"),
]

# Legitimate uses of the words above: (pattern of the whole match's line, why it is fine).
ALLOW = [
    r"--new-session",                 # bubblewrap's flag (setsid for the sandboxed process)
    r"pytest_sessionstart\(session\)",  # pytest's hook and its argument
    r"scope=\"session\"",            # pytest fixture scope
    r"session-wide",                  # the same fixture's docstring
]

# File names: a round suffix such as `_s12` or `-s3.`, or a round or ticket word with a number.
NAME_PATTERN = re.compile(r"(?:^|[_\-.])(?:s\d{1,2}|s[e]ssion\d*|i[s]sue\d*|round\d+)(?=[_\-.]|$)", re.I)

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
    # the phrases are assembled here so that this file itself stays clean
    w = {"S": "se" + "ssion", "L": "le" + "ase", "I": "is" + "sue", "A": "as" + "ked"}
    caught = [t.format(**w) for t in (
        "Thirteenth {S} (2026-12-02)", "in this {S}", "the {S}'s device {L}", "a borrowed GPU {L}",
        "history ({I} 3)", "not part of {I} 10's findings", "see #12", "other ag" + "ents shared the machine",
        "shared with ~6 other jo" + "bs", "+0.05 {A}", "Other {I}s add suites", "(the le" + "ad merges this)",
        "--out /tmp/s18/table3.md")]
    for text in caught:
        assert find_development_words(text), text
    fine = ['bw = [self.bwrap, "--new-' + w["S"] + '"]', '@pytest.fixture(scope="' + w["S"] + '")', "release the cache",
            'colors = {"self": "#1f77b4", "full": "#777777"}', "# 1. the first step", "the first round ran 2.5 s",
            "the model is " + w["A"] + " to summarize", "dropless dispatch " + w["A"] + ": einsum", "please"]
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
