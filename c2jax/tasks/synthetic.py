"""Synthetic bug-fix repositories generated from a seed, in three difficulty levels.

Level 1: one tiny file (a function or two of 1-3 lines); a one-token bug (`-` for `+`, `<` for
         `>`, `[0]` for `[-1]` ...) in the function the prompt names, in the file it names.
Level 2: a 2-4 module package; the prompt names a function in one module, the bug sits in a
         helper it calls from another module.
Level 3: two bugs in two helper modules, or one bug plus a missing helper function that must
         be written (the calling module fails to import until it exists).

Everything comes from `FN_TEMPLATES`: small functions with a correct token and wrong
alternatives. Expected outputs are computed by running our own (trusted) correct template,
and every chosen input set is checked to tell the buggy version from the fixed one.
Hidden tests are plain-python assert scripts (no pytest needed in the sandbox).
"""
from __future__ import annotations

import dataclasses
import random
import string as _string

from c2jax.tasks.base import (
    Task,
    minimal_edit,
    plain_test_script,
    split_of,
    stable_hash,
)


@dataclasses.dataclass(frozen=True)
class FnTemplate:
    key: str
    names: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]
    body: str          # indented body; {p0}.. parameter names, {OP} the mutable token
    good: str
    bads: tuple[str, ...]
    inputs: str        # input generator name, see _gen_inputs
    mutation: str      # kind of planted bug


def _t(key, names, params, body, good, bads, inputs, mutation):
    return FnTemplate(key, tuple(names), tuple(tuple(p) for p in params), body, good, tuple(bads),
                      inputs, mutation)


