"""Command-line interface: ``python -m mrc_lib COMMAND``.

Each sub-command lives next to the code it drives; this module only parses arguments and turns
:class:`~mrc_lib.errors.UserError` into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from mrc_lib.errors import UserError


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def cmd_validate(args):
    from mrc_lib.data.squad import read_squad

    _print_json(read_squad(args.file).summary())


def cmd_evaluate(args):
    from mrc_lib.metrics import evaluate_files

    _print_json(evaluate_files(args.data_file, args.pred_file, args.na_prob_file,
                               args.na_prob_thresh))


def cmd_download(args):
    from mrc_lib.data.sources import download

    for path in download(args.name, cache_dir=args.cache_dir):
        print(path)


def cmd_prepare(args):
    from mrc_lib.data.cache import prepare

    _print_json(prepare(args.dataset, splits=args.splits.split(","), glove=args.glove,
                        pipeline=args.spacy_model, rebuild=args.rebuild))


def cmd_stats(args):
    from mrc_lib.data.cache import stats_table

    print(stats_table(args.dataset, glove=args.glove))


def cmd_train(args):
    from mrc_lib.train import train_cli

    _print_json(train_cli(args))


def cmd_predict(args):
    from mrc_lib.train import predict_cli

    _print_json(predict_cli(args))


def cmd_bench(args):
    from mrc_lib.bench import bench_cli

    _print_json(bench_cli(args))


def cmd_reproduce(args):
    from mrc_lib.reproduce import reproduce_cli

    reproduce_cli(args)


def build_parser() -> argparse.ArgumentParser:
    from mrc_lib.measurements import add_parser as add_measure_parser
    from mrc_lib.queue import add_parser as add_queue_parser

    p = argparse.ArgumentParser(prog="python -m mrc_lib", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("validate", help="check a SQuAD-format file and print its counts")
    s.add_argument("file")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("evaluate", help="official SQuAD v1.1/v2.0 evaluation")
    s.add_argument("data_file")
    s.add_argument("pred_file")
    s.add_argument("--na-prob-file", default=None)
    s.add_argument("--na-prob-thresh", type=float, default=1.0)
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser("download", help="download a named source into the cache")
    s.add_argument("name")
    s.add_argument("--cache-dir", default=None)
    s.set_defaults(func=cmd_download)

    s = sub.add_parser("prepare", help="tokenize, align and cache a dataset")
    s.add_argument("--dataset", default="squad-v1.1")
    s.add_argument("--splits", default="train,dev")
    s.add_argument("--glove", default="glove.6B.50d")
    s.add_argument("--spacy-model", default=None,
                   help="a full spaCy pipeline (adds POS/NER/lemma); default: blank English")
    s.add_argument("--rebuild", action="store_true")
    s.set_defaults(func=cmd_prepare)

    s = sub.add_parser("stats", help="counts and length percentiles of a dataset")
    s.add_argument("--dataset", default="squad-v1.1")
    s.add_argument("--glove", default="glove.6B.50d")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("train", help="train a reader")
    s.add_argument("--model", required=True)
    s.add_argument("--dataset", default="squad-v1.1")
    s.add_argument("--profile", default="smoke")
    s.add_argument("--out", required=True)
    s.add_argument("--config", default=None, help="a yaml/json file of overrides")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE")
    s.add_argument("--resume", action="store_true")
    s.add_argument("--record", default=None, metavar="PATH",
                   help="write the finished run's record here (e.g. book/runs/CHAPTER/RUN.json)")
    s.add_argument("--chapter", default="", help="the chapter named in the record")
    s.add_argument("--run", default=None, help="the run named in the record (default: --out's "
                                                "folder name)")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("predict", help="answer questions with a trained run")
    s.add_argument("--run", required=True)
    s.add_argument("--context")
    s.add_argument("--question")
    s.add_argument("--file")
    s.set_defaults(func=cmd_predict)

    s = sub.add_parser("bench", help="training/inference throughput and peak memory")
    s.add_argument("--model", required=True)
    s.add_argument("--seq-len", type=int, default=300)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--device", default="auto")
    s.add_argument("--out", default=None, help="also write the JSON here")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("reproduce", help="run a chapter notebook with papermill")
    s.add_argument("name", nargs="?")
    s.add_argument("--all", action="store_true")
    s.add_argument("--profile", default="auto")
    s.add_argument("-p", dest="params", nargs=2, action="append", default=[],
                   metavar=("KEY", "VALUE"))
    s.add_argument("--force", action="store_true")
    s.add_argument("--retrain", action="store_true",
                   help="at the full profile, train runs that have a matching record")
    s.add_argument("--records-only", action="store_true",
                   help="at the full profile, never train: stop where a run has no record")
    s.set_defaults(func=cmd_reproduce)

    add_queue_parser(sub)
    add_measure_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
