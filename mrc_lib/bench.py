"""Throughput and peak memory of a reader at a profile's size (``full`` by default), on
synthetic batches (which carry the keys of every task's batches).

The reader is built with the profile's hyperparameters over a random vocabulary the
size of SQuAD v1.1's with GloVe 50d, and fed random batches with contexts of ``seq_len``
tokens and questions of 30. After a few warm-up steps it measures training (forward, backward,
optimizer step and weight averaging, exactly the trainer's step) and inference examples per
second, and projects the seconds per epoch of SQuAD v1.1 training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.config import TrainConfig, resolve_config
from mrc_lib.inference import bf16_autocast
from mrc_lib.models import build_model
from mrc_lib.train import (
    EMA,
    TrainingStep,
    autocast,
    build_optimizer,
    count_parameters,
    device_name,
    new_graph_step,
    peak_memory_bytes,
    resolve_device,
)
from mrc_lib.utils import atomic_write_json

SQUAD_TRAIN_EXAMPLES = 87_599
# The readers' code as their speed knows it, recorded in each bring-up entry and profile file:
# a change that makes a step faster or slower without changing any config raises it, and a GPU
# session then measures the eager bring-up and the profile again (benchmarks/gpu_session.py).
# 1: the first bring-ups and the first profile (2026-11-24 to 26); 2: padding zeroed by one
# multiplication (mrc_lib.nn.zero_padding) instead of masked_fill's negation, copy and fill;
# 3: RNN layers in full precision under bf16 autocast, where torch ran them in fp16
# (mrc_lib.nn.rnn.full_precision).
SPEED_REVISION = 3
# The revision of the recorded step's check (benchmarks/gpu_bringup.py --cuda-graphs, written to
# its file as agreement_revision; a file without the field is of revision 1). 2: the check's
# eager step trains in train mode; in revision 1 it ran in the eval mode that the inference
# timing left, so every RNN reader failed (a cuDNN RNN has no backward in eval mode) and the
# others' agreement compared a step with dropout to one without.
AGREEMENT_REVISION = 2
# A bring-up entry's error while its measurement runs, kept with the seconds it had when its
# command was cut (benchmarks/gpu_bringup.py; the Full-scale runs page shows them).
CUT = "cut: the command ended before this reader's measurement did"
# A reader compiled whole and cut after this long is not tried again, on its GPU or another on
# its chip: every process of a GPU command (8.5 minutes at most) would compile as long before
# its first step.
WHOLE_FINAL_SECONDS = 240
QUESTION_LEN = 30
WORD_CHARS = 16  # the data pipeline truncates words to 16 characters
WARMUP_STEPS = 3
CANDIDATES = 10  # candidates per question in synthetic batches (the CBT's number)


@dataclass
class SyntheticVocab:
    """A random vocabulary the size of the one ``prepare`` builds for SQuAD v1.1 with GloVe 6B
    50d: 72,498 words, of which the first 476 are learned, and 227 characters."""

    word_vectors: np.ndarray
    n_trainable: int = 476
    n_chars: int = 227
    n_feats: int = 4
    # the tag sets of en_core_web_sm, for readers that embed POS/NER tags (sizes matter only)
    pos_tags: list = field(default_factory=lambda: [f"pos{i}" for i in range(50)])
    ner_tags: list = field(default_factory=lambda: [f"ner{i}" for i in range(19)])

    @classmethod
    def random(cls, size: int = 72_498, dim: int = 50, seed: int = 0) -> SyntheticVocab:
        rng = np.random.default_rng(seed)
        return cls(rng.normal(0.0, 0.4, (size, dim)).astype(np.float32))


def synthetic_batch(vocab: SyntheticVocab, batch_size: int, context_len: int,
                    question_len: int = QUESTION_LEN, seed: int = 0) -> dict[str, Tensor]:
    """A random batch with every key of :mod:`mrc_lib.data` batches and no padding: those of a
    SQuAD batch, and those of the choice tasks' batches (:mod:`mrc_lib.data.choice`), whose
    document is the context, whose query is the question and whose candidates are the words of
    the first (up to) :data:`CANDIDATES` context positions, the answer the first of them."""
    g = torch.Generator().manual_seed(seed)
    V = len(vocab.word_vectors)

    def side(length: int) -> tuple[Tensor, Tensor, Tensor]:
        words = torch.randint(1, V, (batch_size, length), generator=g)
        chars = torch.randint(1, vocab.n_chars, (batch_size, length, WORD_CHARS), generator=g)
        return words, chars, torch.ones(batch_size, length, dtype=torch.bool)

    c_words, c_chars, c_mask = side(context_len)
    q_words, q_chars, q_mask = side(question_len)
    tags = {f"{side_}_{kind}": torch.randint(1, len(names), (batch_size, n), generator=g)
            for side_, n in (("c", context_len), ("q", question_len))
            for kind, names in (("pos", vocab.pos_tags), ("ner", vocab.ner_tags))}
    y1 = torch.randint(0, context_len, (batch_size,), generator=g)
    y2 = (y1 + torch.randint(0, 15, (batch_size,), generator=g)).clamp(max=context_len - 1)
    n_cands = min(CANDIDATES, context_len)
    position = torch.arange(context_len).expand(batch_size, -1)
    choice = {"doc_words": c_words, "doc_forms": c_words, "doc_mask": c_mask,
              "query_words": q_words, "query_mask": q_mask,
              "cand_words": c_words[:, :n_cands], "cand_forms": c_words[:, :n_cands],
              "cand_index": position.where(position < n_cands, -1),
              "cand_mask": torch.ones(batch_size, n_cands, dtype=torch.bool),
              "answer": torch.zeros(batch_size, dtype=torch.long)}
    return {"c_words": c_words, "c_chars": c_chars, "c_mask": c_mask,
            "q_words": q_words, "q_chars": q_chars, "q_mask": q_mask,
            "c_feats": torch.rand(batch_size, context_len, vocab.n_feats, generator=g),
            "q_feats": torch.randint(0, 2, (batch_size, question_len, 3), generator=g).float(),
            "q_type": torch.zeros(batch_size, dtype=torch.long), "y1": y1, "y2": y2,
            "has_answer": torch.ones(batch_size, dtype=torch.bool),
            "idx": torch.arange(batch_size), **tags, **choice}


def _seconds(fn: Callable[[], object], steps: int, device: torch.device,
             warmup: int = WARMUP_STEPS) -> float:
    """Wall time of ``steps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tic = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


