import gzip

import pytest

from attnlab.data import DataError, read_pairs, read_parallel_files, read_tsv_pairs, train_tokenizer
from attnlab.data.batching import TokenBatchSampler, collate_pairs
from attnlab.demo import corpus_dir


def test_shipped_corpus_keeps_attribution():
    d = corpus_dir()
    assert (d / "NOTICE").read_text().count("CC-BY 2.0") >= 1
    first = gzip.open(d / "train.tsv.gz", "rt", encoding="utf-8").readline().split("\t")
    assert len(first) == 3 and first[2].startswith("CC-BY 2.0 (France) Attribution: tatoeba.org")
    pairs = read_tsv_pairs(d / "test.tsv")
    assert len(pairs) == 1000


def test_tsv_errors_name_file_and_line(tmp_path):
    f = tmp_path / "bad.tsv"
    f.write_text("hello\t你好\nonly one field\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: expected at least 2 TAB-separated fields"):
        read_tsv_pairs(f)
    f.write_bytes("good\t好\n".encode() + b"bad \xff\xfe bytes\tx\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: invalid UTF-8"):
        read_tsv_pairs(f)
    f.write_text("\n\n")
    with pytest.raises(DataError, match="no sentence pairs"):
        read_tsv_pairs(f)


def test_tsv_columns_and_direction(tmp_path):
    f = tmp_path / "p.tsv"
    f.write_text("a\tb\tc\nd\te\tf\n")
    assert read_tsv_pairs(f).src == ["a", "d"]
    assert read_tsv_pairs(f, reverse=True).src == ["b", "e"]
    assert read_tsv_pairs(f, src_col=2, tgt_col=0).tgt == ["a", "d"]


def test_aligned_files(tmp_path):
    a, b = tmp_path / "train.de.gz", tmp_path / "train.en.gz"
    with gzip.open(a, "wt") as f:
        f.write("eins\nzwei\ndrei\n")
    with gzip.open(b, "wt") as f:
        f.write("one\ntwo\n")
    with pytest.raises(DataError, match=r"misaligned files: .*train.en.gz ends before line 3"):
        read_parallel_files(a, b)
    with gzip.open(b, "wt") as f:
        f.write("one\ntwo\nthree\n")
    pairs = read_pairs(f"{a},{b}")
    assert pairs.src == ["eins", "zwei", "drei"] and pairs.tgt == ["one", "two", "three"]


def test_tokenizer_round_trip_english_and_chinese():
    pairs = read_tsv_pairs(corpus_dir() / "dev.tsv")
    for texts in (pairs.src, pairs.tgt):
        tok = train_tokenizer(texts, 600)
        for t in texts[:200] + ["Unseen: Ω≈ç √ 𝄞 emoji 🙂", "没见过的字：龘"]:
            assert tok.decode(tok.encode(t, bos=True, eos=True)) == t  # byte fallback: no <unk>
        assert tok.pad_id == 0 and tok.bos_id == 1 and tok.eos_id == 2 and tok.unk_id == 3


def test_token_batches_respect_budget_and_are_deterministic():
    src = [3, 5, 9, 2, 7, 7, 1, 4] * 10
    tgt = [4, 4, 8, 3, 6, 9, 2, 4] * 10
    s = TokenBatchSampler(src, tgt, max_tokens=30, seed=3)
    batches = s.batches(0)
    assert sorted(i for b in batches for i in b) == list(range(80))
    for b in batches:
        assert max(max(src[i], tgt[i]) for i in b) * len(b) <= 30 or len(b) == 1
    assert batches == s.batches(0) and batches != s.batches(1)


def test_teacher_forcing_shifts_the_target_right():
    src, mask, tgt_in, labels = collate_pairs([[5, 6, 2]], [[1, 7, 8, 2]], pad_id=0)
    assert tgt_in.tolist() == [[1, 7, 8]] and labels.tolist() == [[7, 8, 2]]
    assert mask.tolist() == [[True, True, True]]


def test_traditional_to_simplified_normalisation():
    pytest.importorskip("opencc")
    from attnlab.data.readers import to_simplified
    assert to_simplified(["我買了那輛車。", "下周可能会结冰。"]) == ["我买了那辆车。", "下周可能会结冰。"]
