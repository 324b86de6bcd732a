"""Adaptive Bi-directional Attention (Chen et al. 2021), BiDAF++, QANet-NA and the SQuAD 2.0
protocols: each equation recomputed directly, the initialisation, masks, gradients, data."""

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from mrc_lib.config import TrainConfig
from mrc_lib.data.squad import Answer, Example, SquadFile
from mrc_lib.data.squad2 import (
    check_disjoint,
    concat,
    load_squad2,
    split_by_article,
    synthesize_unanswerable,
    tuned_scores,
)
from mrc_lib.errors import UserError
from mrc_lib.models import build_model, hparam_defaults
from mrc_lib.models.aba import (
    ABAttention,
    AdaptiveBiAttention,
    granularities,
    granularity_names,
    last_token_outputs,
    question_side,
)
from mrc_lib.models.bidafpp import NoAnswerHead, SelfAttention
from mrc_lib.nn import mask_logits, span_loss
from mrc_lib.tasks import get_task

TINY = {"bidafpp": {"hidden": 8, "proj": 16, "char_dim": 4, "char_channels": 6, "na_hidden": 8},
        "qanet_na": {"d_model": 8, "heads": 2, "model_blocks": 1, "char_dim": 4,
                     "char_channels": 6, "na_hidden": 8},
        "san": {"d_lexicon": 8, "hidden": 4, "d_align": 8, "steps": 3}}
READERS = list(TINY)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def vocab():
    rng = np.random.default_rng(0)
    return types.SimpleNamespace(word_vectors=rng.normal(size=(40, 8)).astype(np.float32),
                                 n_trainable=4, n_chars=12, n_feats=4)


def batch(c_lens=(9, 6), q_lens=(4, 3)):
    g = torch.Generator().manual_seed(1)
    B, Lc, Lq = len(c_lens), max(c_lens), max(q_lens)
    c_mask = torch.arange(Lc)[None] < torch.tensor(c_lens)[:, None]
    q_mask = torch.arange(Lq)[None] < torch.tensor(q_lens)[:, None]
    return {"c_words": torch.randint(1, 40, (B, Lc), generator=g) * c_mask,
            "c_chars": torch.randint(1, 12, (B, Lc, 5), generator=g) * c_mask[..., None],
            "q_words": torch.randint(1, 40, (B, Lq), generator=g) * q_mask,
            "q_chars": torch.randint(1, 12, (B, Lq, 5), generator=g) * q_mask[..., None],
            "c_mask": c_mask, "q_mask": q_mask,
            "c_feats": torch.rand(B, Lc, 4, generator=g) * c_mask[..., None],
            "y1": torch.tensor([2, -1]), "y2": torch.tensor([4, -1]),
            "has_answer": torch.tensor([True, False])}


def padded(b, extra=3):
    """``b`` with ``extra`` more padding positions after every context and question."""
    def pad(x):
        return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)

    return {k: pad(v) if k[0] in "cq" else v for k, v in b.items()}


def model(name, aba, **options):
    return build_model(name, vocab(), aba=aba, **TINY[name], **options)


def reader_inputs(net, b, side):
    """The arguments of ``net.layers`` for one side of batch ``b``."""
    if hasattr(net, "lexicon_p"):  # SAN's lexicon input of the passage needs the question
        x_p, x_q = net.word(b["c_words"]), net.word(b["q_words"])
        extra = [net.aligned(x_p, x_q, b["q_mask"])]
        if net.n_feats:
            extra.append(b["c_feats"])
        return b["c_words"], b["c_mask"], net.lexicon_p, extra
    return b[f"{side}_words"], b[f"{side}_chars"], b[f"{side}_mask"]


def masks(c_lens, q_lens):
    Lc, Lq = max(c_lens), max(q_lens)
    return (torch.arange(Lc)[None] < torch.tensor(c_lens)[:, None],
            torch.arange(Lq)[None] < torch.tensor(q_lens)[:, None])


