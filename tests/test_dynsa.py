"""DynSA (Zhuang & Wang 2019, Eqs. 1-6) against direct computations, and the DynSAN reader."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.config import TrainConfig
from mrc_lib.data.choice import PassageSplit, sentence_passages
from mrc_lib.data.multipassage import passage_mask
from mrc_lib.models import build_model
from mrc_lib.models.bibosa import BiBloSABlock
from mrc_lib.models.dynsa import DynSA, select_tokens
from mrc_lib.models.dynsan import PassageLayout, has_loss
from mrc_lib.models.dynsan_mc import DynSANMC, candidate_log_probs
from mrc_lib.tasks import get_task
from tests.test_models import make_batch, tiny_vocab

B, L, D, H = 3, 11, 16, 4
LENGTHS = [11, 7, 2]


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    mask = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    return torch.randn(B, L, D), mask


def direct_dynsa(block: DynSA, x, mask, chosen_sets):
    """Eqs. 1-5 token by token from the block's own parameters: attention among
    ``chosen_sets[b][h]`` (real positions)."""
    u = block.local_encoder(x, mask)
    d = D // H
    y = torch.zeros_like(x)
    for b in range(B):
        n = int(mask[b].sum())
        f_u = torch.relu(u[b, :n] @ block.f_u.weight.T + block.f_u.bias)  # F^U(U)
        g = torch.sigmoid(f_u @ block.f_g.weight.T + block.f_g.bias)  # Eq. 1: [n, H]
        z = []
        for h in range(H):
            # Eq. 4: F_h = F^H_h(F^U_h(U)), F^U_h(U) = head h's columns of F^U(U)
            f_h = f_u[:, h * d:(h + 1) * d] @ block.f_h.weight[h] + block.f_h.bias[h]
            a_h = torch.zeros_like(f_h)  # A*_h: zero at the unchosen positions
            idx = sorted(chosen_sets[b][h])
            for t in idx:  # Eq. 2 for each chosen token: Q_h, K_h, V_h from U_h
                q = u[b, t] @ block.w_q.weight[h]
                keys = [u[b, s] @ block.w_k.weight[h] for s in idx]
                values = [u[b, s] @ block.w_v.weight[h] for s in idx]
                weights = torch.softmax(torch.stack([q @ k for k in keys]) / math.sqrt(D / H), 0)
                a_h[t] = sum(w * v for w, v in zip(weights, values))
            z.append((f_h + a_h) * (g[:, h] / g[:, h].max()).unsqueeze(-1))  # Eq. 3
        y[b, :n] = torch.cat(z, dim=-1) @ block.f_y.weight.T + u[b, :n]  # Eq. 5
    return y


def test_k_at_least_length_equals_direct_eqs_1_to_5(inputs):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=L).eval()
    with torch.no_grad():
        y, g = block(x, mask)
        everything = [[set(range(n))] * H for n in LENGTHS]
        expected = direct_dynsa(block, x, mask, everything)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert (g[~mask] == 0).all()


def test_small_k_attends_among_the_top_k_gates(inputs):
    x, mask = inputs
    k = 3
    block = DynSA(D, heads=H, top_k=k).eval()
    with torch.no_grad():
        y, g = block(x, mask)
        top = [[set(np.argsort(-g[b, :n, h].numpy(), kind="stable")[:k].tolist())
                for h in range(H)] for b, n in enumerate(LENGTHS)]
        expected = direct_dynsa(block, x, mask, top)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_eq2_scores_are_not_symmetric(inputs):
    """Query and key are different projections of U_h (Eq. 2), so token i's score for j is not
    j's score for i."""
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=L).eval()
    with torch.no_grad():
        u = block.local_encoder(x, mask)[0, :5]
        scores = (u @ block.w_q.weight[0]) @ (u @ block.w_k.weight[0]).T
    assert not torch.allclose(scores, scores.T)


