"""The input layer shared by the readers: word and character embeddings through a highway.

BiDAF (Seo et al., 2017, Sec. 2, layers 1-2) and QANet (Yu et al., 2018, Sec. 2.2, layer 1)
embed a token the same way: a pre-trained GloVe vector, a character-level CNN max-pooled over
the word, and a two-layer highway network over their concatenation. Optionally (``use_features``)
the context side also receives the hand-made token features of the data pipeline (exact match,
normalized term frequency, as in DrQA); the question side then receives zeros in their place, so
context and question keep one embedding size and can share the layers above.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.nn import CharCNN, Highway, WordEmbedding


class InputEmbedding(nn.Module):
    """``e = Highway([GloVe(w); CharCNN(chars); f])`` for each token, ``[B, L, out_dim]``.

    Args:
        vocab: supplies ``word_vectors`` (``[V, d_word]``), ``n_trainable``, ``n_chars`` and
            ``n_feats``.
        char_dim: size of a character embedding.
        char_channels: number of CNN filters, i.e. the size of the character-level word vector.
        char_kernel: CNN filter width, in characters.
        highway_layers: depth of the highway network.
        word_dropout: dropout on the word vectors.
        char_dropout: dropout on the character embeddings, inside the CNN.
        highway_dropout: dropout inside the highway network.
        use_features: append ``vocab.n_feats`` token features to each context token.
        oov_rows: a trainable row per word without a GloVe vector (else one shared UNK row).
    """

    def __init__(self, vocab, *, char_dim: int, char_channels: int, char_kernel: int,
                 highway_layers: int = 2, word_dropout: float = 0.0, char_dropout: float = 0.0,
                 highway_dropout: float = 0.0, use_features: bool = False,
                 oov_rows: bool = True):
        super().__init__()
        vectors = torch.as_tensor(vocab.word_vectors, dtype=torch.float32)
        self.word = WordEmbedding(vectors, vocab.n_trainable, oov_rows)
        self.char = CharCNN(vocab.n_chars, char_dim, char_channels, char_kernel, char_dropout)
        self.word_dropout = nn.Dropout(word_dropout)
        self.n_feats = vocab.n_feats if use_features else 0
        self.out_dim = vectors.shape[1] + char_channels + self.n_feats
        self.highway = Highway(self.out_dim, highway_layers, highway_dropout)

    def forward(self, words: Tensor, chars: Tensor, feats: Tensor | None = None) -> Tensor:
        """Embed ``words`` ``[B, L]`` and ``chars`` ``[B, L, W]``; ``feats`` ``[B, L, F]`` are
        the context features (``None`` for the question, or when features are off)."""
        parts = [self.word_dropout(self.word(words)), self.char(chars)]
        if self.n_feats:
            if feats is None:
                feats = parts[0].new_zeros(*words.shape, self.n_feats)
            parts.append(feats.to(parts[0].dtype))
        return self.highway(torch.cat(parts, dim=-1))