_P2 = (("a", "b"), ("x", "y"), ("m", "n"), ("left", "right"))
_P1 = (("x",), ("n",), ("value",), ("v",))
FN_TEMPLATES: tuple[FnTemplate, ...] = (
    _t("add", ["add", "plus", "add_numbers"], _P2, "    return {p0} {OP} {p1}\n", "+", ["-", "*"], "int2", "operator_swap"),
    _t("sub", ["subtract", "minus", "difference"], _P2, "    return {p0} {OP} {p1}\n", "-", ["+"], "int2", "operator_swap"),
    _t("mul", ["multiply", "times", "product"], _P2, "    return {p0} {OP} {p1}\n", "*", ["+", "-"], "int2", "operator_swap"),
    _t("maxof", ["max_of", "larger", "biggest"], _P2, "    return {p0} if {p0} {OP} {p1} else {p1}\n", ">", ["<"], "int2", "comparison_flip"),
    _t("minof", ["min_of", "smaller", "lowest"], _P2, "    return {p0} if {p0} {OP} {p1} else {p1}\n", "<", [">"], "int2", "comparison_flip"),
    _t("absdiff", ["abs_diff", "distance", "gap"], _P2, "    return abs({p0} {OP} {p1})\n", "-", ["+"], "int2", "operator_swap"),
    _t("area", ["area", "rect_area", "surface"], (("w", "h"), ("width", "height")), "    return {p0} {OP} {p1}\n", "*", ["+"], "pos2", "operator_swap"),
    _t("perim", ["perimeter", "rect_perimeter", "border"], (("w", "h"), ("width", "height")), "    return 2 * ({p0} {OP} {p1})\n", "+", ["*", "-"], "pos2", "operator_swap"),
    _t("power", ["power", "pow_of", "raise_to"], (("base", "exp"), ("b", "e")), "    return {p0} {OP} {p1}\n", "**", ["*"], "small2", "operator_swap"),
    _t("even", ["is_even", "even", "divisible_by_two"], _P1, "    return {p0} % 2 {OP} 0\n", "==", ["!="], "int1", "comparison_flip"),
    _t("odd", ["is_odd", "odd"], _P1, "    return {p0} % 2 {OP} 1\n", "==", ["!="], "int1", "comparison_flip"),
    _t("pos", ["is_positive", "positive", "above_zero"], _P1, "    return {p0} {OP} 0\n", ">", ["<", ">="], "int1", "comparison_flip"),
    _t("neg", ["is_negative", "negative", "below_zero"], _P1, "    return {p0} {OP} 0\n", "<", [">", "<="], "int1", "comparison_flip"),
    _t("square", ["square", "squared"], _P1, "    return {p0} {OP} {p0}\n", "*", ["+", "-"], "int1", "operator_swap"),
    _t("inc", ["increment", "inc", "next_number"], _P1, "    return {p0} {OP} 1\n", "+", ["-"], "int1", "operator_swap"),
    _t("dec", ["decrement", "dec", "previous_number"], _P1, "    return {p0} {OP} 1\n", "-", ["+"], "int1", "operator_swap"),
    _t("double", ["double", "twice"], _P1, "    return {p0} {OP} 2\n", "*", ["+", "-"], "int1", "operator_swap"),
    _t("halve", ["halve", "half"], _P1, "    return {p0} {OP} 2\n", "/", ["*", "-"], "int1", "operator_swap"),
    _t("negate", ["negate", "flip_sign"], _P1, "    return {OP}{p0}\n", "-", ["+"], "int1", "operator_swap"),
    _t("ctof", ["c_to_f", "celsius_to_fahrenheit"], (("c",), ("celsius",)), "    return {p0} * 9 / 5 {OP} 32\n", "+", ["-"], "int1", "operator_swap"),
    _t("last", ["last", "last_item", "tail_value"], (("xs",), ("items",), ("values",)), "    return {p0}[{OP}]\n", "-1", ["0", "1"], "list", "off_by_one"),
    _t("first", ["first", "first_item", "head"], (("xs",), ("items",), ("values",)), "    return {p0}[{OP}]\n", "0", ["-1", "1"], "list", "off_by_one"),
    _t("total", ["total", "sum_all", "add_up"], (("xs",), ("items",), ("values",)),
       "    result = 0\n    for item in {p0}:\n        result {OP}= item\n    return result\n", "+", ["-", "*"], "list", "operator_swap"),
    _t("countpos", ["count_positive", "num_positive"], (("xs",), ("items",), ("values",)),
       "    return sum(1 for item in {p0} if item {OP} 0)\n", ">", ["<", ">="], "list", "comparison_flip"),
    _t("mean", ["mean", "average"], (("xs",), ("items",), ("values",)), "    return sum({p0}) {OP} len({p0})\n", "/", ["*", "-"], "list", "operator_swap"),
    _t("empty", ["is_empty", "empty"], (("xs",), ("items",)), "    return len({p0}) {OP} 0\n", "==", ["!=", ">"], "list0", "comparison_flip"),
    _t("rev", ["reverse", "reversed_text", "backwards"], (("s",), ("text",), ("word",)), "    return {p0}[::{OP}]\n", "-1", ["1", "2"], "str", "changed_constant"),
    _t("shout", ["shout", "to_upper", "loud"], (("s",), ("text",), ("word",)), "    return {p0}.{OP}()\n", "upper", ["lower", "title"], "str", "wrong_method"),
    _t("whisper", ["whisper", "to_lower", "quiet"], (("s",), ("text",), ("word",)), "    return {p0}.{OP}()\n", "lower", ["upper"], "strU", "wrong_method"),
    _t("vowel", ["is_vowel", "vowel"], (("ch",), ("c",), ("letter",)), "    return {p0} {OP} \"aeiou\"\n", "in", ["not in"], "char", "comparison_flip"),
    _t("initial", ["initial", "first_letter"], (("s",), ("name",), ("word",)), "    return {p0}[{OP}].upper()\n", "0", ["-1", "1"], "str", "off_by_one"),
    _t("clamp", ["clamp", "limit", "bound"], (("x", "lo", "hi"), ("v", "low", "high")), "    return max({p1}, {OP}({p0}, {p2}))\n", "min", ["max"], "clamp", "wrong_call"),
    _t("between", ["between", "in_range"], (("x", "lo", "hi"), ("v", "low", "high")), "    return {p1} <= {p0} {OP} {p2}\n", "<=", ["<", ">="], "between", "comparison_flip"),
    _t("repeat", ["repeat", "echo"], (("s", "k"), ("text", "times")), "    return {p0} {OP} {p1}\n", "*", ["+"], "strint", "operator_swap"),
)
TEMPLATES_BY_KEY = {t.key: t for t in FN_TEMPLATES}


