"""Tests of the shared neural layers in :mod:`mrc_lib.nn`.

Every layer is compared with a direct (loop or einsum) computation of its defining equation
on tiny tensors, checked for exact zeros at padding, for NaN-free fully masked rows, and for
gradients reaching every trainable parameter.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mrc_lib.errors import UserError
from mrc_lib.nn import (
    RNN,
    AdditiveSimilarity,
    BiDAFAttention,
    BilinearSimilarity,
    CharCNN,
    CoAttention,
    DepthwiseSeparableConv,
    DotSimilarity,
    EncoderBlock,
    Highway,
    LockedDropout,
    MultiHeadSelfAttention,
    ScaledDotSimilarity,
    TrilinearSimilarity,
    WordEmbedding,
    add_positions,
    build_similarity,
    context_to_query,
    conv_over_time,
    decode_span,
    mask_logits,
    masked_softmax,
    query_to_context,
    query_to_context_dcn,
    sinusoidal_positions,
    span_loss,
    window_conv,
    zero_padding,
)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def lengths_mask(lengths: list[int], L: int | None = None) -> torch.Tensor:
    """``[B, L]`` bool mask with the first ``lengths[b]`` positions real."""
    L = max(lengths) if L is None else L
    return torch.arange(L) < torch.tensor(lengths).unsqueeze(1)


def assert_grads_reach_every_parameter(module: torch.nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"
        assert torch.isfinite(p.grad).all(), f"{name} got a non-finite gradient"


def softmax_over(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Reference softmax of a 1-D ``x`` over the entries where ``keep``; zeros elsewhere."""
    out = torch.zeros_like(x)
    if keep.any():
        out[keep] = torch.exp(x[keep] - x[keep].max()) / torch.exp(x[keep] - x[keep].max()).sum()
    return out


# ---------------------------------------------------------------- masking and softmax


def test_mask_logits_uses_most_negative_finite_value():
    x = torch.randn(2, 3)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out = mask_logits(x, mask)
    assert torch.equal(out[mask], x[mask])
    assert (out[~mask] == torch.finfo(torch.float32).min).all()


class OpNames(TorchDispatchMode):
    """The ATen operations dispatched under it, in order, views apart."""

    VIEWS = {"view", "unsqueeze", "expand", "transpose", "t", "detach", "permute", "reshape"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_zero_padding_equals_masked_fill_in_one_operation_each_way():
    """The rows at padding positions become 0, as ``masked_fill(~mask, 0)`` gives, values and
    gradients, for a mask of the leading dimensions or of ``x``'s rank; one multiplication
    forward and one backward, where masked_fill dispatches a negation and a fill that copies
    its input first (two kernels on a GPU) forward, and a fill backward."""
    x = torch.randn(2, 5, 3, 4, requires_grad=True)
    mask = lengths_mask([5, 2])
    rows = mask[:, :, None, None]
    for m, full in ((mask, rows), (rows, rows), (mask[:, None, None, :4], mask[:, None, None, :4])):
        ref_x = x.detach().clone().requires_grad_()
        seed = torch.randn(2, 5, 3, 4)
        with OpNames() as ops:
            y = zero_padding(x, m)
            (y * seed).sum().backward()
        ref = ref_x.masked_fill(~full, 0.0)
        (ref * seed).sum().backward()
        assert torch.equal(y, ref) and torch.equal(x.grad, ref_x.grad)
        # zero_padding's one multiplication each way, and the loss's y · seed and its gradient
        assert ops.names.count("mul") == 4 and "masked_fill" not in ops.names
        x.grad = None


def test_encoder_block_zeroes_padding_without_masked_fill():
    """QANet's block masks its convolutions' inputs and outputs, its attention's output and its
    own output by multiplication (:func:`zero_padding`): no masked_fill, forward or backward."""
    block = EncoderBlock(8, num_convs=2, kernel_size=3, heads=2, layer_dropout=0.1).train()
    mask = lengths_mask([6, 3])
    with OpNames() as ops:
        block(torch.randn(2, 6, 8), mask).sum().backward()
    assert "masked_fill" not in ops.names
    assert ops.names.count("bitwise_not") == 1  # the attention's keys of an all-padding row


def test_masked_softmax_matches_reference_and_zeroes_padding():
    x = torch.randn(3, 5)
    mask = lengths_mask([5, 2, 0])
    p = masked_softmax(x, mask)
    for b in range(3):
        torch.testing.assert_close(p[b], softmax_over(x[b], mask[b]))
    assert (p[~mask] == 0).all()
    assert torch.equal(p[2], torch.zeros(5))  # fully masked row: zeros, not NaN


def test_masked_softmax_broadcasts_mask_over_other_dim():
    x = torch.randn(2, 4, 3)
    mask = lengths_mask([3, 1])  # over the last dim
    p = masked_softmax(x, mask.unsqueeze(1), dim=-1)
    assert (p[1, :, 1:] == 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 4))