def test_local_encoder_is_conv_of_layer_norm_plus_input(inputs):
    """Sec. 2.1: U = Conv(LN(X)) + X, twice."""
    x, mask = inputs
    block = DynSA(D, heads=H).eval()
    with torch.no_grad():
        expected = x
        for conv, norm in zip(block.local.convs, block.local.norms):
            expected = expected + conv(norm(expected), mask)
        torch.testing.assert_close(block.local_encoder(x, mask), expected)
    assert len(block.local.convs) == 2


def test_selection_is_brute_force_top_k_and_never_padding():
    torch.manual_seed(1)
    scores = torch.rand(B, H, L)
    mask = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    for k in (1, 4, 7, 20):
        index, chosen = select_tokens(scores, mask, k)
        assert index.shape == (B, H, min(k, L))
        for b, n in enumerate(LENGTHS):
            for h in range(H):
                picked = {int(i) for i, c in zip(index[b, h], chosen[b, h]) if c}
                brute = sorted(range(n), key=lambda t: -float(scores[b, h, t]))[:k]
                assert picked == set(brute)
                assert all(mask[b, int(i)] == c for i, c in zip(index[b, h], chosen[b, h]))
                assert len(set(index[b, h].tolist())) == index.shape[-1]  # no repeats


def test_attention_never_builds_l_by_l(monkeypatch):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.shape)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    block = DynSA(8, heads=2, top_k=5).eval()
    mask = torch.ones(2, 50, dtype=torch.bool)
    with torch.no_grad():
        y, g = block(torch.randn(2, 50, 8), mask)
        a = block.attend(torch.randn(2, 50, 8), g.transpose(1, 2), mask)
    assert seen == [(2, 2, 5, 4)] * 2
    index, _ = select_tokens(g.transpose(1, 2), mask, 5)
    unchosen = torch.ones(2, 2, 50, dtype=torch.bool).scatter(2, index, False)
    assert (a[unchosen] == 0).all() and (a[~unchosen] != 0).any()


def test_padding_does_not_change_real_outputs(inputs):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=4).eval()
    padded = torch.cat([x, torch.randn(B, 5, D)], dim=1)
    with torch.no_grad():
        y, _ = block(x, mask)
        y_pad, _ = block(padded, torch.cat([mask, torch.zeros(B, 5, dtype=torch.bool)], 1))
    torch.testing.assert_close(y_pad[:, :L], y, atol=1e-5, rtol=1e-5)
    assert (y_pad[:, L:] == 0).all()


@pytest.mark.parametrize("switches", [{}, {"attention": False}, {"conv": False},
                                      {"selection": "random"}])
def test_gradients_reach_the_gate(inputs, switches):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=3, **switches).train()
    y, _ = block(x.requires_grad_(), mask)
    y.square().sum().backward()
    assert block.f_g.weight.grad.abs().sum() > 0
    assert x.grad[~mask].abs().sum() == 0  # nothing flows from padding


