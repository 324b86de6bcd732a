"""DynSAN's multiple-choice head (Zhuang & Wang, ACL 2019, Sec. 3.4.2, Eqs. 7-8) and the task it
is trained on in this book.

With ``S`` ``[L, D]`` the output of the cross-passage attention layer over all ``M`` passages:

* Eq. 7: ``r = softmax(F^S(S))``, a distribution over all ``L`` tokens (``F^S`` linear);
* Eq. 8: ``P(c | q, P) = Σ_{i ∈ T_c} r_i``, ``T_c`` the positions of candidate ``c``'s mentions;
* training maximises ``log P(answer | q, P)``.

For WikiHop the paper concatenates a binary feature to the word and character embeddings: is
the token (part of) a candidate answer (Sec. 4.1). :class:`DynSANMC` is the DynSAN reader with
that feature (``c_feats`` ``[B, L, 1]``) and this head in place of the span pointers.

WikiHop is not available here. The stand-in is chapter 05's cloze set
(:func:`mrc_lib.data.cloze.load_wiki_cloze`, subset NE: Children's-Book-Test-style questions
built from SQuAD's Wikipedia articles, 10 candidate entities drawn from the document) in
**multi-passage form**: every sentence of the document is a passage, in document order (its
rank), and the query with its blank is the question (:class:`ClozePassages`). Entity units
(words joined by ``_``) have no GloVe vector and get the unknown word's; the character CNN and
the candidate feature tell them apart.

The task needs its own small loop (:func:`train_mc`): accuracy instead of the SQuAD
evaluation, built from the trainer's pieces (``build_optimizer``, ``LRSchedule``, ``EMA``,
``train_step``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.checkpoint import seed_everything
from mrc_lib.data.vocab import MAX_WORD_CHARS
from mrc_lib.models.dynsan import DynSAN
from mrc_lib.nn import mask_logits

SENTENCE_ENDS = frozenset({".", "!", "?"})


def sentence_passages(document: list[str]) -> np.ndarray:
    """Each token's passage: a new passage starts after every sentence-final token."""
    ends = np.fromiter((w in SENTENCE_ENDS for w in document), bool, len(document))
    return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int64)


def candidate_log_probs(logits: Tensor, cand_index: Tensor, n_candidates: int) -> Tensor:
    """Eqs. 7-8 in log space: ``log Σ_{i ∈ T_c} r_i`` with ``r = softmax(logits)`` (masked
    logits ``[B, L]``) and ``T_c`` the positions where ``cand_index`` ``[B, L]`` is ``c``
    (``-1``: no candidate). Returns ``[B, n_candidates]``; a candidate without mentions gets
    ``-inf``."""
    log_r = logits.log_softmax(-1)  # Eq. 7
    c = torch.arange(n_candidates, device=logits.device)
    mentions = cand_index.unsqueeze(1) == c[None, :, None]  # [B, C, L]: i ∈ T_c
    return log_r.unsqueeze(1).masked_fill(~mentions, float("-inf")).logsumexp(-1)  # Eq. 8


def with_candidate_feature(vocab) -> SimpleNamespace:
    """``vocab``'s embeddings with one context feature: the candidate flag."""
    return SimpleNamespace(word_vectors=vocab.word_vectors, n_trainable=vocab.n_trainable,
                           n_chars=vocab.n_chars, n_feats=1)


class DynSANMC(DynSAN):
    """DynSAN with the candidate feature and the multiple-choice head (Eqs. 7-8).

    ``forward`` returns ``candidate_log_probs`` ``[B, C]`` (Eq. 8, in log space) and, in
    training, ``loss`` ``−log P(answer)`` averaged over the batch (plus the Eq. 6 penalty as
    ``aux_loss``). ``vocab`` must have ``n_feats = 1`` (:func:`with_candidate_feature`).
    """

    FEATURES = True

    def build_head(self, d_model: int, make_block) -> None:
        self.f_s = nn.Linear(d_model, 1, bias=False)  # F^S (Eq. 7)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        enc = self.encode(batch)
        logits = mask_logits(self.f_s(enc.s).squeeze(-1).float(), enc.c_mask)
        log_p = candidate_log_probs(logits, batch["cand_index"], batch["cand_mask"].shape[1])
        out = {"candidate_log_probs": log_p.masked_fill(~batch["cand_mask"], float("-inf"))}
        if self.training:
            out["loss"] = -log_p.gather(1, batch["answer"].unsqueeze(1)).mean()
        return self.finish(out, enc)


