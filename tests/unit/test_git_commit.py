"""The git_commit tag of a tracked run is read from the checkout's .git files (no git process per run): a branch,
a detached HEAD, packed refs, a worktree, a subfolder of the checkout, and "unknown" where it cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from esbatch.tracking.mlflow_tracker import git_commit

A, B = "a" * 40, "b" * 40


def repo(top: Path, head: str, refs: dict[str, str] | None = None, packed: dict[str, str] | None = None) -> Path:
    git = top / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text(head + "\n")
    for ref, sha in (refs or {}).items():
        (git / ref).parent.mkdir(parents=True, exist_ok=True)
        (git / ref).write_text(sha + "\n")
    if packed:
        lines = ["# pack-refs with: peeled fully-peeled sorted"] + [f"{sha} {ref}" for ref, sha in packed.items()]
        (git / "packed-refs").write_text("\n".join(lines) + "\n")
    return top


def test_a_branch_a_detached_head_and_packed_refs(tmp_path):
    assert git_commit(repo(tmp_path / "a", "ref: refs/heads/main", {"refs/heads/main": A})) == A
    assert git_commit(repo(tmp_path / "b", B)) == B
    packed = {"refs/heads/other": A, "refs/heads/main": B}
    assert git_commit(repo(tmp_path / "c", "ref: refs/heads/main", packed=packed)) == B
    # a loose ref wins over a stale packed one, as in git
    both = repo(tmp_path / "d", "ref: refs/heads/main", {"refs/heads/main": A}, packed={"refs/heads/main": B})
    assert git_commit(both) == A


def test_a_subfolder_of_the_checkout_finds_its_top(tmp_path):
    top = repo(tmp_path / "r", "ref: refs/heads/main", {"refs/heads/main": A})
    (top / "esbatch" / "tracking").mkdir(parents=True)
    assert git_commit(top / "esbatch" / "tracking") == A


def test_a_worktree_reads_its_own_head_and_the_shared_refs(tmp_path):
    main = repo(tmp_path / "main", "ref: refs/heads/main", {"refs/heads/main": A, "refs/heads/wt": B})
    wt_git = main / ".git" / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/wt\n")
    (wt_git / "commondir").write_text("../..\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {wt_git}\n")
    assert git_commit(wt) == B


def bad_gitfile(p: Path) -> Path:
    p.mkdir()
    (p / ".git").write_text("not a gitdir line\n")
    return p


@pytest.mark.parametrize(
    "make",
    [
        lambda p: p,  # no repository at all (an installed wheel)
        lambda p: repo(p, "ref: refs/heads/gone"),  # a HEAD naming a ref that exists nowhere
        lambda p: repo(p, ""),  # an empty HEAD
        bad_gitfile,  # a .git file without a gitdir line
    ],
    ids=["no-repo", "missing-ref", "empty-head", "bad-gitfile"],
)
def test_unknown_where_it_cannot_be_read(tmp_path, make):
    assert git_commit(make(tmp_path / "x")) == "unknown"
