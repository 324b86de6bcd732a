"""The data pipeline: sources and downloads, SQuAD reading, tokenization, cache, batching.

Names are imported lazily, so ``python -m mrc_lib download`` or ``validate`` do not pay for
importing torch and spaCy.
"""

import importlib

_EXPORTS = {
    "PreparedData": "cache", "load_prepared": "cache", "prepare": "cache",
    "Split": "dataset", "encode_squad": "dataset", "encode_texts": "dataset",
    "read_squad": "squad", "Vocab": "vocab",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mrc_lib.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'mrc_lib.data' has no attribute {name!r}")