def _gen_inputs(kind: str, rng: random.Random) -> tuple:
    r = rng.randint
    word = lambda: "".join(rng.choice(_string.ascii_lowercase) for _ in range(r(3, 6)))
    if kind == "int2":
        return (r(-9, 9), r(-9, 9))
    if kind == "pos2":
        return (r(1, 9), r(1, 9))
    if kind == "small2":
        return (r(2, 5), r(0, 4))
    if kind == "int1":
        return (r(-9, 9),)
    if kind == "list":
        return ([r(-9, 9) for _ in range(r(2, 5))],)
    if kind == "list0":
        return ([r(-9, 9) for _ in range(r(0, 3))],)
    if kind == "str":
        return (word(),)
    if kind == "strU":
        return (word().upper(),)
    if kind == "char":
        return (rng.choice(_string.ascii_lowercase),)
    if kind == "clamp":
        lo = r(-5, 2)
        return (r(-9, 9), lo, lo + r(2, 6))
    if kind == "between":
        lo = r(-5, 2)
        return (r(-7, 9), lo, lo + r(0, 4))
    if kind == "strint":
        return (word()[:3], r(2, 3))
    raise KeyError(kind)


@dataclasses.dataclass
class _Fn:
    template: FnTemplate
    name: str
    params: tuple[str, ...]

    def source(self, token: str | None = None) -> str:
        token = self.template.good if token is None else token
        fmt = {f"p{i}": p for i, p in enumerate(self.params)}
        body = self.template.body.replace("{OP}", token.format(**fmt)).format(**fmt)
        return f"def {self.name}({', '.join(self.params)}):\n{body}"

    def call(self, token: str | None, args: tuple):
        ns: dict = {}
        exec(self.source(token), ns)  # noqa: S102 -- our own template code, never model output
        try:
            return ns[self.name](*args)
        except Exception as e:  # noqa: BLE001
            return f"<{type(e).__name__}>"


def _pick_fn(rng: random.Random, used_names: set[str], exclude_keys=()) -> _Fn:
    while True:
        t = rng.choice(FN_TEMPLATES)
        if t.key in exclude_keys:
            continue
        name = rng.choice(t.names)
        if name in used_names:
            continue
        used_names.add(name)
        return _Fn(t, name, rng.choice(t.params))


def _cases(fn: _Fn, bad: str, rng: random.Random, n: int = 4):
    """Input tuples for tests: the first one exposes the bug; total n."""
    exposing, others = [], []
    for _ in range(200):
        args = _gen_inputs(fn.template.inputs, rng)
        good_out = fn.call(None, args)
        if isinstance(good_out, str) and good_out.startswith("<"):
            continue  # the correct function raises on it: not a test input
        if fn.call(bad, args) != good_out:
            if repr(args) not in map(repr, exposing):
                exposing.append(args)
        elif len(others) < n and repr(args) not in map(repr, others):
            others.append(args)
        if len(exposing) >= 2 and len(exposing) + len(others) >= n:
            break
    if not exposing:
        raise RuntimeError(f"no input exposes {fn.template.key} with {bad!r}")
    return (exposing + others)[: max(n, 1)]


def _fmt_call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def _asserts(fn: _Fn, cases, call_name: str | None = None) -> str:
    call_name = call_name or fn.name
    lines = []
    for args in cases:
        want = fn.call(None, args)
        lines.append(f"assert _same({_fmt_call(call_name, args)}, {want!r}), "
                     f"{_fmt_call(call_name, args) + ' should be ' + repr(want)!r}")
    return "\n".join(lines)


