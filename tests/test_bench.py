"""``bench`` runs tiny on CPU and reports every measurement (no timing is asserted)."""

import json
from argparse import Namespace

import pytest
import torch

from mrc_lib.bench import SyntheticVocab, bench_cli, synthetic_batch


def test_synthetic_batch_is_well_formed():
    vocab = SyntheticVocab.random(size=500, dim=8)
    batch = synthetic_batch(vocab, batch_size=4, context_len=20)
    assert batch["c_words"].shape == (4, 20) and batch["q_chars"].shape == (4, 30, 16)
    assert batch["c_words"].min() >= 1 and batch["c_words"].max() < 500
    assert (batch["y1"] <= batch["y2"]).all() and (batch["y2"] < 20).all()
    assert (batch["y2"] - batch["y1"] < 15).all()
    assert torch.equal(batch["c_words"], synthetic_batch(vocab, 4, 20)["c_words"])


@pytest.mark.parametrize("model", ["bidaf", "qanet"])
def test_bench_reports_positive_measurements(tmp_path, model):
    args = Namespace(model=model, seq_len=12, batch_size=2, steps=1, device="cpu",
                     out=str(tmp_path / "bench.json"))
    result = bench_cli(args)
    assert json.loads((tmp_path / "bench.json").read_text()) == result
    assert result["model"] == model and result["bf16"] is False
    for key in ("train_examples_per_s", "infer_examples_per_s", "projected_epoch_seconds",
                "peak_memory_bytes"):
        assert result[key] > 0
    assert result["projected_epoch_seconds"] == pytest.approx(
        87_599 / result["train_examples_per_s"])
    assert 0 < result["params"]["trainable"] < result["params"]["total"]
