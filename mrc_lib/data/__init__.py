"""The data pipeline: sources and downloads, SQuAD reading, tokenization, cache, batching."""

from mrc_lib.data.cache import PreparedData, load_prepared, prepare
from mrc_lib.data.dataset import Split, encode_squad, encode_texts
from mrc_lib.data.squad import read_squad
from mrc_lib.data.vocab import Vocab

__all__ = ["PreparedData", "Split", "Vocab", "encode_squad", "encode_texts", "load_prepared",
           "prepare", "read_squad"]
