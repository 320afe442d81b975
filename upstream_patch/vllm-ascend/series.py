"""The vllm-ascend series: where it lives, its base commit, its file format.

Each ``NNNN-<slug>.patch`` is a commit message, a ``---`` line, ``git diff --stat`` and
``git diff -B -D --full-index``. There is deliberately no mail header: no ``From:``, no date, no
``Signed-off-by``. Whoever sends the series is its author (``apply.py`` commits with their own git
identity) and signs it off (``git rebase --signoff``).

``-B -D`` writes a file that is rewritten almost entirely (``patch_balance_schedule.py`` and its
test) as its new text only, with the old text's blob id in the ``index`` line instead of the old
lines: the old text is vllm-ascend's (and its ``schedule()`` copy is vLLM's), which this repository
does not carry. ``git apply`` does not take such sections; ``apply.py`` checks the file's blob id
(a stricter check than context lines), writes the new text and gives the rest to ``git apply``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# vllm-ascend main, fetched 2026-11-30: "[Test] add memcache dsv4-flash weekly case (#14760)".
BASE_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"
SERIES_DIR = HERE / BASE_COMMIT[:8]
BALANCE_MODULE = "vllm_ascend/patch/platform/patch_balance_schedule.py"
SEPARATOR = "\n---\n"


def patches(directory: Path = SERIES_DIR) -> list[Path]:
    return sorted(directory.glob("*.patch"))


def render(message: str, stat: str, diff: str) -> str:
    return f"{message.strip()}\n{SEPARATOR.strip()}\n{stat.rstrip()}\n\n{diff}"


def message_of(patch_text: str) -> str:
    """The commit message (subject, blank line, body) of one series file."""
    return patch_text.split(SEPARATOR, 1)[0].strip() + "\n"


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
        for rewrite in split_rewrites(patch.read_text())[0]:
            if rewrite.path == path:
                return rewrite.text
    raise ValueError(f"the series does not rewrite {path}")