def test_masked_softmax_fully_masked_row_has_finite_gradient():
    x = torch.randn(2, 4, requires_grad=True)
    mask = lengths_mask([4, 0], L=4)
    (masked_softmax(x, mask) * torch.randn(2, 4)).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_softmax_low_precision_and_autocast(dtype):
    x = torch.randn(3, 6).to(dtype)
    mask = lengths_mask([6, 3, 0])
    p = masked_softmax(x, mask)
    assert not p.isnan().any() and (p[~mask] == 0).all()
    torch.testing.assert_close(p[:2].float().sum(-1), torch.ones(2), atol=1e-2, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.Linear(4, 6)(torch.randn(3, 4))
        p = masked_softmax(logits, mask)
    assert not p.isnan().any() and (p[~mask] == 0).all()
    assert (p[2] == 0).all()


# ---------------------------------------------------------------- similarity functions


def test_trilinear_equals_explicit_concatenation():
    B, Lc, Lq, d = 2, 4, 3, 5
    c, q = torch.randn(B, Lc, d), torch.randn(B, Lq, d)
    sim = TrilinearSimilarity(d)
    ci = c.unsqueeze(2).expand(B, Lc, Lq, d)
    qj = q.unsqueeze(1).expand(B, Lc, Lq, d)
    explicit = torch.cat([ci, qj, ci * qj], dim=-1) @ sim.w.flatten()
    torch.testing.assert_close(sim(c, q), explicit)
    assert_grads_reach_every_parameter(sim, sim(c, q).square().sum())


def test_other_similarities_equal_their_definitions():
    B, Lc, Lq, d1, d2, h = 2, 4, 3, 5, 6, 7
    c, q, q_same = torch.randn(B, Lc, d1), torch.randn(B, Lq, d2), torch.randn(B, Lq, d1)
    dot = torch.einsum("bid,bjd->bij", c, q_same)
    torch.testing.assert_close(DotSimilarity()(c, q_same), dot)
    torch.testing.assert_close(ScaledDotSimilarity(d1)(c, q_same), dot / math.sqrt(d1))

    bilinear = BilinearSimilarity(d1, d2)
    W = bilinear.W.weight  # [d1, d2]
    torch.testing.assert_close(bilinear(c, q), torch.einsum("bid,de,bje->bij", c, W, q))

    additive = AdditiveSimilarity(d1, d2, h)
    expected = torch.empty(B, Lc, Lq)
    for b in range(B):
        for i in range(Lc):
            for j in range(Lq):
                hidden = torch.tanh(additive.W1(c[b, i]) + additive.W2(q[b, j]))
                expected[b, i, j] = additive.v(hidden)
    torch.testing.assert_close(additive(c, q), expected)
    for module in (bilinear, additive):
        assert_grads_reach_every_parameter(module, module(c, q).square().sum())


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("trilinear", TrilinearSimilarity),
        ("dot", DotSimilarity),
        ("scaled_dot", ScaledDotSimilarity),
        ("bilinear", BilinearSimilarity),
        ("additive", AdditiveSimilarity),
    ],
)
def test_build_similarity(name, cls):
    sim = build_similarity(name, 4)
    assert isinstance(sim, cls)
    assert sim(torch.randn(2, 5, 4), torch.randn(2, 3, 4)).shape == (2, 5, 3)


def test_build_similarity_rejects_bad_names_and_dimensions():
    with pytest.raises(UserError, match="unknown similarity"):
        build_similarity("cosine", 4)
    with pytest.raises(UserError, match="equal dimensions"):
        build_similarity("dot", 4, 5)
    assert build_similarity("bilinear", 4, 5)(torch.randn(1, 2, 4), torch.randn(1, 3, 5)).shape \
        == (1, 2, 3)


# ---------------------------------------------------------------- attention flow


def tiny_attention_inputs(d: int = 3):
    """Context of lengths [4, 2] and query of lengths [2, 3]: both have padding."""
    c_mask, q_mask = lengths_mask([4, 2]), lengths_mask([2, 3])
    S = torch.randn(2, 4, 3)
    return S, torch.randn(2, 4, d), torch.randn(2, 3, d), c_mask, q_mask


def test_context_to_query_equals_eq2_loop():
    S, c, q, c_mask, q_mask = tiny_attention_inputs()
    u_tilde = context_to_query(S, q, q_mask)
    for b in range(2):
        for t in range(4):
            a_t = softmax_over(S[b, t], q_mask[b])  # a_t = softmax(S_t:)
            torch.testing.assert_close(u_tilde[b, t], (a_t.unsqueeze(1) * q[b]).sum(0))


