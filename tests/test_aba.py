"""Adaptive Bi-directional Attention (Chen et al. 2021), BiDAF++, QANet-NA and the SQuAD 2.0
protocols: each equation recomputed directly, the initialisation, masks, gradients, data."""

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

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
from mrc_lib.models.aba import AdaptiveBiAttention, granularities, question_side
from mrc_lib.models.bidafpp import NoAnswerHead, SelfAttention
from mrc_lib.train import reader_loss

TINY = {"bidafpp": {"hidden": 8, "proj": 16, "char_dim": 4, "char_channels": 6, "na_hidden": 8},
        "qanet_na": {"d_model": 8, "heads": 2, "model_blocks": 1, "char_dim": 4,
                     "char_channels": 6, "na_hidden": 8}}


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
            "y1": torch.tensor([2, -1]), "y2": torch.tensor([4, -1]),
            "has_answer": torch.tensor([True, False])}


def padded(b, extra=3):
    """``b`` with ``extra`` more padding positions after every context and question."""
    def pad(x):
        return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)

    return {k: pad(v) if k[0] in "cq" else v for k, v in b.items()}


def model(name, aba):
    return build_model(name, vocab(), aba=aba, **TINY[name])


def masks(c_lens, q_lens):
    Lc, Lq = max(c_lens), max(q_lens)
    return (torch.arange(Lc)[None] < torch.tensor(c_lens)[:, None],
            torch.arange(Lq)[None] < torch.tensor(q_lens)[:, None])


# --- the mechanism, equation by equation -----------------------------------------------------


def test_eq3_weighted_history_is_the_lambda_sum_of_projected_granularities():
    aba = AdaptiveBiAttention([4, 6, 4])
    with torch.no_grad():
        aba.lam.copy_(torch.tensor([0.5, -1.0, 2.0]))
    hos = [torch.randn(2, 5, 4), torch.randn(2, 5, 6), torch.randn(2, 5, 4)]
    W = aba.project[1].weight  # [4, 6]
    direct = 0.5 * hos[0] + -1.0 * torch.einsum("bld,kd->blk", hos[1], W) + 2.0 * hos[2]
    assert torch.allclose(aba.weighted(hos), direct, atol=1e-6)
    assert isinstance(aba.project[0], torch.nn.Identity)  # Cⁿ is never projected


def test_eq4_trilinear_row_column_softmax_and_dcn_against_loops():
    d, c_lens, q_lens = 3, (5, 3), (4, 2)
    c_mask, q_mask = masks(c_lens, q_lens)
    p, q = torch.randn(2, 5, d), torch.randn(2, 4, d)
    att = AdaptiveBiAttention([d, d]).attention.eval()
    out, row = att(p, q, c_mask, q_mask)
    w = att.similarity.w.reshape(-1)
    for b, (n, m) in enumerate(zip(c_lens, q_lens)):
        H = torch.tensor([[float(w.detach() @ torch.cat([p[b, t], q[b, j], p[b, t] * q[b, j]]))
                           for j in range(m)] for t in range(n)]) + att.similarity.bias
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
    att = AdaptiveBiAttention([2, 2], dropout=1.0).attention.train()
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


def test_eq1_2_stack_order_and_lambda_initialisation():
    layers = [torch.full((1, 2, 1), float(i)) for i in range(4)]  # E, C¹, C², C³
    order = [float(h[0, 0, 0]) for h in granularities(layers, torch.full((1, 2, 1), 9.0))]
    assert order == [3.0, 2.0, 1.0, 0.0, 9.0]  # Cⁿ … C¹, E, A
    assert AdaptiveBiAttention([4, 6, 4, 4]).lam.tolist() == [1.0, 0.0, 0.0, 0.0]


# --- the readers ---------------------------------------------------------------------------------


def attention_inputs(module):
    seen = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[:2]))
    return seen


@pytest.mark.parametrize("name", ["bidafpp", "qanet_na"])
def test_aba_at_initialisation_reduces_to_the_base_attention_inputs(name):
    net = model(name, aba=True).eval()
    base_in, aba_in = attention_inputs(net.attention), attention_inputs(net.aba.attention)
    with torch.no_grad():
        net(batch())
    (c, q), (hos_p, hos_q) = base_in[0], aba_in[0]
    assert torch.equal(hos_p, c) and torch.equal(hos_q, q)  # ĤOS_p = C_pⁿ, ĤOS_q = C_qⁿ


def test_qanet_aba_at_initialisation_is_qanet_when_the_attentions_share_weights():
    base, aba = model("qanet_na", aba=False).eval(), model("qanet_na", aba=True).eval()
    aba.load_state_dict(base.state_dict(), strict=False)
    aba.aba.attention.load_state_dict(base.attention.state_dict())
    with torch.no_grad():
        x, y = base(batch()), aba(batch())
    for key in ("start_logits", "end_logits", "na_logits", "attention"):
        assert torch.allclose(x[key], y[key], atol=1e-5), key


def test_qanet_na_keeps_qanet_layer_for_layer():
    qanet = build_model("qanet", vocab(), **{k: v for k, v in TINY["qanet_na"].items()
                                             if k != "na_hidden"}).eval()
    na = model("qanet_na", aba=False).eval()
    na.load_state_dict(qanet.state_dict(), strict=False)
    b = batch()
    with torch.no_grad():
        x, y = qanet(b), na(b)
        layers = na.layers(b["c_words"], b["c_chars"], b["c_mask"])
        assert torch.equal(layers[-1], qanet.encode(b["c_words"], b["c_chars"], b["c_mask"]))
    for key in ("start_logits", "end_logits", "attention"):
        assert torch.allclose(x[key], y[key], atol=1e-6), key
    assert {"aba", "na_hidden", "d_model", "model_blocks"} <= set(hparam_defaults("qanet_na"))


@pytest.mark.parametrize("name", ["bidafpp", "qanet_na"])
@pytest.mark.parametrize("aba", [False, True])
def test_readers_outputs_masks_and_padding_invariance(name, aba):
    net = model(name, aba).eval()
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


@pytest.mark.parametrize("name", ["bidafpp", "qanet_na"])
def test_gradients_reach_lambda_and_every_projection(name):
    net = model(name, aba=True).train()
    reader_loss(net(batch()), batch()).backward()
    assert (net.aba.lam.grad != 0).all()
    net.zero_grad()
    with torch.no_grad():
        net.aba.lam.fill_(0.5)
    reader_loss(net(batch()), batch()).backward()
    for p in net.aba.project.parameters():  # BiDAF++: E (width 14) is projected to 16
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert net.aba.attention.similarity.w.grad.abs().sum() > 0


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


@pytest.fixture
def squad2_mirror(mirror):
    """The tiny v1.1 mirror plus a SQuAD 2.0 dev file of four articles of its own."""
    words = "denver broncos won the game in santa clara".split()
    data = []
    for a in range(4):
        context = " ".join(words[a:] + words[:a]) + " ."
        qas = [{"id": f"v2-{a}-{k}", "question": f"which {words[k]} won ?",
                "is_impossible": k % 2 == 1,
                "answers": [] if k % 2 else [{"text": words[k], "answer_start":
                                              context.index(words[k])}]} for k in range(4)]
        data.append({"title": f"Dev_{a}", "paragraphs": [{"context": context, "qas": qas}]})
    (mirror / "squad" / "dev-v2.0.json").write_text(json.dumps({"version": "v2.0",
                                                                 "data": data}))
    return mirror


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