def test_ablation_switches_remove_what_table3_removes(inputs, monkeypatch):
    """(b) no self-attention: no attention call and no Q/K/V; (c) no convolutions; (d) the K
    tokens are drawn at random, not by the gate; (e) on top of (d), no gate at all."""
    x, mask = inputs
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    no_attention = DynSA(D, heads=H, top_k=3, attention=False).eval()
    no_attention(x, mask)
    assert calls == [] and not hasattr(no_attention, "w_q")
    with torch.no_grad():  # (b) is Eq. 3 with A*_h = 0
        u = no_attention.local_encoder(x, mask)
        f_u = torch.relu(no_attention.f_u(u))
        g = no_attention.gate(f_u, mask)
        f_h = no_attention.f_h(f_u.view(B, L, H, -1).transpose(1, 2))
        z = f_h * (g / g.amax(1, keepdim=True)).transpose(1, 2).unsqueeze(-1)
        expected = (no_attention.f_y(z.transpose(1, 2).reshape(B, L, D)) + u) * mask[..., None]
        torch.testing.assert_close(no_attention(x, mask)[0], expected)
    assert len(DynSA(D, heads=H, conv=False).local.convs) == 0
    torch.testing.assert_close(DynSA(D, heads=H, conv=False).local_encoder(x, mask), x)
    picked = []
    random_block = DynSA(D, heads=H, top_k=3, selection="random").eval()
    monkeypatch.setattr(random_block, "attend",
                        lambda u, scores, m: picked.append(scores) or torch.zeros(B, H, L, D // H))
    _, g = random_block(x, mask)
    assert not torch.equal(picked[0], g.transpose(1, 2))  # not the gate's ranking
    no_gate = DynSA(D, heads=H, top_k=3, selection="random", gate=False).eval()
    y, g = no_gate(x, mask)
    assert g is None and no_gate.f_g is None and y.shape == x.shape
    with pytest.raises(ValueError):
        DynSA(D, heads=H, gate=False)  # a gate-less block cannot select by the gate


def test_l1_penalty_is_the_aux_loss_the_trainer_adds():
    """Eq. 6: in training the reader returns β‖G‖₁ over every DynSA gate (question side and
    end block included), averaged over the batch, and the task's ``loss`` adds it to the
    reader's own loss; (f) β = 0 and (e) no gate drop it."""
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **{**TINY, "beta": 0.3}).train()
    batch = make_batch(c_lens=[16, 12], q_lens=[5, 4])
    seen = []
    for m in model.modules():
        if isinstance(m, DynSA):
            m.register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    out = model(batch)
    expected = 0.3 * sum(g.sum() for g in seen) / 2
    assert len(seen) == 2 + 1 + TINY["num_blocks"] + 1  # passages, question, aligned, N, end
    torch.testing.assert_close(out["aux_loss"], expected)
    torch.testing.assert_close(get_task("span").loss(out, batch), out["loss"] + out["aux_loss"])
    assert "aux_loss" not in model.eval()(batch)
    assert "aux_loss" not in build_model("dynsan", tiny_vocab(), **{**TINY, "beta": 0.0})(batch)
    no_gate = build_model("dynsan", tiny_vocab(), **{**TINY, "selection": "random",
                                                     "gate": False}).train()
    assert "aux_loss" not in no_gate(batch) and "gates" not in no_gate(batch)


def test_has_loss_sums_over_every_occurrence():
    """Sec. 3.4.1: −log Σ_{(i,j) ∈ T} p^s_i p^e_j, by hand."""
    torch.manual_seed(0)
    start, end = torch.randn(2, 9), torch.randn(2, 9)
    occ_start = torch.tensor([[1, 5, -1], [2, -1, -1]])
    occ_end = torch.tensor([[2, 6, -1], [4, -1, -1]])
    p_s, p_e = start.softmax(-1), end.softmax(-1)
    expected = -(torch.log(p_s[0, 1] * p_e[0, 2] + p_s[0, 5] * p_e[0, 6])
                 + torch.log(p_s[1, 2] * p_e[1, 4])) / 2
    torch.testing.assert_close(has_loss(start, end, occ_start, occ_end), expected)
    unaligned = torch.tensor([[-1, -1, -1]])  # a third example without any occurrence
    torch.testing.assert_close(has_loss(torch.cat([start, start[:1]]), torch.cat([end, end[:1]]),
                                        torch.cat([occ_start, unaligned]),
                                        torch.cat([occ_end, unaligned])), expected)
    start.requires_grad_()  # the example left out gets no gradient, and no NaN
    has_loss(start, end, unaligned.expand(2, 3), unaligned.expand(2, 3)).backward()
    assert torch.equal(start.grad, torch.zeros_like(start))


def test_readers_own_loss_uses_the_batch_occurrences_and_the_end_follows_the_start():
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **TINY).train()
    batch = make_batch(c_lens=[16, 12], q_lens=[5, 4])
    batch["occ_start"] = torch.stack([batch["y1"], torch.tensor([0, -1])], 1)
    batch["occ_end"] = torch.stack([batch["y2"], torch.tensor([1, -1])], 1)
    torch.manual_seed(1)
    out = model(batch)
    expected = has_loss(out["start_logits"], out["end_logits"], batch["occ_start"],
                        batch["occ_end"])
    torch.testing.assert_close(out["loss"], expected)
    model.eval()
    with torch.no_grad():
        before = model(batch)["end_logits"]
        model.w_s.weight.add_(1.0)  # only the start pointer changes...
        after = model(batch)["end_logits"]
    assert not torch.allclose(before, after)  # ...and the end pointer follows it


