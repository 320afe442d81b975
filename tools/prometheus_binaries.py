#!/usr/bin/env python3
"""Prometheus and promtool for the monitoring tests, from Debian's ``prometheus`` package.

    python tools/prometheus_binaries.py install   # exit 3 (reason recorded) where it cannot
    python tools/prometheus_binaries.py which promtool

``install`` fetches the package with ``apt-get download`` and unpacks it with ``dpkg-deb -x``
into the cache (``$VLLM_BALANCE_CACHE/prometheus``, beside the sdists): no root needed where apt
has its package lists, no service started, nothing else of the system changed. As root it runs
``apt-get update`` first when the download fails (a fresh machine has no lists). The two
binaries need only libc. The archive's version is taken as it is (bookworm: 2.42.0+ds-5+deb12u1,
what the tests were written on): a stable release keeps one version per package, so an exact
pin would break a fresh clone at the next point release.

Where it cannot install, the reason goes to ``refusal.txt`` in the cache and the tests that need
the binaries skip with it (``tests/monitoring.py``). ``which`` prefers the cache, then PATH.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The cache of testbed/balance_testbed/seam_patch.py's sdists (read here, not imported: this script
# needs only the standard library).
CACHE = Path(os.environ.get("VLLM_BALANCE_CACHE", Path.home() / ".cache" / "vllm-balance"))
PACKAGE = "prometheus"
HOME = CACHE / "prometheus"
BINARIES = ("promtool", "prometheus")
REFUSAL = HOME / "refusal.txt"


class InstallError(RuntimeError):
    """Why the binaries could not be installed (one line)."""


def which(name: str) -> Path | None:
    """The cached binary ``name``, else the one on PATH, else None."""
    cached = HOME / "usr" / "bin" / name
    if cached.is_file():
        return cached
    found = shutil.which(name)
    return Path(found) if found else None


def refusal() -> str:
    """Why the binaries are missing, for a skip message."""
    recorded = REFUSAL.read_text().strip() if REFUSAL.exists() else "install not run"
    return (
        f"{'/'.join(BINARIES)} not in {HOME / 'usr' / 'bin'} nor on PATH "
        f"(`python tools/prometheus_binaries.py install`: {recorded})"
    )


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True)


def _download(into: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise InstallError("no apt-get/dpkg-deb here (not a Debian-based machine)")
    done = _run(["apt-get", "download", PACKAGE], into)
    if done.returncode != 0 and os.geteuid() == 0:
        _run(["apt-get", "update"], into)  # a fresh machine has no package lists yet
        done = _run(["apt-get", "download", PACKAGE], into)
    debs = sorted(into.glob(f"{PACKAGE}_*.deb"))
    if done.returncode != 0 or not debs:
        reason = (done.stderr.strip().splitlines() or ["no .deb"])[-1]
        root = "" if os.geteuid() == 0 else "; not root: `apt-get update` could not be run"
        raise InstallError(f"apt-get download {PACKAGE} failed: {reason}{root}")
    return debs[-1]


def install() -> str:
    """The binaries in the cache (a no-op when there); returns promtool's version line."""
    HOME.parent.mkdir(parents=True, exist_ok=True)
    if not all((HOME / "usr" / "bin" / name).is_file() for name in BINARIES):
        with tempfile.TemporaryDirectory(dir=HOME.parent) as scratch:
            deb = _download(Path(scratch))
            unpacked = Path(scratch) / "root"
            done = _run(["dpkg-deb", "-x", str(deb), str(unpacked)], Path(scratch))
            if done.returncode != 0:
                raise InstallError(f"dpkg-deb -x {deb.name} failed: {done.stderr.strip()}")
            shutil.rmtree(HOME, ignore_errors=True)
            try:
                unpacked.rename(HOME)  # whole or not at all: another session may look meanwhile
            except OSError:  # another session's install got there first
                if not (HOME / "usr" / "bin" / "promtool").is_file():
                    raise
    version = _run([str(HOME / "usr" / "bin" / "promtool"), "--version"], HOME)
    if version.returncode != 0:
        raise InstallError(f"the unpacked promtool does not run: {version.stderr.strip()}")
    REFUSAL.unlink(missing_ok=True)
    return version.stdout.splitlines()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="fetch and unpack Debian's prometheus into the cache")
    find = sub.add_parser("which", help="print a binary's path (exit 1 if missing)")
    find.add_argument("name", choices=BINARIES)
    args = parser.parse_args()
    if args.command == "which":
        path = which(args.name)
        print(path or refusal())
        return 0 if path else 1
    try:
        print(f"{install()} in {HOME}")
    except InstallError as exc:
        HOME.mkdir(parents=True, exist_ok=True)
        REFUSAL.write_text(f"{exc}\n")
        print(f"cannot install Prometheus: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
