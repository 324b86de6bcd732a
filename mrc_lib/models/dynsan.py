"""DynSAN: Token-level Dynamic Self-Attention Network for Multi-Passage Reading Comprehension
(Zhuang & Wang, ACL 2019, Sec. 3).

A question comes with ``M`` passages, ranked by a retriever. The reader encodes each passage
against the question, then lets every token of every passage interact with every other at the
token level, which full self-attention over thousands of tokens cannot afford; DynSA blocks
(:mod:`mrc_lib.models.dynsa`) can. Layers:

1. input (Sec. 3.1): fixed word vectors and a char CNN (15-d characters) through a two-layer
   highway network, projected to ``D = 128``, sinusoidal positions (counted from the start of
   each passage);
2. encoding: one DynSA block shared by the question and each passage;
3. alignment (Sec. 3.2), as in QANet (Yu et al., 2018), which the paper follows: trilinear
   similarity, context-to-query and query-to-context attention ``[c; a; c⊙a; c⊙b]``, projected
   to ``D``, then a DynSA block (the paper credits query-to-context to BiDAF; we compute it in
   QANet's DCN form, :class:`mrc_lib.nn.CoAttention`);
4. cross-passage attention (Sec. 3.3): the passages concatenated in rank order, plus a learned
   embedding of each token's passage rank, through ``N = 4`` DynSA blocks: ``S``;
5. prediction (Sec. 3.4.1), HAS-style (Pang et al., 2019) as the paper adapts it: start and
   end distributions over *all* tokens of all passages; the end pointer is conditioned on the
   start distribution, and a DynSA block stands where HAS has an RNN; the loss sums over every
   occurrence of the answer in every passage (below).

The paper's only equation for its prediction layer is the form of the distributions, "over all
tokens as in Equation 7" (a linear projection of ``S`` and a softmax over all ``L`` tokens); the
rest it defers to Pang et al. (2019), which is not in this book's collection. Our reading,
stated as ours:
``p^s = softmax(w_sᵀ S)``; ``s̄ = Σ_i p^s_i S_i`` (the start-attended summary a pointer
network's RNN receives); ``S^e = DynSA(F^E([S; s̄]))`` with ``F^E`` linear ``2D → D``;
``p^e = softmax(w_eᵀ S^e)``; loss ``−log Σ_{(i, j) ∈ T} p^s_i p^e_j`` over the set ``T`` of
answer occurrences (batch keys ``occ_start``/``occ_end``, from
:mod:`mrc_lib.data.multipassage`; the gold span alone where a batch has none). Conditioning the
end on one start position (``p^e(j | i)``) is the other reading; it needs one end pass per
candidate start. No paragraph quality estimator, as in the paper.

A batch holds the passages concatenated as one context; ``c_passage`` ``[B, Lc]`` (from
:mod:`mrc_lib.data.multipassage`) gives each token's passage and ``c_passage_mask``
``[B, M, Lp]`` the real tokens of each (absent: one passage, plain SQuAD). Layers 1-3 run on
the passages cut apart into a ``[B·M, Lp]`` batch, layer 4 on the whole. No step reads a
length or a count back from the device.

Switches: ``block`` replaces every DynSA block by a Bi-LSTM (``"bilstm"``), QANet's full
self-attention encoder block (``"fullsan"``) or Bi-BloSA (``"bibosa"``,
:mod:`mrc_lib.models.bibosa`): Table 4's baselines and Table 3 (g, h). Table 3's ablations:
(a) ``cross_passage=False`` (the top blocks, and the end block, run inside each passage),
(b) ``attention=False``, (c) ``conv=False``, (d) ``selection="random"``, (e) ``selection=
"random"`` and ``gate=False``, (f) ``beta=0``; (g) ``block="bibosa", conv=False``,
(h) ``block="bibosa"``.
Training (Sec. 4.2, the trainer's job): Adam, learning rate 1e-3 after a 500-step warm-up,
EMA 0.9999, dropout 0.1, batch 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.models.bibosa import BiBloSABlock
from mrc_lib.models.dynsa import DynSA, gate_penalty
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import (
    RNN,
    CoAttention,
    EncoderBlock,
    add_positions,
    mask_logits,
    masked_softmax,
    zero_padding,
)

BLOCKS = ("dynsa", "bilstm", "fullsan", "bibosa")
ANALYSIS_EXAMPLES = 32  # Figure 4: the first 32 dev questions
FIGURE3_EXAMPLES = 2  # Figure 3: the first 2 dev questions, their first FIGURE3_TOKENS tokens
FIGURE3_TOKENS = 800
ACTIVE = 0.01  # Figure 4(b): a token is active when its activity exceeds 0.01 (Sec. 4.6)
BANDS = (0.01, 0.99)  # Figure 4(a): g ≤ 0.01, in between, g ≥ 0.99 (our bands; see analysis)


@dataclass
class PassageLayout:
    """Where each token of a concatenated context sits: passage ``p`` and position ``j`` in it.

    Passages are contiguous and in order, so ``j = t − offset[p]``. :meth:`split` cuts
    ``[B, L, ·]`` into a ``[B·M, Lp, ·]`` batch of passages; :meth:`merge` puts it back. ``M``
    and ``Lp`` are the shape of ``per_passage``, which the batch brings
    (:func:`mrc_lib.data.multipassage.passage_mask`): nothing is read back from the device.
    """

    passage: Tensor  # [B, L] long
    position: Tensor  # [B, L] long
    mask: Tensor  # [B, L] bool
    per_passage: Tensor  # [B, M, Lp] bool: the real tokens of each passage

    @classmethod
    def of(cls, passage: Tensor, mask: Tensor, per_passage: Tensor) -> PassageLayout:
        passage = passage.masked_fill(~mask, 0)
        lengths = per_passage.sum(-1)  # [B, M]
        offsets = lengths.cumsum(1) - lengths
        position = torch.arange(passage.shape[1], device=passage.device) - offsets.gather(1,
                                                                                          passage)
        return cls(passage, position.masked_fill(~mask, 0), mask, per_passage)

    @classmethod
    def single(cls, mask: Tensor) -> PassageLayout:
        """One passage per context (plain SQuAD): ``M = 1``, ``Lp = L``."""
        return cls.of(torch.zeros_like(mask, dtype=torch.long), mask, mask.unsqueeze(1))

    @property
    def passages(self) -> int:
        return self.per_passage.shape[1]

    @property
    def passage_mask(self) -> Tensor:
        """``[B·M, Lp]``: True at the real tokens of each passage."""
        return self.per_passage.flatten(0, 1)

    def split(self, x: Tensor) -> Tensor:
        """``[B, L, *]`` to ``[B·M, Lp, *]``; padding lands in a spare slot that is dropped."""
        B, M, Lp = self.per_passage.shape
        out = x.new_zeros(B, M, Lp + 1, *x.shape[2:])
        b = torch.arange(B, device=x.device).unsqueeze(1).expand_as(self.passage)
        j = self.position.masked_fill(~self.mask, Lp)
        out = out.index_put((b, self.passage, j), x, accumulate=True)
        return out[:, :, :Lp].flatten(0, 1)

    def merge(self, y: Tensor) -> Tensor:
        """``[B·M, Lp, *]`` back to ``[B, L, *]``, zero at padding."""
        B, M, _ = self.per_passage.shape
        y = y.unflatten(0, (B, M))
        b = torch.arange(B, device=y.device).unsqueeze(1)
        out = y[b, self.passage, self.position]
        return zero_padding(out, self.mask)


class Baseline(nn.Module):
    """A Table 4 baseline in a DynSA block's place: same interface, no gates."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, None]:
        return self.layer(x, mask), None


