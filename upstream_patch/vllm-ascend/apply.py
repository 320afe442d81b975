"""Apply a vllm-ascend series to a vllm-ascend checkout, one commit per patch, as you.

    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> --pr PR [--check]
    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> --pr PR --mbox DIR
    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> --pr PR --export

``PR`` is one of ``srf``, ``pause-state`` (``series.PRS``); the base is the one made for
the checkout's commit or release (``vllm_ascend/_version.py``), or ``--base``. Each patch becomes
a commit whose author is the git identity configured in that checkout. Whole-file rewrites are
written after checking the file's blob id (see ``series.py``); everything else goes through
``git apply --index``. Either all patches apply or the checkout is reset to where it was.
``--check`` does the same in a temporary worktree. ``--mbox DIR`` writes the series as plain
mbox files (rewrites expanded against the checkout) for ``git am --keep-non-patch --keep-cr``.
``--export`` goes the other way: the checkout's commits since the base become the series' files.

Runs with any Python 3.10+ and git: ``python upstream_patch/vllm-ascend/apply.py`` from the
package's checkout needs no ``PYTHONPATH`` and nothing installed (its only import, ``series``, sits
beside it). Sign the commits off before sending:
``git rebase --signoff <start>``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from series import (
    CHECK_IDENTITY,
    PRS,
    PatchError,
    apply_series,
    base_for_tree,
    base_of,
    expand_rewrites,
    export_series,
    git,
    patches,
    series_dir,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vllm-ascend git work tree")
    parser.add_argument("--pr", required=True, choices=PRS, help="which pull request's series")
    parser.add_argument("--base", help="the base folder (default: the one made for the tree)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="apply in a throw-away worktree")
    mode.add_argument("--export", action="store_true", help="write its commits as the series")
    mode.add_argument("--mbox", type=Path, metavar="DIR", help="write plain mbox files for git am")
    args = parser.parse_args()
    tree = args.tree.resolve()
    try:
        directory = series_dir(args.base or base_for_tree(tree), args.pr)
        if args.export:
            for path in export_series(tree, base_of(directory, tree), directory):
                print(path.relative_to(directory.parents[2]))
            return
        series = patches(directory)
        if not series:
            raise PatchError(f"no series {directory.parent.name}/{args.pr}")
        print(f"series {directory.parent.name}/{args.pr} ({len(series)} patches) on {tree}")
        if args.mbox:
            written = expand_rewrites(tree, series, args.mbox.resolve())
            print("\n".join(str(p) for p in written))
            print(f"git -C {tree} am --keep-non-patch --keep-cr {args.mbox}/*.patch")
            return
        if args.check:
            with tempfile.TemporaryDirectory() as scratch:
                work = Path(scratch) / "check"
                git(tree, "worktree", "add", "-q", "--detach", str(work), "HEAD")
                try:
                    apply_series(work, CHECK_IDENTITY, series)
                finally:
                    git(tree, "worktree", "remove", "--force", str(work))
            print(f"the series applies to {tree} ({len(series)} patches)")
            return
        start = apply_series(tree, (), series)
    except PatchError as exc:
        raise SystemExit(f"not applied: {exc}") from None
    author = git(tree, "log", "-1", "--format=%an <%ae>").stdout.strip()
    print(f"{len(series)} commits on {start[:12]}, author {author}.")
    print(f"Sign them off before sending: git rebase --signoff {start[:12]}")


if __name__ == "__main__":
    main()
