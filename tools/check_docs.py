#!/usr/bin/env python3
"""Check README.md, docs/*.md and upstream_patch/**/*.md: every relative link resolves
(file and #anchor).

Run by the lint session (pre-commit hook "docs-links"). Exit 1 with one line per dead link.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.*)$", re.MULTILINE)


def anchors(path: Path) -> set[str]:
    slugs = set()
    for title in HEADING.findall(path.read_text(encoding="utf-8")):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def dead_links(doc: Path) -> list[str]:
    dead = []
    text = doc.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if not resolved.exists():
            dead.append(f"{doc.relative_to(ROOT)}: dead link {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            dead.append(
                f"{doc.relative_to(ROOT)}: no heading for #{anchor} in {file_part or doc.name}"
            )
    return dead


def main() -> int:
    docs = [
        ROOT / "README.md",
        *sorted(ROOT.glob("docs/*.md")),
        *sorted(ROOT.glob("upstream_patch/**/*.md")),
    ]
    problems = [line for doc in docs if doc.exists() for line in dead_links(doc)]
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
