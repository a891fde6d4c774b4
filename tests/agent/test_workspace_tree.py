"""Host-side access to a task tree: links are reported or replaced, never followed."""
import os

from c2jax.agent.workspace import read_tree, remove_tree_path, write_tree_files


def _outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("SECRET")
    return out


def test_read_tree_reports_links_and_special_files(tmp_path):
    out = _outside(tmp_path)
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("A = 1\n")
    os.symlink(out / "secret.txt", tree / "leak.py")
    os.symlink(out, tree / "vendor")
    os.mkfifo(tree / "fifo")
    (tree / "bin.dat").write_bytes(b"\xff\xfe\x00")
    snap = read_tree(tree)
    assert snap == {"bin.dat": "<binary>", "fifo": "<special file>", "leak.py": f"<symlink to {out / 'secret.txt'}>",
                    "pkg/a.py": "A = 1\n", "vendor": f"<symlink to {out}>"}


def test_write_tree_files_replaces_links_instead_of_following_them(tmp_path):
    out = _outside(tmp_path)
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(out, tree / "grading")
    os.symlink(out / "secret.txt", tree / "t.py")
    write_tree_files(tree, {"grading/test_x.py": "X\n", "t.py": "T\n"})
    assert sorted(os.listdir(out)) == ["secret.txt"] and (out / "secret.txt").read_text() == "SECRET"
    assert not (tree / "grading").is_symlink() and (tree / "grading" / "test_x.py").read_text() == "X\n"
    assert not (tree / "t.py").is_symlink() and (tree / "t.py").read_text() == "T\n"
    os.symlink(out, tree / "gone")
    remove_tree_path(tree, "gone")
    remove_tree_path(tree, "grading")
    remove_tree_path(tree, "missing/x.py")
    assert sorted(os.listdir(tree)) == ["t.py"] and (out / "secret.txt").exists()