# --- the mechanism, equation by equation -----------------------------------------------------


def test_eq1_2_stack_order_paper_and_newest_first():
    layers = [torch.full((1, 2, 1), float(i)) for i in range(4)]  # E, C¹, C², C³
    a = torch.full((1, 2, 1), 9.0)
    assert [float(h[0, 0, 0]) for h in granularities(layers, a)] == [0.0, 1.0, 2.0, 3.0, 9.0]
    assert [float(h[0, 0, 0]) for h in granularities(layers, a, "newest_first")] == \
        [3.0, 2.0, 1.0, 0.0, 9.0]
    assert granularity_names(3) == ["E", "C1", "C2", "C3", "A"]
    assert granularity_names(3, "newest_first") == ["C3", "C2", "C1", "E", "A"]


def test_eq3_two_elementwise_lambdas_first_column_ones():
    aba = AdaptiveBiAttention([3, 2, 2])  # widths of E, C¹, A
    assert aba.lam_p is not aba.lam_q
    for lam in (aba.lam_p, aba.lam_q):
        assert lam.lam.tolist() == [1.0] * 3 + [0.0] * 4  # E's column 1, the others 0
    with torch.no_grad():
        aba.lam_p.lam.copy_(torch.randn(7))
    hos = [torch.randn(2, 5, 3), torch.randn(2, 5, 2), torch.randn(2, 5, 2)]
    lam = aba.lam_p.lam
    direct = torch.cat([lam[:3] * hos[0], lam[3:5] * hos[1], lam[5:] * hos[2]], dim=-1)
    assert torch.allclose(aba.lam_p(hos), direct)
    # at initialisation λ^q keeps E and zeroes C¹ and A
    assert torch.equal(aba.lam_q(hos), torch.cat([hos[0], torch.zeros(2, 5, 4)], dim=-1))


def test_eq3_equal_widths_is_the_d_by_k_matrix_of_the_paper():
    aba = AdaptiveBiAttention([4, 4, 4])
    with torch.no_grad():
        aba.lam_p.lam.copy_(torch.randn(12))
    matrix = aba.lam_p.lam.reshape(3, 4).T  # [d, K]: column k is granularity k
    hos = [torch.randn(1, 2, 4) for _ in range(3)]
    direct = torch.stack(hos, dim=-1) * matrix  # λ ⊙ HOSᵀ word by word, [1, 2, d, K]
    assert torch.allclose(aba.lam_p(hos), direct.transpose(-1, -2).flatten(-2))


def test_shared_scalar_option_is_the_lambda_sum_of_projected_granularities():
    aba = AdaptiveBiAttention([6, 4, 4], lam="shared_scalar", hos_order="newest_first")  # E, C¹, A
    assert aba.lam_p is aba.lam_q
    assert aba.lam_p.lam.tolist() == [1.0, 0.0, 0.0]
    with torch.no_grad():
        aba.lam_p.lam.copy_(torch.tensor([0.5, -1.0, 2.0]))
    hos = [torch.randn(2, 5, 4), torch.randn(2, 5, 6), torch.randn(2, 5, 4)]  # C¹, E, A
    W = aba.lam_p.project[1].weight  # [4, 6]
    direct = 0.5 * hos[0] + -1.0 * torch.einsum("bld,kd->blk", hos[1], W) + 2.0 * hos[2]
    assert torch.allclose(aba.lam_p(hos), direct, atol=1e-6)
    assert isinstance(aba.lam_p.project[0], torch.nn.Identity)