_FLAT_FILES = ("calc.py", "mathutil.py", "helpers.py", "ops.py", "util.py", "funcs.py", "tools.py")
_PKG_NAMES = ("shop", "core", "lib", "app", "toolkit", "engine")
_HELPER_MODS = ("util", "helpers", "mathutil", "ops", "basics")
_HELPER_MODS2 = ("extra", "numutil", "textutil", "common", "prims")
_MAIN_MODS = ("pipeline", "report", "batch", "service", "main_logic")
_DISTRACTOR_FNS = 2


def _task(level: int, prompt: str, files: dict, tests: str, ref: list, meta: dict,
          test_name: str = "test_hidden.py") -> Task:
    fp = repr((prompt, sorted(files.items())))
    split = split_of(fp)
    tid = f"synthetic-L{level}-{stable_hash(fp):015x}"
    hidden = {f".c2jax_hidden/{test_name}": plain_test_script(tests)}
    return Task(task_id=tid, suite=f"synthetic:{level}", split=split, prompt=prompt, files=files,
                hidden_tests=hidden, test_command=None,
                reference_solution=ref, metadata=dict(meta, difficulty=level), timeout_s=20.0)


def _level1(rng: random.Random) -> Task:
    used: set[str] = set()
    fn = _pick_fn(rng, used)
    bad = rng.choice(fn.template.bads)
    fname = rng.choice(_FLAT_FILES)
    fns = [fn]
    if rng.random() < 0.4:
        fns.insert(rng.randint(0, 1), _pick_fn(rng, used, exclude_keys={fn.template.key}))
    fixed = "\n\n".join(f.source() for f in fns)
    buggy = "\n\n".join(f.source(bad if f is fn else None) for f in fns)
    cases = _cases(fn, bad, rng, n=3)
    args = cases[0]
    got, want = fn.call(bad, args), fn.call(None, args)
    prompt = f"{_symptom(_fmt_call(fn.name, args), got, want)} (in {fname}). Fix it."
    mod = fname[:-3]
    tests = f"from {mod} import {', '.join(f.name for f in fns)}\n\n" + "\n".join(
        _asserts(f, cases if f is fn else _cases(f, f.template.bads[0], rng, n=2)) for f in fns)
    meta = {"mutation": fn.template.mutation, "template": fn.template.key, "bug_file": fname,
            "bug_function": fn.name, "wrong_token": bad}
    return _task(1, prompt, {fname: buggy}, tests, [minimal_edit(fname, buggy, fixed)], meta)


def _layout(rng: random.Random):
    """Module paths and import prefixes: a package directory or flat files."""
    if rng.random() < 0.5:
        pkg = rng.choice(_PKG_NAMES)
        return pkg, (lambda m: f"{pkg}/{m}.py"), (lambda m: f"{pkg}.{m}")
    return None, (lambda m: f"{m}.py"), (lambda m: m)


def _helper_module(fns: list[_Fn], bug: tuple[_Fn, str] | None) -> str:
    return "\n\n".join(f.source(bug[1] if bug and f is bug[0] else None) for f in fns)


def _wrapper(fn: _Fn, cname: str) -> str:
    n = len(fn.params)
    if n == 1:
        return f"def {cname}(items):\n    return [{fn.name}(item) for item in items]\n"
    vars_ = ", ".join("abc"[:n])
    return f"def {cname}(rows):\n    return [{fn.name}({vars_}) for {vars_} in rows]\n"


def _wrapper_expect(fn: _Fn, token, cases):
    return [fn.call(token, args) for args in cases]


def _error_of(out) -> str | None:
    """The exception name if `out` is a captured exception marker from _Fn.call."""
    if isinstance(out, str) and out.startswith("<") and out.endswith("Error>"):
        return out[1:-1]
    return None


def _symptom(call: str, got, want) -> str:
    outs = got if isinstance(got, list) else [got]
    errs = [e for e in map(_error_of, outs) if e]
    if errs:
        return f"{call} raises {errs[0]}, expected {want!r}"
    return f"{call} returns {got!r}, expected {want!r}"


