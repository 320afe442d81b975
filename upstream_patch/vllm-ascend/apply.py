"""Apply the vllm-ascend series to a vllm-ascend checkout, one commit per patch, as you.

    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> [--check]

Each patch becomes a commit whose author is the git identity configured in that checkout
(nothing in the series names an author). Whole-file rewrites are written after checking the
file's blob id (see ``series.py``); everything else goes through ``git apply --index``. Either all
patches apply or the checkout is reset to where it was. ``--check`` does the same in a temporary
worktree and leaves the checkout as it is.

The series was made for vllm-ascend ``series.BASE_COMMIT``; a checkout elsewhere is tried all the
same (the blob ids and ``git apply`` decide) with a note. Sign the commits off before sending:
``git rebase --signoff <start>`` (the Developer Certificate of Origin is the sender's statement).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import BASE_COMMIT, message_of, patches, split_rewrites  # noqa: E402


class ApplyError(RuntimeError):
    pass


def git(tree: Path, *args: str, stdin: str | None = None) -> str:
    run = subprocess.run(["git", *args], cwd=tree, input=stdin, capture_output=True, text=True)
    if run.returncode != 0:
        raise ApplyError(f"git {' '.join(args)}: {run.stderr.strip() or run.stdout.strip()}")
    return run.stdout


def apply_patch(tree: Path, patch: Path, identity: tuple[str, ...] = ()) -> None:
    text = patch.read_text()
    rewrites, rest = split_rewrites(text)
    for rewrite in rewrites:
        target = tree / rewrite.path
        found = git(tree, "hash-object", rewrite.path).strip() if target.exists() else "absent"
        if found != rewrite.old_blob:
            raise ApplyError(f"{patch.name}: {rewrite.path} is {found}, not {rewrite.old_blob}")
    if rest:
        git(tree, "apply", "--index", "--whitespace=nowarn", stdin=rest)
    for rewrite in rewrites:
        (tree / rewrite.path).write_text(rewrite.text)
        git(tree, "add", rewrite.path)
        if git(tree, "hash-object", rewrite.path).strip() != rewrite.new_blob:
            raise ApplyError(f"{patch.name}: {rewrite.path} written, but not the expected blob")
    git(tree, *identity, "commit", "-q", "-F", "-", stdin=message_of(text))


def apply_series(tree: Path, identity: tuple[str, ...] = ()) -> str:
    """Apply every patch on ``tree``'s HEAD; returns the starting commit. All or nothing."""
    if git(tree, "status", "--porcelain", "--untracked-files=no").strip():
        raise ApplyError(f"{tree} has uncommitted changes; commit or stash them first")
    start = git(tree, "rev-parse", "HEAD").strip()
    if start != BASE_COMMIT:
        print(f"note: the series was made for {BASE_COMMIT}; this checkout is at {start}")
    try:
        for patch in patches():
            apply_patch(tree, patch, identity)
    except ApplyError:
        git(tree, "reset", "-q", "--hard", start)
        raise
    return start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vllm-ascend git work tree")
    parser.add_argument("--check", action="store_true", help="apply in a throw-away worktree")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    tree = args.tree.resolve()
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as scratch:
                work = Path(scratch) / "check"
                git(tree, "worktree", "add", "-q", "--detach", str(work), "HEAD")
                try:
                    # Throw-away commits: a placeholder identity, never sent anywhere.
                    apply_series(
                        work, ("-c", "user.name=check", "-c", "user.email=check@localhost")
                    )
                finally:
                    git(tree, "worktree", "remove", "--force", str(work))
            print(f"the series applies to {tree} ({len(patches())} patches)")
            return
        start = apply_series(tree)
    except ApplyError as exc:
        raise SystemExit(f"not applied: {exc}") from None
    author = git(tree, "log", "-1", "--format=%an <%ae>").strip()
    print(f"{len(patches())} commits on {start[:12]}, author {author}.")
    print(f"Sign them off before sending: git rebase --signoff {start[:12]}")


if __name__ == "__main__":
    main()