def test_eq4_trilinear_row_column_softmax_and_dcn_against_loops():
    d, c_lens, q_lens = 3, (5, 3), (4, 2)
    c_mask, q_mask = masks(c_lens, q_lens)
    p, q = torch.randn(2, 5, d), torch.randn(2, 4, d)
    att = ABAttention(d).eval()
    out, row = att(p, q, c_mask, q_mask)
    w = att.similarity.w.reshape(-1)
    for b, (n, m) in enumerate(zip(c_lens, q_lens)):
        H = torch.tensor([[float(w.detach() @ torch.cat([p[b, t], q[b, j], p[b, t] * q[b, j]]))
                           for j in range(m)] for t in range(n)])
        H_hat = torch.softmax(H, dim=1)  # row softmax, over the question
        H_bar = torch.softmax(H, dim=0)  # column softmax, over the passage
        M = H_hat @ q[b, :m]
        S = H_hat @ H_bar.T @ p[b, :n]
        P = p[b, :n]
        direct = torch.cat([P, M, P * M, P * S], dim=-1)
        assert torch.allclose(out[b, :n], direct, atol=1e-5)
        assert torch.allclose(row[b, :n, :m], H_hat, atol=1e-6)
        assert (out[b, n:] == 0).all() and (row[b, :, m:] == 0).all()


def test_eq4_dropout_acts_on_the_similarity_matrix():
    """With dropout 1 every H_tj is 0: the row softmax is uniform over the real question."""
    c_mask, q_mask = masks((4,), (3,))
    p, q = torch.randn(1, 4, 2), torch.randn(1, 3, 2)
    att = ABAttention(2, dropout=1.0).train()
    out, row = att(p, q, c_mask, q_mask)
    assert torch.allclose(row, torch.full((1, 4, 3), 1 / 3))
    assert torch.allclose(out[0, :, 2:4], q[0].mean(0).expand(4, 2), atol=1e-6)


def test_question_side_A_is_the_attention_weighted_passage_average():
    c_mask, q_mask = masks((5, 3), (4, 2))
    a = torch.randn(2, 5, 3)
    attn = torch.softmax(torch.randn(2, 5, 4), -1) * q_mask[:, None] * c_mask[..., None]
    a_q = question_side(a, attn, c_mask)
    for b, (n, m) in enumerate([(5, 4), (3, 2)]):
        for j in range(m):
            weights = attn[b, :n, j]
            assert torch.allclose(a_q[b, j], (weights[:, None] * a[b, :n]).sum(0) / weights.sum(),
                                  atol=1e-6)
        assert (a_q[b, m:] == 0).all()


def test_eqs_1_to_4_together_against_the_equations_written_out():
    c_mask, q_mask = masks((5, 4), (3, 2))
    aba = AdaptiveBiAttention([3, 2, 2], dropout=0.3).eval()
    with torch.no_grad():
        aba.lam_p.lam.copy_(torch.randn(7))
        aba.lam_q.lam.copy_(torch.randn(7))
    e_p, c_p, a = torch.randn(2, 5, 3), torch.randn(2, 5, 2), torch.randn(2, 5, 2)
    e_q, c_q = torch.randn(2, 3, 3), torch.randn(2, 3, 2)
    attn = torch.softmax(torch.randn(2, 5, 3), -1) * q_mask[:, None] * c_mask[..., None]
    i, row = aba([e_p, c_p], [e_q, c_q], a, attn, c_mask, q_mask)
    hos_p = aba.lam_p.lam * torch.cat([e_p, c_p, a], -1)  # Eqs. 1, 3
    hos_q = aba.lam_q.lam * torch.cat([e_q, c_q, question_side(a, attn, c_mask)], -1)  # 2, 3
    direct, _ = aba.attention(hos_p, hos_q, c_mask, q_mask)  # Eq. 4, checked above
    assert torch.allclose(i, direct) and i.shape[-1] == aba.out_dim == 4 * 7


# --- the readers ---------------------------------------------------------------------------------


def attention_inputs(module):
    seen = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[:2]))
    return seen


@pytest.mark.parametrize("name", READERS)
def test_paper_initialisation_keeps_only_the_embedding(name):
    net = model(name, aba=True).eval()
    seen = attention_inputs(net.aba.attention)
    with torch.no_grad():
        net(batch())
    hos_p, hos_q = seen[0]
    width = net.aba.lam_p.widths[0]
    p = net.layers(*reader_inputs(net, batch(), "c"))
    assert torch.equal(hos_p[..., :width], p[0]) and (hos_p[..., width:] == 0).all()
    assert (hos_q[..., width:] == 0).all()