def _wrapper_arg(fn: _Fn, cases):
    return [a[0] for a in cases] if len(fn.params) == 1 else [tuple(a) for a in cases]


def _level23(rng: random.Random, level: int) -> Task:
    pkg, path_of, mod_of = _layout(rng)
    used: set[str] = set()
    h1 = rng.choice(_HELPER_MODS)
    h2 = rng.choice([m for m in _HELPER_MODS2])
    main = rng.choice(_MAIN_MODS)
    helpers1 = [_pick_fn(rng, used) for _ in range(rng.randint(2, 3))]
    helpers2 = [_pick_fn(rng, used) for _ in range(rng.randint(1, 2))]
    target = rng.choice(helpers1)
    bad = rng.choice(target.template.bads)
    bugs = [(h1, helpers1, target, bad)]
    missing: _Fn | None = None
    variant = "one_bug"
    if level == 3:
        if rng.random() < 0.5:
            variant = "two_bugs"
            t2 = rng.choice(helpers2)
            bugs.append((h2, helpers2, t2, rng.choice(t2.template.bads)))
        else:
            variant = "bug_and_missing_function"
            missing = _pick_fn(rng, used)
    used_helpers = [b[2] for b in bugs] + ([missing] if missing else [])
    cnames = {f.name: f"batch_{f.name}" for f in used_helpers}
    # main module: imports the helpers it wraps
    imports = []
    by_mod: dict[str, list[str]] = {}
    for f in used_helpers:
        m = h2 if (f in helpers2) else h1
        by_mod.setdefault(m, []).append(f.name)
    for m, names in by_mod.items():
        imports.append(f"from {mod_of(m)} import {', '.join(names)}")
    main_src = "\n".join(imports) + "\n\n\n" + "\n\n".join(_wrapper(f, cnames[f.name]) for f in used_helpers)
    files: dict[str, str] = {}
    if pkg:
        files[f"{pkg}/__init__.py"] = ""
    fixed_h1 = _helper_module(helpers1 + ([missing] if missing else []), None)
    fixed_h2 = _helper_module(helpers2, None)
    buggy_bug = {b[0]: (b[2], b[3]) for b in bugs}
    files[path_of(h1)] = _helper_module(helpers1, buggy_bug.get(h1))
    files[path_of(h2)] = _helper_module(helpers2, buggy_bug.get(h2))
    files[path_of(main)] = main_src
    if rng.random() < 0.5:  # an unrelated, correct module
        extra = [_pick_fn(rng, used) for _ in range(_DISTRACTOR_FNS)]
        files[path_of("misc")] = _helper_module(extra, None)
    # prompt and tests
    symptoms, tests = [], [f"from {mod_of(main)} import {', '.join(cnames.values())}"]
    for _, _, f, b in bugs:
        cases = _cases(f, b, rng, n=3)
        arg = _wrapper_arg(f, cases)
        got, want = _wrapper_expect(f, b, cases), _wrapper_expect(f, None, cases)
        symptoms.append(_symptom(f"{cnames[f.name]}({arg!r})", got, want))
        tests.append(f"assert _same({cnames[f.name]}({arg!r}), {want!r}), "
                     f"{cnames[f.name] + ' is wrong'!r}")
        tests.append(f"from {mod_of(h2 if f in helpers2 else h1)} import {f.name}")
        tests.append(_asserts(f, cases))
    main_path = path_of(main)
    if missing is not None:
        cases = _cases(missing, missing.template.bads[0], rng, n=3)
        arg = _wrapper_arg(missing, cases)
        want = _wrapper_expect(missing, None, cases)
        sig = f"{missing.name}({', '.join(missing.params)})"
        symptoms.append(f"importing {main_path} fails: {sig} is missing from {path_of(h1)}; "
                        f"{cnames[missing.name]}({arg!r}) should give {want!r}")
        tests.append(f"assert _same({cnames[missing.name]}({arg!r}), {want!r})")
        tests.append(f"from {mod_of(h1)} import {missing.name}")
        tests.append(_asserts(missing, cases))
    prompt = f"In {main_path}: " + "; and ".join(symptoms) + ". Please fix."
    ref = [minimal_edit(path_of(h1), files[path_of(h1)], fixed_h1)]
    if variant == "two_bugs":
        ref.append(minimal_edit(path_of(h2), files[path_of(h2)], fixed_h2))
    meta = {"variant": variant, "mutation": "+".join(b[2].template.mutation for b in bugs)
            + ("+missing_function" if missing else ""),
            "bug_files": [path_of(b[0]) for b in bugs], "named_file": main_path,
            "templates": [b[2].template.key for b in bugs]}
    return _task(level, prompt, files, "\n".join(tests), ref, meta)


