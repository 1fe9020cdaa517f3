"""``bench/gpu_bare.py`` (the GPU check for a bare offline box) and ``make gpu-bundle``.

The slow test builds the bundle as a user would, unpacks it, and runs the check with ``--device
cpu --tiny`` under a python that has torch, transformers and peft (and what they need) but not
pydantic, gymnasium, httpx or rapidfuzz: everything else must come from the bundle's wheels.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# a script, not a package: loaded from its file so bench/ never joins sys.path
_spec = importlib.util.spec_from_file_location("gpu_bare", ROOT / "bench" / "gpu_bare.py")
gpu_bare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bare)

#: What a bare GPU box's python lacks (the check must bring it along).
# fmt: off
ABSENT = {
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gymnasium", "sqlalchemy",
    "duckdb", "rapidfuzz", "docstring-parser", "httpx", "httpcore", "rich", "typer",
}
# fmt: on


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        for inner, text in files.items():
            zf.writestr(inner, text)
    return path


def test_use_wheels_takes_what_this_python_lacks_and_can_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    _wheel(tmp_path, "fakepkg_26-1.0-py3-none-any.whl", {"fakepkg_26/__init__.py": "VALUE = 26\n"})
    _wheel(tmp_path, "otherarch_26-1.0-cp27-cp27m-win32.whl", {"otherarch_26/__init__.py": ""})
    old = md.version("typing_extensions")
    _wheel(
        tmp_path,
        "typing_extensions-0.0.1-py3-none-any.whl",
        {"typing_extensions.py": "BROKEN = 1\n"},
    )
    used = gpu_bare.use_wheels(tmp_path)
    assert used == ["fakepkg-26==1.0"]  # not the windows one, not an older typing_extensions
    import fakepkg_26

    assert fakepkg_26.VALUE == 26 and md.version("typing_extensions") == old
    assert gpu_bare.use_wheels(tmp_path) == used  # unpacked once, reused


def test_the_flop_count_is_qwen3_8bs_matmuls() -> None:
    config = gpu_bare.qwen3_config("8b")
    embedding = config.vocab_size * config.hidden_size
    # published: 8.19 B parameters, of which the input embedding does no matmul
    assert abs(gpu_bare.linear_params(config) + embedding - 8.19e9) / 8.19e9 < 0.01
    assert gpu_bare.model_flops_per_token(config, 8192) > 4 * gpu_bare.linear_params(config)


def test_bad_arguments_say_what_is_allowed() -> None:
    run = [sys.executable, str(ROOT / "bench" / "gpu_bare.py")]
    proc = subprocess.run(
        [*run, "--only", "learner,nope"], capture_output=True, text=True, timeout=60, check=False
    )
    assert (
        proc.returncode == 2 and "unknown part(s) nope; choose from learner, logits" in proc.stderr
    )
    proc = subprocess.run(
        [*run, "--device", "gpu"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2 and "--device must be cpu or cuda[:N], got 'gpu'" in proc.stderr


def _bare_python(target: Path) -> Path:
    """A venv that sees torch, transformers, peft and their own requirements, linked from this
    environment, and none of :data:`ABSENT`."""
    todo, dists = ["torch", "transformers", "peft"], {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in dists or name in ABSENT:
            continue
        try:
            dists[name] = dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    site = target / "site"
    site.mkdir(parents=True)
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if (
                top.endswith(".pth")
                or top == ".."
                or not (base / top).exists()
                or (site / top).exists()
            ):
                continue
            (site / top).symlink_to(base / top)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(target / "venv")], check=True
    )
    (lib,) = (target / "venv" / "lib").glob("python3*")
    (lib / "site-packages" / "bare.pth").write_text(f"{site.resolve()}\n")
    return target / "venv" / "bin" / "python"


@pytest.mark.slow
def test_the_bundle_runs_the_check_under_a_bare_python(tmp_path: Path) -> None:
    make = subprocess.run(
        ["make", "-o", ".venv/.installed", "gpu-bundle", f"PY={sys.executable}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert make.returncode == 0, make.stdout[-2000:] + make.stderr[-2000:]
    archive = ROOT / "build" / "gpu-bundle.tar.gz"
    assert archive.stat().st_size < 64 * 2**20 * 0.75  # well under what a device session carries
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "box", filter="data")
    python = _bare_python(tmp_path / "env")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    lacks = subprocess.run(
        [str(python), "-c", "import pydantic"],
        capture_output=True,
        text=True,
        env=clean,
        check=False,
    )
    assert lacks.returncode != 0 and "No module named 'pydantic'" in lacks.stderr
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [str(python), "twinrl/bench/gpu_bare.py", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=tmp_path / "box", capture_output=True, text=True, timeout=600, env=clean, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"pydantic==" + md.version("pydantic"), "gymnasium==" + md.version("gymnasium")} <= set(
        result["wheels_used"]
    )
    parts = result["parts"]
    assert set(parts) == {"learner", "logits", "adapter_save", "decode", "grpo"}
    assert not [p for p in parts.values() if "error" in p], parts
    assert parts["learner"]["tokens_per_s"] > 0 and parts["learner"]["plan_learner_gib"] > 0
    assert parts["logits"]["chunked"]["chunk"] < parts["logits"]["unchunked"]["chunk"]
    assert parts["decode"]["seqs_256"]["tokens"] == 256 * parts["decode"]["new_tokens"]
    assert parts["grpo"]["steps"] == 2 and all(r is not None for r in parts["grpo"]["rewards"])
    for line in ("learner       tokens/s", "decode        256 sequences", "grpo          2 steps"):
        assert line in proc.stdout, proc.stdout