@pytest.mark.parametrize("name", ["bidafpp", "qanet_na"])
def test_newest_first_option_starts_from_the_base_attention_inputs(name):
    net = model(name, aba=True, aba_lam="shared_scalar", aba_order="newest_first",
                aba_feed="attention").eval()
    base_in, aba_in = attention_inputs(net.attention), attention_inputs(net.aba.attention)
    with torch.no_grad():
        net(batch())
    (c, q), (hos_p, hos_q) = base_in[0], aba_in[0]
    assert torch.equal(hos_p, c) and torch.equal(hos_q, q)  # ĤOS_p = C_pⁿ, ĤOS_q = C_qⁿ


def test_qanet_with_our_aba_options_at_initialisation_is_qanet():
    base = model("qanet_na", aba=False).eval()
    aba = model("qanet_na", aba=True, aba_lam="shared_scalar", aba_order="newest_first",
                aba_feed="attention").eval()
    aba.load_state_dict(base.state_dict(), strict=False)
    aba.aba.attention.load_state_dict(base.attention.state_dict())
    with torch.no_grad():
        x, y = base(batch()), aba(batch())
    for key in ("start_logits", "end_logits", "na_logits", "attention"):
        assert torch.allclose(x[key], y[key], atol=1e-5), key


def test_qanet_na_keeps_qanet_layer_for_layer():
    qanet = build_model("qanet", vocab(), **{k: v for k, v in TINY["qanet_na"].items()
                                             if k != "na_hidden"}).eval()
    na = model("qanet_na", aba=False, no_answer="head").eval()
    na.load_state_dict(qanet.state_dict(), strict=False)
    b = batch()
    with torch.no_grad():
        x, y = qanet(b), na(b)
        layers = na.layers(b["c_words"], b["c_chars"], b["c_mask"])
        assert torch.equal(layers[-1], qanet.encode(b["c_words"], b["c_chars"], b["c_mask"]))
    for key in ("start_logits", "end_logits", "attention"):
        assert torch.allclose(x[key], y[key], atol=1e-6), key
    assert {"aba", "aba_lam", "no_answer", "d_model"} <= set(hparam_defaults("qanet_na"))


OUTPUT_LAYER = {"bidafpp": "start_rnn", "qanet_na": "w1", "san": "answer"}


@pytest.mark.parametrize("name", READERS)
def test_I_is_the_input_of_the_output_layer(name):
    net = model(name, aba=True).eval()
    seen_i, seen_out = [], []
    net.aba.register_forward_hook(lambda _, __, out: seen_i.append(out[0]))
    getattr(net, OUTPUT_LAYER[name]).register_forward_pre_hook(
        lambda _, args: seen_out.append(args))
    with torch.no_grad():
        net(batch())
    reads = seen_out[0][1] if name == "san" else seen_out[0][0]  # SAN: answer(s₀, memory)
    assert torch.equal(reads, seen_i[0]) and reads.shape[-1] == net.aba.out_dim


@pytest.mark.parametrize("name", READERS)
def test_attention_feed_option_puts_I_in_place_of_the_attention_output(name):
    net = model(name, aba=True, aba_feed="attention").eval()
    seen = []
    net.aba.register_forward_hook(lambda _, __, out: seen.append(out[0]))
    with torch.no_grad():
        net(batch())
    assert seen[0].shape[-1] == net.aba.out_dim  # the width of the base attention's output
    assert net.aba.feed == "attention"


