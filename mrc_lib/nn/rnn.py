"""Recurrent encoders over padded batches, with variational (locked) dropout."""

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mrc_lib.errors import UserError

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU}


class LockedDropout(nn.Module):
    """Variational dropout (Gal & Ghahramani 2016): one mask per sequence, shared over time.

    Input ``[B, L, d]``; the mask has shape ``[B, 1, d]``.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], 1, x.shape[2]).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class RNN(nn.Module):
    """Stacked (bi)LSTM/GRU over a padded batch.

    Each layer is its own single-layer ``nn.LSTM``/``nn.GRU``, so that locked dropout can act
    on the input of every layer and the layer outputs can be concatenated (``concat_layers``,
    as in DrQA). Sequences are packed by their lengths, so padding never reaches the backward
    direction; outputs at padding positions are exactly 0.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bidirectional: bool = True,
        cell: str = "lstm",
        dropout: float = 0.0,
        concat_layers: bool = False,
    ) -> None:
        super().__init__()
        if cell not in CELLS:
            raise UserError(f"unknown RNN cell {cell!r}; choose one of {', '.join(CELLS)}")
        directions = 2 if bidirectional else 1
        self.concat_layers = concat_layers
        self.dropout = LockedDropout(dropout)
        self.layers = nn.ModuleList(
            CELLS[cell](
                input_size if i == 0 else directions * hidden_size,
                hidden_size,
                batch_first=True,
                bidirectional=bidirectional,
            )
            for i in range(num_layers)
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """``[B, L, d]`` to ``[B, L, (2)h]`` (``[B, L, num_layers·(2)h]`` with concat_layers)."""
        return self.encode(x, mask)[0]

    def final_states(self, x: Tensor, mask: Tensor) -> Tensor:
        """Last hidden state of the top layer per direction, concatenated: ``[B, (2)h]``."""
        return self.encode(x, mask)[1]

    def encode(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Outputs (as :meth:`forward`) and final states (as :meth:`final_states`) in one pass.

        For the backward direction the final state is the one after reading the first token.
        A sequence without any real token gets zero outputs and zero final states.
        """
        B, L, _ = x.shape
        lengths = mask.sum(dim=1)
        # pack_padded_sequence rejects empty sequences: run them over one (padding) step and
        # zero their results afterwards.
        packed_lengths = lengths.clamp(min=1).cpu()
        outputs = []
        for rnn in self.layers:
            packed = pack_padded_sequence(
                self.dropout(x), packed_lengths, batch_first=True, enforce_sorted=False
            )
            out, h_n = rnn(packed)
            x, _ = pad_packed_sequence(out, batch_first=True, total_length=L)
            outputs.append(x)
        out = torch.cat(outputs, dim=-1) if self.concat_layers else outputs[-1]
        h_n = h_n[0] if isinstance(h_n, tuple) else h_n  # LSTM returns (h_n, c_n)
        final = h_n.transpose(0, 1).reshape(B, -1)  # [directions, B, h] -> [B, directions·h]
        empty = (lengths == 0).unsqueeze(-1)
        return out.masked_fill(~mask.unsqueeze(-1), 0.0), final.masked_fill(empty, 0.0)
