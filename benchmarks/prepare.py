"""Benchmark: `prepare` of SQuAD v1.1 train+dev with GloVe 6B 50d, cold and warm.

Cold = into an empty cache folder (read, validate, tokenize, align, vocab, encode, write);
warm = the same call again (digests + cache hit) and a full `load_prepared`.
Writes ``benchmarks/results/prepare.json``. Needs MRC_DATA_DIR (or internet).
"""

import json
import os
import platform
import tempfile
import time
from pathlib import Path

from mrc_lib.data import load_prepared, prepare
from mrc_lib.utils import atomic_write_json


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    with tempfile.TemporaryDirectory() as cache:
        cold = prepare("squad-v1.1", cache_dir=cache)
        t = time.perf_counter()
        warm = prepare("squad-v1.1", cache_dir=cache)
        warm_s = time.perf_counter() - t
        t = time.perf_counter()
        data = load_prepared("squad-v1.1", cache_dir=cache)
        load_s = time.perf_counter() - t
    out = {
        "benchmark": "prepare squad-v1.1 train+dev, glove.6B.50d, blank:en tokenizer",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "cold_seconds": cold["seconds"], "cold_build_seconds": cold["build_seconds"],
        "warm_prepare_seconds": round(warm_s, 2), "warm_load_prepared_seconds": round(load_s, 2),
        "built": [cold["built"], warm["built"]], "cache_bytes": cold["cache_bytes"],
        "cache_mb": round(cold["cache_bytes"] / 2**20, 1),
        "questions": {s: len(v) for s, v in data.splits.items()},
        "alignment": {s: m["alignment"] for s, m in cold["splits"].items()},
        "targets": {"cold_seconds": 60, "warm_seconds": 2, "cache_mb": 40},
    }
    atomic_write_json(Path(__file__).parent / "results" / "prepare.json", out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