def test_last_token_loss_na_score_and_decoding():
    b = batch()
    start, end = torch.randn(2, 9), torch.randn(2, 9)
    start, end = (mask_logits(x, b["c_mask"]) for x in (start, end))
    out = last_token_outputs(start, end, b, max_len=3)
    last = torch.tensor([8, 5])
    direct = span_loss(start, end, torch.tensor([2, 5]), torch.tensor([4, 5]))
    assert torch.allclose(out["loss"], direct)  # the unanswerable example points at token 5
    for k, n in enumerate((9, 6)):
        p1, p2 = torch.softmax(start[k], 0), torch.softmax(end[k], 0)
        best = max(p1[i] * p2[j] for i in range(n - 1) for j in range(i, min(i + 3, n - 1)))
        expected = torch.log(p1[last[k]] * p2[last[k]] / best)
        assert torch.allclose(out["na_logits"][k], expected, atol=1e-5)
        for key in ("start_logits", "end_logits"):
            assert out[key][k, last[k]] == torch.finfo(torch.float32).min
        # by default, the best of every span i <= j of the other tokens (the bases' decoding)
        every = max(p1[i] * p2[j] for i in range(n - 1) for j in range(i, n - 1))
        assert torch.allclose(last_token_outputs(start, end, b)["na_logits"][k],
                              torch.log(p1[last[k]] * p2[last[k]] / every), atol=1e-5)
    assert "loss" not in last_token_outputs(start, end, {"c_mask": b["c_mask"]})


@pytest.mark.parametrize("name", READERS)
@pytest.mark.parametrize("aba", [False, True])
@pytest.mark.parametrize("no_answer", ["last_token", "head"])
def test_readers_outputs_masks_and_padding_invariance(name, aba, no_answer):
    net = model(name, aba, no_answer=no_answer).eval()
    b = batch()
    with torch.no_grad():
        out = net(b)
        more = net(padded(b))
    assert out["na_logits"].shape == (2,)
    assert out["start_logits"].shape == out["end_logits"].shape == (2, 9)
    assert (out["start_logits"][1, 6:] == torch.finfo(torch.float32).min).all()
    assert torch.allclose(torch.softmax(out["start_logits"], -1)[1, 6:], torch.zeros(3))
    for key in ("start_logits", "end_logits"):  # longer padding in the batch changes nothing
        assert torch.allclose(out[key][:, :6], more[key][:, :6], atol=1e-5), key
    assert torch.allclose(out["na_logits"], more["na_logits"], atol=1e-5)
    assert ("loss" in out) == (no_answer == "last_token")


@pytest.mark.parametrize("name", READERS)
def test_gradients_reach_both_lambdas(name):
    net = model(name, aba=True).train()
    get_task("span_na").loss(net(batch()), batch()).backward()
    for lam in (net.aba.lam_p.lam, net.aba.lam_q.lam):
        assert lam.grad is not None and lam.grad.abs().sum() > 0
    assert net.aba.attention.similarity.w.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["bidafpp", "qanet_na"])
def test_gradients_reach_lambda_and_every_projection_in_the_shared_scalar_option(name):
    net = model(name, aba=True, aba_lam="shared_scalar").train()
    with torch.no_grad():
        net.aba.lam_p.lam.fill_(0.5)
    get_task("span_na").loss(net(batch()), batch()).backward()
    assert (net.aba.lam_p.lam.grad != 0).all()
    for p in net.aba.lam_p.project.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_bidafpp_self_attention_excludes_each_word_itself():
    layer = SelfAttention(dim=4, hidden=3, dropout=0.0).eval()
    x, mask = torch.randn(1, 5, 4), torch.tensor([[True] * 4 + [False]])
    with torch.no_grad():
        out = layer(x, mask)
        h = layer.rnn(x, mask)[0, :4]
        S = layer.similarity(h[None], h[None])[0]
        S.fill_diagonal_(float("-inf"))
        h_tilde = torch.softmax(S, dim=1) @ h
        direct = x[0, :4] + layer.out(torch.cat([h, h_tilde, h * h_tilde], -1)[None])[0]
    assert torch.allclose(out[0, :4], direct, atol=1e-5)