def time_steps(step: TrainingStep, batch: dict[str, Tensor], steps: int,
               warmup: int = WARMUP_STEPS, infer: bool = True) -> tuple[float, float | None]:
    """Seconds of ``steps`` calls of the trainer's step ``step`` (a :class:`TrainingStep`:
    :func:`~mrc_lib.train.train_step`, then the weight average's update; with
    ``cuda_graphs``, recorded and replayed) and of ``steps`` inference passes of its reader on
    ``batch`` (``None`` without ``infer``), each after ``warmup`` untimed ones. The step runs its
    ``net``: the reader itself or its ``torch.compile`` wrapper."""
    cfg, dev = step.cfg, step.device

    @torch.no_grad()
    def infer_once():
        new_graph_step(cfg)
        with autocast(cfg, dev):
            step.net(batch)

    step.model.train()
    train_seconds = _seconds(lambda: step(batch), steps, dev, warmup)
    if not infer:
        return train_seconds, None
    step.model.eval()
    return train_seconds, _seconds(infer_once, steps, dev, warmup)


@dataclass
class Setup:
    """A reader ready for the trainer's step on synthetic batches."""

    cfg: TrainConfig
    device: torch.device
    vocab: SyntheticVocab
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ema: EMA | None

    def batch(self, seq_len: int, seed: int = 0) -> dict[str, Tensor]:
        """A synthetic batch of ``cfg.batch_size`` with contexts of ``seq_len`` tokens, on the
        device."""
        return {k: v.to(self.device) for k, v in
                synthetic_batch(self.vocab, self.cfg.batch_size, seq_len, seed=seed).items()}


def full_readers() -> list[str]:
    """The registered readers that the full profile configures."""
    from mrc_lib.config import profile_values
    from mrc_lib.errors import UserError
    from mrc_lib.models import MODELS

    names = []
    for name in sorted(MODELS):
        try:
            profile_values("full", name)
        except UserError:
            continue
        names.append(name)
    return names


