"""What every chapter notebook does around its content: resolve the papermill parameters, label
smoke-scale runs, and write ``results.json`` (tables with the paper's numbers beside ours,
figures) in the format :mod:`mrc_lib.reproduce` publishes."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mrc_lib.reproduce import resolve_profile, validate_results
from mrc_lib.train import device_name, resolve_device
from mrc_lib.utils import atomic_write_json

SMOKE_BANNER = ("**Smoke-scale (CPU) run.** Small real subset, shrunk models, a few minutes on a "
                "CPU: the numbers below check that everything runs end to end and are **not** "
                "comparable to the paper's. The full profile runs on a GPU "
                "(`python -m mrc_lib reproduce NAME --profile full`).")


@dataclass
class Run:
    """One execution of a chapter notebook."""

    profile: str
    seed: int
    device: torch.device
    out_dir: Path
    tables: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    data_digests: dict = field(default_factory=dict)  # file name -> sha256 of the data used

    @property
    def smoke(self) -> bool:
        return self.profile == "smoke"

    @property
    def tag(self) -> str:
        """A label for figure titles: smoke-scale results say so wherever they appear."""
        return " (smoke-scale run)" if self.smoke else ""

    def table(self, key: str, *, caption: str, columns: list[str], rows: list[list],
              paper_columns: list[str], dataset: str, paper_source: str | None = None):
        """Record a table; ``paper_columns`` name the columns holding the paper's numbers."""
        self.tables[key] = {"caption": caption + self.tag, "columns": columns, "rows": rows,
                            "paper_columns": paper_columns, "dataset": dataset,
                            "profile": self.profile,
                            **({"paper_source": paper_source} if paper_source else {})}
        import pandas as pd

        return pd.DataFrame(rows, columns=columns)

    def figure(self, key: str, fig, *, dpi: int = 110) -> Path:
        """Save ``fig`` as ``key.png``; a smoke-scale figure is stamped as such in its corner."""
        if self.smoke:
            fig.text(0.995, 0.003, "smoke-scale run (CPU): not comparable to the paper",
                     ha="right", va="bottom", fontsize=8, color="firebrick")
        path = self.out_dir / f"{key}.png"
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        self.figures[key] = path.name
        return path

    def train(self, name: str, cfg, data=None) -> dict:
        """Train run ``name`` of this chapter per ``cfg`` (resuming its checkpoint if one is
        there) and return its metrics, with the reader's ``analysis`` payload when it has one.
        Chapters train through this one call, so that runs are recorded in one place."""
        from mrc_lib.train import train

        out = self.out_dir / name
        return train(cfg, out, resume=(out / "checkpoint.pt").exists(), data=data)

    def save(self) -> Path:
        results = {"tables": self.tables, "figures": self.figures, "notes": self.notes,
                   "data_digests": self.data_digests, "device": device_name(self.device)}
        path = self.out_dir / "results.json"
        validate_results(path, results, self.profile)
        atomic_write_json(path, results)
        return path


def start(profile: str = "auto", seed: int = 0, data_dir: str = "", device: str = "auto",
          out_dir: str = "runs/notebook") -> Run:
    """Resolve parameters (``auto`` profile: full on CUDA, smoke otherwise), seed everything,
    point the data pipeline at ``data_dir`` and show the smoke banner when it applies."""
    if data_dir:
        os.environ["MRC_DATA_DIR"] = str(Path(data_dir).resolve())
    run = Run(resolve_profile(profile), seed, resolve_device(device), Path(out_dir))
    run.out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if run.smoke:
        from IPython.display import Markdown, display

        display(Markdown(SMOKE_BANNER))
    return run
