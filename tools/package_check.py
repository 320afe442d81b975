"""Check a built wheel as a dependent would use it (run by ``nox -s package``).

    python tools/package_check.py <wheel> <vllm-ascend sdist> [<vllm-ascend sdist> ...]

1. The ``ascend`` extra pins nothing that conflicts with a vllm-ascend release's own pins: for
   every requirement of the extra that the release also names, the release's pinned version must
   satisfy ours (read from the sdist's ``PKG-INFO``: its ``Requires-Dist``).
2. The wheel holds two top-level packages: the product ``vllm_balance`` and the simulator
   ``balance_sim``.
3. Installed from the wheel (this interpreter's environment), vLLM's own
   ``load_general_plugins()`` finds the entry point and the plugin installs its
   ``run_engine_core`` wrapper; a DP=2 MoE config with the key activates balance scheduling.
"""

from __future__ import annotations

import argparse
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


# The product and, beside it, the simulator that drives it (never inside it).
TOP_LEVEL_PACKAGES = {"vllm_balance", "balance_sim"}


def top_level_packages(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist() if name.endswith(".py")}


def sdist_metadata(sdist: Path):
    with tarfile.open(sdist) as tar:
        [member] = [
            m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        ]
        return Parser().parsestr(tar.extractfile(member).read().decode())


def extra_conflicts(wheel: Path, sdist: Path) -> list[str]:
    ours = [Requirement(r) for r in wheel_metadata(wheel).get_all("Requires-Dist") or []]
    ascend_extra = [r for r in ours if r.marker and r.marker.evaluate({"extra": "ascend"})]
    theirs = {}
    for line in sdist_metadata(sdist).get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        pinned = [s.version for s in requirement.specifier if s.operator == "=="]
        if pinned:
            theirs[requirement.name.lower().replace("_", "-")] = pinned[0]
    conflicts = []
    for requirement in ascend_extra:
        version = theirs.get(requirement.name.lower().replace("_", "-"))
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            conflicts.append(f"{requirement} vs {sdist.name}'s {requirement.name}=={version}")
    return conflicts


def activates_through_the_entry_point() -> str:
    import vllm.plugins
    from vllm.v1.engine.core import EngineCoreProc

    from balance_testbed import factories
    from vllm_balance import activation

    vllm.plugins.load_general_plugins()
    wrapper = EngineCoreProc.__dict__["run_engine_core"].__func__
    assert wrapper.__module__ == "vllm_balance.activation", wrapper
    config = factories.make_vllm_config(
        moe=True, data_parallel_size=2, additional_config={"enable_balance_scheduling": True}
    )
    assert activation.activate_for(config) is True
    return config.scheduler_config.scheduler_cls.__name__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the built wheel (installed in this environment)")
    parser.add_argument("sdists", type=Path, nargs="*", help="vllm-ascend sdists to check against")
    args = parser.parse_args()
    wheel, sdists = args.wheel, args.sdists
    import vllm_balance

    installed = Path(vllm_balance.__file__).resolve()
    assert "site-packages" in installed.parts, f"not the installed wheel: {installed}"
    packages = top_level_packages(wheel)
    if packages != TOP_LEVEL_PACKAGES:
        print(f"the wheel holds {sorted(packages)}, expected {sorted(TOP_LEVEL_PACKAGES)}")
        return 1
    print(f"wheel packages: {', '.join(sorted(packages))}")
    for sdist in sdists:
        conflicts = extra_conflicts(wheel, sdist)
        if conflicts:
            print("the ascend extra conflicts:", *conflicts, sep="\n  ")
            return 1
        print(f"ascend extra: no conflict with {sdist.name}'s pins")
    placeholders = [
        url for url in wheel_metadata(wheel).get_all("Project-URL") or [] if ".invalid/" in url
    ]
    if placeholders:  # CI builds the package too: said, not failed (docs/releasing.md, step 1)
        print("not releasable yet: placeholder project URLs:", *placeholders, sep="\n  ")
    scheduler = activates_through_the_entry_point()
    print(f"installed from {wheel.name}: the entry point activates balance ({scheduler})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
