"""Apply the vllm-ascend series to a vllm-ascend checkout, one commit per patch, as you.

    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> [--check]
    python upstream_patch/vllm-ascend/apply.py <vllm-ascend work tree> --export

Each patch becomes a commit whose author is the git identity configured in that checkout
(nothing in the series names an author). Whole-file rewrites are written after checking the
file's blob id (see ``series.py``); everything else goes through ``git apply --index``. Either all
patches apply or the checkout is reset to where it was. ``--check`` does the same in a temporary
worktree and leaves the checkout as it is. ``--export`` goes the other way: the checkout's commits
since ``series.BASE_COMMIT`` become the series files (how the series is changed).

The series was made for vllm-ascend ``series.BASE_COMMIT``; a checkout elsewhere is tried all the
same (the blob ids and ``git apply`` decide) with a note. Sign the commits off before sending:
``git rebase --signoff <start>`` (the Developer Certificate of Origin is the sender's statement).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import (  # noqa: E402
    BASE_COMMIT,
    SERIES_DIR,
    PatchError,
    apply_series,
    export_series,
    git,
    patches,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vllm-ascend git work tree")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="apply in a throw-away worktree")
    mode.add_argument("--export", action="store_true", help="write its commits as the series")
    args = parser.parse_args()
    tree = args.tree.resolve()
    try:
        if args.export:
            for path in export_series(tree):
                print(path.relative_to(SERIES_DIR.parent.parent.parent))
            return
        if git(tree, "rev-parse", "HEAD").stdout.strip() != BASE_COMMIT:
            print(f"note: the series was made for {BASE_COMMIT}; this checkout is elsewhere")
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
    except PatchError as exc:
        raise SystemExit(f"not applied: {exc}") from None
    author = git(tree, "log", "-1", "--format=%an <%ae>").stdout.strip()
    print(f"{len(patches())} commits on {start[:12]}, author {author}.")
    print(f"Sign them off before sending: git rebase --signoff {start[:12]}")


if __name__ == "__main__":
    main()