def test_query_to_context_equals_eq3_loop():
    S, c, q, c_mask, q_mask = tiny_attention_inputs()
    h_tilde = query_to_context(S, c, c_mask, q_mask)
    assert h_tilde.shape == c.shape
    for b in range(2):
        row_max = torch.stack([S[b, t][q_mask[b]].max() for t in range(4)])  # max_j S_tj
        b_weights = softmax_over(row_max, c_mask[b])
        expected = (b_weights.unsqueeze(1) * c[b]).sum(0)
        for t in range(4):
            torch.testing.assert_close(h_tilde[b, t], expected)


def test_query_to_context_dcn_equals_matrix_product():
    S, c, q, c_mask, q_mask = tiny_attention_inputs()
    for b in range(2):
        s_row = torch.stack([softmax_over(S[b, t], q_mask[b]) for t in range(4)])
        s_col = torch.stack([softmax_over(S[b, :, j], c_mask[b]) for j in range(3)], dim=1)
        expected = torch.einsum("tj,sj,sd->td", s_row, s_col, c[b])  # S̄ · S̄̄ᵀ · C
        torch.testing.assert_close(query_to_context_dcn(S, c, c_mask, q_mask)[b], expected)


@pytest.mark.parametrize("cls", [BiDAFAttention, CoAttention])
def test_attention_layers_build_g_and_zero_padding(cls):
    d = 3
    _, c, q, c_mask, q_mask = tiny_attention_inputs(d)
    layer = cls(d)
    G, attn = layer(c, q, c_mask, q_mask)
    assert G.shape == (2, 4, 4 * d) and attn.shape == (2, 4, 3)
    S = layer.similarity(c, q)
    q2c = query_to_context if cls is BiDAFAttention else query_to_context_dcn
    u_tilde, h_tilde = context_to_query(S, q, q_mask), q2c(S, c, c_mask, q_mask)
    expected = torch.cat([c, u_tilde, c * u_tilde, c * h_tilde], dim=-1)
    torch.testing.assert_close(G[c_mask], expected[c_mask])
    assert (G[~c_mask] == 0).all()
    assert (attn[~c_mask] == 0).all()
    assert (attn.masked_select(~q_mask.unsqueeze(1)) == 0).all()
    torch.testing.assert_close(attn.sum(-1)[c_mask], torch.ones(int(c_mask.sum())))
    assert_grads_reach_every_parameter(layer, G.square().sum())


@pytest.mark.parametrize("cls", [BiDAFAttention, CoAttention])
def test_attention_layers_fully_masked_query_gives_no_nan(cls):
    _, c, q, c_mask, _ = tiny_attention_inputs()
    q_mask = lengths_mask([0, 3], L=3)
    layer = cls(3)
    G, attn = layer(c.requires_grad_(), q, c_mask, q_mask)
    assert torch.isfinite(G).all() and torch.isfinite(attn).all()
    assert (attn[0] == 0).all()
    G.sum().backward()
    assert torch.isfinite(c.grad).all()


# ---------------------------------------------------------------- multi-head self-attention


def manual_self_attention(mhsa: MultiHeadSelfAttention, x: torch.Tensor, mask: torch.Tensor):
    """softmax(Q Kᵀ / sqrt(d_k)) V per head, masked keys, then the output projection."""
    B, L, D = x.shape
    H, dk = mhsa.heads, D // mhsa.heads
    q, k, v = mhsa.qkv(x).split(D, dim=-1)
    out = torch.zeros(B, L, D)
    for b in range(B):
        if not mask[b].any():
            continue
        heads = []
        for h in range(H):
            cols = slice(h * dk, (h + 1) * dk)
            scores = q[b, :, cols] @ k[b, :, cols].T / math.sqrt(dk)
            scores = scores.masked_fill(~mask[b], float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[b, :, cols])
        out[b] = mhsa.out(torch.cat(heads, dim=-1)) * mask[b].unsqueeze(1)
    return out


def test_multihead_self_attention_equals_manual_computation():
    mhsa = MultiHeadSelfAttention(8, heads=2).eval()
    x, mask = torch.randn(3, 5, 8), lengths_mask([5, 3, 0])
    out = mhsa(x, mask)
    torch.testing.assert_close(out, manual_self_attention(mhsa, x, mask))
    assert (out[~mask] == 0).all() and not out.isnan().any()


