"""Apply the vllm-ascend series to a vllm-ascend checkout, one commit per patch, as you.

    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> [--check]
    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> --export --series NAME

Each patch becomes a commit whose author is the git identity configured in that checkout
(nothing in the series names an author). Whole-file rewrites are written after checking the
file's blob id (see ``series.py``); everything else goes through ``git apply --index``. Either all
patches apply or the checkout is reset to where it was. ``--check`` does the same in a temporary
worktree and leaves the checkout as it is. ``--export`` goes the other way: the checkout's commits
since the series' base become its files (how a series is changed).

One series per base (``upstream_patch/vllm-ascend/<base>/``: the commit 182b75ea, the release
v0.30.0rc2); the one made for the checkout's commit or release (``vllm_ascend/_version.py``) is
used unless ``--series`` names one; the blob ids and ``git apply`` decide whether it applies.
Sign the commits off before sending: ``git rebase --signoff <start>`` (the Developer Certificate
of Origin is the sender's statement).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from series import (
    HERE,
    PatchError,
    all_series,
    apply_series,
    base_of,
    export_series,
    git,
    patches,
    series_for_tree,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vllm-ascend git work tree")
    parser.add_argument(
        "--series",
        help="the series folder to use or export into (default: the one made for the tree's "
        f"commit or release; now: {', '.join(d.name for d in all_series())})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="apply in a throw-away worktree")
    mode.add_argument("--export", action="store_true", help="write its commits as the series")
    args = parser.parse_args()
    tree = args.tree.resolve()
    try:
        directory = HERE / args.series if args.series else series_for_tree(tree)
        series = patches(directory)
        if args.export:
            for path in export_series(tree, base_of(directory, tree), directory):
                print(path.relative_to(HERE.parent.parent))
            return
        print(f"series {directory.name} ({len(series)} patches) on {tree}")
        if args.check:
            with tempfile.TemporaryDirectory() as scratch:
                work = Path(scratch) / "check"
                git(tree, "worktree", "add", "-q", "--detach", str(work), "HEAD")
                try:
                    # Throw-away commits: a placeholder identity, never sent anywhere.
                    apply_series(
                        work, ("-c", "user.name=check", "-c", "user.email=check@localhost"), series
                    )
                finally:
                    git(tree, "worktree", "remove", "--force", str(work))
            print(f"the series applies to {tree} ({len(series)} patches)")
            return
        start = apply_series(tree, series=series)
    except PatchError as exc:
        raise SystemExit(f"not applied: {exc}") from None
    author = git(tree, "log", "-1", "--format=%an <%ae>").stdout.strip()
    print(f"{len(series)} commits on {start[:12]}, author {author}.")
    print(f"Sign them off before sending: git rebase --signoff {start[:12]}")


if __name__ == "__main__":
    main()