def test_no_answer_head_pools_by_start_end_and_self_attention():
    head = NoAnswerHead(dim=3, hidden=4).eval()
    h, mask = torch.randn(1, 4, 3), torch.tensor([[True, True, True, False]])
    s, e = torch.randn(1, 4), torch.randn(1, 4)
    z = head(h, s.masked_fill(~mask, -1e30), e.masked_fill(~mask, -1e30), mask)
    with torch.no_grad():
        v = [torch.softmax(x[0, :3], 0) @ h[0, :3] for x in (s, e, head.w(h)[..., 0])]
        direct = head.mlp(torch.cat(v)[None])[0, 0]
    assert torch.allclose(z[0], direct, atol=1e-6)


# --- the SQuAD 2.0 protocols ---------------------------------------------------------------------


def squad_file(article_sizes, prefix="q"):
    """Articles of 3 paragraphs; ``article_sizes`` gives (answerable, unanswerable) each."""
    sq = SquadFile(path=f"<{prefix}>", version="2.0")
    for a, (n_ans, n_na) in enumerate(article_sizes):
        for p in range(3):
            sq.titles.append(f"{prefix}-article-{a}")
            sq.contexts.append(f"Paragraph {p} of {prefix} article {a} says word{a}x{p} here.")
        for k in range(n_ans + n_na):
            cid = 3 * a + k % 3
            answer = f"word{a}x{k % 3}"
            answers = () if k >= n_ans else (
                Answer(answer, sq.contexts[cid].index(answer)),)
            sq.examples.append(Example(f"{prefix}{a}-{k}", f"What does {a} {k} say?", cid,
                                       answers, k >= n_ans))
    return sq


def test_split_by_article_is_deterministic_disjoint_and_balanced():
    dev = squad_file([(6, 6), (4, 4), (3, 5), (5, 3), (2, 2), (4, 4)])
    halves = split_by_article(dev)
    again = split_by_article(dev)
    assert [e.qid for e in halves["eval"].examples] == [e.qid for e in again["eval"].examples]
    adapt, eval_ = (set(halves[s].titles) for s in ("adapt", "eval"))
    assert not adapt & eval_ and adapt | eval_ == set(dev.titles)
    assert sum(len(h.examples) for h in halves.values()) == len(dev.examples)
    shares = [sum(e.is_impossible for e in h.examples) / len(h.examples) for h in halves.values()]
    sizes = [len(h.examples) for h in halves.values()]
    assert shares[0] == shares[1] == 0.5 and sizes == [24, 24]  # an exact balance exists


def test_synthesized_unanswerables_pair_other_paragraphs_without_the_answer():
    train = squad_file([(9, 0), (6, 0)])
    out = synthesize_unanswerable(train)
    made = out.examples[len(train.examples):]
    assert len(made) == 8 and abs(len(made) / len(out.examples) - 1 / 3) < 0.05
    original = {e.qid: e for e in train.examples}
    for ex in made:
        src = original[ex.qid.removesuffix("-na")]
        assert ex.is_impossible and not ex.answers and ex.question == src.question
        assert ex.context_id != src.context_id
        assert out.titles[ex.context_id] == train.titles[src.context_id]
        assert src.answers[0].text.lower() not in out.contexts[ex.context_id].lower()
    assert [e.context_id for e in synthesize_unanswerable(train).examples] == \
        [e.context_id for e in out.examples]


def test_train_and_dev_articles_must_be_disjoint():
    train, dev = squad_file([(3, 0)], "t"), squad_file([(2, 2)], "d")
    check_disjoint(train, dev)
    with pytest.raises(UserError, match="share 1 article"):
        check_disjoint(concat([train, dev], "mixed"), dev)