class ClozePassages:
    """Cloze questions in multi-passage form, encoded with ``vocab`` (word and char ids)."""

    def __init__(self, examples, vocab):
        self.examples = examples
        self.vocab = vocab
        self.rows = [self._encode(e) for e in examples]

    def _ids(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        chars = np.zeros((len(words), MAX_WORD_CHARS), np.int64)
        for t, w in enumerate(words):
            ids = self.vocab.char_ids(w)
            chars[t, :len(ids)] = ids
        return np.fromiter((self.vocab.word_id(w) for w in words), np.int64, len(words)), chars

    def _encode(self, e) -> dict:
        index = {c: k for k, c in enumerate(e.candidates)}
        cand = np.fromiter((index.get(w, -1) for w in e.document), np.int64, len(e.document))
        return {"c": self._ids(e.document), "q": self._ids(e.query), "cand": cand,
                "passage": sentence_passages(e.document), "answer": index[e.answer],
                "n_cands": len(e.candidates)}

    def __len__(self) -> int:
        return len(self.examples)

    def question(self, i: int) -> str:
        return " ".join(self.examples[i].query)

    def collate(self, pos) -> dict[str, Tensor]:
        rows = [self.rows[i] for i in pos]
        Lc, Lq = max(len(r["cand"]) for r in rows), max(len(r["q"][0]) for r in rows)
        C = max(r["n_cands"] for r in rows)
        batch = {k: np.zeros(shape, np.int64) for k, shape in (
            ("c_words", (len(rows), Lc)), ("c_chars", (len(rows), Lc, MAX_WORD_CHARS)),
            ("q_words", (len(rows), Lq)), ("q_chars", (len(rows), Lq, MAX_WORD_CHARS)),
            ("c_passage", (len(rows), Lc)))}
        batch["cand_index"] = np.full((len(rows), Lc), -1, np.int64)
        for b, r in enumerate(rows):
            n, m = len(r["cand"]), len(r["q"][0])
            batch["c_words"][b, :n], batch["c_chars"][b, :n] = r["c"]
            batch["q_words"][b, :m], batch["q_chars"][b, :m] = r["q"]
            batch["c_passage"][b, :n], batch["cand_index"][b, :n] = r["passage"], r["cand"]
        out = {k: torch.from_numpy(v) for k, v in batch.items()}
        out["c_mask"], out["q_mask"] = out["c_words"] != 0, out["q_words"] != 0
        out["c_feats"] = (out["cand_index"] >= 0).float().unsqueeze(-1)  # candidate feature
        n_cands = torch.tensor([r["n_cands"] for r in rows])
        out["cand_mask"] = torch.arange(C)[None] < n_cands[:, None]
        out["answer"] = torch.tensor([r["answer"] for r in rows])
        out["idx"] = torch.as_tensor(np.asarray(pos))
        return out

    def batches(self, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0):
        order = (np.random.default_rng([seed, epoch]).permutation(len(self)) if shuffle
                 else np.arange(len(self)))
        for lo in range(0, len(order), batch_size):
            yield self.collate(order[lo:lo + batch_size])


@torch.no_grad()
def evaluate_mc(model: nn.Module, split: ClozePassages, batch_size: int,
                device: torch.device) -> dict:
    """Accuracy of the most probable candidate, and the accuracy of a random choice."""
    from mrc_lib.train import to_device  # mrc_lib.train imports the models: not at load time

    model.eval()
    right = 0
    for batch in split.batches(batch_size, shuffle=False):
        batch = to_device(batch, device)
        right += int((model(batch)["candidate_log_probs"].argmax(-1) == batch["answer"]).sum())
    chance = float(np.mean([1 / r["n_cands"] for r in split.rows])) if len(split) else 0.0
    return {"accuracy": right / max(len(split), 1), "questions": len(split), "chance": chance}


def train_mc(model: nn.Module, data: dict[str, ClozePassages], cfg,
             device: torch.device) -> dict:
    """Train on ``data["train"]`` per ``cfg`` (optimizer, warm-up, clipping, EMA, epochs, batch
    size, seed) and evaluate the averaged weights on ``valid`` and ``test`` after each epoch."""
    from mrc_lib.train import (
        EMA,
        LRSchedule,
        averaged,
        build_optimizer,
        count_parameters,
        to_device,
        train_step,
    )

    seed_everything(cfg.seed)
    model.to(device)
    optimizer = build_optimizer(cfg, model, device)
    schedule = LRSchedule(optimizer, cfg)
    ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None
    history, seconds = [], []
    for epoch in range(cfg.epochs):
        model.train()
        tic = time.perf_counter()
        for batch in data["train"].batches(cfg.batch_size, shuffle=True, seed=cfg.seed,
                                           epoch=epoch):
            train_step(model, to_device(batch, device), optimizer, cfg, device)
            schedule.step()
            if ema is not None:
                ema.update(model)
        seconds.append(time.perf_counter() - tic)
        with averaged(model, ema):
            scores = {s: evaluate_mc(model, data[s], cfg.eval_batch_size, device)
                      for s in ("valid", "test")}
        history.append({"epoch": epoch + 1, **scores})
    return {"dev": history[-1]["valid"], "test": history[-1]["test"], "history": history,
            "seconds_per_epoch": seconds, "params": count_parameters(model)}
