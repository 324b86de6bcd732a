"""DynSAN: Token-level Dynamic Self-Attention Network for Multi-Passage Reading Comprehension
(Zhuang & Wang, ACL 2019, Sec. 3).

A question comes with ``M`` passages, ranked by a retriever. The reader encodes each passage
against the question, then lets every token of every passage interact with every other at the
token level, which full self-attention over thousands of tokens cannot afford; DynSA blocks
(:mod:`mrc_lib.models.dynsa`) can. Layers:

1. input: fixed GloVe vectors and a char CNN through a two-layer highway network, projected to
   ``D = 128``, sinusoidal positions (counted from the start of each passage);
2. encoding: one DynSA block shared by the question and each passage;
3. alignment, as in QANet: trilinear similarity, context-to-query and DCN query-to-context
   attention ``[c; a; c⊙a; c⊙b]``, projected to ``D``, then another DynSA block;
4. cross-passage attention: the passages concatenated in rank order, plus a learned embedding
   of each token's passage rank, through ``N = 4`` DynSA blocks;
5. output: start and end distributions over all tokens of all passages,
   ``p1 ∝ exp(w1ᵀ[Y_{N-1}; Y_N])``, ``p2 ∝ exp(w2ᵀ[Y_{N-1}; Y_N])``.

A batch holds the passages concatenated as one context; ``c_passage`` ``[B, Lc]`` (from
:mod:`mrc_lib.data.multipassage`) gives each token's passage (absent: one passage, plain SQuAD).
Layers 1-3 run on the passages cut apart into a ``[B·M, Lp]`` batch, layer 4 on the whole.

Switches: ``block`` replaces every DynSA block by a Bi-LSTM (``"bilstm"``) or QANet's
full self-attention encoder block (``"fullsan"``), the baselines of Table 4; the ablations of
Table 3 are ``cross_passage=False`` (layer 4 within each passage), ``attention=False``,
``conv=False``, ``selection="random"``, ``gate_scaling=False`` and ``beta=0``.
Training (Sec. 4.2, the trainer's job): Adam, learning rate 1e-3 after a 500-step warm-up,
EMA 0.9999, dropout 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.models.dynsa import DynSA, gate_penalty
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import RNN, CoAttention, EncoderBlock, add_positions, mask_logits

BLOCKS = ("dynsa", "bilstm", "fullsan")


@dataclass
class PassageLayout:
    """Where each token of a concatenated context sits: passage ``p`` and position ``j`` in it.

    Passages are contiguous and in order, so ``j = t − offset[p]``. :meth:`split` cuts
    ``[B, L, ·]`` into a ``[B·M, Lp, ·]`` batch of passages; :meth:`merge` puts it back.
    """

    passage: Tensor  # [B, L] long
    position: Tensor  # [B, L] long
    mask: Tensor  # [B, L] bool
    lengths: Tensor  # [B, M] tokens per passage

    @classmethod
    def of(cls, passage: Tensor, mask: Tensor) -> PassageLayout:
        passage = passage.masked_fill(~mask, 0)
        M = int(passage.max()) + 1
        lengths = passage.new_zeros(passage.shape[0], M).scatter_add_(1, passage, mask.long())
        offsets = lengths.cumsum(1) - lengths
        position = torch.arange(passage.shape[1], device=passage.device) - offsets.gather(1,
                                                                                          passage)
        return cls(passage, position.masked_fill(~mask, 0), mask, lengths)

    @property
    def passages(self) -> int:
        return self.lengths.shape[1]

    @property
    def passage_mask(self) -> Tensor:
        """``[B·M, Lp]``: True at the real tokens of each passage."""
        Lp = max(int(self.lengths.max()), 1)
        return (torch.arange(Lp, device=self.lengths.device) < self.lengths.unsqueeze(-1)
                ).flatten(0, 1)

    def split(self, x: Tensor) -> Tensor:
        """``[B, L, *]`` to ``[B·M, Lp, *]``; padding lands in a spare slot that is dropped."""
        B, M = self.lengths.shape
        Lp = max(int(self.lengths.max()), 1)
        out = x.new_zeros(B, M, Lp + 1, *x.shape[2:])
        b = torch.arange(B, device=x.device).unsqueeze(1).expand_as(self.passage)
        j = self.position.masked_fill(~self.mask, Lp)
        out = out.index_put((b, self.passage, j), x, accumulate=True)
        return out[:, :, :Lp].flatten(0, 1)

    def merge(self, y: Tensor) -> Tensor:
        """``[B·M, Lp, *]`` back to ``[B, L, *]``, zero at padding."""
        B, M = self.lengths.shape
        y = y.unflatten(0, (B, M))
        b = torch.arange(B, device=y.device).unsqueeze(1)
        out = y[b, self.passage, self.position]
        return out.masked_fill(~self.mask.view(*self.mask.shape, *[1] * (out.dim() - 2)), 0.0)


class Baseline(nn.Module):
    """A Table 4 baseline in a DynSA block's place: same interface, no gates."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, None]:
        return self.layer(x, mask), None


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
        char_channels, char_kernel: char CNN filters and width.
        dropout: between layers and inside blocks (paper: 0.1).
        char_dropout: on character embeddings.
        beta: the L1 gate penalty ``β`` (paper: 1e-5).
        max_passages: rank embeddings; later passages share the last one.
        block: ``dynsa``, or the Table 4 baselines ``bilstm`` and ``fullsan``.
        cross_passage, conv, attention, selection, gate_scaling: Table 3's ablations.
    """

    def __init__(self, vocab, *, d_model: int = 128, heads: int = 8, top_k: int = 256,
                 num_blocks: int = 4, num_convs: int = 2, kernel_size: int = 7,
                 char_dim: int = 15, char_channels: int = 100, char_kernel: int = 5,
                 dropout: float = 0.1, char_dropout: float = 0.05, beta: float = 1e-5,
                 max_passages: int = 128, block: str = "dynsa", cross_passage: bool = True,
                 conv: bool = True, attention: bool = True, selection: str = "gate",
                 gate_scaling: bool = True):
        super().__init__()
        if block not in BLOCKS:
            raise UserError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")

        def make_block() -> nn.Module:
            if block == "bilstm":
                return Baseline(RNN(d_model, d_model // 2, dropout=dropout))
            if block == "fullsan":
                return Baseline(EncoderBlock(d_model, num_convs, kernel_size, heads, dropout))
            return DynSA(d_model, heads, top_k, num_convs, kernel_size, dropout, conv=conv,
                         attention=attention, selection=selection, gate_scaling=gate_scaling)

        self.cross_passage, self.beta = cross_passage, beta
        # 1. Input: Highway([GloVe; CharCNN]) projected to D.
        self.embed = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, word_dropout=dropout,
                                    char_dropout=char_dropout, highway_dropout=dropout)
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
        # 5. Output.
        self.w1 = nn.Linear(2 * d_model, 1, bias=False)
        self.w2 = nn.Linear(2 * d_model, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def embed_side(self, words: Tensor, chars: Tensor) -> Tensor:
        """Layer 1 without the positions: ``[B, L, D]``."""
        return self.embed_proj(self.embed(words, chars))

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        passage = batch.get("c_passage", torch.zeros_like(batch["c_words"]))
        layout = PassageLayout.of(passage, c_mask)
        p_mask, M = layout.passage_mask, layout.passages
        gates = []  # [B, L, H] per DynSA layer over the context, for Figure 4
        every_gate = []  # question side too, for the Eq. 6 penalty

        def run(blk: nn.Module, x: Tensor, mask: Tensor, per_passage: bool) -> Tensor:
            y, g = blk(x, mask)
            if g is not None:
                gates.append(layout.merge(g) if per_passage else g)
                every_gate.append(g)
            return y

        # Layers 1-2: passages [B·M, Lp, D] and question [B, Lq, D].
        c = add_positions(layout.split(self.embed_side(batch["c_words"], batch["c_chars"])))
        q = add_positions(self.embed_side(batch["q_words"], batch["q_chars"]))
        c = run(self.encoder, self.dropout(c), p_mask, True)
        q, g_q = self.encoder(self.dropout(q), q_mask)
        if g_q is not None:
            every_gate.append(g_q)
        # Layer 3: each passage against the question.
        g, attn = self.attention(c, q.repeat_interleave(M, 0), p_mask,
                                 q_mask.repeat_interleave(M, 0))
        c = run(self.aligned, self.dropout(self.attn_proj(g)), p_mask, True)
        # Layer 4: all passages in rank order (or each alone: ablation (a)).
        x = layout.merge(c) + self.rank(passage.clamp(max=self.rank.num_embeddings - 1))
        ys = [x]
        for blk in self.blocks:
            x = self.dropout(x)
            if self.cross_passage:
                x = run(blk, x, c_mask, False)
            else:
                x = layout.merge(run(blk, layout.split(x), p_mask, True))
            ys.append(x)
        # Layer 5: p1, p2 over every token of every passage.
        y = torch.cat(ys[-2:], dim=-1)
        start = self.w1(y).squeeze(-1)
        end = self.w2(y).squeeze(-1)
        out = {"start_logits": mask_logits(start.float(), c_mask),
               "end_logits": mask_logits(end.float(), c_mask),
               "attention": layout.merge(attn).float()}
        if gates:
            out["gates"] = torch.stack(gates, dim=1).float()  # [B, layers, L, H]
        if self.training and self.beta > 0 and every_gate:
            out["aux_loss"] = gate_penalty(every_gate, self.beta, len(c_mask))  # Eq. 6
        return out
