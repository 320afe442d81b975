"""The vllm-ascend series: where they live, their bases, their file format; export and apply.

One series per pull request and base: ``<base>/<pr>/NNNN-<slug>.patch``, the base a commit's
first 8 digits (``182b75ea``) or a release (``v0.30.0rc2``), the PR one of ``PRS``. Each file is
what ``git format-patch`` writes (an mbox message: ``From``, ``Date``, ``Subject``, the commit
message, ``---``, ``git diff --stat``, the diff), so ``git am --keep-non-patch`` applies a series
to its base (``--keep-non-patch`` keeps vllm-ascend's ``[Core]``-style title prefixes, which
plain ``git am`` strips with ``[PATCH]``). The author is a placeholder
(``PLACEHOLDER_AUTHOR``, an ``.invalid`` address) and the date is fixed, so an export is the same
bytes every time; there is no ``Signed-off-by``: whoever sends a series is its author and signs
it off (``git rebase --reset-author --signoff``; ``apply.py`` commits as you already).

One exception to plain diffs: a file whose old text is vllm-ascend's copy of vLLM's
``schedule()``, which this repository does not carry, is given as its new text plus the old
text's blob id (``git diff -B -D``: a rewrite section). ``apply_series`` checks the blob id and
writes the new text; ``expand_rewrites`` turns such a series into plain mbox files against a
vllm-ascend checkout that has the old text (``apply.py --mbox``), which ``git am`` then applies.

The patch files are the series' only copy. To change one: apply it to a checkout at its base
(``apply.py``), amend or add commits there, and ``apply.py --export`` writes them back.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


# NOTE: PatchError and git() have a twin in balance_testbed.seam_patch (the vLLM series). These
# scripts run from a vllm-ascend checkout with a plain python (apply.py), where this repository's
# test bed is not installed, so they need nothing beyond the standard library and git.
class PatchError(RuntimeError):
    """A series that does not apply; the message is one line, fit for a command-line error."""


def git(
    repo: Path, *args: str, env: dict | None = None, check: bool = True, stdin: str = ""
) -> subprocess.CompletedProcess:
    """``git -C repo ARGS``; with ``check``, a failure raises PatchError with git's first line."""
    result = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, input=stdin
    )
    if check and result.returncode != 0:
        lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
        raise PatchError(f"git {' '.join(args)}: {lines[0] if lines else '(no output)'}")
    return result


# vllm-ascend main, fetched 2026-11-30: "[Test] add memcache dsv4-flash weekly case (#14760)".
BASE_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"
# The pull requests, in the order they are meant to merge (each README row says what it needs).
PRS = ("srf", "pause-state")
RELEASE_SERIES_PREFIX = "v"
VERSION_FILE = "vllm_ascend/_version.py"
BALANCE_MODULE = "vllm_ascend/patch/platform/patch_balance_schedule.py"
SLUG_LENGTH = 54  # of the subject, as git format-patch names its files
PLACEHOLDER_AUTHOR = "vllm-balance-scheduling <dev@vllm-balance.invalid>"
FIXED_DATE = "Thu, 1 Jan 1970 00:00:00 +0000"
MBOX_FROM = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"


