"""The comparison chapter: records read tolerantly, verdicts computed from them."""

import json

from mrc_lib.comparison import (
    NOT_MEASURED,
    NOT_REPRODUCED,
    REPRODUCED,
    Side,
    claims,
    load_records,
    score,
    verdict_all_better,
    verdict_better,
    verdict_faster_similar,
)


def record(model, f1, dataset="squad-v1.1", profile="full", eps=100.0, run="ch/run",
           data_options=None, **hparams):
    """A record scoring ``f1``; a SQuAD 2.0 one scores it on the eval half (chapter 04's
    analysis payload), and 0 on its ``dev``, the adapt half that it also trained on."""
    chapter, name = run.split("/", 1)
    out = {"chapter": chapter, "run": name,
           "config": {"model": model, "dataset": dataset, "profile": profile,
                      "hparams": hparams, "data_options": data_options or {}},
           "dev": {"f1": f1, "exact_match": f1 - 8}, "examples_per_second": eps,
           "complete": True}
    if dataset == "squad-v2.0":
        out["analysis"] = {"scores": {"threshold": 0.3, "adapt": {"f1": 0.0},
                                      "eval": {"f1": f1, "exact": f1 - 8}}}
        out["dev"] = {"f1": 0.0, "exact": 0.0}
    return out


def test_verdicts():
    assert verdict_better(81.4, 79.6) == REPRODUCED
    assert verdict_better(79.0, 79.6) == NOT_REPRODUCED
    assert verdict_better(None, 79.6) == verdict_better(81.0, None) == NOT_MEASURED
    assert verdict_all_better([(70.8, 68.7), (69.1, 67.2)]) == REPRODUCED
    assert verdict_all_better([(70.8, 68.7), (66.0, 67.2)]) == NOT_REPRODUCED
    assert verdict_all_better([(66.0, 68.7), (None, 67.2)]) == NOT_MEASURED
    assert verdict_faster_similar(4.3, 3.5, 79.5, 80.1) == REPRODUCED
    assert verdict_faster_similar(3.0, 3.5, 79.5, 80.1) == NOT_REPRODUCED
    assert verdict_faster_similar(4.3, 3.5, 78.0, 80.1) == NOT_REPRODUCED
    assert verdict_faster_similar(4.3, None, 79.5, 80.1) == NOT_MEASURED


def test_sides_select_full_complete_runs_of_their_reader():
    runs = [record("rnet", 79.0), record("rnet", 81.0), record("rnet", 99.0, profile="smoke"),
            {**record("rnet", 99.0), "complete": False}, record("bidafpp", 70.0, "squad-v2.0"),
            record("bidafpp", 72.0, "squad-v2.0", aba=True)]
    assert score(runs, Side("rnet")) == 80.0  # mean over seeds; smoke and partial runs ignored
    assert score(runs, Side("decaprop")) is None
    assert score(runs, Side("bidafpp", "squad-v2.0", {"aba": False})) == 70.0
    assert score(runs, Side("bidafpp", "squad-v2.0", {"aba": True})) == 72.0


def test_claims_without_records_are_not_yet_measured():
    rows = claims([])
    assert rows and all(r[-1] == NOT_MEASURED for r in rows)
    assert all("not measured" in r[2] for r in rows)
    rows = claims([record("decaprop", 81.0, run="03_decaprop/decaprop"),
                   record("rnet", 79.0, run="03_decaprop/rnet"),
                   record("rnet", 90.0, run="03_decaprop/rnet_plus_something")])
    assert rows[0][-1] == REPRODUCED and "DecaProp 81.00, R-NET 79.00" in rows[0][2]


def test_load_records_tolerates_absence_and_junk(tmp_path):
    assert load_records(tmp_path / "nowhere") == []
    (tmp_path / "ch").mkdir()
    (tmp_path / "ch" / "a.json").write_text(json.dumps(record("rnet", 80.0)))
    (tmp_path / "ch" / "b.json").write_text("{not json")
    (tmp_path / "ch" / "c.json").write_text("[]")
    assert [r["config"]["model"] for r in load_records(tmp_path)] == ["rnet"]


