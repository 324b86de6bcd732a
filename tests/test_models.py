"""Tests for the model registry and the BiDAF and QANet readers, on a tiny random vocabulary,
and of every registered reader's masking."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.config import resolve_config
from mrc_lib.data.dataset import CONTEXT_KEYS, FILL, QUESTION_KEYS, pad_lengths
from mrc_lib.data.multipassage import passage_mask
from mrc_lib.errors import UserError
from mrc_lib.models import MODELS, build_model, hparam_defaults
from mrc_lib.nn import span_loss

V, D_WORD, N_TRAINABLE, N_CHARS, N_FEATS = 50, 8, 10, 20, 4
WORD_LEN = 6

TINY = {
    "bidaf": dict(hidden=8, char_dim=4, char_channels=6, char_kernel=3),
    "qanet": dict(d_model=16, heads=2, emb_convs=2, emb_kernel=3, model_blocks=2,
                  model_convs=1, model_kernel=3, char_dim=4, char_channels=6, char_kernel=3),
}
NO_DROPOUT = {
    "bidaf": dict(dropout=0.0),
    "qanet": dict(dropout=0.0, char_dropout=0.0, layer_dropout=0.0),
}


def tiny_vocab() -> SimpleNamespace:
    vectors = np.random.default_rng(0).normal(size=(V, D_WORD)).astype(np.float32)
    return SimpleNamespace(word_vectors=vectors, n_trainable=N_TRAINABLE, n_chars=N_CHARS,
                           n_feats=N_FEATS)


def tiny_model(name: str, dropout: bool = False, **hparams) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, tiny_vocab(), **TINY[name],
                       **({} if dropout else NO_DROPOUT[name]), **hparams)


def pad_stack(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad each ``[l, ...]`` tensor with zeros to ``[length, ...]`` and stack them."""
    out = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def make_batch(c_lens: list[int], q_lens: list[int], seed: int = 0, pad_to: tuple = (),
               key: int = 7) -> dict[str, torch.Tensor]:
    """Random examples whose answer is the two tokens after the question's ``key`` word in the
    context (a lookup that needs the attention); ``pad_to`` = (Lc, Lq) adds extra padding.
    Word ids cover both the trainable and the fixed rows of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    Lc, Lq = pad_to or (max(c_lens), max(q_lens))

    def words(n):  # random ids in [1, V) other than the key
        w = torch.randint(1, V - 1, (n,), generator=g)
        return w + (w >= key).long()

    def chars(w):  # a deterministic spelling of each word id, 1-6 characters
        n = 1 + w % WORD_LEN
        spelled = 1 + (w.unsqueeze(1) * (torch.arange(WORD_LEN) + 3)) % (N_CHARS - 1)
        return spelled * (torch.arange(WORD_LEN) < n.unsqueeze(1))

    c_words, q_words, y1 = [], [], []
    for lc, lq in zip(c_lens, q_lens):
        c, q = words(lc), words(lq)
        p = int(torch.randint(0, lc - 2, (1,), generator=g))
        c[p] = q[int(torch.randint(0, lq, (1,), generator=g))] = key
        c_words.append(c)
        q_words.append(q)
        y1.append(p + 1)
    c_words, q_words = pad_stack(c_words, Lc), pad_stack(q_words, Lq)
    y1 = torch.tensor(y1)
    return {
        "c_words": c_words, "c_chars": chars(c_words.flatten()).view(*c_words.shape, WORD_LEN),
        "c_mask": c_words != 0,
        "q_words": q_words, "q_chars": chars(q_words.flatten()).view(*q_words.shape, WORD_LEN),
        "q_mask": q_words != 0,
        "c_feats": torch.rand(len(c_lens), Lc, N_FEATS, generator=g) * (c_words != 0)[..., None],
        "q_type": torch.zeros(len(c_lens), dtype=torch.long),
        "y1": y1, "y2": y1 + 1, "has_answer": torch.ones(len(c_lens), dtype=torch.bool),
        "idx": torch.arange(len(c_lens)),
    }


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def batch():
    return make_batch(c_lens=[12, 7, 9], q_lens=[5, 3, 4])


@pytest.mark.parametrize("name", ["bidaf", "qanet"])
@pytest.mark.parametrize("use_features", [False, True])
def test_output_shapes_and_masking(name, use_features, batch):
    model = tiny_model(name, dropout=True, use_features=use_features)
    out = model(batch)
    B, Lc = batch["c_words"].shape
    Lq = batch["q_words"].shape[1]
    assert out["start_logits"].shape == out["end_logits"].shape == (B, Lc)
    assert out["start_logits"].dtype == out["end_logits"].dtype == torch.float32
    assert out["attention"].shape == (B, Lc, Lq)
    for key in ("start_logits", "end_logits"):
        p = torch.softmax(out[key], dim=-1)
        assert torch.all(p[~batch["c_mask"]] == 0)
        torch.testing.assert_close(p.sum(-1), torch.ones(B))
    # Attention: a distribution over the real query words at each real context word.
    attn = out["attention"]
    assert torch.all(attn.masked_select(~batch["q_mask"][:, None, :]) == 0)
    torch.testing.assert_close(attn.sum(-1), batch["c_mask"].float())


def test_features_change_only_the_flagged_model(batch):
    """``c_feats`` are read only when ``use_features`` is set."""
    for use_features in (False, True):
        model = tiny_model("bidaf", use_features=use_features).eval()
        other = dict(batch, c_feats=batch["c_feats"] + 1.0)
        same = torch.equal(model(batch)["start_logits"], model(other)["start_logits"])
        assert same != use_features


@pytest.mark.parametrize("name", ["bidaf", "qanet"])
def test_gradients_reach_every_trainable_parameter(name, batch):
    model = tiny_model(name, use_features=True)
    out = model(batch)
    span_loss(out["start_logits"], out["end_logits"], batch["y1"], batch["y2"]).backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, pname
    # The GloVe rows are a buffer, never a parameter; the PAD row gets no gradient. QANet maps
    # every out-of-vocabulary word to one <UNK> row (Sec. 2.2); BiDAF learns a row for each.
    word = model.embed.word
    assert word.trainable.shape == (N_TRAINABLE if name == "bidaf" else 2, D_WORD)
    assert not any(t is word.fixed for t in model.parameters())
    torch.testing.assert_close(word.fixed, torch.as_tensor(tiny_vocab().word_vectors[N_TRAINABLE:]))
    assert torch.all(word.trainable.grad[0] == 0)


@pytest.mark.parametrize("name", ["bidaf", "qanet"])
def test_padding_does_not_change_the_output(name):
    """An eval-mode reader on an example padded with extra context and query positions gives
    the same logits and attention at the real positions as on the unpadded example."""
    model = tiny_model(name, use_features=True).eval()
    short = make_batch([9], [4], seed=3)
    padded = make_batch([9], [4], seed=3, pad_to=(15, 7))
    with torch.no_grad():
        a, b = model(short), model(padded)
    for key in ("start_logits", "end_logits"):
        torch.testing.assert_close(b[key][:, :9], a[key], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b["attention"][:, :9, :4], a["attention"], rtol=1e-5, atol=1e-6)
    assert torch.all(b["attention"][:, 9:] == 0) and torch.all(b["attention"][:, :, 4:] == 0)


def test_registry():
    assert {"bidaf", "qanet"} <= set(MODELS)
    assert hparam_defaults("bidaf") == dict(hidden=100, char_dim=8, char_channels=100,
                                            char_kernel=5, dropout=0.2, locked_dropout=False,
                                            use_features=False, init="torch")
    assert hparam_defaults("qanet")["d_model"] == 128
    with pytest.raises(UserError, match="unknown model 'nope'.*bidaf.*qanet"):
        build_model("nope", tiny_vocab())
    with pytest.raises(UserError, match="unknown hyperparameter.*hiden.*known: .*hidden"):
        build_model("bidaf", tiny_vocab(), hiden=4)


def test_bidaf_dropout_on_lstm_inputs_is_the_papers_unless_locked():
    """BiDAF (Sec. 4) cites Srivastava et al.'s dropout: a new mask at every position of each
    LSTM's input. ``locked_dropout`` (a departure) shares one mask over a sequence."""
    from mrc_lib.nn import LockedDropout

    for locked, kind in ((False, torch.nn.Dropout), (True, LockedDropout)):
        model = build_model("bidaf", tiny_vocab(), hidden=4, char_channels=4,
                            locked_dropout=locked)
        rnns = [model.contextual, model.modeling, model.end_lstm]
        assert all(type(r.dropout) is kind and r.dropout.p == 0.2 for r in rnns)


