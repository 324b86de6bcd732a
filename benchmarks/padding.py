"""What ``pad_multiple`` costs and buys on SQuAD v1.1 train: one epoch's batches, as training
draws them (length-bucketed and shuffled, the full profile's batch size and length limits).

    python benchmarks/padding.py                        # BiDAF's and QANet's batch sizes
    python benchmarks/padding.py --multiples 1,16,32

For each multiple, padding a batch's context and question lengths up to it (``pad_multiple``,
:func:`mrc_lib.data.dataset.pad_lengths`) gives:

* ``extra_context_positions``: the context positions of the epoch's batches (batch size times
  padded length, summed) over those without the rounding, less 1: the extra work of layers that
  run over every context position;
* ``shapes``: the distinct (context, question) batch lengths in the epoch: one CUDA graph is
  recorded for each under ``compile_mode: reduce-overhead``;
* ``real_token_fraction``: real context tokens over the context positions.

Multi-passage batches (DynSAN) also round each passage's length; they are not measured here.
Needs the prepared SQuAD data (``MRC_DATA_DIR`` or the cache). Results go to
``benchmarks/results/padding_squad.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.config import resolve_config  # noqa: E402
from mrc_lib.utils import atomic_write_json  # noqa: E402


def rounded(n: np.ndarray, multiple: int) -> np.ndarray:
    return -(-n // multiple) * multiple


def padding_costs(batches: list[np.ndarray], c_len: np.ndarray, q_len: np.ndarray,
                  multiples: list[int], *, context_limit: int, question_limit: int) -> dict:
    """The costs above, for one epoch's ``batches`` (positions) of examples with these context
    and question lengths (each cut at its limit, as the batches are)."""
    c_len, q_len = np.minimum(c_len, context_limit), np.minimum(q_len, question_limit)
    longest = np.array([[c_len[b].max(), q_len[b].max()] for b in batches])
    sizes = np.array([len(b) for b in batches])
    base = (sizes * longest[:, 0]).sum()
    out = {}
    for m in multiples:
        lc, lq = rounded(longest[:, 0], m), rounded(longest[:, 1], m)
        positions = (sizes * lc).sum()
        out[str(m)] = {"extra_context_positions": round(float(positions / base - 1), 4),
                       "shapes": len(set(zip(lc.tolist(), lq.tolist()))),
                       "real_token_fraction": round(float(c_len.sum() / positions), 4)}
    return {"batches": len(batches), "batch_size": int(sizes.max()), "multiples": out}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="bidaf,qanet", help="whose batch size and limits")
    p.add_argument("--multiples", default="1,8,16,32,64")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "padding_squad.json"))
    args = p.parse_args(argv)
    from mrc_lib.train import load_data

    multiples = [int(m) for m in args.multiples.split(",")]
    results = {"dataset": "squad-v1.1 train, one epoch (seed 0)", "models": {}}
    for name in args.models.split(","):
        cfg = resolve_config(name, profile="full")
        train = load_data(cfg).splits["train"]
        batches = train.batch_order(cfg.batch_size, shuffle=True, seed=cfg.seed)  # epoch 1's
        results["models"][name] = padding_costs(
            batches, train.context_lengths(), train.question_lengths(), multiples,
            context_limit=cfg.context_limit, question_limit=cfg.question_limit)
        print(name, results["models"][name], flush=True)
    atomic_write_json(Path(args.out), results)
    print(args.out)
    return results


if __name__ == "__main__":
    main()
