"""Long-horizon synthetic tasks: deterministic, split-disjoint, valid, and with more tool output
than a small context holds."""
import re

from c2jax.tasks import load_suite, long_horizon, validate_task


def test_deterministic_disjoint_and_registered():
    a = long_horizon.load("train", 6, seed=1)
    assert [t.task_id for t in a] == [t.task_id for t in long_horizon.load("train", 6, seed=1)]
    assert [t.task_id for t in a[:3]] == [t.task_id for t in long_horizon.load("train", 3, seed=1)]
    held = load_suite("long_horizon", "heldout", n=4, seed=1)
    assert not {t.task_id for t in a} & {t.task_id for t in held}
    assert all(t.split == "heldout" and t.suite == "long_horizon" for t in held)


def test_one_legacy_constant_per_module_and_long_tool_output():
    for t in long_horizon.load("heldout", 4, seed=0, n_files=10):
        facts = t.metadata["facts"]
        assert len(facts) == 10 == len(t.metadata["modules"])
        for path in t.metadata["modules"]:
            found = re.findall(r"^(LEGACY_[A-Z]+) = (\d+)$", t.files[path], re.M)
            assert len(found) == 1 and facts[found[0][0]] == int(found[0][1])
        assert t.metadata["tool_output_chars"] > 8192          # more than an 8k-token context
        assert "grep" not in t.tools and "run" not in t.tools   # the modules must be read one by one


def test_reference_passes_and_bad_outcomes_fail():
    t = long_horizon.load("train", 1, seed=2, n_files=3, file_chars=300)[0]
    v = validate_task(t)
    assert v.ok, v.problems
    facts = dict(t.metadata["facts"])
    from c2jax.tasks.base import local_run, write_files

    def grade(registry_src, tmp, score=None):
        files = dict(t.files, **{"registry.py": registry_src})
        write_files(tmp, files)
        g = t.grade(tmp, local_run)
        if score is not None:
            assert abs(g.score - score) < 1e-9, (g.score, score, g.details)
        return g.passed

    import tempfile
    from pathlib import Path
    src = lambda d: long_horizon.REGISTRY_SRC.replace("REGISTRY = {}", f"REGISTRY = {d!r}")
    with tempfile.TemporaryDirectory() as d:
        assert grade(src(facts), Path(d), score=1.0)
    missing = dict(list(facts.items())[1:])
    with tempfile.TemporaryDirectory() as d:
        assert not grade(src(missing), Path(d), score=2 / 3)  # one value forgotten: partial credit
    wrong = {k: v + 1 if i == 0 else v for i, (k, v) in enumerate(facts.items())}
    wrong["LEGACY_EXTRA"] = 5
    with tempfile.TemporaryDirectory() as d:
        assert not grade(src(wrong), Path(d), score=2 / 3)    # one value wrong, an extra key
    imports = "from settings import *\n" + src(facts)
    with tempfile.TemporaryDirectory() as d:
        assert not grade(imports, Path(d), score=0.0)        # must not use settings/: no credit
    with tempfile.TemporaryDirectory() as d:
        assert not grade("REGISTRY = {", Path(d), score=0.0)  # does not import


def test_scripted_agent_plan_is_a_copy_of_the_listing_and_survives_a_summary():
    """Each read turn thinks two lines of the listing, 'after:\\n<last read>\\n<this file>' ('first:\\n
    <file>' at the start), names spelled as the listing spells them; a self-summary keeps only
    read up to: and the found lines (in reading order), and after the restart the agent lists
    settings/ again and reads on after that module."""
    from c2jax.agent import chat_format as cf
    from c2jax.agent import long_horizon_policy as lhp
    task = long_horizon.load("train", 1, seed=4, n_files=4, file_chars=200)[0]
    pol = lhp.LongHorizonPolicy(task)
    names = [m.split("/")[1] for m in task.metadata["modules"]]
    codec = cf.as_codec(None)
    list_call = cf.render_assistant(calls=[{"name": "list_dir", "arguments": {"path": "settings"}}])
    listing = cf.render_tool_result(0, "list_dir", True, "\n".join(["__init__.py", *names]))
    ctx = cf.render_system("s") + cf.render_user(task.prompt) + cf.assistant_prefix() + list_call + listing
    order = []
    for i, name in enumerate(names):
        msg = cf.parse_assistant(pol.next_message(codec.encode(ctx + cf.assistant_prefix()), codec))
        assert msg.thinking == ("first:\n" if i == 0 else f"after:\n{names[i - 1]}\n") + name
        assert [(c.name, c.arguments) for c in msg.calls] == [("read_file", {"path": f"settings/{name}"})]
        ctx += cf.assistant_prefix() + cf.render_assistant(calls=[{"name": "read_file", "arguments": {
            "path": f"settings/{name}"}}], thinking=msg.thinking)
        src = task.files[f"settings/{name}"]
        ctx += cf.render_tool_result(0, "read_file", True, f"settings/{name} (lines 1-9 of 9)\n{src}")
        order += [n for n, _ in lhp._FACT_RE.findall(src)]
        if i == 1:  # summarize here, then continue from the summary alone
            summary = pol.self_summary(ctx)
            found = "\n".join(f"{n} = {task.metadata['facts'][n]}" for n in order)
            assert f"<|summary|>read up to:\n{names[1]}\nfound:\n{found}\n" in summary
            assert "files:" not in summary and names[2] not in summary
            ctx = cf.render_system("s") + cf.render_user(task.prompt) + summary + cf.render_user("continue")
            k = pol.knowledge(ctx)
            assert k["files"] == [] and k["cursor"] == names[1] and list(k["facts"]) == order
            relist = cf.parse_assistant(pol.next_message(codec.encode(ctx + cf.assistant_prefix()), codec))
            assert [(c.name, c.arguments) for c in relist.calls] == [("list_dir", {"path": "settings"})]
            ctx += cf.assistant_prefix() + list_call + listing
            assert pol.knowledge(ctx)["read"] == task.metadata["modules"][:2]
    final = cf.parse_assistant(pol.next_message(codec.encode(ctx + cf.assistant_prefix()), codec))
    assert not final.thinking and [c.name for c in final.calls] == ["write_file"]
    content = final.calls[0].arguments["content"]
    assert all(f"{k} = {v}\n" in content for k, v in task.metadata["facts"].items())
