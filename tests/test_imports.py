"""``mrc_lib.data`` never imports the engine (the trainer and the readers)."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import mrc_lib.data

ENGINE = ("mrc_lib.train", "mrc_lib.models")


def test_data_modules_do_not_import_the_engine():
    modules = [f"mrc_lib.data.{m.name}" for m in pkgutil.iter_modules(mrc_lib.data.__path__)]
    assert "mrc_lib.data.squad2" in modules
    probe = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                       text=True, check=True).stdout)
    assert [m for m in loaded if m.startswith(ENGINE)] == []


def test_data_modules_do_not_import_the_engine_lazily():
    """Nor inside a function: every import statement of ``mrc_lib/data`` is checked."""
    found = []
    for path in Path(mrc_lib.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith(ENGINE)]
    assert found == []
