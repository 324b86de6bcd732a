"""EA Reader: each equation recomputed directly on tiny tensors, padding, gradients, training."""

import numpy as np
import pytest
import torch

from mrc_lib.data.cloze import StringTable, encode_examples
from mrc_lib.errors import UserError
from mrc_lib.models.cloze_train import ClozeConfig, train_cloze
from mrc_lib.models.ea_reader import (
    MSCF,
    EAReader,
    MemoryWrite,
    candidate_logits,
    cloze_loss,
)
from tests.test_cloze import make_examples, synthetic_article


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x) / torch.exp(x).sum()


def direct_mscf(mscf: MSCF, D: torch.Tensor, q: torch.Tensor, n: int, bitwise: bool):
    """Eqs. 2, 5-7 for one example with ``n`` real tokens, token by token and feature by
    feature."""
    L, k = mscf.L, mscf.k
    W_d, W_q = mscf.project_d.weight, mscf.project_q.weight
    contexts, maps = [], []
    for l in range(L):
        rows = slice(l * k, (l + 1) * k)
        d_l = [W_d[rows] @ D[i] for i in range(n)]  # Eq. 2
        q_l = W_q[rows] @ q
        if bitwise:
            W_a = mscf.scores[l].W_a.weight
            scores = torch.stack([W_a @ torch.tanh(d * q_l) for d in d_l])  # [n, k]
        else:  # bilinear: d^T W q, one score per token
            W = mscf.scores[l].similarity.W.weight
            scores = torch.stack([(d @ (W @ q_l)).expand(k) for d in d_l])
        A = torch.stack([softmax(scores[:, f]) for f in range(k)], dim=1)  # Eq. 5, per feature
        contexts.append(sum(A[i] * d_l[i] for i in range(n)))  # Eq. 6
        maps.append(A)
    fuse = mscf.fuse[0]
    o = torch.relu(fuse.weight @ torch.cat(contexts) + fuse.bias)  # Eq. 7
    return o, torch.stack(maps, dim=1)  # [n, L, k]


@pytest.mark.parametrize("scoring", ["bitwise", "bilinear"])
def test_mscf_matches_equations_with_padding(scoring):
    torch.manual_seed(0)
    mscf = MSCF(dim=12, subspaces=3, scoring=scoring)
    D, q = torch.randn(2, 7, 12), torch.randn(2, 12)
    lengths = [7, 4]
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    o, A = mscf(D, q, mask)
    for b, n in enumerate(lengths):
        o_direct, A_direct = direct_mscf(mscf, D[b], q[b], n, scoring == "bitwise")
        assert torch.allclose(o[b], o_direct, atol=1e-5)
        assert torch.allclose(A[b, :n], A_direct, atol=1e-5)
        assert (A[b, n:] == 0).all()
    # Padding values never reach the result.
    D_noise = D.clone()
    D_noise[1, 4:] = 100.0
    assert torch.allclose(mscf(D_noise, q, mask)[0], o)


def test_bitwise_attention_differs_per_feature_tokenwise_does_not():
    torch.manual_seed(0)
    D, q, mask = torch.randn(1, 5, 8), torch.randn(1, 8), torch.ones(1, 5, dtype=torch.bool)
    _, A_bit = MSCF(8, 2, "bitwise")(D, q, mask)
    _, A_tok = MSCF(8, 2, "additive")(D, q, mask)
    assert torch.allclose(A_bit.sum(dim=1), torch.ones(1, 2, 4))  # softmax over tokens
    assert not torch.allclose(A_bit[..., 0], A_bit[..., 1])
    assert torch.allclose(A_tok[..., 0:1].expand_as(A_tok), A_tok)


def test_stanford_ar_reading_is_plain_bilinear_attention():
    torch.manual_seed(0)
    mscf = MSCF(6, subspaces=1, scoring="bilinear", fusion=False)
    D, q, mask = torch.randn(1, 4, 6), torch.randn(1, 6), torch.ones(1, 4, dtype=torch.bool)
    o, _ = mscf(D, q, mask)
    W = mscf.scores[0].similarity.W.weight
    alpha = softmax(D[0] @ (W @ q[0]))  # Eq. 3
    assert torch.allclose(o[0], alpha @ D[0], atol=1e-6)
    with pytest.raises(UserError):
        MSCF(6, subspaces=2, fusion=False)
    with pytest.raises(UserError):
        MSCF(10, subspaces=3)


def test_write_gate_matches_equations():
    torch.manual_seed(0)
    write = MemoryWrite(5)
    M, e = torch.randn(2, 4, 5), torch.randn(2, 5)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    out = write(M, e, mask)
    for b in range(2):
        for i in range(4):
            G = torch.sigmoid(write.W_e.weight @ e[b] + write.W_e.bias
                              + write.W_m.weight @ M[b, i])  # Eq. 9
            expected = G * e[b] + (1 - G) * M[b, i] if mask[b, i] else torch.zeros(5)  # Eq. 10
            assert torch.allclose(out[b, i], expected, atol=1e-6)


