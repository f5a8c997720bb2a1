"""The control plane stays light: nothing in scheduler/ or common/ imports torch."""

import subprocess
import sys


def test_control_plane_modules_never_import_torch():
    code = (
        "import sys, importlib, pkgutil, scheduler, common\n"
        "for pkg in (scheduler, common):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy'))\n"
        "print(len(bad), bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "0", out.stdout
