"""QANet's convolution + self-attention encoder block and its parts (Yu et al. 2018)."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.nn.attention import MultiHeadSelfAttention, zero_padding


class DepthwiseSeparableConv(nn.Module):
    """Depthwise separable convolution (Chollet 2017): a per-channel convolution over time
    ("same" padding) followed by a 1×1 convolution across channels.

    Input ``[B, L, in_ch]``, output ``[B, L, out_ch]``, optionally through a ReLU; padding
    positions are zeroed before the convolution (so they never leak into real positions) and
    in the output.

    Both convolutions go through :func:`conv_over_time`.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, relu: bool = False) -> None:
        super().__init__()
        self.depthwise = nn.Conv1d(in_ch, in_ch, kernel_size, padding="same", groups=in_ch)
        self.pointwise = nn.Conv1d(in_ch, out_ch, 1)
        self.activation = nn.ReLU() if relu else nn.Identity()

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None:
            x = zero_padding(x, mask)
        y = self.activation(conv_over_time(self.pointwise, conv_over_time(self.depthwise, x)))
        return y if mask is None else zero_padding(y, mask)


def conv_over_time(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """``conv`` (stride 1, "same" padding, full or depthwise) over ``x`` ``[N, T, C]`` with time
    before channels: ``[N, T, out]``.

    Eager steps call the module, one kernel. Under ``torch.compile`` it is :func:`window_conv`,
    which the compiler turns into one fused kernel (depthwise) or one matrix product (full) for
    every sequence length, where its convolution lowering fixes the length and compiles again
    for each new one.
    """
    if torch.compiler.is_compiling():
        return window_conv(x, conv.weight, conv.bias, conv.groups)
    return conv(x.transpose(1, 2)).transpose(1, 2)


def window_conv(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int = 1) -> Tensor:
    """The convolution with "same" padding of ``x`` ``[N, T, C]`` by ``weight`` ``[O, C/groups,
    k]`` (``groups`` 1 or ``C``), from each position's window of ``k`` inputs, zero outside the
    sequence (``(k − 1) // 2`` positions before, ``k // 2`` after, as ``nn.Conv1d`` pads):
    ``y_to = Σ_c Σ_j w_ocj x_(t+j−(k−1)//2),c + b_o``, or for a depthwise weight
    ``y_tc = Σ_j w_cj x_(t+j−(k−1)//2),c + b_c``."""
    k = weight.shape[-1]
    windows = F.pad(x, (0, 0, (k - 1) // 2, k // 2)).unfold(1, k, 1)  # [N, T, C, k]
    if groups == 1:
        return F.linear(windows.flatten(2), weight.flatten(1), bias)
    if groups != x.shape[-1] or weight.shape[1] != 1:
        raise ValueError(f"window_conv: groups={groups} is neither 1 nor the {x.shape[-1]} "
                         "channels")
    y = (windows * weight.squeeze(1)).sum(-1)
    return y if bias is None else y + bias


def sinusoidal_positions(
    length: int, dim: int, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)`` (Vaswani et al.
    2017 Sec. 3.5): ``[length, dim]``.
    """
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    angles = pos * freq  # [length, ceil(dim / 2)]
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[:, :dim]
    return pe.to(dtype) if dtype is not None else pe


# One table per (width, device, dtype), grown to the longest sequence seen: eager steps slice it
# instead of recomputing the encodings in every encoder block.
_POSITION_TABLES: dict[tuple, Tensor] = {}


def add_positions(x: Tensor) -> Tensor:
    """Add sinusoidal position encodings to ``x`` of shape ``[B, L, d]``."""
    length, dim = x.shape[1], x.shape[2]
    if torch.compiler.is_compiling():  # in a compiled graph the encodings fuse into the add
        return x + sinusoidal_positions(length, dim, x.device, x.dtype)
    key = (dim, x.device, x.dtype)
    table = _POSITION_TABLES.get(key)
    if table is None or len(table) < length:
        with torch.inference_mode(False):  # usable by training even if first built under it
            table = sinusoidal_positions(max(length, 512), dim, x.device, x.dtype)
        _POSITION_TABLES[key] = table
    return x + table[:length]


class FeedForward(nn.Module):
    """Position-wise feed-forward layer ``W2 relu(W1 x)`` (Vaswani et al. 2017 Eq. 2).

    ``forward`` takes (and ignores) the mask, like the other sublayers of :class:`EncoderBlock`.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.net(x)


class EncoderBlock(nn.Module):
    """QANet encoder block (Yu et al. 2018 Sec. 2.2, Fig. 1 right).

    ``x + positions``, then sublayers ``[convolution × num_convs, self-attention, feed-forward]``,
    each wrapped as ``x + dropout(f(layernorm(x)))``. The convolutions are depthwise separable
    with a ReLU, as in the authors' code.

    Stochastic depth (Huang et al. 2016): sublayer ``l`` of the ``L`` sublayers in the whole
    stack survives training with probability ``p_l = 1 − l/L · layer_dropout`` and is rescaled
    by ``1/p_l`` when kept, so evaluation uses every sublayer unscaled. ``layer_index``
    (1-based) and ``total_layers`` place this block in its stack of blocks; sublayers are counted
    across the stack, as in the authors' code. The draw is a gate ``b_l ~ Bernoulli(p_l)`` on
    the tensor's device, ``x + b_l/p_l · dropout(f(layernorm(x)))``, not a Python branch: the
    step never waits for a host-side draw and ``torch.compile`` captures the block as one graph.
    A dropped sublayer is still computed (about 5% more work at ``layer_dropout = 0.1``) and its
    parameters receive zero gradients, as TensorFlow's ``tf.cond`` gives the branch not taken,
    so Adam still moves them by their momentum at that step.
    """

    def __init__(
        self,
        dim: int,
        num_convs: int,
        kernel_size: int,
        heads: int,
        dropout: float = 0.1,
        layer_dropout: float = 0.0,
        layer_index: int = 1,
        total_layers: int = 1,
    ) -> None:
        super().__init__()
        per_block = num_convs + 2
        first = (layer_index - 1) * per_block + 1
        total = total_layers * per_block
        self.drop_probs = [layer_dropout * l / total for l in range(first, first + per_block)]
        survival = torch.tensor([1.0 - p for p in self.drop_probs])
        self.register_buffer("survival", survival, persistent=False)  # p_l
        self.register_buffer("rescale", torch.where(survival > 0, 1 / survival, 0.0),
                             persistent=False)  # 1/p_l (0 for a sublayer that never survives)
        self.stochastic_depth = layer_dropout > 0
        self.sublayers = nn.ModuleList(
            [DepthwiseSeparableConv(dim, dim, kernel_size, relu=True) for _ in range(num_convs)]
            + [MultiHeadSelfAttention(dim, heads, dropout), FeedForward(dim)]
        )
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in self.sublayers)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """``[B, L, dim]`` to ``[B, L, dim]``; zero at padding positions."""
        x = add_positions(x)
        if self.training and self.stochastic_depth:
            gates = torch.bernoulli(self.survival) * self.rescale  # b_l / p_l, one per sublayer
        for l, (f, norm) in enumerate(zip(self.sublayers, self.norms)):
            y = f(norm(x), mask)
            if not self.training:
                x = x + y
            elif self.stochastic_depth:
                x = torch.addcmul(x, gates[l], self.dropout(y))
            else:
                x = x + self.dropout(y)
        return zero_padding(x, mask)
