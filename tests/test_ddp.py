"""DDP: ``torchrun`` starts two CPU processes (Gloo) that train the toy reader of
``test_train.py`` together; rank 0 alone evaluates and writes the run.

Run as a script (``python tests/test_ddp.py OUT``), this file is the entry point of each process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_processes_train_and_only_rank_zero_writes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", __file__, str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    # 64 examples in batches of 16: 4 batches an epoch, 2 for each process.
    assert metrics["steps"] == 2 * 2
    assert metrics["dev"]["f1"] >= 0.0
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2]
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert len(predictions) == 32


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import toy_config, toy_data

    from mrc_lib.train import train

    train(toy_config(), sys.argv[1], data=toy_data())
