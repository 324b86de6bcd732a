"""EA Reader: each equation recomputed directly on tiny tensors, padding, gradients, and
training by the shared trainer on the ``cloze`` task (exact resume)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrc_lib import train as engine
from mrc_lib.config import TrainConfig
from mrc_lib.data.choice import ChoiceData, ClozeSplit
from mrc_lib.data.cloze import StringTable, encode_examples
from mrc_lib.errors import UserError
from mrc_lib.models import build_model
from mrc_lib.models.ea_reader import (
    MSCF,
    EAReader,
    MemoryWrite,
    occurrence_mean,
    occurrences,
    pointer_sum,
    restrict,
)
from mrc_lib.tasks import get_task
from tests.test_cloze import make_examples, synthetic_article


def reader(vectors, **hparams) -> EAReader:
    """An EA Reader over the embedding rows ``vectors`` (the cloze task's ``vocab``)."""
    return EAReader(SimpleNamespace(word_vectors=vectors), **hparams)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x) / torch.exp(x).sum()


def eq11(model: EAReader, x: torch.Tensor, batch: dict, present: torch.Tensor) -> torch.Tensor:
    """Eq. 11 from the module's parameters: ``log p = log softmax(W_a x)`` over the vocabulary
    without its padding row (``W_a = E P``), read at each candidate's word; ``-inf`` for a
    candidate not in the document."""
    W_a = model.embed.weight[1:] @ model.P.weight  # [V - 1, 2h]
    log_p = torch.log_softmax(x @ W_a.T, dim=-1)  # p over the words 1..V-1
    return log_p.gather(1, batch["cand_words"].clamp(min=1) - 1).masked_fill(~present,
                                                                              float("-inf"))


def direct_mscf(mscf: MSCF, D: torch.Tensor, q: torch.Tensor, n: int, scoring: str):
    """Eqs. 2-7 for one example with ``n`` real tokens, token by token and feature by
    feature."""
    L, k = mscf.L, mscf.k
    contexts, maps = [], []
    for l in range(L):
        rows = slice(l * k, (l + 1) * k)
        W_d = (mscf.project_d.weight if isinstance(mscf.project_d, torch.nn.Linear)
               else torch.eye(L * k))[rows]
        W_q = (mscf.project_q.weight if isinstance(mscf.project_q, torch.nn.Linear)
               else torch.eye(L * k))[rows]
        d_l = [W_d @ D[i] for i in range(n)]  # Eq. 2
        q_l = W_q @ q
        values = d_l
        if scoring == "bitwise":
            W = mscf.scores[l].W.weight
            scores = torch.stack([W @ torch.tanh(d * q_l) for d in d_l])  # Eq. 5, [n, k]
        elif scoring == "bilinear":  # Eq. 3: d^T W_b q, one score per token
            W_b = mscf.scores[l].similarity.W.weight
            scores = torch.stack([(d @ (W_b @ q_l)).expand(k) for d in d_l])
        elif scoring == "additive":  # Eq. 4: w^T tanh(W_1 d + W_2 q)
            sim = mscf.scores[l].similarity
            scores = torch.stack([
                (sim.v.weight @ torch.tanh(sim.W1.weight @ d + sim.W2.weight @ q_l)).expand(k)
                for d in d_l])
        elif scoring == "dot":  # multiplicative: d^T q
            scores = torch.stack([(d @ q_l).expand(k) for d in d_l])
        else:  # multi-head: scaled dot product of query and key, separate values
            scores = torch.stack([(d @ q_l / k ** 0.5).expand(k) for d in d_l])
            values = [mscf.project_v.weight[rows] @ D[i] for i in range(n)]
        A = torch.stack([softmax(scores[:, f]) for f in range(k)], dim=1)  # per feature
        contexts.append(sum(A[i] * values[i] for i in range(n)))  # Eq. 6
        maps.append(A)
    fuse = mscf.fuse[0]
    assert fuse.bias is None  # Eq. 7 has none
    o = torch.relu(fuse.weight @ torch.cat(contexts))  # Eq. 7
    return o, torch.stack(maps, dim=1)  # [n, L, k]


