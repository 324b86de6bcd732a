"""Neural building blocks shared by every reader in :mod:`mrc_lib.models`.

All tensors are batch-first; masks are ``bool`` with ``True`` marking a real token.
"""

from mrc_lib.nn.attention import (
    AdditiveSimilarity,
    BiDAFAttention,
    BilinearSimilarity,
    CoAttention,
    DotSimilarity,
    MultiHeadSelfAttention,
    ScaledDotSimilarity,
    TrilinearSimilarity,
    build_similarity,
    c2q_attention,
    context_to_query,
    mask_logits,
    masked_softmax,
    query_to_context,
    query_to_context_dcn,
    zero_padding,
)
from mrc_lib.nn.conv import (
    DepthwiseSeparableConv,
    EncoderBlock,
    FeedForward,
    add_positions,
    conv_over_time,
    sinusoidal_positions,
    window_conv,
)
from mrc_lib.nn.embedding import CharCNN, Highway, WordEmbedding
from mrc_lib.nn.rnn import RNN, LockedDropout
from mrc_lib.nn.span import decode_span, span_loss

__all__ = [
    "RNN",
    "AdditiveSimilarity",
    "BiDAFAttention",
    "BilinearSimilarity",
    "CharCNN",
    "CoAttention",
    "DepthwiseSeparableConv",
    "DotSimilarity",
    "EncoderBlock",
    "FeedForward",
    "Highway",
    "LockedDropout",
    "MultiHeadSelfAttention",
    "ScaledDotSimilarity",
    "TrilinearSimilarity",
    "WordEmbedding",
    "add_positions",
    "conv_over_time",
    "build_similarity",
    "c2q_attention",
    "context_to_query",
    "decode_span",
    "mask_logits",
    "masked_softmax",
    "query_to_context",
    "query_to_context_dcn",
    "sinusoidal_positions",
    "window_conv",
    "span_loss",
    "zero_padding",
]
