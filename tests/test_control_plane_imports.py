"""The architecture's import rules: the control plane loads no torch, and no two modules import each other."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "scheduler", "worker", "kernels", "bench")


def test_control_plane_modules_never_import_torch():
    code = (
        "import sys, importlib, pkgutil\n"
        "import pagedkv.scheduler, pagedkv.common, pagedkv.bench\n"
        "names = []\n"
        "for pkg in (pagedkv.scheduler, pagedkv.common, pagedkv.bench):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "        names.append(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy'))\n"
        "print(len(bad), len(names), bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    num_bad, num_modules = map(int, out.stdout.split()[:2])
    assert num_bad == 0, out.stdout
    on_disk = [p for pkg in ("scheduler", "common", "bench") for p in (REPO / pkg).glob("*.py") if p.stem != "__init__"]
    assert num_modules == len(on_disk)  # every module of the three packages was imported


def module_imports() -> dict[str, set[str]]:
    """pagedkv module -> the pagedkv modules it imports (at any depth of the file), from the source."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).glob("*.py"):
            name = f"pagedkv.{package}" + ("" if path.stem == "__init__" else f".{path.stem}")
            modules[name] = path
    edges = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedkv"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("pagedkv")}
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and \
                    node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def test_no_two_modules_import_each_other():
    edges = module_imports()
    assert edges["pagedkv.scheduler.cli"] >= {"pagedkv.bench.replay"}  # the reader sees lazy imports too

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in edges[start])

    cycles = sorted((a, b) for a in edges for b in edges[a] if reaches(b, a, set()))
    assert cycles == []


def test_the_serving_path_does_not_import_the_benchmark():
    edges = module_imports()
    serving = [m for m in edges if m.startswith(("pagedkv.scheduler", "pagedkv.common", "pagedkv.worker"))
               and m != "pagedkv.scheduler.cli"]  # the CLI's `bench` subcommand runs it
    assert [m for m in serving if any(d.startswith("pagedkv.bench") for d in edges[m])] == []
