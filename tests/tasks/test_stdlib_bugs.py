"""Stdlib bug injection: mutation operators, real shadowing of the stdlib module, validation."""
import sys

import pytest

from c2jax.tasks import load_suite, validate_task
from c2jax.tasks import stdlib_bugs as sb


def test_mutation_operators_are_local_text_edits():
    src = ("def f(a, b, xs):\n"
           "    if a < b and b > 0:\n"
           "        a += 1\n"
           "    return g(a, b) + xs[-1]\n")
    muts = sb.enumerate_mutations(src)
    kinds = {m.kind for m in muts}
    assert {"comparison_flip", "boolean_flip", "operator_swap", "off_by_one", "removed_line",
            "swapped_arguments"} <= kinds
    texts = {m.source for m in muts}
    assert src.replace("a < b", "a <= b") in texts
    assert src.replace(" and ", " or ") in texts
    assert src.replace("g(a, b)", "g(b, a)") in texts
    assert src.replace("xs[-1]", "xs[-2]") in texts
    assert src.replace("        a += 1\n", "        pass\n") in texts
    for m in muts:  # one site changed: every other line is untouched
        changed = [x for x, y in zip(src.splitlines(), m.source.splitlines()) if x != y]
        assert len(changed) <= 1 or m.kind == "removed_line"
    assert [m.mutation_id for m in muts] == [m.mutation_id for m in sb.enumerate_mutations(src)]


def test_shadowing_is_real(stdlib_cache):
    # unittest imports textwrap at startup, so sys.path order alone would not shadow it.
    src, test_src = sb.module_sources("textwrap")
    ok, _, _ = sb.run_test_file("textwrap", src, test_src)
    assert ok and all(v in ("pass", "skip") for v in ok.values())
    broken = src.replace("def dedent(text):\n", "def dedent(text):\n    raise RuntimeError('local copy')\n", 1)
    assert broken != src
    out, msgs, _ = sb.run_test_file("textwrap", broken, test_src)
    failed = {k for k, v in out.items() if v != "pass"}
    dedent_tests = {k for k in out if ".DedentTestCase." in k}
    assert dedent_tests and dedent_tests <= failed and len(failed) < len(out)
    assert any("local copy" in m for m in msgs.values())


def test_shadowing_import_fresh_module(stdlib_cache):
    # bisect's tests load the module with import_fresh_module(blocked=['_bisect']).
    src, test_src = sb.module_sources("bisect")
    broken = src.replace("def insort_right(", "def insort_right(*_a, **_k):\n    raise RuntimeError\n\n\ndef _unused(", 1)
    out, _, _ = sb.run_test_file("bisect", broken, test_src)
    failed = {k for k, v in out.items() if v != "pass"}
    assert failed and all("Python" in k for k in failed), failed  # the C-backed tests still pass


def test_generation_deterministic_and_valid(stdlib_cache):
    kw = {"modules": ("textwrap", "string", "fnmatch")}
    a = load_suite("stdlib_bugs", "train", n=4, seed=0, **kw)
    b = load_suite("stdlib_bugs", "train", n=4, seed=0, **kw)  # from the cache now
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert [t.files for t in a] == [t.files for t in b]
    assert len({t.metadata["module"] for t in a}) == 3
    for t in a:
        assert t.metadata["fail_to_pass"]
        assert t.metadata["module"] + ".py" in t.files and len(t.files) == 1
        assert all(k.startswith(".c2jax_hidden/") for k in t.hidden_tests)
        r = validate_task(t)
        assert r.ok, (t.task_id, r.problems)


def test_heldout_modules_are_disjoint(stdlib_cache):
    assert not set(sb.TRAIN_MODULES) & set(sb.HELDOUT_MODULES)
    held = load_suite("stdlib_bugs", "heldout", n=2, seed=0, modules=("colorsys",))
    assert all(t.split == "heldout" for t in held)
    for t in held:
        assert validate_task(t).ok


def test_python_version_is_312():
    assert sys.version_info[:2] == (3, 12)
    assert (sb.TEST_DIR / "test_textwrap.py").exists()


def test_bad_module_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="Lib/test"):
        sb.module_sources("no_such_module")