@pytest.mark.parametrize("scoring, projections", [
    ("bitwise", True), ("bilinear", True), ("additive", True), ("dot", True),
    ("multihead", True), ("bitwise", False)])
def test_mscf_matches_equations_with_padding(scoring, projections):
    torch.manual_seed(0)
    mscf = MSCF(dim=12, subspaces=3, scoring=scoring, projections=projections)
    D, q = torch.randn(2, 7, 12), torch.randn(2, 12)
    lengths = [7, 4]
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    o, A = mscf(D, q, mask)
    for b, n in enumerate(lengths):
        o_direct, A_direct = direct_mscf(mscf, D[b], q[b], n, scoring)
        assert torch.allclose(o[b], o_direct, atol=1e-5)
        assert torch.allclose(A[b, :n], A_direct, atol=1e-5)
        assert (A[b, n:] == 0).all()
    # Padding values never reach the result.
    D_noise = D.clone()
    D_noise[1, 4:] = 100.0
    assert torch.allclose(mscf(D_noise, q, mask)[0], o)


def test_multiplicative_and_multihead_differ_from_bilinear():
    dot, bilinear, multihead = (MSCF(12, 3, s) for s in ("dot", "bilinear", "multihead"))
    assert not any(n.endswith("W.weight") for n, _ in dot.scores.named_parameters())
    assert sum(p.numel() for p in bilinear.scores.parameters()) == 3 * 4 * 4
    assert multihead.project_v is not None and dot.project_v is None
    assert sum(p.numel() for p in multihead.parameters()) == \
        sum(p.numel() for p in dot.parameters()) + 12 * 12  # the value projections W_v^l


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
            G = torch.sigmoid(write.W_e.weight @ e[b] + write.W_m.weight @ M[b, i])  # Eq. 9
            expected = G * e[b] + (1 - G) * M[b, i] if mask[b, i] else torch.zeros(5)  # Eq. 10
            assert torch.allclose(out[b, i], expected, atol=1e-6)


def test_pointer_sum_variant_sums_attention_over_occurrences():
    torch.manual_seed(0)
    z = torch.randn(2, 6)
    forms = torch.tensor([[5, 7, 5, 9, 8, 0], [7, 7, 9, 0, 0, 0]])
    mask = forms != 0
    cands = torch.tensor([[5, 7, 9, 4], [7, 9, 5, 0]])  # 4 and 5 (row 1) absent, 0 padding
    occurs = occurrences(forms, mask, cands)
    p = torch.softmax(restrict(pointer_sum(z, occurs), occurs.any(-1)), dim=1)
    for b in range(2):
        alpha = softmax(z[b, mask[b]])  # attention over real tokens
        mass = torch.stack([alpha[forms[b, mask[b]] == c].sum() if c else torch.tensor(0.0)
                            for c in cands[b]])
        assert torch.allclose(p[b], mass / mass.sum(), atol=1e-6)
    assert p[0, 3] == 0 and p[1, 2] == 0 and p[1, 3] == 0


def test_cloze_objective_skips_unreachable_answers_and_restrict_is_exact_in_bf16():
    objective = get_task("cloze").objective
    logits = torch.tensor([[0.0, 0.0, 5.0], [0.0, 1.0, 2.0]], requires_grad=True)
    candidates = torch.tensor([[True, True, False], [False, True, True]])
    log_p = restrict(logits, candidates).log_softmax(-1)
    loss = objective({"candidate_log_probs": log_p},
                     {"answer": torch.tensor([0, 0])})  # row 1: answer absent, skipped
    assert torch.allclose(loss, -torch.log(torch.tensor(0.5)))
    none = objective({"candidate_log_probs": log_p[1:]}, {"answer": torch.tensor([0])})
    assert none == 0 and none.requires_grad  # no reachable answer: a zero in the graph
    none.backward()
    assert (logits.grad == 0).all()
    # Huge float32 logits (beyond bfloat16's most negative finite value) stay masked exactly.
    big = torch.tensor([[-1e38, -2e38, 3e38]]).to(torch.bfloat16)
    scores = restrict(big, torch.tensor([[True, True, False]]))
    assert scores.dtype == torch.float32 and scores[0, 2] == float("-inf")
    assert scores.log_softmax(-1).argmax(-1).item() == 0  # the decoding: argmax