# ---------------------------------------------------------------- class / parser scenarios
# A helper module with a small class or parser, and a function in another module that uses it.
# Slots {S0}, {S1}... hold tokens: (good, bads) per slot; one slot gets a wrong token.

@dataclasses.dataclass(frozen=True)
class Scenario:
    key: str
    module: str
    helper_src: str
    slots: tuple[tuple[str, tuple[str, ...]], ...]
    exports: str
    main_src: str                  # defines {main}; uses the exported names
    main_names: tuple[str, ...]
    inputs: str                    # generator name in _scenario_inputs


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("stack", "structures", (
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n\n"
        "    def push(self, item):\n        self.items.append(item)\n\n"
        "    def pop(self):\n        return self.items.pop({S0})\n\n"
        "    def peek(self):\n        return self.items[{S1}]\n\n"
        "    def size(self):\n        return len(self.items)\n"),
        (("", ("0",)), ("-1", ("0",))), "Stack",
        "def {main}(words):\n    stack = Stack()\n    for w in words:\n        stack.push(w)\n"
        "    top = stack.peek()\n    out = [stack.pop() for _ in range(stack.size())]\n    return top, out\n",
        ("reverse_words", "unstack", "last_first"), "words"),
    Scenario("queue", "structures", (
        "class Queue:\n"
        "    def __init__(self):\n        self.items = []\n\n"
        "    def enqueue(self, item):\n        self.items.append(item)\n\n"
        "    def dequeue(self):\n        return self.items.pop({S0})\n\n"
        "    def is_empty(self):\n        return len(self.items) {S1} 0\n"),
        (("0", ("",)), ("==", ("!=",))), "Queue",
        "def {main}(jobs):\n    queue = Queue()\n    for job in jobs:\n        queue.enqueue(job)\n"
        "    done = []\n    while not queue.is_empty():\n        done.append(queue.dequeue())\n    return done\n",
        ("run_jobs", "process_in_order", "drain"), "words"),
    Scenario("inventory", "inventory", (
        "class Inventory:\n"
        "    def __init__(self):\n        self.stock = {}\n\n"
        "    def add(self, name, qty):\n        self.stock[name] = self.stock.get(name, 0) {S0} qty\n\n"
        "    def remove(self, name, qty):\n"
        "        if self.stock.get(name, 0) {S1} qty:\n            return False\n"
        "        self.stock[name] -= qty\n        return True\n\n"
        "    def count(self, name):\n        return self.stock.get(name, {S2})\n"),
        (("+", ("-",)), ("<", (">", "<=")), ("0", ("1",))), "Inventory",
        "def {main}(orders):\n    inv = Inventory()\n    results = []\n    for kind, name, qty in orders:\n"
        "        if kind == 'add':\n            inv.add(name, qty)\n        else:\n"
        "            results.append(inv.remove(name, qty))\n"
        "    return results, {n: inv.count(n) for n in ('apple', 'pear', 'fig')}\n",
        ("apply_orders", "process_orders", "update_stock"), "orders"),
    Scenario("parser", "parser", (
        "def evaluate(expr):\n"
        "    tokens = expr.split()\n"
        "    total = int(tokens[{S0}])\n"
        "    for i in range(1, len(tokens), 2):\n"
        "        op, num = tokens[i], int(tokens[i + 1])\n"
        "        if op == '+':\n            total {S1}= num\n"
        "        else:\n            total -= num\n"
        "    return total\n"),
        (("0", ("1",)), ("+", ("-",))), "evaluate",
        "def {main}(lines):\n    return [evaluate(line) for line in lines]\n",
        ("evaluate_all", "run_sums", "calc_lines"), "exprs"),
    Scenario("counter", "counting", (
        "def count_words(text):\n"
        "    counts = {}\n"
        "    for word in text.{S0}():\n"
        "        counts[word] = counts.get(word, 0) + {S1}\n"
        "    return counts\n\n\n"
        "def most_common(counts):\n"
        "    return {S2}(counts, key=lambda w: (counts[w], w))\n"),
        (("split", ("strip",)), ("1", ("2",)), ("max", ("min",))), "count_words, most_common",
        "def {main}(texts):\n    return [most_common(count_words(t)) for t in texts]\n",
        ("top_words", "summarize_texts", "headline_words"), "texts"),
)