@pytest.mark.parametrize("name, steps", [("bidaf", 25), ("qanet", 15)])
def test_overfits_a_tiny_batch(name, steps):
    """Adam drives the span loss on 8 examples down by a large factor, and only the trainable
    embedding rows move."""
    model = tiny_model(name)
    batch = make_batch(c_lens=[16, 12, 14, 10, 16, 9, 13, 15], q_lens=[5, 4, 5, 3, 4, 5, 2, 4])
    fixed = model.embed.word.fixed.clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(steps):
        out = model(batch)
        loss = span_loss(out["start_logits"], out["end_logits"], batch["y1"], batch["y2"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 20, losses
    assert torch.equal(model.embed.word.fixed, fixed)
    model.eval()
    out = model(batch)
    assert torch.equal(out["start_logits"].argmax(-1), batch["y1"])
    assert torch.equal(out["end_logits"].argmax(-1), batch["y2"])


# --- every reader ------------------------------------------------------------------------------

# Outputs compared at the real positions: logits over the context, per-question scores, the
# context-to-question attention.
COMPARED = ("start_logits", "end_logits", "na_logits", "candidate_log_probs", "attention")


def ragged_batch(vocab, lengths, passages: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic batch (every key a reader reads) whose rows have the (context, question)
    ``lengths``, zero ids past them; ``passages`` > 0 splits each context into that many
    passages (DynSAN's multi-passage layout)."""
    Lc, Lq = max(c for c, _ in lengths), max(q for _, q in lengths)
    b = synthetic_batch(vocab, len(lengths), Lc, question_len=Lq, seed=1)
    for i, (lc, lq) in enumerate(lengths):
        for key, v in b.items():
            if key.startswith(CONTEXT_KEYS) and v.dim() >= 2:
                v[i, lc:] = FILL.get(key, 0)
            elif key.startswith(QUESTION_KEYS) and v.dim() >= 2:
                v[i, lq:] = 0
    if passages:
        per = torch.arange(Lc) * passages // Lc
        b["c_passage"] = per.expand(len(lengths), Lc).where(b["c_mask"], 0).contiguous()
        b["c_passage_mask"] = torch.from_numpy(
            passage_mask(b["c_passage"].numpy(), b["c_mask"].numpy()))
    return b


# The library's readers (other test files register toy ones).
READERS = sorted(n for n, cls in MODELS.items() if cls.__module__.startswith("mrc_lib."))


@pytest.mark.parametrize("name, passages", [(n, 0) for n in READERS] + [("dynsan", 3)])
def test_every_reader_gives_each_question_the_same_output_whatever_its_padding(name, passages):
    """Evaluation sorts questions by length and pads each batch to its longest, and training
    may pad further (``pad_multiple``): an eval-mode reader (the smoke profile's sizes) must
    give a row the same outputs at its real positions whether its batch is padded to its own
    length or further (:func:`pad_lengths`)."""
    vocab = SyntheticVocab.random(size=600, dim=8)
    torch.manual_seed(0)
    model = build_model(name, vocab, **resolve_config(name, profile="smoke").hparams).eval()
    lengths = [(23, 7), (12, 4), (17, 6)]
    batch = ragged_batch(vocab, lengths, passages)
    padded = pad_lengths(batch, 16)
    assert padded["c_mask"].shape[1] == 32 and padded["q_mask"].shape[1] == 16
    if passages:
        assert padded["c_passage_mask"].shape[-1] == 16
    with torch.no_grad():
        a, b = model(batch), model(padded)
    compared = [key for key in COMPARED if key in a]
    assert compared, f"{name} returns none of {COMPARED}"
    for key in compared:
        x, y = a[key], b[key][tuple(slice(0, n) for n in a[key].shape)]
        if key in ("start_logits", "end_logits"):
            keep = batch["c_mask"]
        elif key == "attention" and x.dim() == 3:
            keep = batch["c_mask"].unsqueeze(2) & batch["q_mask"].unsqueeze(1)
        else:
            keep = torch.isfinite(x)
        torch.testing.assert_close(y[keep], x[keep], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
