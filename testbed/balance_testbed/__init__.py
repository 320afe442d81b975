"""The test bed shared by tests/, benchmarks/, tools/ and upstream_patch/ (installed editable by
nox, so the repository's files it reads are found from here)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