def patches(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.patch"))


def read_patch(patch: Path) -> str:
    """A series file's text with its line ends as they are (vllm-ascend has CRLF files)."""
    return patch.read_bytes().decode("utf-8")


def all_series() -> list[Path]:
    """Every ``<base>/<pr>`` folder that holds patches."""
    return sorted(d for d in HERE.glob("*/*") if d.is_dir() and patches(d))


def bases() -> list[str]:
    return sorted({d.parent.name for d in all_series()})


def tree_release(tree: Path) -> str | None:
    """The vllm-ascend release a work tree is (``vllm_ascend/_version.py``), if it says."""
    path = tree / VERSION_FILE
    if not path.exists():
        return None
    match = re.search(r"^__version__ = version = '([^']+)'", path.read_text(), re.M)
    return match.group(1) if match else None


def base_for_tree(tree: Path) -> str:
    """The base folder made for ``tree``: its HEAD commit's, else its release's."""
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    release = tree_release(tree)
    for base in bases():
        if head.startswith(base) or (
            release is not None and base == f"{RELEASE_SERIES_PREFIX}{release}"
        ):
            return base
    raise PatchError(
        f"no series for {tree} (HEAD {head[:12]}, release {release}); bases: {bases()}"
    )


def series_dir(base: str, pr: str) -> Path:
    if pr not in PRS:
        raise PatchError(f"no pull request {pr!r}; they are {', '.join(PRS)}")
    return HERE / base / pr


def base_of(directory: Path, tree: Path) -> str:
    """The commit of ``tree`` a series was made on: the named commit, or for a release the tag
    ``v<release>`` where the tree has it, else its root commit (an unpacked sdist)."""
    base = directory.parent.name
    if not base.startswith(RELEASE_SERIES_PREFIX):
        return git(tree, "rev-parse", base).stdout.strip()
    tag = git(tree, "tag", "--list", base).stdout.strip()
    if tag:
        return git(tree, "rev-parse", f"{tag}^{{commit}}").stdout.strip()
    return git(tree, "rev-list", "--max-parents=0", "HEAD").stdout.split()[0]


def render(subject: str, body: str, stat: str, diff: str, number: int, total: int) -> str:
    """One mbox message as ``git format-patch`` writes it (placeholder author, fixed date)."""
    prefix = "[PATCH]" if total == 1 else f"[PATCH {number}/{total}]"
    return (
        f"{MBOX_FROM}\nFrom: {PLACEHOLDER_AUTHOR}\nDate: {FIXED_DATE}\n"
        f"Subject: {prefix} {subject}\n\n{body.strip()}\n---\n{stat.rstrip()}\n\n{diff}"
    )


def commit_message(patch: Path) -> str:
    """The commit message of a series file: its subject (without ``[PATCH n/m]``) and body."""
    text = read_patch(patch)
    headers, _, rest = text.partition("\n\n")
    match = re.search(r"^Subject: \[PATCH[^\]]*\] (.*)$", headers, re.M)
    if match is None:
        raise PatchError(f"{patch.name}: no Subject: [PATCH] header")
    body = rest.split("\n---\n", 1)[0].strip()
    return f"{match.group(1)}\n\n{body}\n"


_REWRITE_HEADER = re.compile(
    r"diff --git a/(?P<path>\S+) b/(?P=path)\n"
    r"dissimilarity index \d+%\n"
    r"index (?P<old>[0-9a-f]{40})\.\.(?P<new>[0-9a-f]{40})(?: \d+)?\n"
    r"--- a/(?P=path)\n\+\+\+ b/(?P=path)\n"
    r"@@ -\?,\? \+1,(?P<count>\d+) @@\n"
)


@dataclass(frozen=True)
class Rewrite:
    path: str
    old_blob: str  # git blob id the file must have before
    new_blob: str
    text: str


def split_rewrites(patch_text: str) -> tuple[list[Rewrite], str]:
    """(the whole-file rewrites, the rest of the diff for ``git apply``) of one series file."""
    head, _, diff = patch_text.partition("\ndiff --git ")
    sections = re.split(r"(?m)^(?=diff --git )", "diff --git " + diff) if diff else []
    rewrites, rest = [], []
    for section in filter(None, sections):
        match = _REWRITE_HEADER.match(section)
        if match is None:
            rest.append(section)
            continue
        lines = section[match.end() :].splitlines(keepends=True)
        count = int(match["count"])
        if len(lines) != count or not all(line.startswith("+") for line in lines):
            raise ValueError(f"{match['path']}: malformed rewrite section")
        text = "".join(line[1:] for line in lines)
        rewrites.append(Rewrite(match["path"], match["old"], match["new"], text))
    return rewrites, "".join(rest)


def post_image(path: str, directory: Path) -> str:
    """The text the series gives ``path``, a file it rewrites whole."""
    for patch in patches(directory):
        for rewrite in split_rewrites(read_patch(patch))[0]:
            if rewrite.path == path:
                return rewrite.text
    raise ValueError(f"the series does not rewrite {path}")


def _diff(tree: Path, commit: str, out: Path, *options: str) -> str:
    # Through a file: git's output read as text would lose the CRs of CRLF files.
    diff_file = out / ".diff"
    git(tree, "diff", *options, "--full-index", "--no-color", f"--output={diff_file}",
        f"{commit}^", commit)  # fmt: skip
    try:
        return read_patch(diff_file)
    finally:
        diff_file.unlink()


def _whole_file_rewrites(tree: Path, commit: str, out: Path) -> bool:
    """Whether ``commit`` rewrites a file whose old text stays out of this repository."""
    return "dissimilarity index" in _diff(tree, commit, out, "-B", "-D")


def export_series(tree: Path, base: str, out: Path, expand: bool = False) -> list[Path]:
    """Write each commit of ``tree`` from ``base`` to HEAD as ``NNNN-<subject>.patch`` in ``out``
    (replacing the series there); returns the files written. ``expand``: plain diffs throughout
    (for ``git am``, never committed here: a rewrite's old lines are vllm-ascend's copy)."""
    commits = git(tree, "rev-list", "--reverse", f"{base}..HEAD").stdout.split()
    if not commits:  # a checkout at the base: writing nothing would delete the series
        raise PatchError(f"{tree} has no commits after {base[:12]}: nothing to export")
    out.mkdir(parents=True, exist_ok=True)
    for old in patches(out):
        old.unlink()
    written = []
    for number, commit in enumerate(commits, 1):
        subject = git(tree, "log", "-1", "--format=%s", commit).stdout.strip()
        body = git(tree, "log", "-1", "--format=%b", commit).stdout
        stat = git(tree, "diff", "--stat=80", f"{commit}^", commit).stdout
        options = () if expand else ("-B", "-D")
        diff = _diff(tree, commit, out, *options)
        slug = git(tree, "log", "-1", "--format=%f", commit).stdout.strip()[:SLUG_LENGTH]
        path = out / f"{number:04d}-{slug}.patch"
        path.write_bytes(render(subject, body, stat, diff, number, len(commits)).encode("utf-8"))
        written.append(path)
    return written


def apply_patch(tree: Path, patch: Path, identity: tuple[str, ...] = ()) -> None:
    """One series file as one commit on ``tree``: rewrites after their blob id is checked."""
    text = read_patch(patch)
    rewrites, rest = split_rewrites(text)
    for rewrite in rewrites:
        target = tree / rewrite.path
        found = "absent"
        if target.exists():
            found = git(tree, "hash-object", rewrite.path).stdout.strip()
        if found != rewrite.old_blob:
            raise PatchError(f"{patch.name}: {rewrite.path} is {found}, not {rewrite.old_blob}")
    if rest:
        git(tree, "apply", "--index", "--whitespace=nowarn", stdin=rest)
    for rewrite in rewrites:
        (tree / rewrite.path).write_text(rewrite.text)
        git(tree, "add", rewrite.path)
        if git(tree, "hash-object", rewrite.path).stdout.strip() != rewrite.new_blob:
            raise PatchError(f"{patch.name}: {rewrite.path} written, but not the expected blob")
    git(tree, *identity, "commit", "-q", "-F", "-", stdin=commit_message(patch))


def apply_series(tree: Path, identity: tuple[str, ...], series: list[Path]) -> str:
    """Apply every patch on ``tree``'s HEAD; returns the starting commit. All or nothing."""
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise PatchError(f"{tree} has uncommitted changes; commit or stash them first")
    start = git(tree, "rev-parse", "HEAD").stdout.strip()
    try:
        for patch in series:
            apply_patch(tree, patch, identity)
    except PatchError:
        git(tree, "reset", "-q", "--hard", start)
        raise
    return start


def expand_rewrites(tree: Path, series: list[Path], out: Path) -> list[Path]:
    """The series as plain mbox files ``git am`` applies, written to ``out`` (outside this
    repository): applied in a throw-away worktree of ``tree`` and exported with full diffs."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch) / "expand"
        git(tree, "worktree", "add", "-q", "--detach", str(work), "HEAD")
        try:
            start = apply_series(work, CHECK_IDENTITY, series)
            return export_series(work, start, out, expand=True)
        finally:
            git(tree, "worktree", "remove", "--force", str(work))


# Throw-away commits (--check, --mbox): a placeholder identity, never sent anywhere.
CHECK_IDENTITY = ("-c", "user.name=check", "-c", "user.email=check@localhost")


def git_am(tree: Path, files: list[Path]) -> subprocess.CompletedProcess:
    """``git am --keep-non-patch`` of ``files`` on ``tree`` (what a reviewer runs)."""
    return subprocess.run(
        ["git", "-C", str(tree), *CHECK_IDENTITY, "am", "-q", "--keep-non-patch", "--keep-cr",
         *map(str, files)],
        capture_output=True, text=True,
    )  # fmt: skip
