"""Recurrent encoders over padded batches, with variational (locked) or standard dropout."""

import contextlib

import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.nn.attention import zero_padding

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

    Each layer is its own single-layer ``nn.LSTM``/``nn.GRU``, so that dropout can act on the
    input of every layer and the layer outputs can be concatenated (``concat_layers``, as in
    DrQA). Padding never reaches a real position, and outputs at padding positions are exactly
    0 (see :meth:`encode`). ``locked``: one dropout mask per sequence (variational dropout,
    Gal & Ghahramani 2016); otherwise a new mask at every position (standard dropout,
    Srivastava et al. 2014). The layers compute in full precision, also under autocast
    (:func:`full_precision`).
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
        locked: bool = True,
    ) -> None:
        super().__init__()
        if cell not in CELLS:
            raise UserError(f"unknown RNN cell {cell!r}; choose one of {', '.join(CELLS)}")
        directions = 2 if bidirectional else 1
        self.hidden_size, self.bidirectional = hidden_size, bidirectional
        self.concat_layers = concat_layers
        self.dropout = LockedDropout(dropout) if locked else nn.Dropout(dropout)
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

        The forward direction reads each sequence from its first token, so its padding comes
        after every real token. The backward direction reads a copy of the batch in which each
        sequence of ``n`` tokens is rotated by ``n`` (``z_t = x_(t+n) mod L``), so that it ends
        at the last position and its padding, read last in reverse, again comes after every
        real token; the layer reads the batch and the copy as one batch of ``2B`` (one cuDNN
        call, no packing, no host synchronisation) and the copy's backward outputs are rotated
        back. The final states are the forward output at the last real token and the backward
        output at the first. A sequence without any real token gets zero outputs and zero
        final states.
        """
        B, L, _ = x.shape
        lengths = mask.sum(dim=1, keepdim=True)  # [B, 1]
        steps = torch.arange(L, device=x.device)
        to_end, back = (steps + lengths) % L, (steps - lengths) % L  # [B, L] each
        h = self.hidden_size
        outputs = []
        for rnn in self.layers:
            x = self.dropout(x)
            if self.bidirectional:
                out = full_precision(rnn, torch.cat([x, take(x, to_end)]))  # [2B, L, 2h]
                x = torch.cat([out[:B, :, :h], take(out[B:, :, h:], back)], dim=-1)
            else:
                x = full_precision(rnn, x)
            outputs.append(x)
        out = torch.cat(outputs, dim=-1) if self.concat_layers else outputs[-1]
        last = take(outputs[-1], (lengths - 1).clamp(min=0))[:, 0]  # [B, (2)h]
        final = torch.cat([last[:, :h], outputs[-1][:, 0, h:]], -1) if self.bidirectional else last
        return (zero_padding(out, mask),
                final.masked_fill(lengths == 0, 0.0))


def full_precision(rnn: nn.RNNBase, x: Tensor) -> Tensor:
    """The outputs of layer ``rnn`` for ``x``, in full precision also under autocast (TF32
    matrix products on CUDA). torch's autocast runs a cuDNN RNN in float16 whatever its dtype
    (``_cudnn_rnn_cast_reflatten``, ``aten/src/ATen/cudnn/AutocastRNN.cpp``): a bf16 reader's
    RNNs computed in fp16, without the loss scaling fp16 needs, as PhaseCond's outputs showed
    on an H100. The reader's other operations keep their autocast precision. (A device without
    autocast, such as ``meta``, where ``benchmarks/cudagraph_check.py`` traces, has none to
    turn off.)"""
    device = x.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) \
            else contextlib.nullcontext():
        return rnn(x.float())[0]


def has_rnn_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds RNN layers (``nn.LSTM``/``nn.GRU``, as :class:`RNN` does): those
    :func:`full_precision` runs outside autocast."""
    return any(isinstance(m, nn.RNNBase) for m in model.modules())


def take(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, t]]`` for ``x`` ``[B, L, d]`` and ``index`` ``[B, T]``: ``[B, T, d]``."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