def test_offline_protocol_end_to_end_and_tuned_threshold(squad2_mirror, tmp_path, monkeypatch):
    data = load_squad2(context_limit=None)
    assert data.protocol == "offline" and data.version == "2.0"
    assert data.splits["dev"] is data.adapt
    assert not set(data.adapt.text["titles"]) & set(data.eval.text["titles"])
    assert len(data.adapt) == len(data.eval) == 8
    # train = 7 v1.1 questions + 4 synthesized (one per two, rounded up) + the 8 adapt ones
    assert len(data.splits["train"]) == 7 + 4 + 8
    assert load_squad2(context_limit=None).folder == data.folder  # read back from the cache
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "nothing"))  # the cache alone suffices
    assert load_squad2(context_limit=None).folder == data.folder

    class Oracle(torch.nn.Module):
        """Answers at the gold span, no-answer probability 0.9 where there is none."""

        def forward(self, b):
            L = b["c_mask"].shape[1]
            y1, y2 = b["y1"].clamp(min=0), b["y2"].clamp(min=0)
            start = torch.nn.functional.one_hot(y1, L).float() * 20
            end = torch.nn.functional.one_hot(y2, L).float() * 20
            return {"start_logits": start, "end_logits": end,
                    "na_logits": torch.where(b["has_answer"], -2.2, 2.2)}

    cfg = types.SimpleNamespace(eval_batch_size=4, max_answer_len=15, bf16=False)
    scores = tuned_scores(Oracle(), data, cfg, torch.device("cpu"))
    # The official search returns the largest no-answer probability of an answered question.
    assert scores["threshold"] == pytest.approx(torch.sigmoid(torch.tensor(-2.2)).item())
    assert scores["eval"]["exact"] == scores["eval"]["f1"] == 100.0
    assert scores["eval"]["HasAns_total"] == scores["eval"]["NoAns_total"] == 4


@pytest.fixture
def real_data_dir():
    if not os.environ.get("MRC_DATA_DIR"):
        pytest.skip("MRC_DATA_DIR is not set")
    return Path(os.environ["MRC_DATA_DIR"])


@pytest.mark.real_data
def test_real_dev_v2_halves_are_balanced_and_disjoint_from_v11_train(real_data_dir):
    from mrc_lib.data.squad import read_squad

    dev = read_squad(real_data_dir / "squad" / "dev-v2.0.json")
    halves = split_by_article(dev)
    shares = [sum(e.is_impossible for e in h.examples) / len(h.examples) for h in halves.values()]
    sizes = [len(h.examples) for h in halves.values()]
    assert abs(shares[0] - shares[1]) < 0.005 and abs(sizes[0] - sizes[1]) < 0.01 * sum(sizes)
    train = json.loads((real_data_dir / "squad" / "train-v1.1.json").read_text())
    assert not {a["title"] for a in train["data"]} & set(dev.titles)


@pytest.mark.parametrize("name", READERS)
def test_analysis_payload_scores_the_protocol_and_summarises_lambda(name, squad2_mirror):
    data = load_squad2(context_limit=None)
    cfg = TrainConfig(name, eval_batch_size=100)
    net = build_model(name, data.vocab, aba=True, **TINY[name]).eval()
    with torch.no_grad():
        payload = net.analysis(data, cfg)
    assert len(json.dumps(payload)) < 200_000
    scores = payload["scores"]
    assert scores["eval"]["HasAns_total"] == scores["eval"]["NoAns_total"] == 4
    assert 0.0 <= scores["answered"] <= 100.0
    kinds = [e["has_answer"] for e in payload["examples"]]
    assert kinds == [False, True]
    for e in payload["examples"]:
        assert np.array(e["attention"]).shape == (len(e["passage"]), len(e["question"]))
    lam = payload["lambda"]
    n = len(lam["granularities"])
    assert lam["granularities"][0] == "E" and lam["granularities"][-1] == "A"
    assert lam["lambda_p"] == [1.0] + [0.0] * (n - 1) == lam["lambda_q"]
    assert lam["share_p"][0] == pytest.approx(1.0) and sum(lam["share_q"]) == pytest.approx(1.0)
    assert "lambda" not in build_model(name, data.vocab, **TINY[name]).eval().analysis(data, cfg)