def tiny_batch(vocab: int = 20, n: int = 9, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    forms = torch.randint(2, vocab, (3, n), generator=g)
    lengths = torch.tensor([n, 6, 4])
    mask = torch.arange(n)[None] < lengths[:, None]
    forms = forms.masked_fill(~mask, 0)
    cands = torch.cat([forms[:, :3], torch.tensor([[vocab - 1], [0], [0]])], dim=1)
    return {"doc_words": forms, "doc_forms": forms, "doc_mask": mask,
            "query_words": torch.tensor([[3, 4, 5], [6, 7, 0], [8, 0, 0]]),
            "query_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]).bool(),
            "cand_words": cands, "cand_forms": cands, "answer": torch.tensor([0, 1, 2])}


@pytest.mark.parametrize("normalize", ["vocabulary", "candidates"])
@pytest.mark.parametrize("answer", ["final_state", "final_state_free"])
def test_eq11_answer_from_final_state_by_hand(normalize, answer):
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), hidden=4, subspaces=2, hops=2, answer=answer,
                   normalize=normalize).eval()
    batch = tiny_batch()
    with torch.no_grad():
        out = model(batch)
        _, s_T, _, _ = model.read(batch)
        if answer == "final_state":
            W_a = model.embed.weight @ model.P.weight  # [V, 2h]: W_a = E P
        else:  # a free W_a: a row per word but padding; padding's row is never read
            assert model.W_a.weight.shape == (19, 8) and not hasattr(model, "P")
            W_a = torch.cat([torch.full((1, 8), float("nan")), model.W_a.weight])
        for b in range(3):
            present = [int(c) != 0 and bool((batch["doc_forms"][b, batch["doc_mask"][b]]
                                             == c).any()) for c in batch["cand_forms"][b]]
            logits = W_a @ s_T[b]  # Eq. 11, over the whole vocabulary
            rows = [int(w) for w, ok in zip(batch["cand_words"][b], present) if ok]
            if normalize == "vocabulary":  # p = softmax(W_a s_T) over every word but padding
                p = softmax(logits[1:])[torch.tensor(rows) - 1]
            else:  # the departure: restricted to the candidates in the document
                p = softmax(logits[rows])
            got = out["candidate_log_probs"][b].exp()
            assert torch.allclose(got[torch.tensor(present)], p, atol=1e-5)
            assert (got[~torch.tensor(present)] == 0).all()
    log_p = out["candidate_log_probs"]
    assert log_p.dtype == torch.float32 and torch.isfinite(log_p[0, :3]).all()
    assert torch.isinf(log_p[1:, 3]).all()  # padding candidates
    total = log_p.exp().sum(-1)
    assert torch.allclose(total, torch.ones(3)) == (normalize == "candidates")
    assert (total <= 1 + 1e-6).all()