@dataclass
class Encoding:
    """Layers 1-4 of a batch: ``S`` ``[B, L, D]`` and what the heads need around it."""

    s: Tensor
    layout: PassageLayout
    c_mask: Tensor
    attention: Tensor  # context-to-query attention, [B, L, Lq]
    gates: list  # [B, L, H] per layer -1, 0, 1..N over the context, for Figures 3-4 (eval only)
    every_gate: list  # the question side and the head's blocks too, for the Eq. 6 penalty


def has_loss(start_logits: Tensor, end_logits: Tensor, occ_start: Tensor,
             occ_end: Tensor) -> Tensor:
    """``−log Σ_{(i, j) ∈ T} p^s_i p^e_j``, averaged over the batch: the likelihood of the
    answer summed over all its occurrences ``T`` (``occ_start``/``occ_end`` ``[B, O]``, ``-1``
    where an example has fewer than ``O``; an example without any, e.g. an answer that could not
    be aligned to the tokens, is left out of the mean). Logits ``[B, L]`` are already masked."""
    log_s, log_e = start_logits.log_softmax(-1), end_logits.log_softmax(-1)
    valid = occ_start >= 0
    terms = (log_s.gather(1, occ_start.clamp(min=0)) + log_e.gather(1, occ_end.clamp(min=0)))
    answered = valid.any(-1, keepdim=True)
    # An example without occurrences gets the finite logsumexp of zeros, then weight 0 (a
    # boolean index would read its count back from the device).
    log_p = terms.masked_fill(~valid, float("-inf")).masked_fill(~answered, 0.0).logsumexp(-1)
    answered = answered.squeeze(-1)
    return -(log_p * answered).sum() / answered.sum().clamp(min=1)