def test_candidate_scores_sum_attention_over_occurrences():
    torch.manual_seed(0)
    z = torch.randn(2, 6)
    forms = torch.tensor([[5, 7, 5, 9, 8, 0], [7, 7, 9, 0, 0, 0]])
    mask = forms != 0
    cands = torch.tensor([[5, 7, 9, 4], [7, 9, 5, 0]])  # 4 and 5 (row 1) absent, 0 padding
    p = torch.softmax(candidate_logits(z, forms, mask, cands), dim=1)
    for b in range(2):
        alpha = softmax(z[b, mask[b]])  # attention over real tokens
        mass = torch.stack([alpha[forms[b, mask[b]] == c].sum() if c else torch.tensor(0.0)
                            for c in cands[b]])
        assert torch.allclose(p[b], mass / mass.sum(), atol=1e-6)
    assert p[0, 3] == 0 and p[1, 2] == 0 and p[1, 3] == 0


def test_loss_skips_unreachable_answers():
    logits = candidate_logits(torch.zeros(2, 3), torch.tensor([[4, 5, 4], [4, 5, 6]]),
                              torch.ones(2, 3, dtype=torch.bool), torch.tensor([[4, 5], [9, 6]]))
    loss = cloze_loss(logits, torch.tensor([0, 0]))  # row 1: answer 9 is not in the document
    assert torch.isfinite(loss)
    assert torch.allclose(loss, -torch.log(torch.tensor(2 / 3)))


def tiny_batch(vocab: int = 20, n: int = 9, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    forms = torch.randint(2, vocab, (3, n), generator=g)
    lengths = torch.tensor([n, 6, 4])
    mask = torch.arange(n)[None] < lengths[:, None]
    forms = forms.masked_fill(~mask, 0)
    return {"doc_words": forms, "doc_forms": forms, "doc_mask": mask,
            "query_words": torch.tensor([[3, 4, 5], [6, 7, 0], [8, 0, 0]]),
            "query_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]).bool(),
            "cand_forms": forms[:, :3], "answer": torch.tensor([0, 1, 2])}


def test_multi_hop_composition_shares_weights():
    torch.manual_seed(0)
    model = EAReader(torch.randn(20, 6), hidden=4, subspaces=2, hops=3).eval()
    one_hop = EAReader(torch.randn(20, 6), hidden=4, subspaces=2, hops=1)
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in one_hop.parameters())
    batch = tiny_batch()
    mask = batch["doc_mask"]
    with torch.no_grad():
        out = model(batch)
        M = model.doc_encoder(model.embed(batch["doc_words"]), mask)
        s = model.query_encoder.final_states(model.embed(batch["query_words"]),
                                             batch["query_mask"])
        for _ in range(3):
            e, _ = model.mscf(M, s, mask)
            s = model.W_s.weight @ s.unsqueeze(-1)
            s = s.squeeze(-1) + e  # Eq. 8
            M = model.write(M, e, mask)  # Eqs. 9-10
        z = torch.einsum("bnd,de,be->bn", M, model.W_o.weight, s)
        logits = candidate_logits(z, batch["doc_forms"], mask, batch["cand_forms"])
    assert torch.allclose(out["logits"], logits, atol=1e-5)
    assert out["attention"].shape == (3, 3, 9, 2)


def test_logits_do_not_depend_on_padding():
    torch.manual_seed(0)
    model = EAReader(torch.randn(20, 6), hidden=4, subspaces=2, hops=2).eval()
    batch = tiny_batch()
    wider = {k: v.clone() for k, v in batch.items()}
    for key in ("doc_words", "doc_forms", "doc_mask"):
        wider[key] = torch.cat([batch[key], torch.zeros_like(batch[key][:, :4])], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(batch)["logits"], model(wider)["logits"], atol=1e-5)


@pytest.mark.parametrize("hparams", [
    {"scoring": "bitwise", "hops": 2, "write": True},
    {"scoring": "additive", "hops": 1},
    {"scoring": "scaled_dot", "hops": 2, "write": False},
    {"scoring": "bilinear", "subspaces": 1, "fusion": False, "hops": 1},
])
def test_gradients_reach_every_parameter(hparams):
    torch.manual_seed(0)
    model = EAReader(torch.randn(20, 6), **{"hidden": 4, "subspaces": 2, **hparams})
    batch = tiny_batch()
    cloze_loss(model(batch)["logits"], batch["answer"]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert (model.embed.weight.grad[0] == 0).all()  # PAD row


def test_training_resumes_exactly(tmp_path):
    table = StringTable()
    sets = {split: encode_examples(make_examples(synthetic_article(12), (0, 0, i), "NE",
                                                 doc_sentences=8), table)
            for i, split in enumerate(("train", "valid", "test"))}
    word_ids = np.arange(len(table.words))
    vectors = np.random.default_rng(0).normal(size=(len(table.words), 6)).astype(np.float32)
    cfg = ClozeConfig(hparams={"hidden": 4, "subspaces": 2, "hops": 2}, epochs=2,
                      batch_size=2)
    _, straight = train_cloze(sets, word_ids, vectors, cfg, tmp_path / "a")
    train_cloze(sets, word_ids, vectors, ClozeConfig(**{**cfg.__dict__, "epochs": 1}),
                tmp_path / "b")
    _, resumed = train_cloze(sets, word_ids, vectors, cfg, tmp_path / "b")
    assert straight["history"] == resumed["history"] and straight["test"] == resumed["test"]
    assert (tmp_path / "a" / "model.pt").is_file() and 0 <= straight["test"] <= 100
    with pytest.raises(UserError, match="lr"):
        train_cloze(sets, word_ids, vectors, ClozeConfig(**{**cfg.__dict__, "lr": 0.1}),
                    tmp_path / "a")
