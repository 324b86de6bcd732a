"""QANet: Combining Local Convolution with Global Self-Attention (Yu et al., ICLR 2018).

Five layers (Sec. 2.2 of the paper), with no recurrence anywhere:

1. input embedding layer: fixed GloVe word vectors, every out-of-vocabulary word mapped to one
   trainable ``<UNK>`` vector, and a char CNN over trainable character
   vectors of ``p2 = 200`` dimensions (words cut or padded to 16 characters, the row-wise
   maximum of the convolution's output taken), through a two-layer highway network, then
   mapped to ``d`` by a one-dimensional convolution of width 1;
2. embedding encoder layer: one encoder block ``[conv × 4, self-attention, feed-forward]``,
   each sub-layer ``f`` wrapped as ``x + f(layernorm(x))``, shared by context and question;
3. context-query attention layer: the trilinear similarity, ``A = S̄ Q`` and the DCN
   query-to-context ``B = S̄ S̿ᵀ C``, giving ``[c; a; c⊙a; c⊙b]``;
4. model encoder layer: a stack of 7 blocks with 2 convolutions each, applied three times with
   shared weights to give ``M0``, ``M1``, ``M2``;
5. output layer: ``p1 = softmax(W1[M0; M1])``, ``p2 = softmax(W2[M0; M2])``.

Regularization: dropout 0.1 between layers (0.1 on words, 0.05 on characters) and stochastic
depth inside each stack, sub-layer ``l`` of ``L`` surviving with ``1 - l/L · (1 - p_L)``,
``p_L = 0.9``. Training in the paper (the trainer's job): Adam with β1 = 0.8, β2 = 0.999,
ε = 1e-7, a learning rate warmed up from 0 to 0.001 over 1000 steps (inverse exponential), L2
weight decay 3e-7, and an exponential moving average of all weights with decay 0.9999.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.models.bidaf import attention_payload
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import CoAttention, EncoderBlock, mask_logits


class EncoderStack(nn.Module):
    """``num_blocks`` encoder blocks in sequence; stochastic depth numbers their sub-layers
    across the whole stack."""

    def __init__(self, dim: int, num_blocks: int, num_convs: int, kernel_size: int, heads: int,
                 dropout: float, layer_dropout: float):
        super().__init__()
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, num_convs, kernel_size, heads, dropout, layer_dropout,
                         layer_index=i, total_layers=num_blocks)
            for i in range(1, num_blocks + 1))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, mask)
        return x


@register("qanet")
class QANet(nn.Module):
    """The QANet reader.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        d_model: ``d``, the width of every encoder (paper: 128).
        heads: self-attention heads (paper: 8).
        emb_blocks, emb_convs, emb_kernel: embedding encoder (paper: 1 block, 4 convs, width 7).
        model_blocks, model_convs, model_kernel: model encoder (paper: 7 blocks, 2 convs,
            width 5).
        char_dim: character embedding size (paper: p2 = 200, Sec. 2.2).
        char_channels: char CNN filters, the size of a character-level word vector (paper: 200).
        char_kernel: char CNN filter width.
        dropout: dropout between layers and on word vectors (paper: 0.1).
        char_dropout: dropout on character embeddings (paper: 0.05).
        layer_dropout: ``1 - p_L``, the drop probability of the last sub-layer of a stack
            (paper: 0.1).
        use_features: append the data pipeline's token features to the context embedding.
        oov_rows: a departure (BiDAF's code, our other readers): a trainable vector for each
            training word without a GloVe vector, instead of the paper's one ``<UNK>``.
    """

    compile_regions = (EncoderBlock,)  # compile=true compiles each block (train.compiled)

    def __init__(self, vocab, *, d_model: int = 128, heads: int = 8, emb_blocks: int = 1,
                 emb_convs: int = 4, emb_kernel: int = 7, model_blocks: int = 7,
                 model_convs: int = 2, model_kernel: int = 5, char_dim: int = 200,
                 char_channels: int = 200, char_kernel: int = 5, dropout: float = 0.1,
                 char_dropout: float = 0.05, layer_dropout: float = 0.1,
                 use_features: bool = False, oov_rows: bool = False):
        super().__init__()
        # 1. Input embedding: Highway([x_w; x_c]) mapped to d by a width-1 convolution.
        self.embed = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, word_dropout=dropout,
                                    char_dropout=char_dropout, highway_dropout=dropout,
                                    use_features=use_features, oov_rows=oov_rows)
        self.embed_proj = nn.Linear(self.embed.out_dim, d_model, bias=False)
        # 2. Embedding encoder, shared by context and question.
        self.emb_encoder = EncoderStack(d_model, emb_blocks, emb_convs, emb_kernel, heads,
                                        dropout, layer_dropout)
        # 3. Context-query attention: [c; a; c⊙a; c⊙b], mapped back to d.
        self.attention = CoAttention(d_model)
        self.attn_proj = nn.Linear(4 * d_model, d_model, bias=False)
        # 4. Model encoder, one stack applied three times.
        self.model_encoder = EncoderStack(d_model, model_blocks, model_convs, model_kernel,
                                          heads, dropout, layer_dropout)
        # 5. Output: W1, W2 ∈ R^(2d).
        self.w1 = nn.Linear(2 * d_model, 1, bias=False)
        self.w2 = nn.Linear(2 * d_model, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def encode(self, words: Tensor, chars: Tensor, mask: Tensor,
               feats: Tensor | None = None) -> Tensor:
        """Layers 1-2 for one side: ``[B, L, d]``."""
        x = self.embed_proj(self.embed(words, chars, feats))
        return self.emb_encoder(x, mask)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        # Layers 1-2: C [B, n, d] and Q [B, m, d].
        c = self.encode(batch["c_words"], batch["c_chars"], c_mask, batch.get("c_feats"))
        q = self.encode(batch["q_words"], batch["q_chars"], q_mask)
        # Layer 3: [c; a; c⊙a; c⊙b] [B, n, 4d]; attn = S̄, the row-normalized similarity.
        g, attn = self.attention(c, q, c_mask, q_mask)
        # Layer 4: M0, M1, M2 from the same stack.
        m0 = self.model_encoder(self.dropout(self.attn_proj(g)), c_mask)
        m1 = self.model_encoder(self.dropout(m0), c_mask)
        m2 = self.model_encoder(self.dropout(m1), c_mask)
        # Layer 5: p1 = softmax(W1[M0; M1]), p2 = softmax(W2[M0; M2]).
        start = self.w1(torch.cat([m0, m1], dim=-1)).squeeze(-1)
        end = self.w2(torch.cat([m0, m2], dim=-1)).squeeze(-1)
        return {"start_logits": mask_logits(start.float(), c_mask),
                "end_logits": mask_logits(end.float(), c_mask),
                "attention": attn.float()}

    def analysis(self, data, cfg) -> dict:
        """Figure payload: the row-normalized similarity ``S̄`` of a few dev questions."""
        return attention_payload(self, data.splits["dev"])
