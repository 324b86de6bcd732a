"""What imports what: ``mrc_lib.data`` never imports the engine, and loading prepared data needs
no spaCy (the GPU machine has none)."""

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


def test_the_gpu_machine_loads_prepared_data_without_spacy(mirror, tmp_path):
    """The GPU machine has neither spaCy (``../shared/gpu/README.md``) nor the raw files: the
    packed runner's modules import without spaCy, and prepared SQuAD, in its multi-passage form
    too, loads from the cache alone."""
    import os

    from mrc_lib.config import resolve_config
    from mrc_lib.train import load_data

    configs = [resolve_config("bidaf", profile="smoke"),
               resolve_config("dynsan", profile="smoke", overrides=["data_options.passages=2"])]
    sizes = [len(load_data(cfg).splits["train"]) for cfg in configs]  # built here, with spaCy
    (tmp_path / "configs.json").write_text(json.dumps([cfg.to_dict() for cfg in configs]))
    probe = ("import json, sys\nsys.modules['spacy'] = None  # import spacy: ImportError\n"
             "import mrc_lib.data.choice, mrc_lib.data.cloze, mrc_lib.queue, mrc_lib.tasks\n"
             "from mrc_lib.config import TrainConfig\nfrom mrc_lib.train import load_data\n"
             f"configs = json.load(open({str(tmp_path / 'configs.json')!r}))\n"
             "print(json.dumps([len(load_data(TrainConfig.from_dict(c)).splits['train'])\n"
             "                  for c in configs]))")
    env = {**os.environ, "MRC_DATA_DIR": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == sizes