def test_load_records_finds_runs_named_with_a_folder(tmp_path):
    """PhaseCond's seeds (``phasecond/seed0``) and the EA Reader's variants (``NE/...``) are
    records one folder deeper than the chapter's."""
    (tmp_path / "06_phasecond" / "phasecond").mkdir(parents=True)
    (tmp_path / "06_phasecond" / "phasecond" / "seed0.json").write_text(
        json.dumps(record("phasecond", 80.0, run="06_phasecond/phasecond/seed0")))
    (tmp_path / "01_bidaf_qanet").mkdir()
    (tmp_path / "01_bidaf_qanet" / "bidaf.json").write_text(
        json.dumps(record("bidaf", 75.0, run="01_bidaf_qanet/bidaf")))
    found = load_records(tmp_path)
    assert sorted(r["config"]["model"] for r in found) == ["bidaf", "phasecond"]
    assert score(found, Side("phasecond", runs="06_phasecond/phasecond/seed{seed}")) == 80.0


def test_readme_lists_every_registered_reader():
    from mrc_lib.book import ROOT
    from mrc_lib.models import MODELS, _import_readers

    _import_readers()
    readme = (ROOT / "README.md").read_text()
    library = [name for name, cls in MODELS.items() if cls.__module__.startswith("mrc_lib.")]
    assert [name for name in library if f"| `{name}` |" not in readme] == []
    assert "one model file, one profile and one notebook" in readme


def test_a_side_counts_only_its_table_rows_runs():
    """DynSAN's Table 4 side is the single-passage K = 32 run: not a multi-passage run, an
    ablation or a K sweep of the same reader, even one whose hparams match."""
    side = Side.headline("dynsan")
    mp = {"passages": 4, "token_cap": 5000}
    runs = [record("dynsan", 79.0, run="02_dynsan/table4_dynsa", block="dynsa", top_k=32),
            record("dynsan", 70.0, run="02_dynsan/table3_0", data_options=mp, block="dynsa"),
            record("dynsan", 71.0, run="02_dynsan/figure5a_k32", data_options=mp, top_k=32),
            record("dynsan", 80.0, run="02_dynsan/table4_fullsan", block="fullsan")]
    assert score(runs, side) == 79.0
    seeds = Side("phasecond", runs="06_phasecond/phasecond/seed{seed}")
    runs = [record("phasecond", f1, run=f"06_phasecond/{name}") for f1, name in
            [(80.0, "phasecond/seed0"), (81.0, "phasecond/seed12"),
             (99.0, "phasecond_qpattplus/seed0"), (98.0, "phasecond/seedx")]]
    assert score(runs, seeds) == 80.5
    # a reader without a headline run: its profile's config, on its profile's data
    assert Side.headline("san").runs is None


def test_squad2_sides_score_the_eval_half_not_the_adapt_half():
    """Offline, a SQuAD 2.0 run's dev is the adapt half, which it trained on: the ABA claim
    reads the eval half at the tuned threshold, as chapter 04 reports."""
    runs = [record("bidafpp", 68.0, "squad-v2.0", run="04_aba/bidafplusplus_seed0"),
            record("bidafpp", 70.0, "squad-v2.0", run="04_aba/bidafplusplus_plus_aba_seed0",
                   aba=True)]
    base = Side("bidafpp", "squad-v2.0", runs="04_aba/bidafplusplus_seed{seed}")
    assert score(runs, base) == 68.0
    row = claims(runs)[2]
    assert "BiDAF++ 68.00 → 70.00" in row[2] and "eval half" in row[0]
    no_payload = {**runs[0], "analysis": None}
    assert score([no_payload], Side("bidafpp", "squad-v2.0")) is None
