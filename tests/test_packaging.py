"""Installed layout: everything lives under the one `pagedkv` package, nothing top-level.

PyPI has distributions named common, scheduler, worker and kernels (kernels is one transformers can
use); installing ours as top-level packages would overwrite theirs, and `python -m worker` started
in a directory holding a worker.py would run the wrong program.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "__init__.py", "common", "scheduler", "worker", "kernels", "bench"]
SHADOWS = ["common", "scheduler", "worker", "kernels"]


def write_shadows(directory: Path) -> None:
    """Modules named like pagedkv's folders that fail loudly if anything imports them."""
    for name in SHADOWS:
        (directory / f"{name}.py").write_text(f"raise ImportError('the local {name}.py was imported')\n")


def test_pip_install_puts_nothing_but_pagedkv_at_the_top_of_site_packages(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes its egg-info and build/ next to the sources
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, src / name)
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    top = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top == {"pagedkv"}
    for package in ("common", "scheduler", "worker", "kernels", "bench"):
        assert (site / "pagedkv" / package / "__init__.py").is_file()
    # the C kernels are built from source on first use: every source file ships
    sources = {p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".c", ".h")}
    assert sources and sources <= {p.name for p in (site / "pagedkv" / "kernels").iterdir()}
    # the installed copy imports whole from a directory full of look-alike modules
    write_shadows(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import pagedkv.scheduler.engine, pagedkv.worker.worker, "
                            "pagedkv.bench.replay, pagedkv; print(pagedkv.__file__)"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == str(site / "pagedkv" / "__init__.py")
