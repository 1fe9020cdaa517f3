#!/usr/bin/env python3
"""Gather what ``bench/gpu_bare.py`` needs on a bare, offline GPU box into one small archive.

``make gpu-bundle`` runs it::

    python bench/gpu_bundle.py [--out build/gpu-bundle] [--python 3.10,3.11,3.12,3.13]
                               [--arch x86_64,aarch64]

It writes ``build/gpu-bundle/twinrl/`` (this project's source: ``twin``, ``rewards``, ``envs``,
``trainer``, ``data``, ``bench``, ``pyproject.toml``, as git tracks them) with ``wheels/`` inside
(the dependencies a python with torch, transformers and peft lacks: pydantic, gymnasium, httpx,
docstring-parser and theirs, pure Python, at the versions of this environment; pydantic-core and
rapidfuzz, compiled, for each CPython and architecture asked), then ``build/gpu-bundle.tar.gz``.
Wheels come from PyPI through ``pip download`` (nothing is installed). The archive must stay
under :data:`LIMIT` bytes; the script fails when it does not.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The most the archive may weigh (64 MiB is what a device session may carry).
LIMIT = 48 * 2**20
#: Source folders and files the check imports or reads.
SOURCE = ("twin", "rewards", "envs", "trainer", "data", "bench", "pyproject.toml")
#: Pure-Python projects the check imports that torch, transformers and peft do not bring.
PURE = (
    "pydantic", "annotated-types", "typing-inspection", "typing-extensions",
    "gymnasium", "cloudpickle", "farama-notifications", "docstring-parser",
    "httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi",
)  # fmt: skip
#: Compiled projects the check imports: one wheel per CPython version and architecture. pydantic
#: needs its own pydantic-core release exactly; any rapidfuzz 3 serves.
COMPILED = {"pydantic-core": None, "rapidfuzz": ">=3.9,<4"}
#: manylinux tags pip may take for each architecture (newest last).
PLATFORMS = ("manylinux2014_{arch}", "manylinux_2_17_{arch}", "manylinux_2_28_{arch}")


def pinned(project: str) -> str:
    """``project==<this environment's version>``, or the bare name when it is not installed."""
    try:
        return f"{project}=={md.version(project)}"
    except md.PackageNotFoundError:
        return project


def download(dest: Path, requirements: list[str], *extra: str) -> None:
    """``pip download --no-deps --only-binary=:all:`` of ``requirements`` into ``dest``.

    Raises:
        SystemExit: pip failed (its last lines are printed).
    """
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), *extra, *requirements]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise SystemExit(
            f"gpu_bundle: pip download {' '.join(requirements)} {' '.join(extra)} failed:\n{tail}"
        )


def gather_wheels(dest: Path, pythons: list[str], arches: list[str]) -> list[str]:
    """The pure wheels once, the compiled ones per python version and architecture.

    Returns:
        The ``python/arch`` pairs with no compiled wheels (said, not fatal: the check then needs
        that python to have pydantic and rapidfuzz itself).
    """
    dest.mkdir(parents=True, exist_ok=True)
    download(dest, [pinned(p) for p in PURE])
    compiled = [f"{p}{spec}" if spec else pinned(p) for p, spec in COMPILED.items()]
    missing = []
    for arch in arches:
        platforms = [a for p in PLATFORMS for a in ("--platform", p.format(arch=arch))]
        for version in pythons:
            try:
                download(
                    dest,
                    compiled,
                    "--python-version",
                    version,
                    "--implementation",
                    "cp",
                    *platforms,
                )
            except SystemExit as exc:
                print(
                    f"{exc}\ngpu_bundle: no compiled wheels for CPython {version} on {arch}",
                    file=sys.stderr,
                )
                missing.append(f"{version}/{arch}")
    return missing


def copy_source(dest: Path) -> int:
    """The tracked files of :data:`SOURCE` (git ls-files), or every file when git is not there."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", *SOURCE], cwd=ROOT, capture_output=True, text=True, check=True
        )
        files = [ROOT / f for f in listed.stdout.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        files = [
            f
            for s in SOURCE
            for f in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))
        ]
    n = 0
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts:
            target = dest / f.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-bundle")
    parser.add_argument(
        "--python", default="3.10,3.11,3.12,3.13", help="CPython versions of the compiled wheels"
    )
    parser.add_argument(
        "--arch", default="x86_64", help="architectures of the compiled wheels (aarch64 for GH200)"
    )
    args = parser.parse_args(argv)
    pythons = [v.strip() for v in args.python.split(",") if v.strip()]
    arches = [a.strip() for a in args.arch.split(",") if a.strip()]
    tree = args.out / "twinrl"
    shutil.rmtree(args.out, ignore_errors=True)
    files = copy_source(tree)
    missing = gather_wheels(tree / "wheels", pythons, arches)
    archive = args.out.with_suffix(".tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname="twinrl")
    size = archive.stat().st_size
    wheels = len(list((tree / "wheels").glob("*.whl")))
    print(f"gpu_bundle: {archive} ({size / 2**20:.1f} MiB): {files} source files, {wheels} wheels "
          f"(compiled for CPython {', '.join(pythons)} on {', '.join(arches)})")  # fmt: skip
    if missing:
        print(
            f"gpu_bundle: not covered (no compiled wheels): {', '.join(missing)}", file=sys.stderr
        )
    here = f"{sys.version_info[0]}.{sys.version_info[1]}/{platform.machine()}"
    if here in missing:
        return 1
    if size > LIMIT:
        print(
            f"gpu_bundle: the archive is over {LIMIT / 2**20:.0f} MiB; ask for fewer --python / "
            "--arch",
            file=sys.stderr,
        )
        return 1
    print("on the GPU box: tar xzf gpu-bundle.tar.gz && python3 twinrl/bench/gpu_bare.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
