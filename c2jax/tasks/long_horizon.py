"""Long-horizon synthetic tasks: more tool output than a small model's context holds.

A repository has `n_files` modules under settings/ (each ~`file_chars` characters of plausible
filler: constants, small functions, comments) and every module defines exactly one
`LEGACY_<NAME> = <int>` at a random line. The task: collect all of them into
`REGISTRY = {name: value}` in registry.py, as literals (registry.py must not use settings/).
The tool set is read_file / list_dir / edit_file / write_file (no grep, no shell), so the
agent must read every module, one tool output after another: with 8 modules of 900 chars
the tool output alone is ~8k byte-tokens, so a 2k-4k context has to be compacted, and the final
write needs values read long before (i.e. from before any summary).

Hidden test: REGISTRY equals the expected dict (exact types), `total()` works, and registry.py
does not mention settings. It first reports one outcome per constant (right value in REGISTRY, and
registry.py free of settings/), so a failing episode's verifier score is the fraction of constants
it got right (capped at 0.99 by Task.run_hidden_tests): partial credit RL can learn from.

The scripted agent for these tasks, `LongHorizonPolicy`, is c2jax.agent.long_horizon_policy.

Registered (c2jax.tasks) as suites "long_horizon" and "long_horizon_small" (5 modules x 200
chars: the tiny model's size), or use load() directly.
"""
from __future__ import annotations

import random

from c2jax.tasks.base import Task, plain_test_script, split_of, stable_hash

TOOLS = ["read_file", "list_dir", "edit_file", "write_file"]
# registry.py gathers its LEGACY_ lines with this one line (the scripted agent writes it verbatim)
REGISTRY_LINE = 'REGISTRY = {k: v for k, v in globals().items() if k.startswith("LEGACY_")}'
_MODULES = ("alpha", "beacon", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
            "kestrel", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
            "umber", "vortex", "willow", "xenon", "yarrow", "zephyr")
_CONST = ("TIMEOUT", "RETRIES", "PORT", "BATCH", "LIMIT", "WIDTH", "HEIGHT", "DEPTH", "RATE", "WINDOW",
          "BUFFER", "QUOTA", "SHARDS", "WORKERS", "BACKOFF", "TTL", "SLOTS", "LEVEL", "OFFSET", "SCALE")
_VERBS = ("scale", "shift", "clip", "pad", "wrap", "bump", "trim", "fold")
_NOUNS = ("value", "count", "size", "index", "total", "width", "score", "step")
_COMMENTS = ("kept for backwards compatibility", "tuned on the staging cluster", "do not change without a review",
             "see the operations handbook", "mirrors the old service defaults", "used by the nightly jobs",
             "units are seconds unless noted", "values below were measured in 2021")


def _filler_block(rng: random.Random, used: set[str]) -> str:
    kind = rng.random()
    if kind < 0.45:
        while True:
            name = f"{rng.choice(_CONST)}_{rng.randint(1, 99)}"
            if name not in used:
                used.add(name)
                return f"{name} = {rng.randint(0, 5000)}"
    if kind < 0.75:
        while True:
            fn = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
            if fn not in used:
                used.add(fn)
                op = rng.choice(["+", "-", "*"])
                return f"\ndef {fn}(x):\n    return x {op} {rng.randint(1, 9)}\n"
    return f"# {rng.choice(_COMMENTS)}"


def module_source(rng: random.Random, name: str, value: int, file_chars: int) -> str:
    """A settings module of ~file_chars characters of filler with one LEGACY_<NAME> = value line."""
    used: set[str] = set()
    blocks = [f'"""Settings for the {name} service."""']
    while sum(len(b) + 1 for b in blocks) < file_chars:
        blocks.append(_filler_block(rng, used))
    at = rng.randint(1, len(blocks))
    blocks.insert(at, f"LEGACY_{name.upper()} = {value}")
    return "\n".join(blocks) + "\n"


def _per_fact_report(facts: dict[str, int]) -> str:
    """Hidden-test lines that record one check per constant (the runner's partial credit)."""
    return ("try:\n"
            "    _src = open('registry.py').read()\n"
            "    import registry as _reg\n"
            "    _got = _reg.REGISTRY if 'settings' not in _src else None\n"
            "except BaseException:\n"
            "    _got = None\n"
            f"_facts = {facts!r}\n"
            "for _k, _v in _facts.items():\n"
            "    check(_k, isinstance(_got, dict) and _k in _got and _same(_got[_k], _v))\n")


REGISTRY_SRC = ('"""Legacy constants, collected in one place."""\n\nREGISTRY = {}\n\n\n'
                "def total():\n    return sum(REGISTRY.values())\n")


def generate_one(seed: int, index: int, n_files: int = 8, file_chars: int = 900) -> Task:
    rng = random.Random(stable_hash("long_horizon", seed, index, n_files, file_chars))
    names = sorted(rng.sample(_MODULES, n_files))
    facts = {f"LEGACY_{n.upper()}": rng.randint(10, 999) for n in names}
    files = {f"settings/{n}.py": module_source(rng, n, facts[f"LEGACY_{n.upper()}"], file_chars) for n in names}
    files["settings/__init__.py"] = ""
    files["registry.py"] = REGISTRY_SRC
    prompt = (f"Each of the {n_files} modules in settings/ defines one LEGACY_* constant. Put all of them in "
              "REGISTRY in registry.py as {name: value}, written as literals: settings/ is being deleted, so "
              "registry.py must not use it.")
    tests = (_per_fact_report(facts) + "from registry import REGISTRY, total\n"
             f"assert _same(REGISTRY, {facts!r}), 'REGISTRY is wrong: ' + repr(REGISTRY)\n"
             f"assert total() == {sum(facts.values())}\n"
             "assert 'settings' not in open('registry.py').read(), 'registry.py must not use settings/'\n")
    fp = repr((prompt, sorted(files.items())))
    ref = [{"name": "edit_file", "arguments": {"path": "registry.py", "old": "REGISTRY = {}",
                                                "new": f"REGISTRY = {facts!r}"}}]
    return Task(task_id=f"long_horizon-{stable_hash(fp):015x}", suite="long_horizon", split=split_of(fp),
                prompt=prompt, files=files, hidden_tests={".c2jax_hidden/test_registry.py": plain_test_script(tests)},
                test_command=None, reference_solution=ref, tools=list(TOOLS),
                metadata={"facts": facts, "modules": [f"settings/{n}.py" for n in names],
                          "tool_output_chars": sum(len(files[f"settings/{n}.py"]) for n in names),
                          "n_files": n_files, "file_chars": file_chars},
                reference_message="REGISTRY now holds every LEGACY constant.", timeout_s=20.0)


def load(split: str, n: int | None = None, seed: int = 0, n_files: int = 8, file_chars: int = 900) -> list[Task]:
    """`n` (default 20) distinct tasks of `split`, deterministic in the arguments; load(n=5) is
    a prefix of load(n=10)."""
    n = 20 if n is None else n
    out, seen, index = [], set(), 0
    while len(out) < n:
        if index > 50 * n + 1000:
            raise RuntimeError(f"long_horizon could not find {n} distinct {split} tasks")
        t = generate_one(seed, index, int(n_files), int(file_chars))
        index += 1
        if t.split == split and t.task_id not in seen:
            seen.add(t.task_id)
            out.append(t)
    return out


SMALL = {"n_files": 5, "file_chars": 200}  # "long_horizon_small": ~1.9k BPE tokens in full (tiny model)