def test_word_vectors_are_fixed_by_default():
    assert not build_model("dynsan", tiny_vocab(), **TINY).embed.word.trainable.requires_grad
    trained = build_model("dynsan", tiny_vocab(), **TINY, fixed_words=False)
    assert trained.embed.word.trainable.requires_grad


def test_passage_layout_split_and_merge():
    passage = torch.tensor([[0, 0, 0, 1, 1, 2, 0], [0, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    per_passage = torch.from_numpy(passage_mask(passage.numpy(), mask.numpy()))
    layout = PassageLayout.of(passage, mask, per_passage)
    x = torch.arange(14.0).view(2, 7, 1) + 1
    parts = layout.split(x)
    assert parts.shape == (2 * 3, 4, 1)  # B·M passages of the longest passage's length
    expected = [[1, 2, 3, 0], [4, 5, 0, 0], [6, 0, 0, 0],
                [8, 0, 0, 0], [9, 10, 11, 12], [0, 0, 0, 0]]
    assert parts.squeeze(-1).tolist() == expected
    assert layout.passage_mask.long().tolist() == [[int(v > 0) for v in r] for r in expected]
    assert torch.equal(layout.merge(parts), x.masked_fill(~mask.unsqueeze(-1), 0))


def small_reader(vocab, **hparams):
    return build_model("dynsan", vocab, d_model=16, heads=2, top_k=8, num_blocks=2, char_dim=4,
                       char_channels=8, **hparams).eval()


@pytest.fixture
def multi_batch():
    vocab = SyntheticVocab.random(size=600, dim=8)
    batch = synthetic_batch(vocab, 2, 30, question_len=6)
    batch["c_passage"] = (torch.arange(30) // 10).expand(2, 30).clone()
    batch["c_passage_mask"] = torch.from_numpy(passage_mask(batch["c_passage"].numpy(),
                                                            batch["c_mask"].numpy()))
    return vocab, batch


@pytest.mark.parametrize("passages", ["one", "several"])
def test_reader_training_step_reads_nothing_back_from_the_device(multi_batch, passages):
    """No ``.item()``, no length read on the host, no boolean index: TorchDynamo captures the
    whole training forward in one graph (the layout's shape comes with the batch)."""
    vocab, batch = multi_batch
    if passages == "one":
        batch = {k: v for k, v in batch.items() if not k.startswith("c_passage")}
    model = small_reader(vocab).train()
    explained = torch._dynamo.explain(model)(batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.parametrize("cross", [True, False])
def test_cross_passage_attention_links_passages(multi_batch, cross):
    vocab, batch = multi_batch
    torch.manual_seed(0)
    model = small_reader(vocab, cross_passage=cross)
    changed = dict(batch, c_words=batch["c_words"].clone())
    changed["c_words"][:, 25] = 7  # a word of the last passage
    with torch.no_grad():
        a, b = model(batch)["start_logits"], model(changed)["start_logits"]
    first_passage_same = torch.allclose(a[:, :10], b[:, :10])
    assert first_passage_same != cross


@pytest.mark.parametrize("block", ["dynsa", "bilstm", "fullsan", "bibosa"])
def test_reader_blocks_train(multi_batch, block):
    vocab, batch = multi_batch
    model = small_reader(vocab, block=block)
    with torch.no_grad():
        gates = model.eval()(batch).get("gates")  # Figures 3-4 read them outside training
    assert (gates is not None) == (block == "dynsa")
    if block == "dynsa":
        assert gates.shape == (2, 2 + 2, 30, 2)  # layers -1, 0 and N = 2 blocks
    out = model.train()(batch)
    assert out["start_logits"].shape == out["end_logits"].shape == (2, 30)
    assert "gates" not in out
    get_task("span").loss(out, batch).backward()
    for part in ("blocks.1", "end_block"):
        assert all(p.grad is not None for n, p in model.named_parameters() if part in n)


@pytest.mark.parametrize(("hparams", "kind", "convs"), [
    ({"block": "bibosa", "conv": False}, BiBloSABlock, 0),  # Table 3 (g), Table 4 Bi-BloSAN
    ({"block": "bibosa"}, BiBloSABlock, 2),  # Table 3 (h): (g) + convolutional layers
    ({"conv": False}, DynSA, 0),  # Table 3 (c)
])
def test_reader_block_rows(multi_batch, hparams, kind, convs):
    model = small_reader(multi_batch[0], **hparams)
    blocks = [model.encoder, model.aligned, *model.blocks, model.end_block]
    assert all(isinstance(b, kind) and len(b.local.convs) == convs for b in blocks)


class FakeSplit:
    """The part of a dev split that ``analysis`` reads."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(self.batch["c_words"])

    def collate(self, pos):
        return {k: v[torch.as_tensor(pos)] for k, v in self.batch.items()}

    def question(self, i):
        return f"question {i}"

    def tokens(self, i, side="c"):
        return [f"w{t}" for t in range(int(self.batch["c_mask"][i].sum()))]


def test_analysis_is_figures_3_and_4_from_max_gate_over_heads(multi_batch):
    """Activity = max over heads; Figure 4 counts per layer (-1, 0, 1..N), Figure 3 sums the
    cross-passage layers' activities."""
    vocab, batch = multi_batch
    torch.manual_seed(0)
    model = small_reader(vocab)
    data = SimpleNamespace(splits={"dev": FakeSplit(batch)})
    payload = model.analysis(data, None)
    with torch.no_grad():
        activity = model(batch)["gates"].amax(-1)  # [2, layers, 30]
    assert payload["layers"] == [-1, 0, 1, 2]
    bands = torch.stack([activity <= 0.01, (activity > 0.01) & (activity < 0.99),
                         activity >= 0.99], -1).sum((0, 2))
    assert payload["figure4a"] == bands.tolist()
    torch.testing.assert_close(torch.tensor(payload["figure4b"]),
                               (activity > 0.01).sum((0, 2)).float() / 2)
    case = payload["figure3"][0]
    torch.testing.assert_close(torch.tensor(case["score"]), activity[0, 2:].sum(0),
                               atol=1e-4, rtol=0)
    assert len(payload["figure3"]) == 2 and case["passage"] == batch["c_passage"][0].tolist()
    assert small_reader(vocab, block="bilstm").analysis(data, None) == {}


TINY = dict(d_model=16, heads=2, top_k=4, num_blocks=2, kernel_size=3, char_dim=4,
            char_channels=6, char_kernel=3, dropout=0.0, char_dropout=0.0)


def test_reader_masks_padding_and_ignores_it():
    """Padding gets zero probability and does not change the real positions' outputs, even
    with K smaller than the real lengths (padding must never be chosen)."""
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **TINY).eval()
    short = make_batch([9], [4], seed=3)
    padded = make_batch([9], [4], seed=3, pad_to=(15, 7))
    with torch.no_grad():
        a, b = model(short), model(padded)
    for key in ("start_logits", "end_logits"):
        torch.testing.assert_close(b[key][:, :9], a[key], rtol=1e-5, atol=1e-5)
        assert (torch.softmax(b[key], -1)[:, 9:] == 0).all()
    torch.testing.assert_close(b["attention"].sum(-1), padded["c_mask"].float())


def test_reader_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **TINY)
    batch = make_batch(c_lens=[16, 12, 14, 10, 16, 9, 13, 15], q_lens=[5, 4, 5, 3, 4, 5, 2, 4])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(40):  # the HAS loss sums the start and end terms, fixed words: 40 steps
        loss = get_task("span").loss(model(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, losses


def test_eqs_7_8_candidate_probability_sums_r_over_mentions():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    cand_index = torch.tensor([[0, -1, 1, 0, -1, 2]])
    r = logits.softmax(-1)  # Eq. 7
    expected = torch.stack([r[0, 0] + r[0, 3], r[0, 2], r[0, 5], torch.tensor(0.0)]).log()
    torch.testing.assert_close(candidate_log_probs(logits, cand_index, 4)[0], expected)


def test_sentence_passages_start_after_each_sentence_end():
    doc = "anna met bob . bob left ! carl stayed ? dora".split()
    assert sentence_passages(doc).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert sentence_passages(["one", "."]).tolist() == [0, 0]  # a final end opens nothing


def test_multiple_choice_reader_on_cloze_passages():
    """Sentences become passages, the candidate feature marks mentions, and the
    ``multiple_choice`` task's loss is −log P(answer) (Eq. 8) plus the Eq. 6 penalty."""
    from mrc_lib.data.cloze import ClozeExample

    vocab = SimpleNamespace(word_vectors=np.random.default_rng(0).normal(size=(50, 8)),
                            n_trainable=3, n_chars=30, word_id=lambda w: len(w) % 49 + 1,
                            char_ids=lambda w: [ord(c) % 29 + 1 for c in w[:16]])
    examples = [ClozeExample("anna met bob . bob left . carl stayed".split(),
                             "XXXXX met bob".split(), "anna", ["anna", "bob", "carl"]),
                ClozeExample("dora ran . eve sat".split(), "XXXXX sat".split(), "eve",
                             ["dora", "eve"])]
    split = PassageSplit(examples, vocab, "valid")
    batch = split.collate(np.arange(2))
    assert batch["c_passage"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert batch["cand_index"][0].tolist() == [0, -1, 1, -1, 1, -1, -1, 2, -1]
    assert batch["c_feats"][1, :, 0].tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0]
    assert batch["answer"].tolist() == [0, 1] and batch["cand_mask"][1].tolist() == [1, 1, 0]
    assert split.candidates(1) == ["dora", "eve"] and split.answer(0) == "anna"
    torch.manual_seed(0)
    model = DynSANMC(SimpleNamespace(**vars(vocab), n_feats=1), **TINY).train()
    out = model(batch)
    assert "loss" not in out  # the task computes the objective
    log_p = out["candidate_log_probs"]
    task = get_task("multiple_choice")
    nll = -(log_p[0, 0] + log_p[1, 1]) / 2
    torch.testing.assert_close(task.objective(out, batch), nll)
    torch.testing.assert_close(task.loss(out, batch), nll + out["aux_loss"])
    torch.testing.assert_close(task.loss({"candidate_log_probs": log_p}, batch), nll)
    assert torch.isinf(log_p[1, 2])  # a padding candidate
    assert log_p[0].exp().sum() < 1  # Eq. 8: r also sits on tokens that are no candidate
    task.loss(out, batch).backward()
    assert model.f_s.weight.grad.abs().sum() > 0
    cfg = TrainConfig(model="dynsan_mc", dataset="wiki-cloze", task="multiple_choice",
                      eval_batch_size=2, device="cpu")
    evaluation = task.evaluate(model, split, cfg, torch.device("cpu"))
    assert evaluation.scores["questions"] == 2 and not model.training
    assert evaluation.scores["chance"] == pytest.approx(100 * (1 / 3 + 1 / 2) / 2)
    predictions = evaluation.files["predictions.json"]
    assert sorted(predictions) == ["valid-0", "valid-1"]
    assert predictions["valid-0"] in examples[0].candidates
    assert predictions["valid-1"] in examples[1].candidates
    right = sum(predictions[f"valid-{i}"] == e.answer for i, e in enumerate(examples))
    assert evaluation.scores["accuracy"] == 100 * right / 2