def hops_by_hand(model: EAReader, batch: dict, hops: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``M_T`` and ``s_T`` from Eqs. 1 and 8-10, hop by hop, writing after every hop (the last
    write is what the memory answers read)."""
    mask = batch["doc_mask"]
    M = model.doc_encoder(model.embed(batch["doc_words"]), mask)  # M_0 = D
    s = model.query_encoder.final_states(model.embed(batch["query_words"]),
                                         batch["query_mask"])  # s_0 = q
    for t in range(hops):
        e, _ = model.mscf[min(t, len(model.mscf) - 1)](M, s, mask)  # read
        s = (model.W_s.weight @ s.unsqueeze(-1)).squeeze(-1) + e  # Eq. 8
        M = model.write(M, e, mask)  # Eqs. 9-10
    return M, s


@pytest.mark.parametrize("answer", ["pointer_sum", "memory_mean", "memory_mean_projected"])
def test_memory_answers_read_the_final_memory_by_hand(answer):
    """Pointer-sum and Eq. 11 with rows read from the memory: token scores
    ``z_i = m_i^T W_o s_T`` over ``M_T`` (after the last hop's write), then each candidate's
    attention summed (pointer-sum) or the mean memory of its occurrences scored (memory_mean);
    memory_mean_projected scores ``(R m̄_c)^T P s_T``, Eq. 11's ``E P`` with ``E``'s row
    replaced."""
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), hidden=4, subspaces=2, hops=2, answer=answer).eval()
    batch = tiny_batch()
    mask = batch["doc_mask"]
    with torch.no_grad():
        out = model(batch)
        M, s = hops_by_hand(model, batch, 2)
    for b in range(3):
        forms = batch["doc_forms"][b, mask[b]]
        memory = M[b, mask[b]]
        present = [int(c) != 0 and bool((forms == c).any()) for c in batch["cand_forms"][b]]
        rows = [c for c, ok in zip(batch["cand_forms"][b], present) if ok]
        if answer == "memory_mean_projected":  # softmax over the candidates of (R m̄_c)^T P s_T
            rows_of_E = torch.stack([model.R.weight @ memory[forms == c].mean(0) for c in rows])
            p = softmax(rows_of_E @ (model.P.weight @ s[b]))
        elif answer == "pointer_sum":  # Σ_{i: d_i = c} softmax(z)_i, renormalized
            alpha = softmax(memory @ (model.W_o.weight @ s[b]))
            mass = torch.stack([alpha[forms == c].sum() for c in rows])
            p = mass / mass.sum()
        else:  # softmax over the candidates of m̄_c^T W_o s_T
            p = softmax(torch.stack([memory[forms == c].mean(0) @ model.W_o.weight @ s[b]
                                     for c in rows]))
        got = out["candidate_log_probs"][b].exp()
        assert torch.allclose(got[torch.tensor(present)], p, atol=1e-5)
        assert (got[~torch.tensor(present)] == 0).all()


def test_occurrence_mean_averages_token_scores():
    z = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    occurs = torch.tensor([[[True, False, True, False], [False, True, False, False],
                            [False, False, False, False]]])
    assert torch.equal(occurrence_mean(z, occurs), torch.tensor([[2.5, 2.0, 0.0]]))


@pytest.mark.parametrize("share", [False, True])
def test_multi_hop_composition(share):
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), hidden=4, subspaces=2, hops=3, share_mscf=share).eval()
    one_hop = reader(torch.randn(20, 6), hidden=4, subspaces=2, hops=1)
    mscf_params = sum(p.numel() for p in model.mscf[0].parameters())
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in one_hop.parameters()) + (0 if share else 2 * mscf_params)
    batch = tiny_batch()
    mask = batch["doc_mask"]
    with torch.no_grad():
        out = model(batch)
        _, s = hops_by_hand(model, batch, 3)
        present = occurrences(batch["doc_forms"], mask, batch["cand_forms"]).any(-1)
    assert torch.allclose(out["candidate_log_probs"], eq11(model, s, batch, present),
                          atol=1e-5)
    assert out["attention"].shape == (3, 3, 9, 2)


def test_zeroing_mscf_output_changes_the_prediction():
    torch.manual_seed(0)
    model = reader(torch.randn(30, 6), hidden=6, subspaces=2, hops=1, write=False).eval()
    batches = [tiny_batch(vocab=30, seed=s) for s in range(8)]

    def predict(b):  # the cloze task's decoding: the most probable candidate
        return model(b)["candidate_log_probs"].argmax(-1)

    with torch.no_grad():
        before = torch.cat([predict(b) for b in batches])
        handle = model.mscf[0].register_forward_hook(
            lambda module, inputs, output: (torch.zeros_like(output[0]), output[1]))
        after = torch.cat([predict(b) for b in batches])
        handle.remove()
    assert (before != after).any()


def test_candidate_probabilities_do_not_depend_on_padding():
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), hidden=4, subspaces=2, hops=2).eval()
    batch = tiny_batch()
    wider = {k: v.clone() for k, v in batch.items()}
    for key in ("doc_words", "doc_forms", "doc_mask"):
        wider[key] = torch.cat([batch[key], torch.zeros_like(batch[key][:, :4])], dim=1)
    with torch.no_grad():
        a, b = model(batch), model(wider)
    assert torch.allclose(a["candidate_log_probs"], b["candidate_log_probs"], atol=1e-5)


@pytest.mark.parametrize("hparams", [
    {"scoring": "bitwise", "hops": 2, "write": True},
    {"scoring": "bitwise", "hops": 2, "write": True, "answer": "pointer_sum"},
    {"scoring": "bitwise", "hops": 2, "write": True, "answer": "memory_mean"},
    {"scoring": "bitwise", "hops": 2, "write": True, "answer": "memory_mean_projected"},
    {"scoring": "bitwise", "hops": 3, "write": True, "share_mscf": True},
    {"scoring": "bitwise", "hops": 1, "write": False, "projections": False},
    {"scoring": "additive", "hops": 1, "write": False},
    {"scoring": "dot", "hops": 1, "write": False},
    {"scoring": "multihead", "hops": 2, "write": False},
    {"scoring": "bilinear", "subspaces": 1, "fusion": False, "hops": 1, "write": False,
     "readout": "context"},
])
def test_gradients_reach_every_parameter(hparams):
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), **{"hidden": 4, "subspaces": 2, **hparams})
    batch = tiny_batch()
    out = model(batch)
    get_task("cloze").loss(out, batch).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert (model.embed.weight.grad[0] == 0).all()  # PAD row


def test_stanford_ar_answers_from_its_context_vector():
    torch.manual_seed(0)
    model = reader(torch.randn(20, 6), hidden=4, subspaces=1, scoring="bilinear",
                     fusion=False, hops=1, write=False, readout="context").eval()
    assert model.W_s is None
    batch = tiny_batch()
    with torch.no_grad():
        out = model(batch)
        D = model.doc_encoder(model.embed(batch["doc_words"]), batch["doc_mask"])
        q = model.query_encoder.final_states(model.embed(batch["query_words"]),
                                             batch["query_mask"])
        o, _ = model.mscf[0](D, q, batch["doc_mask"])
        present = occurrences(batch["doc_forms"], batch["doc_mask"], batch["cand_forms"]).any(-1)
    assert torch.allclose(out["candidate_log_probs"], eq11(model, o, batch, present), atol=1e-5)


def encoded_sets():
    table = StringTable()
    sets = {split: encode_examples(make_examples(synthetic_article(16), (0, 0, i), "NE",
                                                 stride=1, doc_sentences=8), table)
            for i, split in enumerate(("train", "valid", "test"))}
    return table, sets


def cloze_data(table, sets) -> ChoiceData:
    """The ``cloze`` task's data over tiny in-memory sets (the trainer's ``dev`` is ``valid``),
    with random embedding rows."""
    word_ids = np.arange(len(table.words))
    vectors = np.random.default_rng(0).normal(size=(len(table.words), 6)).astype(np.float32)
    splits = {name: ClozeSplit(sets[source], word_ids, source)
              for name, source in (("train", "train"), ("dev", "valid"), ("test", "test"))}
    return ChoiceData("tiny cloze", SimpleNamespace(word_vectors=vectors), splits,
                      {"tiny.json": "0" * 64})


def test_analysis_payload_is_small_and_serialisable():
    table, sets = encoded_sets()
    data = cloze_data(table, sets)
    model = reader(torch.randn(len(table.words), 6), hidden=4, subspaces=2, hops=2).eval()
    payload = model.analysis(data, None)
    text = json.dumps(payload)
    assert len(text) < 200_000 and len(payload["examples"]) == 3
    first = payload["examples"][0]
    assert len(first["attention"]) == 2 and len(first["attention"][0]) == len(first["tokens"])
    assert len(first["attention"][0][0]) == 2
    assert 0 < sum(first["probabilities"]) <= 1 + 1e-3  # p of Eq. 11, over the vocabulary
    assert first["answer"] in first["candidates"]
    assert first["query"] == data.splits["dev"].question(0)


def test_registered_and_built_over_the_task_vocab():
    table, sets = encoded_sets()
    data = cloze_data(table, sets)
    model = build_model("ea_reader", data.vocab, hidden=4, subspaces=2)
    assert isinstance(model, EAReader)
    assert torch.equal(model.embed.weight, torch.as_tensor(data.vocab.word_vectors))


def cloze_config(**changes) -> TrainConfig:
    values = dict(model="ea_reader", dataset="wiki-cloze", hparams={"hidden": 4, "subspaces": 2,
                  "hops": 2}, epochs=2, batch_size=2, eval_batch_size=4, optimizer="adam",
                  lr=0.01, ema_decay=0.9, device="cpu", log_every=2, checkpoint_every=None)
    return TrainConfig(**{**values, **changes})


def test_trainer_on_the_cloze_task_resumes_exactly(tmp_path):
    table, sets = encoded_sets()
    data = cloze_data(table, sets)
    cfg = cloze_config()
    assert cfg.task == "cloze"  # Wiki-cloze's own task
    straight = engine.train(cfg, tmp_path / "a", data=data)
    engine.train(cloze_config(epochs=1), tmp_path / "b", data=data)
    resumed = engine.train(cfg, tmp_path / "b", resume=True, data=data)
    assert straight["task"] == "cloze" and straight["version"] == "tiny cloze"
    for key in ("dev", "test", "best_epoch", "best_dev", "best_test", "steps"):
        assert resumed[key] == straight[key], key
    for a, b in zip(resumed["history"], straight["history"], strict=True):
        assert (a["dev"], a["test"], a["train_loss"]) == (b["dev"], b["test"], b["train_loss"])
    assert straight["analysis"] == resumed["analysis"]
    for split, scores in (("valid", straight["dev"]), ("test", straight["test"])):
        assert set(scores) == {"accuracy", "questions", "chance"}
        assert scores["questions"] == len(sets[split]) and 0 <= scores["accuracy"] <= 100
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"model.pt", "predictions.json", "metrics.json"} <= files and "vocab" not in files
    predictions = json.loads((tmp_path / "a" / "predictions.json").read_text())
    assert set(predictions) == set(data.splits["dev"].qids)
    with pytest.raises(UserError, match="lr"):
        engine.train(cloze_config(lr=0.1), tmp_path / "a", resume=True, data=data)


def test_gru_dropout_rate_is_the_papers_masks_per_position_unless_locked():
    """The paper gives GRU dropout's rate, 0.1, citing Srivastava et al.; where and how the
    masks are drawn is our reading: a new mask at every position of each BiGRU's input.
    ``locked_dropout`` (a departure) shares one mask over a sequence."""
    from mrc_lib.nn import LockedDropout

    vectors = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32)
    for locked, kind in ((False, torch.nn.Dropout), (True, LockedDropout)):
        model = reader(vectors, hidden=4, subspaces=2, locked_dropout=locked)
        for rnn in (model.doc_encoder, model.query_encoder):
            assert type(rnn.dropout) is kind and rnn.dropout.p == 0.1