def _scenario_inputs(kind: str, rng: random.Random) -> tuple:
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "zeta"]
    if kind == "words":
        return (rng.sample(words, rng.randint(2, 4)),)
    if kind == "orders":
        out = []
        for _ in range(rng.randint(2, 5)):
            kind_ = rng.choice(["add", "add", "remove"])
            out.append((kind_, rng.choice(["apple", "pear", "fig"]), rng.randint(1, 5)))
        return (out,)
    if kind == "exprs":
        def expr():
            parts = [str(rng.randint(1, 9))]
            for _ in range(rng.randint(1, 3)):
                parts += [rng.choice("+-"), str(rng.randint(1, 9))]
            return " ".join(parts)
        return ([expr() for _ in range(rng.randint(1, 3))],)
    if kind == "texts":
        def text():
            return " ".join(rng.choice(words[:4]) for _ in range(rng.randint(3, 6)))
        return ([text() for _ in range(rng.randint(1, 2))],)
    raise KeyError(kind)


def _scenario_source(sc: Scenario, tokens: list[str]) -> str:
    src = sc.helper_src
    for i, tok in enumerate(tokens):
        src = src.replace(f"{{S{i}}}", tok)
    return src


def _scenario_call(sc: Scenario, tokens: list[str], main: str, args: tuple):
    ns: dict = {}
    exec(_scenario_source(sc, tokens) + "\n\n" + sc.main_src.replace("{main}", main), ns)  # noqa: S102 -- our own code
    try:
        return ns[main](*args)
    except Exception as e:  # noqa: BLE001
        return f"<{type(e).__name__}>"


def _scenario_bug(sc: Scenario, rng: random.Random, main: str):
    """(buggy tokens, good tokens, cases exposing the bug first)."""
    good = [g for g, _ in sc.slots]
    for _ in range(20):
        slot = rng.randrange(len(sc.slots))
        bad = list(good)
        bad[slot] = rng.choice(sc.slots[slot][1])
        exposing, others = [], []
        for _ in range(60):
            args = _scenario_inputs(sc.inputs, rng)
            want = _scenario_call(sc, good, main, args)
            if isinstance(want, str) and want.startswith("<"):
                continue
            if _scenario_call(sc, bad, main, args) != want:
                exposing.append(args)
            else:
                others.append(args)
            if len(exposing) >= 2 and len(exposing) + len(others) >= 3:
                break
        if exposing:
            return bad, good, (exposing + others)[:3], slot
    raise RuntimeError(f"scenario {sc.key}: no exposing input")