def test_multihead_self_attention_gradients_and_dropout():
    mhsa = MultiHeadSelfAttention(8, heads=4, dropout=0.5)
    x, mask = torch.randn(2, 6, 8), lengths_mask([6, 2])
    out = mhsa(x, mask)
    assert not torch.allclose(out, mhsa(x, mask))  # dropout on the weights in training
    assert_grads_reach_every_parameter(mhsa, out.square().sum())
    mhsa.eval()
    torch.testing.assert_close(mhsa(x, mask), mhsa(x, mask))
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadSelfAttention(6, heads=4)


# ---------------------------------------------------------------- embeddings


def test_word_embedding_lookup_and_fixed_rows():
    V, d, n_trainable = 7, 4, 3
    vectors = np.random.default_rng(0).normal(size=(V, d)).astype(np.float32)
    emb = WordEmbedding(vectors, n_trainable)
    assert [name for name, _ in emb.named_parameters()] == ["trainable"]
    ids = torch.tensor([[1, 5, 2, 0], [6, 3, 0, 0]])
    expected = torch.as_tensor(vectors)[ids]
    expected[ids == 0] = 0.0  # PAD is zero
    torch.testing.assert_close(emb(ids), expected)

    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    fixed_before, trainable_before = emb.fixed.clone(), emb.trainable.detach().clone()
    (emb(ids) * torch.randn(2, 4, d)).sum().backward()
    assert emb.fixed.grad is None and not emb.fixed.requires_grad
    assert (emb.trainable.grad[0] == 0).all()  # PAD gets no gradient
    assert (emb.trainable.grad[1:] != 0).all()  # rows 1 and 2 were looked up
    opt.step()
    assert torch.equal(emb.fixed, fixed_before)
    assert torch.equal(emb.trainable[0].detach(), torch.zeros(d))
    assert not torch.equal(emb.trainable[1:].detach(), trainable_before[1:])
    assert "fixed" in emb.state_dict()


def test_word_embedding_maps_every_oov_word_to_one_unk_row():
    """QANet Sec. 2.2: all out-of-vocabulary words share the trainable <UNK> vector."""
    V, d, n_trainable = 8, 3, 5  # PAD, UNK, three OOV words, three GloVe words
    vectors = np.random.default_rng(1).normal(size=(V, d)).astype(np.float32)
    emb = WordEmbedding(vectors, n_trainable, oov_rows=False)
    assert emb.trainable.shape == (2, d)
    ids = torch.tensor([[2, 3, 4, 1, 6, 0]])
    out = emb(ids)
    unk = torch.as_tensor(vectors[1])
    for t in range(4):
        torch.testing.assert_close(out[0, t], unk)
    torch.testing.assert_close(out[0, 4], torch.as_tensor(vectors[6]))
    assert (out[0, 5] == 0).all()
    out.sum().backward()
    assert (emb.trainable.grad[0] == 0).all() and (emb.trainable.grad[1] == 4).all()


def test_word_embedding_all_trainable_and_bad_split():
    vectors = torch.randn(4, 2)
    emb = WordEmbedding(vectors, n_trainable=4)
    torch.testing.assert_close(emb(torch.tensor([[3, 1]])), vectors[[3, 1]].unsqueeze(0))
    with pytest.raises(ValueError):
        WordEmbedding(vectors, n_trainable=0)


def test_char_cnn_shape_and_padding_independence():
    cnn = CharCNN(n_chars=10, char_dim=4, out_dim=6, kernel_size=3).eval()
    chars = torch.tensor([[[3, 4, 5, 0], [2, 0, 0, 0], [0, 0, 0, 0]]])  # last word is padding
    out = cnn(chars)
    assert out.shape == (1, 3, 6)
    wider = F.pad(chars, (0, 5))  # more padding characters per word
    torch.testing.assert_close(cnn(wider), out)
    assert (out[0, 2] == 0).all()
    # The first word alone, without any padding character, by the definition.
    x = cnn.embed(torch.tensor([3, 4, 5])).T.unsqueeze(0)
    expected = torch.relu(F.conv1d(x, cnn.conv.weight, cnn.conv.bias, padding=1)).amax(-1)
    torch.testing.assert_close(out[0, 0], expected[0])


def test_char_cnn_gradients_reach_every_parameter():
    cnn = CharCNN(n_chars=10, char_dim=4, out_dim=6, dropout=0.1)
    chars = torch.randint(1, 10, (2, 3, 7))
    chars[:, :, 5:] = 0
    assert_grads_reach_every_parameter(cnn, cnn(chars).square().sum())


def test_highway_equals_definition():
    hw = Highway(5, num_layers=2)
    x = torch.randn(2, 3, 5)
    expected = x
    for transform, gate in zip(hw.transforms, hw.gates):
        g = torch.sigmoid(expected @ gate.weight.T + gate.bias)
        expected = g * torch.relu(expected @ transform.weight.T + transform.bias) \
            + (1 - g) * expected
    torch.testing.assert_close(hw(x), expected)
    assert_grads_reach_every_parameter(hw, hw(x).square().sum())


