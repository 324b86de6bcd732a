"""SAN for SQuAD 2.0 (Liu et al. 2018): each layer recomputed directly from the module's own
parameters on tiny tensors."""

import pytest
import torch

from mrc_lib.models import build_model
from mrc_lib.models.san import AnswerModule
from tests.test_aba import TINY, batch, vocab


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def san(**options):
    return build_model("san", vocab(), **TINY["san"], **options).eval()


def test_answer_module_steps_against_the_equations():
    module = AnswerModule(state=3, memory=4, steps=2, step_dropout=0.4).eval()
    s0, m = torch.randn(1, 3), torch.randn(1, 5, 4)
    mask = torch.tensor([[True] * 4 + [False]])
    begin, end = module(s0, m, mask)
    s, begins, ends = s0[0], [], []
    M = m[0, :4]
    with torch.no_grad():
        for _ in range(2):
            beta = torch.softmax(M @ module.W5.weight @ s, 0)  # softmax(s W₅ M)
            s = module.gru((beta @ M)[None], s[None])[0]  # s_t = GRU(s_{t−1}, x_t)
            p_begin = torch.softmax(M @ module.W6.weight @ s, 0)
            p_end = torch.softmax(M @ module.W7.weight @ torch.cat([s, p_begin @ M]), 0)
            begins.append(p_begin)
            ends.append(p_end)
    assert torch.allclose(begin[0, :4], torch.stack(begins).mean(0), atol=1e-6)
    assert torch.allclose(end[0, :4], torch.stack(ends).mean(0), atol=1e-6)
    assert begin[0, 4] == end[0, 4] == 0


def test_stochastic_prediction_dropout_keeps_at_least_one_step():
    module = AnswerModule(state=2, memory=2, steps=3, step_dropout=1.0).train()
    keep = module.kept_steps(torch.zeros(50, 2))
    assert (keep.sum(1) == 1).all() and (keep == keep[0]).all()  # one draw for all rows
    assert (module.eval().kept_steps(torch.zeros(4, 2)) == 1).all()


def test_lexicon_alignment_and_memory_attention_against_loops():
    net = san()
    x_p, x_q = torch.randn(1, 4, 8), torch.randn(1, 3, 8)
    q_mask = torch.tensor([[True, True, False]])
    aligned = net.aligned(x_p, x_q, q_mask)
    relu = torch.relu
    with torch.no_grad():
        for i in range(4):
            scores = torch.stack([relu(net.align(x_p[0, i])) @ relu(net.align(x_q[0, j]))
                                  for j in range(2)])
            assert torch.allclose(aligned[0, i], torch.softmax(scores, 0) @ x_q[0, :2], atol=1e-5)
        h_p, h_q = torch.randn(1, 4, 16), torch.randn(1, 3, 16)
        c_mask = torch.tensor([[True, True, True, False]])
        u, attn = net.memory_attention(h_p, h_q, c_mask, q_mask)
        for i in range(3):
            scores = torch.stack([relu(net.W3(h_p[0, i])) @ relu(net.W3(h_q[0, j]))
                                  for j in range(2)])
            c = torch.softmax(scores, 0)
            assert torch.allclose(u[0, i], torch.cat([h_p[0, i], c @ h_q[0, :2]]), atol=1e-5)
        assert (attn[0, 3] == 0).all() and (attn[0, :, 2] == 0).all()


def test_memory_self_attention_drops_the_diagonal():
    net = san()
    u, mask = torch.randn(1, 4, 32), torch.tensor([[True, True, True, False]])
    seen = []
    net.memory_rnn.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        net.memory(u, mask)
        U = u[0, :3]
        S = U @ U.T
        S.fill_diagonal_(float("-inf"))
        u_hat = torch.softmax(S, 1) @ U
    assert torch.allclose(seen[0][0, :3], torch.cat([U, u_hat], -1), atol=1e-5)


def test_classifier_is_sigmoid_of_w8_over_s0_and_the_memory_summary():
    net = san(no_answer="head")
    b = batch()
    seen = {}
    net.answer.register_forward_pre_hook(lambda _, args: seen.update(s0=args[0], m=args[1]))
    with torch.no_grad():
        out = net(b)
        k = 0
        m = seen["m"][k, :9]
        gamma = torch.softmax(net.classifier["w9"](m)[:, 0], 0)
        direct = net.classifier["w8"](torch.cat([seen["s0"][k], gamma @ m]))[0]
    assert torch.allclose(out["na_logits"][k], direct, atol=1e-5)


def test_question_summary_s0_is_self_attentive():
    net = san()
    b = batch()
    seen = {}
    net.answer.register_forward_pre_hook(lambda _, args: seen.update(s0=args[0]))
    with torch.no_grad():
        net(b)
        q = net.layers(b["q_words"], b["q_mask"], net.lexicon_q)
        h_q = torch.cat(q[1:], -1)[1, :3]  # the second question has 3 words
        alpha = torch.softmax(net.w4(h_q)[:, 0], 0)
    assert torch.allclose(seen["s0"][1], alpha @ h_q, atol=1e-5)