def _level23_scenario(rng: random.Random, level: int) -> Task:
    pkg, path_of, mod_of = _layout(rng)
    sc = rng.choice(SCENARIOS)
    main_mod = rng.choice(_MAIN_MODS)
    main = rng.choice(sc.main_names)
    bad, good, cases, slot = _scenario_bug(sc, rng, main)
    files: dict[str, str] = {}
    if pkg:
        files[f"{pkg}/__init__.py"] = ""
    spath = path_of(sc.module)
    files[spath] = _scenario_source(sc, bad)
    main_src = f"from {mod_of(sc.module)} import {sc.exports}\n\n\n" + sc.main_src.replace("{main}", main)
    ref = [minimal_edit(spath, files[spath], _scenario_source(sc, good))]
    got = _scenario_call(sc, bad, main, cases[0])
    want = _scenario_call(sc, good, main, cases[0])
    symptoms = [_symptom(_fmt_call(main, cases[0]), got, want)]
    tests = [f"from {mod_of(main_mod)} import {main}"]
    tests += [f"assert _same({_fmt_call(main, a)}, {_scenario_call(sc, good, main, a)!r}), "
              f"{main + ' is wrong'!r}" for a in cases]
    bug_files = [spath]
    templates = [f"scenario:{sc.key}:{slot}"]
    if level == 3:  # a second bug in a function-helper module used by a second entry point
        used: set[str] = set()
        h1 = rng.choice(_HELPER_MODS)
        helpers = [_pick_fn(rng, used) for _ in range(2)]
        target = rng.choice(helpers)
        tbad = rng.choice(target.template.bads)
        hpath = path_of(h1)
        files[hpath] = _helper_module(helpers, (target, tbad))
        cname = f"batch_{target.name}"
        main_src = (f"from {mod_of(h1)} import {target.name}\n" + main_src + "\n\n" + _wrapper(target, cname))
        fcases = _cases(target, tbad, rng, n=3)
        arg = _wrapper_arg(target, fcases)
        symptoms.append(_symptom(f"{cname}({arg!r})", _wrapper_expect(target, tbad, fcases),
                                 _wrapper_expect(target, None, fcases)))
        tests.append(f"from {mod_of(main_mod)} import {cname}")
        tests.append(f"assert _same({cname}({arg!r}), {_wrapper_expect(target, None, fcases)!r})")
        ref.append(minimal_edit(hpath, files[hpath], _helper_module(helpers, None)))
        bug_files.append(hpath)
        templates.append(target.template.key)
    files[path_of(main_mod)] = main_src
    if rng.random() < 0.5:
        used2: set[str] = set()
        files[path_of("misc")] = _helper_module([_pick_fn(rng, used2) for _ in range(2)], None)
    main_path = path_of(main_mod)
    prompt = f"In {main_path}: " + "; and ".join(symptoms) + ". Please fix."
    meta = {"variant": "scenario" if level == 2 else "two_bugs", "mutation": "scenario_slot",
            "bug_files": bug_files, "named_file": main_path, "templates": templates}
    return _task(level, prompt, files, "\n".join(tests), ref, meta)


def generate_one(level: int, seed: int, index: int) -> Task:
    rng = random.Random(stable_hash("synthetic", level, seed, index))
    if level == 1:
        return _level1(rng)
    if level in (2, 3):
        if rng.random() < 0.4:  # a class or parser module instead of plain functions
            return _level23_scenario(rng, level)
        return _level23(rng, level)
    raise ValueError(f"synthetic level must be 1, 2 or 3, got {level}")


def load(split: str, n: int | None = None, seed: int = 0, level: int = 1) -> list[Task]:
    """`n` distinct tasks of `level` in `split` (default n=100), deterministic in (seed, n).

    Candidates are drawn in a fixed order and kept when their content hashes into `split`,
    so train and heldout never share a task, and load(n=10) is a prefix of load(n=20).
    """
    n = 100 if n is None else n
    out, seen = [], set()
    index = 0
    while len(out) < n:
        if index > 50 * n + 1000:
            raise RuntimeError(f"synthetic:{level} could not find {n} distinct {split} tasks")
        t = generate_one(level, seed, index)
        index += 1
        if t.split == split and t.task_id not in seen:
            seen.add(t.task_id)
            out.append(t)
    return out
