"""The vllm-ascend series: where it lives, its base commit, its file format; export and apply.

Each ``NNNN-<slug>.patch`` is a commit message, a ``---`` line, ``git diff --stat`` and
``git diff -B -D --full-index``. There is deliberately no mail header: no ``From:``, no date, no
``Signed-off-by``. Whoever sends the series is its author (``apply.py`` commits with their own git
identity) and signs it off (``git rebase --signoff``).

``-B -D`` writes a file that is rewritten almost entirely (``patch_balance_schedule.py`` and its
test) as its new text only, with the old text's blob id in the ``index`` line instead of the old
lines: the old text is vllm-ascend's (and its ``schedule()`` copy is vLLM's), which this repository
does not carry. ``git apply`` does not take such sections; ``apply_series`` checks the file's blob
id (a stricter check than context lines), writes the new text and gives the rest to ``git apply``.

The patch files are the series' only copy. To change it: apply it to a vllm-ascend checkout at
``BASE_COMMIT`` (``apply.py``), amend or add commits there, and ``apply.py --export`` writes
each commit since ``BASE_COMMIT`` back as a series file. Same commits, same bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from seam_patch import PatchError, commit_message, git

HERE = Path(__file__).resolve().parent

# vllm-ascend main, fetched 2026-11-30: "[Test] add memcache dsv4-flash weekly case (#14760)".
BASE_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"
SERIES_DIR = HERE / BASE_COMMIT[:8]
# One series per base: a commit's first 8 digits, or a release as "v<version>" (its sdist on the
# package registry, or its tag; vllm_ascend/_version.py names the release in both).
RELEASE_SERIES_PREFIX = "v"
VERSION_FILE = "vllm_ascend/_version.py"
BALANCE_MODULE = "vllm_ascend/patch/platform/patch_balance_schedule.py"
SEPARATOR = "\n---\n"
SLUG_LENGTH = 54  # of the subject, as in the names the series has always had


def patches(directory: Path = SERIES_DIR) -> list[Path]:
    return sorted(directory.glob("*.patch"))


def read_patch(patch: Path) -> str:
    """A series file's text with its line ends as they are (vllm-ascend has CRLF files)."""
    return patch.read_bytes().decode("utf-8")


def all_series() -> list[Path]:
    return sorted(d for d in HERE.iterdir() if d.is_dir() and patches(d))


def tree_release(tree: Path) -> str | None:
    """The vllm-ascend release a work tree is (``vllm_ascend/_version.py``), if it says."""
    path = tree / VERSION_FILE
    if not path.exists():
        return None
    match = re.search(r"^__version__ = version = '([^']+)'", path.read_text(), re.M)
    return match.group(1) if match else None


def series_for_tree(tree: Path) -> Path:
    """The series made for ``tree``: its HEAD commit's, else its release's (PatchError if none)."""
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    release = tree_release(tree)
    for directory in all_series():
        if head.startswith(directory.name) or (
            release is not None and directory.name == f"{RELEASE_SERIES_PREFIX}{release}"
        ):
            return directory
    names = ", ".join(d.name for d in all_series())
    raise PatchError(f"no series for {tree} (HEAD {head[:12]}, release {release}); series: {names}")


def base_of(directory: Path, tree: Path) -> str:
    """The commit of ``tree`` a series was made on: the named commit, or for a release series the
    tag ``v<release>`` where the tree has it, else its root commit (an unpacked sdist)."""
    if not directory.name.startswith(RELEASE_SERIES_PREFIX):
        return git(tree, "rev-parse", directory.name).stdout.strip()
    tag = git(tree, "tag", "--list", directory.name).stdout.strip()
    if tag:
        return git(tree, "rev-parse", f"{tag}^{{commit}}").stdout.strip()
    return git(tree, "rev-list", "--max-parents=0", "HEAD").stdout.split()[0]


def render(message: str, stat: str, diff: str) -> str:
    return f"{message.strip()}\n{SEPARATOR.strip()}\n{stat.rstrip()}\n\n{diff}"


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


def post_image(path: str, directory: Path = SERIES_DIR) -> str:
    """The text the series gives ``path``, a file it rewrites whole."""
    for patch in patches(directory):
        for rewrite in split_rewrites(read_patch(patch))[0]:
            if rewrite.path == path:
                return rewrite.text
    raise ValueError(f"the series does not rewrite {path}")


def export_series(tree: Path, base: str = BASE_COMMIT, out: Path = SERIES_DIR) -> list[Path]:
    """Write each commit of ``tree`` from ``base`` to HEAD as ``NNNN-<subject>.patch`` in ``out``
    (replacing the series there); returns the files written."""
    commits = git(tree, "rev-list", "--reverse", f"{base}..HEAD").stdout.split()
    if not commits:  # a checkout at the base: writing nothing would delete the series
        raise PatchError(f"{tree} has no commits after {base[:12]}: nothing to export")
    out.mkdir(parents=True, exist_ok=True)
    for old in patches(out):
        old.unlink()
    written = []
    for number, commit in enumerate(commits, 1):
        message = git(tree, "log", "-1", "--format=%B", commit).stdout
        stat = git(tree, "diff", "--stat=80", f"{commit}^", commit).stdout
        # Through a file: git's output read as text would lose the CRs of CRLF files.
        diff_file = out / ".diff"
        git(tree, "diff", "-B", "-D", "--full-index", "--no-color", f"--output={diff_file}",
            f"{commit}^", commit)  # fmt: skip
        diff = read_patch(diff_file)
        diff_file.unlink()
        slug = git(tree, "log", "-1", "--format=%f", commit).stdout.strip()[:SLUG_LENGTH]
        path = out / f"{number:04d}-{slug}.patch"
        path.write_bytes(render(message, stat, diff).encode("utf-8"))
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


def apply_series(
    tree: Path, identity: tuple[str, ...] = (), series: list[Path] | None = None
) -> str:
    """Apply every patch on ``tree``'s HEAD; returns the starting commit. All or nothing."""
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise PatchError(f"{tree} has uncommitted changes; commit or stash them first")
    start = git(tree, "rev-parse", "HEAD").stdout.strip()
    try:
        for patch in patches() if series is None else series:
            apply_patch(tree, patch, identity)
    except PatchError:
        git(tree, "reset", "-q", "--hard", start)
        raise
    return start