def occurrences(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The answer occurrences of a batch, or its gold span alone."""
    if "occ_start" in batch:
        return batch["occ_start"], batch["occ_end"]
    return batch["y1"].unsqueeze(1), batch["y2"].unsqueeze(1)


@register("dynsan")
class DynSAN(nn.Module):
    """The DynSAN reader.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        d_model: ``D`` (paper: 128).
        heads: ``H`` (paper: 8).
        top_k: ``K``, tokens attended per head (paper: 256).
        num_blocks: ``N``, cross-passage blocks (paper: 4).
        num_convs, kernel_size: each block's local encoder (paper: 2, width 7).
        char_dim: character embedding size (paper: 15).
        char_channels, char_kernel: char CNN filters and width (not given in the paper).
        dropout: between layers and inside blocks (paper: 0.1).
        char_dropout: on character embeddings.
        beta: the L1 gate penalty ``β`` (paper: 1e-5).
        fixed_words: keep every word vector fixed (paper: yes); ``False`` trains the rows of
            words without a pretrained vector, as the other chapters do.
        max_passages: rank embeddings; later passages share the last one.
        block: ``dynsa``, or ``bilstm``, ``fullsan``, ``bibosa`` (Tables 3 and 4).
        cross_passage, conv, attention, selection, gate: Table 3's ablations.
    """

    FEATURES = False  # the context side gets the batch's ``c_feats`` (vocab.n_feats of them)
    compile_regions = (DynSA, EncoderBlock)  # compile=true compiles each block (train.compiled)

    def __init__(self, vocab, *, d_model: int = 128, heads: int = 8, top_k: int = 256,
                 num_blocks: int = 4, num_convs: int = 2, kernel_size: int = 7,
                 char_dim: int = 15, char_channels: int = 100, char_kernel: int = 5,
                 dropout: float = 0.1, char_dropout: float = 0.05, beta: float = 1e-5,
                 fixed_words: bool = True, max_passages: int = 128, block: str = "dynsa",
                 cross_passage: bool = True, conv: bool = True, attention: bool = True,
                 selection: str = "gate", gate: bool = True):
        super().__init__()
        if block not in BLOCKS:
            raise UserError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")

        def make_block() -> nn.Module:
            if block == "bilstm":
                return Baseline(RNN(d_model, d_model // 2, dropout=dropout))
            if block == "fullsan":
                return Baseline(EncoderBlock(d_model, num_convs, kernel_size, heads, dropout))
            if block == "bibosa":
                return BiBloSABlock(d_model, num_convs, kernel_size, dropout, conv=conv)
            return DynSA(d_model, heads, top_k, num_convs, kernel_size, dropout, conv=conv,
                         attention=attention, selection=selection, gate=gate)

        self.cross_passage, self.beta = cross_passage, beta
        # 1. Input: Highway([word vectors; CharCNN; features]) projected to D.
        self.embed = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, word_dropout=dropout,
                                    char_dropout=char_dropout, highway_dropout=dropout,
                                    use_features=self.FEATURES)
        if fixed_words:  # Sec. 3.1: word embeddings are fixed during training
            self.embed.word.trainable.requires_grad_(False)
        self.embed_proj = nn.Linear(self.embed.out_dim, d_model, bias=False)
        # 2. One block shared by question and passages.
        self.encoder = make_block()
        # 3. Alignment [c; a; c⊙a; c⊙b], projected to D, then a block.
        self.attention = CoAttention(d_model)
        self.attn_proj = nn.Linear(4 * d_model, d_model, bias=False)
        self.aligned = make_block()
        # 4. Cross-passage attention over all passages, with rank embeddings.
        self.rank = nn.Embedding(max_passages, d_model)
        self.blocks = nn.ModuleList(make_block() for _ in range(num_blocks))
        self.dropout = nn.Dropout(dropout)
        self.build_head(d_model, make_block)

    def build_head(self, d_model: int, make_block) -> None:
        """5. Prediction (Sec. 3.4.1): start pointer; end pointer conditioned on it through a
        block."""
        self.w_s = nn.Linear(d_model, 1, bias=False)
        self.f_e = nn.Linear(2 * d_model, d_model, bias=False)  # F^E
        self.end_block = make_block()
        self.w_e = nn.Linear(d_model, 1, bias=False)

    def embed_side(self, words: Tensor, chars: Tensor, feats: Tensor | None = None) -> Tensor:
        """Layer 1 without the positions: ``[B, L, D]``."""
        return self.embed_proj(self.embed(words, chars, feats))

    def run_block(self, blk: nn.Module, x: Tensor, enc: Encoding, per_passage: bool,
                  figure: bool = True) -> Tensor:
        """A block over the passages apart (``[B·M, Lp]``) or all together (``[B, L]``); its
        gates are kept for the penalty and, outside training, (``figure``) for Figures 3-4."""
        y, g = blk(x, enc.layout.passage_mask if per_passage else enc.c_mask)
        if g is not None:
            enc.every_gate.append(g)
            if figure and not self.training:
                enc.gates.append(enc.layout.merge(g) if per_passage else g)
        return y

    def apply_context(self, blk: nn.Module, x: Tensor, enc: Encoding,
                      figure: bool = True) -> Tensor:
        """A block over the whole context: across passages, or inside each (ablation (a))."""
        if self.cross_passage:
            return self.run_block(blk, x, enc, False, figure)
        return enc.layout.merge(self.run_block(blk, enc.layout.split(x), enc, True, figure))

    def encode(self, batch: dict[str, Tensor]) -> Encoding:
        """Layers 1-4: ``S``, the output of the cross-passage attention layer."""
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        if "c_passage" in batch:
            layout = PassageLayout.of(batch["c_passage"], c_mask, batch["c_passage_mask"])
        else:
            layout = PassageLayout.single(c_mask)
        passage = layout.passage
        p_mask, M = layout.passage_mask, layout.passages
        enc = Encoding(None, layout, c_mask, None, [], [])
        # Layers 1-2: passages [B·M, Lp, D] and question [B, Lq, D].
        feats = batch.get("c_feats") if self.FEATURES else None
        c = self.embed_side(batch["c_words"], batch["c_chars"], feats)
        c = add_positions(layout.split(c))
        q = add_positions(self.embed_side(batch["q_words"], batch["q_chars"]))
        c = self.run_block(self.encoder, self.dropout(c), enc, True)
        q, g_q = self.encoder(self.dropout(q), q_mask)
        if g_q is not None:
            enc.every_gate.append(g_q)
        # Layer 3: each passage against the question.
        g, attn = self.attention(c, q.repeat_interleave(M, 0), p_mask,
                                 q_mask.repeat_interleave(M, 0))
        enc.attention = layout.merge(attn).float()
        c = self.run_block(self.aligned, self.dropout(self.attn_proj(g)), enc, True)
        # Layer 4: all passages in rank order: S.
        s = layout.merge(c) + self.rank(passage.clamp(max=self.rank.num_embeddings - 1))
        for blk in self.blocks:
            s = self.apply_context(blk, self.dropout(s), enc)
        enc.s = s
        return enc

    def finish(self, out: dict[str, Tensor], enc: Encoding) -> dict[str, Tensor]:
        """Add the gates (Figures 3-4; outside training) and, in training, the Eq. 6 penalty to
        ``out``."""
        if enc.gates:
            out["gates"] = torch.stack(enc.gates, dim=1).float()  # [B, layers, L, H]
        if self.training and self.beta > 0 and enc.every_gate:
            out["aux_loss"] = gate_penalty(enc.every_gate, self.beta, len(enc.c_mask))  # Eq. 6
        return out

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        enc = self.encode(batch)
        s, c_mask = enc.s, enc.c_mask
        # Layer 5: p^s over every token; p^e conditioned on p^s through a block.
        start = mask_logits(self.w_s(s).squeeze(-1).float(), c_mask)
        s_bar = (masked_softmax(start, c_mask).unsqueeze(1).to(s.dtype) @ s).expand_as(s)
        x_e = self.dropout(self.f_e(torch.cat([s, s_bar], -1)))
        s_e = self.apply_context(self.end_block, x_e, enc, figure=False)
        end = mask_logits(self.w_e(s_e).squeeze(-1).float(), c_mask)
        out = {"start_logits": start, "end_logits": end, "attention": enc.attention}
        if self.training:
            out["loss"] = has_loss(start, end, *occurrences(batch))
        return self.finish(out, enc)

    @torch.no_grad()
    def analysis(self, data, cfg) -> dict:
        """Figures 3 and 4 from the gates, on the first dev questions (Secs. 4.5-4.6); in eval
        mode, as the trainer calls it (training steps keep no gates for the figures).

        A token's *activity* in a block is its maximum gate over the heads (raw ``g``, not
        divided by ``max(g_h)`` as in Eq. 3). Layers are indexed as in the paper's Figure 4:
        -1 the encoding block, 0 the block after alignment, 1..N the cross-passage blocks.
        ``figure4a``: per layer, how many tokens fall in each activity band (``g ≤ 0.01``,
        ``0.01 < g < 0.99``, ``g ≥ 0.99``: the paper's band limits are not legible in our copy);
        ``figure4b``: per layer, the average number of tokens per question with ``g > 0.01``.
        ``figure3``: for the first questions, every token's activity summed over the
        cross-passage blocks, by which the paper ranks tokens. Empty for readers without gates.
        """
        split = data.splits["dev"]
        device = next(self.parameters()).device
        n = min(len(split), ANALYSIS_EXAMPLES)
        bands, active, cases = None, None, []
        for lo in range(0, n, 8):
            pos = np.arange(lo, min(lo + 8, n))
            batch = {k: v.to(device) for k, v in split.collate(pos).items()}
            out = self(batch)
            if "gates" not in out:
                return {}
            activity = out["gates"].amax(-1)  # [B, layers, L]
            real = batch["c_mask"].unsqueeze(1)
            low, high = (activity <= BANDS[0]) & real, (activity >= BANDS[1]) & real
            counts = torch.stack([low, real & ~low & ~high, high], -1).sum((0, 2))  # [layers, 3]
            on = ((activity > ACTIVE) & real).sum((0, 2))
            bands = counts if bands is None else bands + counts
            active = on if active is None else active + on
            for row, i in enumerate(pos[:max(FIGURE3_EXAMPLES - lo, 0)].tolist()):
                cases.append(self._figure3_case(split, i, row, batch, activity[row]))
        layers = list(range(-1, bands.shape[0] - 1))
        return {"layers": layers, "questions": n, "bands": list(BANDS),
                "figure4a": bands.tolist(), "figure4b": (active.float() / n).tolist(),
                "figure3": cases}

    @staticmethod
    def _figure3_case(split, i: int, row: int, batch: dict[str, Tensor],
                      activity: Tensor) -> dict:
        """Question ``i`` (row ``row`` of ``batch``): its tokens and their activities summed
        over the cross-passage blocks (layers 1..N), at most ``FIGURE3_TOKENS`` of them."""
        length = int(batch["c_mask"][row].sum())
        keep = min(length, FIGURE3_TOKENS)
        passage = batch.get("c_passage", torch.zeros_like(batch["c_words"]))[row, :keep]
        return {"question": split.question(i), "tokens": split.tokens(i)[:keep],
                "score": [round(float(v), 4) for v in activity[2:, :keep].sum(0)],
                "passage": passage.tolist(), "length": length,
                "answer": [int(batch["y1"][row]), int(batch["y2"][row])]}
