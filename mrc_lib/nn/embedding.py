"""Word embeddings with a fixed pretrained part, the character CNN and the highway network."""

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.nn.attention import zero_padding
from mrc_lib.nn.conv import conv_over_time

PAD, UNK = 0, 1  # the vocabulary's ids (mrc_lib.data.vocab)


class WordEmbedding(nn.Module):
    """Word vectors whose first ``n_trainable`` rows are learned and the rest fixed.

    The vocabulary is ordered so that the rows to learn (PAD, UNK, words without a pretrained
    vector, ...) come first; rows ``[n_trainable, V)`` hold pretrained vectors (GloVe) in a
    buffer that never receives gradients. Row 0 is PAD: it starts at zero and gets no gradient.
    With ``oov_rows=False`` every word without a pretrained vector reads the one trainable UNK
    row (QANet Sec. 2.2: "All the out-of-vocabulary words are mapped to an <UNK> token").
    """

    def __init__(self, vectors: Tensor | np.ndarray, n_trainable: int,
                 oov_rows: bool = True) -> None:
        super().__init__()
        vectors = torch.as_tensor(vectors, dtype=torch.float32)
        if not 1 <= n_trainable <= len(vectors):
            raise ValueError(f"n_trainable must be in [1, {len(vectors)}], got {n_trainable}")
        self.n_trainable, self.oov_rows = n_trainable, oov_rows
        trainable = vectors[:n_trainable if oov_rows else min(n_trainable, UNK + 1)].clone()
        trainable[PAD] = 0.0
        self.trainable = nn.Parameter(trainable)
        self.register_buffer("fixed", vectors[n_trainable:].clone())

    @property
    def dim(self) -> int:
        return self.trainable.shape[1]

    def forward(self, ids: Tensor) -> Tensor:
        """``[B, L]`` ids to ``[B, L, d]`` vectors: one lookup per part, merged by ``where``."""
        learned = ids < self.n_trainable
        rows = ids if self.oov_rows else ids.clamp(max=UNK)  # OOV words read UNK's row
        # Ids of the other part point at PAD, which padding_idx keeps out of the gradient.
        e_learned = F.embedding(rows.where(learned, PAD), self.trainable, padding_idx=PAD)
        if len(self.fixed) == 0:
            return e_learned
        e_fixed = F.embedding((ids - self.n_trainable).clamp(min=0), self.fixed)
        return torch.where(learned.unsqueeze(-1), e_learned, e_fixed)


class CharCNN(nn.Module):
    """Character-level word vectors (Kim 2014; BiDAF Sec. 2.1, QANet Sec. 2.2).

    Embed the characters of each word, convolve over them, apply ReLU and max-pool over the
    real (non-padding) character positions. Input ``[B, L, W]`` character ids (0 = padding),
    output ``[B, L, out_dim]``; a word without characters gets a zero vector.
    """

    def __init__(
        self, n_chars: int, char_dim: int, out_dim: int, kernel_size: int = 5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(n_chars, char_dim, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)
        self.conv = nn.Conv1d(char_dim, out_dim, kernel_size, padding="same")

    def forward(self, chars: Tensor) -> Tensor:
        B, L, W = chars.shape
        chars = chars.view(B * L, W)
        x = self.dropout(self.embed(chars))  # [B*L, W, char_dim]
        h = torch.relu(conv_over_time(self.conv, x))  # [B*L, W, out_dim]
        # ReLU outputs are >= 0, so filling padding with 0 leaves the max over real chars intact.
        h = zero_padding(h, chars != PAD)
        return h.amax(dim=1).view(B, L, -1)


class Highway(nn.Module):
    """Highway network (Srivastava et al. 2015): ``y = g ⊙ relu(W_h x) + (1 − g) ⊙ x``,
    ``g = σ(W_g x)``, stacked ``num_layers`` times; dropout acts on the transform ``relu(W_h x)``.
    """

    def __init__(self, dim: int, num_layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.transforms = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))
        self.gates = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        for transform, gate in zip(self.transforms, self.gates):
            g = torch.sigmoid(gate(x))
            h = self.dropout(torch.relu(transform(x)))
            x = g * h + (1 - g) * x
        return x