def overrides(device: str, tiny: bool = False, compile_mode: str | None = None,
              whole: bool = False, fp32: bool = False, cuda_graphs: bool = False) -> list[str]:
    """The config keys a GPU benchmark sets over its profile's: the device, batches of 2 for a
    ``tiny`` check, full precision (``fp32``: no bf16 autocast, TF32 matrix products), the
    step recorded as CUDA graphs (``cuda_graphs``) and ``torch.compile`` in ``compile_mode``
    (of the ``whole`` reader)."""
    keys = [f"device={device}"] + (["batch_size=2"] if tiny else []) + \
        (["bf16=false"] if fp32 else []) + (["cuda_graphs=true"] if cuda_graphs else [])
    if compile_mode:
        keys += ["compile=true", f"compile_mode={compile_mode}"] + \
            (["compile_whole=true"] if whole else [])
    return keys


def same_code(measured: dict) -> bool:
    """Whether a speed measurement (a bring-up entry, a profile file) was made of the readers'
    code of today (:data:`SPEED_REVISION`; one without the field is of revision 1)."""
    return measured.get("speed_revision", 1) == SPEED_REVISION


def same_check(found: dict) -> bool:
    """Whether a recorded-step file (``gpu_<device>_cuda_graphs.json``) was checked by today's
    :data:`AGREEMENT_REVISION`."""
    return found.get("agreement_revision", 1) == AGREEMENT_REVISION


def reader_hash(model_name: str, profile: str = "full", overrides: Sequence[str] = ()) -> str:
    """The config hash of reader ``model_name`` as :func:`setup` configures it: what a
    bring-up entry records, to tell whether the reader has changed since."""
    from mrc_lib.records import config_hash

    return config_hash(resolve_config(model_name, profile=profile,
                                      overrides=list(overrides)).to_dict())


def setup(model_name: str, profile: str = "full", overrides: Sequence[str] = (),
          vocab_size: int | None = None) -> Setup:
    """Reader ``model_name`` with ``profile``'s hyperparameters (and ``overrides``), seeded,
    over a synthetic vocabulary (SQuAD's size unless ``vocab_size``), on the configured device,
    with the trainer's optimizer and weight average."""
    cfg = resolve_config(model_name, profile=profile, overrides=list(overrides))
    dev = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    vocab = SyntheticVocab.random(**({} if vocab_size is None else {"size": vocab_size}))
    model = build_model(cfg.model, vocab, **cfg.hparams).to(dev)
    optimizer = build_optimizer(cfg, model, dev)
    ema = EMA(model, cfg.ema_decay) if cfg.ema_decay is not None else None
    return Setup(cfg, dev, vocab, model, optimizer, ema)


def bench(model_name: str, seq_len: int = 300, batch_size: int = 32, steps: int = 10,
          device: str = "auto", profile: str = "full", warmup: int = WARMUP_STEPS) -> dict:
    """Measure reader ``model_name`` (``profile``'s hyperparameters) on synthetic batches."""
    s = setup(model_name, profile, [f"device={device}", f"batch_size={batch_size}"])
    cfg, dev, model = s.cfg, s.device, s.model
    batch = s.batch(seq_len)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    train_seconds, infer_seconds = time_steps(
        TrainingStep(model, model, s.optimizer, s.ema, cfg, dev), batch, steps, warmup)
    train_rate = steps * batch_size / train_seconds
    return {
        "model": cfg.model, "profile": profile, "device": device_name(dev),
        "torch": torch.__version__,
        "bf16": bf16_autocast(cfg.bf16, dev.type), "seq_len": seq_len,
        "question_len": QUESTION_LEN, "batch_size": batch_size, "steps": steps,
        "params": count_parameters(model),
        "train_examples_per_s": train_rate,
        "infer_examples_per_s": steps * batch_size / infer_seconds,
        "projected_epoch_seconds": SQUAD_TRAIN_EXAMPLES / train_rate,
        "peak_memory_bytes": peak_memory_bytes(dev),
    }


def bench_cli(args) -> dict:
    """``python -m mrc_lib bench``: print (and with ``--out`` also write) the measurements."""
    result = bench(args.model, args.seq_len, args.batch_size, args.steps, args.device)
    if args.out:
        atomic_write_json(Path(args.out), result)
    return result
