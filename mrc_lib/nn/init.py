"""TensorFlow 1's default initialization, for probing readers whose papers' code ran on it.

No paper in the book states its initialization. PyTorch's defaults and TensorFlow 1's differ:

* a weight matrix or filter: PyTorch draws ``U(±1/sqrt(fan_in))``; ``tf.get_variable`` draws
  Glorot-uniform, ``U(±sqrt(6 / (fan_in + fan_out)))``;
* a bias: PyTorch ``U(±1/sqrt(fan_in))``; TensorFlow zero;
* an embedding table: PyTorch ``N(0, 1)``; ``tf.get_variable`` Glorot-uniform;
* an LSTM: PyTorch ``U(±1/sqrt(h))`` for every matrix and bias; TensorFlow's ``BasicLSTMCell``
  keeps one kernel over ``[x; h]`` for its four gates (Glorot-uniform over that whole
  ``[input + h, 4h]`` matrix), zero biases, and adds ``forget_bias = 1`` to the forget gate.

:func:`tensorflow_init_` re-draws a module's parameters the second way. Fixed word vectors and
the learned rows of :class:`~mrc_lib.nn.WordEmbedding` (drawn at GloVe's scale) are left alone.
"""

import math

import torch
from torch import nn

from mrc_lib.errors import UserError
from mrc_lib.nn.attention import TrilinearSimilarity


def glorot_(weight: torch.Tensor, fan_in: int, fan_out: int) -> None:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        weight.uniform_(-bound, bound)


def tensorflow_init_(module: nn.Module) -> nn.Module:
    """Re-draw ``module``'s Linear, Conv1d, Embedding, LSTM and trilinear-similarity parameters
    as TensorFlow 1's defaults would (see the module docstring); returns ``module``."""
    for m in module.modules():
        if isinstance(m, nn.GRU):
            raise UserError("tensorflow_init_ covers LSTMs only (TensorFlow's GRUCell starts its "
                            "gate biases at 1, which is not implemented)")
        if isinstance(m, (nn.Linear, nn.Conv1d)):
            nn.init.xavier_uniform_(m.weight)  # same fans as TensorFlow's [in, out] layouts
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.xavier_uniform_(m.weight)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, TrilinearSimilarity):  # a linear map of [c; q; c ⊙ q] to one score
            glorot_(m.w, m.w.numel(), 1)
        elif isinstance(m, nn.LSTM):
            h = m.hidden_size
            for name, p in m.named_parameters():
                if name.startswith("weight_ih"):  # [4h, input]: with weight_hh, one kernel
                    glorot_(p, p.shape[1] + h, 4 * h)
                elif name.startswith("weight_hh"):
                    glorot_(p, m.get_parameter(name.replace("hh", "ih")).shape[1] + h, 4 * h)
                elif name.startswith("bias_ih"):  # gates i, f, g, o: forget_bias = 1
                    with torch.no_grad():
                        p.zero_()
                        p[h:2 * h] = 1.0
                else:  # bias_hh: TensorFlow's cell has one bias
                    nn.init.zeros_(p)
    return module