# ---------------------------------------------------------------- recurrent encoders


def test_locked_dropout_shares_mask_over_time():
    drop = LockedDropout(0.5)
    out = drop(torch.ones(4, 6, 10))
    assert torch.equal(out, out[:, :1].expand_as(out))
    assert set(out.unique().tolist()) == {0.0, 2.0}
    drop.eval()
    x = torch.randn(2, 3, 4)
    assert torch.equal(drop(x), x)


def test_rnn_dropout_is_locked_or_new_at_every_position():
    """``locked``: the input of every layer loses the same features at every position of a
    sequence; otherwise each position draws its own mask (standard dropout)."""
    x = torch.ones(4, 6, 10)
    for locked, kind in ((True, LockedDropout), (False, torch.nn.Dropout)):
        rnn = RNN(10, 3, num_layers=2, dropout=0.5, locked=locked)
        assert isinstance(rnn.dropout, kind) and rnn.dropout.p == 0.5
        out = rnn.dropout(x)
        assert set(out.unique().tolist()) == {0.0, 2.0}
        assert torch.equal(out, out[:, :1].expand_as(out)) == locked


def unpacked_reference(rnn: RNN, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's outputs for one unpadded ``[1, L, d]`` sequence, calling the cells directly."""
    outputs = []
    for layer in rnn.layers:
        x = layer(x)[0]
        outputs.append(x)
    return outputs


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("concat_layers", [False, True])
def test_rnn_padded_batch_equals_each_sequence_alone(cell, concat_layers):
    h = 3
    rnn = RNN(4, h, num_layers=2, cell=cell, dropout=0.3, concat_layers=concat_layers).eval()
    lengths = [5, 2, 4]
    mask = lengths_mask(lengths, L=6)
    x = torch.randn(3, 6, 4)
    out, final = rnn.encode(x, mask)
    assert out.shape == (3, 6, (4 if concat_layers else 2) * h) and final.shape == (3, 2 * h)
    assert (out[~mask] == 0).all()
    for b, n in enumerate(lengths):
        layers = unpacked_reference(rnn, x[b : b + 1, :n])
        alone = torch.cat(layers, dim=-1) if concat_layers else layers[-1]
        torch.testing.assert_close(out[b, :n], alone[0])
        top = layers[-1][0]  # forward state after the last token, backward after the first
        torch.testing.assert_close(final[b], torch.cat([top[n - 1, :h], top[0, h:]]))
    torch.testing.assert_close(rnn(x, mask), out)
    torch.testing.assert_close(rnn.final_states(x, mask), final)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_rnn_gradients_equal_each_sequence_alone_and_skip_padding(cell):
    """The rotated copy that the backward direction reads is exact in the backward pass too:
    the batch's gradients are the sum of each sequence's alone, and padding gets none."""
    torch.manual_seed(0)
    h, lengths = 3, [5, 2, 4]
    rnn = RNN(4, h, num_layers=2, cell=cell).eval()
    mask = lengths_mask(lengths, L=6)
    x = torch.randn(3, 6, 4, requires_grad=True)
    w, v = torch.randn(3, 6, 2 * h), torch.randn(3, 2 * h)
    out, final = rnn.encode(x, mask)
    ((out * w).sum() + (final * v).sum()).backward()
    batch = {name: p.grad.clone() for name, p in rnn.named_parameters()}
    assert (x.grad[~mask] == 0).all()
    rnn.zero_grad()
    for b, n in enumerate(lengths):
        alone = x[b : b + 1, :n].detach().requires_grad_()
        top = unpacked_reference(rnn, alone)[-1][0]
        last = torch.cat([top[n - 1, :h], top[0, h:]])
        ((top * w[b, :n]).sum() + (last * v[b]).sum()).backward()
        torch.testing.assert_close(x.grad[b, :n], alone.grad[0])
    for name, p in rnn.named_parameters():
        torch.testing.assert_close(batch[name], p.grad, msg=name)


def test_rnn_unidirectional_and_empty_sequence():
    rnn = RNN(4, 3, bidirectional=False, cell="gru").eval()
    mask = lengths_mask([3, 0], L=3)
    x = torch.randn(2, 3, 4)
    out, final = rnn.encode(x, mask)
    assert out.shape == (2, 3, 3) and final.shape == (2, 3)
    torch.testing.assert_close(final[0], out[0, 2])
    assert (out[1] == 0).all() and (final[1] == 0).all()


def test_rnn_gradients_reach_every_parameter():
    rnn = RNN(4, 3, num_layers=2, dropout=0.2, concat_layers=True)
    x, mask = torch.randn(2, 5, 4), lengths_mask([5, 3])
    out, final = rnn.encode(x, mask)
    assert_grads_reach_every_parameter(rnn, out.square().sum() + final.square().sum())


def test_rnn_layers_compute_in_full_precision_under_autocast():
    """torch's autocast would run a cuDNN layer in float16 whatever its dtype; the encoder runs
    each layer with autocast off on a float32 input (``full_precision``), here under the CPU's
    bf16 autocast, fed a bf16 input as an autocast linear layer gives it."""
    rnn = RNN(4, 3, num_layers=2, cell="gru").eval()
    seen = []
    for layer in rnn.layers:
        layer.register_forward_pre_hook(
            lambda m, args: seen.append((torch.is_autocast_enabled("cpu"), args[0].dtype)))
    x, mask = torch.randn(2, 5, 4), lengths_mask([5, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, final = rnn.encode(x.bfloat16(), mask)
    assert seen == [(False, torch.float32)] * 2
    assert out.dtype == final.dtype == torch.float32
    torch.testing.assert_close(out, rnn(x.bfloat16().float(), mask))


def test_rnn_rejects_unknown_cell():
    with pytest.raises(UserError, match="unknown RNN cell"):
        RNN(4, 3, cell="rnn")


# ---------------------------------------------------------------- convolutional encoder


def test_depthwise_separable_conv_equals_definition_and_ignores_padding():
    conv = DepthwiseSeparableConv(3, 4, kernel_size=3)
    mask = lengths_mask([5, 3], L=5)
    x = torch.randn(2, 5, 3)
    out = conv(x, mask)
    assert out.shape == (2, 5, 4) and (out[~mask] == 0).all()
    D, bd = conv.depthwise.weight[:, 0], conv.depthwise.bias  # [C, k], [C]
    P, bp = conv.pointwise.weight[:, :, 0], conv.pointwise.bias  # [O, C], [O]
    for b, n in enumerate([5, 3]):
        xp = F.pad(x[b, :n], (0, 0, 1, 1))  # the sequence alone, zero-padded by k // 2
        for t in range(n):
            depthwise = (D.T * xp[t : t + 3]).sum(0) + bd  # Σ_k D[c, k] x[t + k − 1, c]
            torch.testing.assert_close(out[b, t], P @ depthwise + bp)
    garbage = x.masked_fill(~mask.unsqueeze(-1), 100.0)
    torch.testing.assert_close(conv(garbage, mask), out)
    with_relu = DepthwiseSeparableConv(3, 4, kernel_size=3, relu=True)
    with_relu.load_state_dict(conv.state_dict())
    torch.testing.assert_close(with_relu(x, mask), torch.relu(out))
    assert_grads_reach_every_parameter(conv, out.square().sum())


@pytest.mark.parametrize("k", [1, 3, 4, 7])
@pytest.mark.parametrize("depthwise", [True, False])
def test_window_conv_equals_nn_conv1d(k, depthwise):
    # Eager steps run the nn.Conv1d; compiled ones, the window form: both agree, gradients too.
    conv = nn.Conv1d(3, 3 if depthwise else 4, k, padding="same", groups=3 if depthwise else 1)
    x = torch.randn(2, 6, 3, requires_grad=True)
    expected = conv(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(conv_over_time(conv, x), expected)
    windowed = window_conv(x, conv.weight, conv.bias, conv.groups)
    torch.testing.assert_close(windowed, expected)
    wrt = [x, conv.weight, conv.bias]
    got = torch.autograd.grad(windowed.square().sum(), wrt)
    for g, want in zip(got, torch.autograd.grad(expected.square().sum(), wrt)):
        torch.testing.assert_close(g, want)


@pytest.mark.parametrize("module", ["conv", "char_cnn"])
def test_convolutions_compile_once_for_every_length(module):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if module == "conv":
        net = torch.compile(DepthwiseSeparableConv(4, 4, kernel_size=3, relu=True),
                            dynamic=True)
    else:
        net = torch.compile(CharCNN(n_chars=10, char_dim=4, out_dim=6, kernel_size=3),
                            dynamic=True)
    for L in (5, 8, 11):
        if module == "conv":
            out = net(torch.randn(2, L, 4, requires_grad=True), lengths_mask([L, 2], L=L))
        else:
            out = net(torch.randint(0, 10, (2, L, 4)))
        out.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("dim", [6, 5])
def test_sinusoidal_positions_match_formula(dim):
    pe = sinusoidal_positions(4, dim)
    assert pe.shape == (4, dim)
    for pos in range(4):
        for i in range(dim):
            angle = pos / 10000 ** (2 * (i // 2) / dim)
            expected = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert pe[pos, i].item() == pytest.approx(expected, abs=1e-5)
    x = torch.randn(2, 4, dim)
    torch.testing.assert_close(add_positions(x), x + pe)
    long = torch.zeros(1, 600, dim)  # longer than any table built so far
    torch.testing.assert_close(add_positions(long)[0], sinusoidal_positions(600, dim))
    assert sinusoidal_positions(3, 4, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_encoder_block_padding_invariance_and_gradients():
    block = EncoderBlock(8, num_convs=2, kernel_size=3, heads=2, dropout=0.1).eval()
    x, mask = torch.randn(2, 5, 8), lengths_mask([5, 3], L=5)
    out = block(x, mask)
    assert out.shape == (2, 5, 8) and (out[~mask] == 0).all()
    longer = block(F.pad(x, (0, 0, 0, 3), value=7.0), lengths_mask([5, 3], L=8))
    torch.testing.assert_close(longer[:, :5], out)
    torch.testing.assert_close(block(x[1:, :3], mask[1:, :3]), out[1:, :3])
    block.train()
    assert_grads_reach_every_parameter(block, block(x, mask).square().sum())


def test_encoder_block_stochastic_depth():
    # Sublayers are counted across the stack: block 2 of 3 with 2 convs holds sublayers 5..8 of 12.
    block = EncoderBlock(8, num_convs=2, kernel_size=3, heads=2, layer_dropout=0.3,
                         layer_index=2, total_layers=3)
    assert block.drop_probs == pytest.approx([0.3 * l / 12 for l in range(5, 9)])
    # With layer_dropout = 1 the last sublayer of a lone block is always dropped in training.
    block = EncoderBlock(8, num_convs=1, kernel_size=3, heads=2, dropout=0.0, layer_dropout=1.0)
    assert block.drop_probs == pytest.approx([1 / 3, 2 / 3, 1.0])
    x, mask = torch.randn(2, 4, 8), lengths_mask([4, 2])
    block(x, mask).sum().backward()
    ffn = block.sublayers[-1]  # computed under a zero gate: zero gradients
    assert all(p.grad is not None and not p.grad.any() for p in ffn.parameters())
    block.eval()
    torch.testing.assert_close(block(x, mask), block(x, mask))


def test_encoder_block_kept_sublayer_is_rescaled_by_survival_probability():
    # No convolutions: self-attention survives with probability 1/2, feed-forward never.
    block = EncoderBlock(8, num_convs=0, kernel_size=3, heads=2, dropout=0.0, layer_dropout=1.0)
    x, mask = torch.randn(2, 4, 8), lengths_mask([4, 2])
    y = add_positions(x)
    attention = block.sublayers[0](block.norms[0](y), mask)
    dropped = y.masked_fill(~mask.unsqueeze(-1), 0.0)
    kept = (y + attention / 0.5).masked_fill(~mask.unsqueeze(-1), 0.0)
    outcomes = []
    for _ in range(400):
        out = block(x, mask)
        outcomes.append(torch.allclose(out, kept))
        assert outcomes[-1] or torch.equal(out, dropped)
    assert 0.4 < sum(outcomes) / len(outcomes) < 0.6  # kept with p = 1/2


def test_encoder_block_is_one_graph_for_torch_compile():
    # The stochastic-depth draw happens on the device: no data-dependent Python branch.
    block = EncoderBlock(8, num_convs=2, kernel_size=3, heads=2, layer_dropout=0.1)
    x, mask = torch.randn(2, 4, 8), lengths_mask([4, 2])
    explained = torch._dynamo.explain(block)(x, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


# ---------------------------------------------------------------- span loss and decoding


def test_span_loss_is_bidaf_eq6_the_two_ends_summed_and_averaged_over_the_batch():
    start, end = torch.randn(3, 6), torch.randn(3, 6)
    y1, y2 = torch.tensor([0, 2, 5]), torch.tensor([1, 2, 5])
    log_p1, log_p2 = start.log_softmax(-1), end.log_softmax(-1)
    expected = -(log_p1[torch.arange(3), y1] + log_p2[torch.arange(3), y2]).mean()
    torch.testing.assert_close(span_loss(start, end, y1, y2), expected)
    masked = mask_logits(start, lengths_mask([6, 3, 6]))
    assert torch.isfinite(span_loss(masked, end, y1, y2))
    ignored = torch.tensor([0, -100, 5])  # targets -100 are left out of the mean...
    torch.testing.assert_close(span_loss(start, end, ignored, ignored),
                               F.cross_entropy(start, ignored) + F.cross_entropy(end, ignored))
    none = torch.full((3,), -100)  # ...and a batch without any gives 0, not NaN
    start.requires_grad_()
    loss = span_loss(start, end, none, none)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(start.grad, torch.zeros_like(start))


def brute_force_span(p_start: torch.Tensor, p_end: torch.Tensor, max_len: int):
    best = (0, 0, float("-inf"))
    for i in range(len(p_start)):
        for j in range(i, min(len(p_start), i + max_len)):
            score = (p_start[i] * p_end[j]).item()
            if score > best[2]:
                best = (i, j, score)
    return best


@pytest.mark.parametrize("max_len", [1, 2, 3, 5, 9, 400])   # 9, 400: every span i <= j
@pytest.mark.parametrize("ties", [False, True])
def test_decode_span_equals_brute_force(max_len, ties):
    B, L = 6, 9
    mask = lengths_mask([9, 1, 4, 7, 2, 9], L=L)
    if ties:  # few distinct logit values: many equal products
        logits_start = torch.randint(0, 3, (B, L)).float()
        logits_end = torch.randint(0, 3, (B, L)).float()
        logits_end[-1] = 0.0  # a row where every end is equally likely
    else:
        logits_start, logits_end = torch.randn(B, L), torch.randn(B, L)
    p_start, p_end = masked_softmax(logits_start, mask), masked_softmax(logits_end, mask)
    start, end, score = decode_span(p_start, p_end, max_len)
    for b in range(B):
        i, j, s = brute_force_span(p_start[b], p_end[b], max_len)
        assert (start[b].item(), end[b].item()) == (i, j)
        assert score[b].item() == s
        assert 0 <= end[b] - start[b] < max_len and end[b] < mask[b].sum()


def test_decode_span_rejects_empty_band():
    with pytest.raises(ValueError):
        decode_span(torch.rand(1, 3), torch.rand(1, 3), 0)


def test_tensorflow_init_draws_glorot_weights_zero_biases_and_forget_bias_one():
    from mrc_lib.nn.init import tensorflow_init_

    torch.manual_seed(0)
    net = nn.ModuleDict({"linear": nn.Linear(30, 20), "conv": nn.Conv1d(8, 40, 5),
                         "emb": nn.Embedding(50, 8, padding_idx=0),
                         "lstm": nn.LSTM(12, 10, bidirectional=True),
                         "sim": TrilinearSimilarity(6)})
    tensorflow_init_(net)

    def within(w, fan_in, fan_out):  # Glorot-uniform: |w| <= sqrt(6 / (fan_in + fan_out))
        bound = math.sqrt(6 / (fan_in + fan_out))
        return bool((w.abs() <= bound).all()) and w.abs().max() > 0.8 * bound

    assert within(net["linear"].weight, 30, 20) and (net["linear"].bias == 0).all()
    assert within(net["conv"].weight, 8 * 5, 40 * 5) and (net["conv"].bias == 0).all()
    assert within(net["emb"].weight[1:], 50, 8) and (net["emb"].weight[0] == 0).all()
    assert within(net["sim"].w, 18, 1)
    lstm = net["lstm"]
    for suffix in ("l0", "l0_reverse"):  # one TensorFlow kernel [input + h, 4h] per direction
        assert within(getattr(lstm, f"weight_ih_{suffix}"), 12 + 10, 40)
        assert within(getattr(lstm, f"weight_hh_{suffix}"), 12 + 10, 40)
        b = getattr(lstm, f"bias_ih_{suffix}")  # gates i, f, g, o: forget_bias = 1
        assert (b[10:20] == 1).all() and (b[:10] == 0).all() and (b[20:] == 0).all()
        assert (getattr(lstm, f"bias_hh_{suffix}") == 0).all()
    with pytest.raises(UserError, match="LSTMs only"):
        tensorflow_init_(nn.GRU(4, 4))


def test_bidaf_takes_tensorflow_init_as_an_option():
    from mrc_lib.bench import SyntheticVocab
    from mrc_lib.models import build_model

    vocab = SyntheticVocab.random(size=1000)
    torch.manual_seed(0)
    torch_init = build_model("bidaf", vocab, hidden=4, char_channels=4)
    torch.manual_seed(0)
    tf_init = build_model("bidaf", vocab, hidden=4, char_channels=4, init="tensorflow")
    assert not (torch_init.contextual.layers[0].bias_ih_l0[4:8] == 1).all()
    assert (tf_init.contextual.layers[0].bias_ih_l0[4:8] == 1).all()
    assert (tf_init.w_p1.weight.abs() <= (6 / 41) ** 0.5).all()
    with pytest.raises(UserError, match="init must be one of"):
        build_model("bidaf", vocab, hidden=4, init="keras")
