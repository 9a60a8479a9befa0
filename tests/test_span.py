"""T5 on attnlab: span-corruption pretraining (--task span) and translation task prefixes
(--source-prefix), from the noise function up to a tiny run that learns."""
import gzip
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.demo import corpus_dir
from attnlab.train import TrainArgs
from attnlab.train.tasks import DataPosition
from attnlab.train.tasks.span import (SpanCorruptionTask, corrupt_spans, noise_counts, random_segmentation,
                                      random_spans_noise_mask)

TINY_T5 = ["--preset", "t5-mini", "--set", "d_model=64", "--set", "d_ff=128", "--set", "n_heads=4",
           "--set", "n_encoder_layers=2", "--set", "n_decoder_layers=2"]
QUIET = ["--no-progress", "--threads", "1"]  # one thread: far faster than two when other processes share the cores


@pytest.fixture(autouse=True)
def _keep_threads():
    """``attnlab train --threads`` sets torch's thread count for the whole process: put it back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of True."""
    out, m = [], mask.tolist()
    for j, v in enumerate(m):
        if v and (j == 0 or not m[j - 1]):
            out.append([j, 0])
        if v:
            out[-1][1] += 1
    return [tuple(s) for s in out]


def _reconstruct(inputs: list[int], target: list[int], sentinels: list[int]) -> list[int]:
    """The original sequence from (input, target): each sentinel of the input replaced by the tokens
    that follow the same sentinel in the target."""
    body = target[1:-1]  # <s> … </s>
    fill, cur = {}, None
    for t in body:
        if t in sentinels:
            cur = t
            fill[cur] = []
        else:
            fill[cur].append(t)
    out = []
    for t in inputs[:-1]:  # … </s>
        out.extend(fill[t] if t in sentinels else [t])
    return out


# -- the noise function ----------------------------------------------------------------------------------


@pytest.mark.parametrize("density, mean_span", [(0.15, 3.0), (0.3, 5.0)])
def test_noise_follows_t5_density_and_span_length(density, mean_span):
    g = torch.Generator().manual_seed(0)
    sentinels = [-(i + 1) for i in range(100)]  # ids no real token has
    noise = tokens = n_spans = 0
    lengths = Counter()
    for _ in range(4):
        for n in range(20, 201):
            mask = random_spans_noise_mask(n, density, mean_span, g)
            spans = _spans(mask)
            want_noise, want_spans = noise_counts(n, density, mean_span)
            # as many runs of noise as spans drawn: two touching spans would have made one run
            assert int(mask.sum()) == want_noise and len(spans) == want_spans
            assert all(length >= 1 for _, length in spans)
            noise, tokens, n_spans = noise + want_noise, tokens + n, n_spans + len(spans)
            lengths.update(length for _, length in spans)
            ids = list(range(1000, 1000 + n))
            inputs, target = corrupt_spans(ids, mask, sentinels, bos=1, eos=2)
            assert inputs[-1] == 2 and target[0] == 1 and target[-1] == 2
            assert [t for t in inputs if t < 0] == sentinels[:len(spans)]  # sentinel 0, 1, 2, … in order
            assert [t for t in target if t < 0] == sentinels[:len(spans)]
            assert target[1] == sentinels[0]  # T5's target starts with sentinel 0
            assert _reconstruct(inputs, target, sentinels) == ids
    assert abs(noise / tokens - density) < 0.01
    assert abs(noise / n_spans - mean_span) < 0.3
    assert len(lengths) >= 4  # span lengths are drawn, not all equal to the mean


def test_spans_are_placed_anywhere_not_only_at_the_end():
    """T5's mask (kept tokens first, then alternating) ends every example with noise; with one span per
    short sentence that would always hide the last tokens. Here a single span starts anywhere."""
    g = torch.Generator().manual_seed(0)
    starts = Counter(_spans(random_spans_noise_mask(20, 0.15, 3.0, g))[0][0] for _ in range(3600))
    assert set(starts) == set(range(18))  # 3 noise tokens: starts 0 … 17, each about 1/18 of the time
    assert max(starts.values()) < 2 * min(starts.values())


def test_random_segmentation_is_a_uniform_partition():
    g = torch.Generator().manual_seed(0)
    seen = Counter(tuple(random_segmentation(5, 3, g)) for _ in range(3000))
    # 5 items in 3 non-empty parts: C(4, 2) = 6 compositions, each equally likely
    assert set(seen) == {(1, 1, 3), (1, 3, 1), (3, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)}
    assert max(seen.values()) / min(seen.values()) < 1.25
    assert random_segmentation(7, 1, g) == [7] and random_segmentation(4, 4, g) == [1, 1, 1, 1]


def test_noise_counts_never_degenerate():
    g = torch.Generator().manual_seed(0)
    for n in range(2, 300):
        for density in (0.01, 0.15, 0.5, 0.99):
            for mean_span in (1.0, 3.0, 50.0):
                noise, spans = noise_counts(n, density, mean_span)
                assert 1 <= noise <= n - 1 and 1 <= spans <= min(noise, n - noise)
                if n < 40:  # even at density 0.99 with spans of 1 the spans are drawn apart
                    mask = random_spans_noise_mask(n, density, mean_span, g)
                    assert int(mask.sum()) == noise and len(_spans(mask)) == spans


# -- the task -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> Path:
    """English sentences from the package's own corpus (every machine has it)."""
    d = tmp_path_factory.mktemp("span")
    with gzip.open(corpus_dir() / "train.tsv.gz", "rt", encoding="utf-8") as f:
        lines = [l.split("\t")[0] for l in f.read().splitlines()[::8]]
    (d / "sentences.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d / "sentences.txt"


def _task(sentences: Path, out: Path, **kw) -> SpanCorruptionTask:
    task = SpanCorruptionTask()
    task.prepare(TrainArgs(task="span", train=str(sentences), out=str(out), vocab_size=500, max_len=32,
                           max_tokens=600, **kw), out, lambda *a: None)
    return task


def test_batches_come_from_the_data_position(sentences, tmp_path):
    a = _task(sentences, tmp_path)
    assert a.sentinels == [4, 5]  # <extra_id_0>, <extra_id_1>: right after the four specials
    pos = DataPosition()
    seen = []
    for step in range(6):
        pos.step = step
        seen.append(a.batch(pos))
        if step == 4:
            saved = (pos.epoch, pos.batch_in_epoch)
    # the same step again, and a resumed run (a new task object, the saved position): the same batch
    again = a.batch(DataPosition(epoch=saved[0], batch_in_epoch=saved[1], step=5))
    b = _task(sentences, tmp_path)
    resumed = b.batch(DataPosition(epoch=saved[0], batch_in_epoch=saved[1], step=5))
    for x, y, z in zip(seen[5], again, resumed):
        assert torch.equal(x, y) and torch.equal(x, z)
    # the same sentences at another step get other noise
    other = a.batch(DataPosition(epoch=saved[0], batch_in_epoch=saved[1], step=6))
    assert not torch.equal(other[0], seen[5][0])
    src, src_mask, tgt_in, labels = seen[5]
    assert src.shape[0] == tgt_in.shape[0] and (tgt_in[:, 0] == 1).all()  # decoder starts at <s>
    assert (labels[:, 0] == 4).all()  # …and first predicts <extra_id_0>


def test_sentinels_typed_by_hand_encode_as_in_training(sentences, tmp_path):
    tok = _task(sentences, tmp_path).tok
    head, it, tail = tok.encode("I think"), tok.encode("it"), tok.encode("will rain")
    assert tok.encode("I think it will rain") == head + it + tail  # words tokenize on their own
    # training replaces the ids of "it" by the sentinel; typed text gives the same ids (no lone "▁")
    assert tok.encode("I think <extra_id_0> will rain") == head + [4] + tail


def test_bad_span_options_are_one_line_usage_errors(capsys):
    for argv, fragment in [
        (["--noise-density", "1.5"], "--noise-density: 1.5 is out of range: must be in (0, 1)"),
        (["--noise-density", "0"], "--noise-density: 0 is out of range: must be in (0, 1)"),
        (["--mean-span-length", "0"], "--mean-span-length: 0 is out of range: must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["train", "--task", "span", "--train", "x.txt", *argv])
        err = capsys.readouterr().err
        lines = [l for l in err.splitlines() if l.strip() and not l.startswith(("usage:", " "))]
        assert e.value.code == 2 and len(lines) == 1 and fragment in lines[0], err
    for argv, fragment in [
        (["--task", "translation", "--noise-density", "0.2"],
         "--noise-density is an option of --task span only (this run is --task translation)"),
        (["--mean-span-length", "2"], "--mean-span-length is an option of --task span only"),
        (["--task", "span", "--source-prefix", "summarize: "],
         "--source-prefix is an option of --task translation only (this run is --task span)"),
    ]:
        assert main(["train", "--train", "x.txt", *argv]) == 2
        lines = [l for l in capsys.readouterr().err.splitlines() if l.strip() and not l.startswith(("usage:", " "))]
        assert len(lines) == 1 and lines[0].startswith("attnlab train: error: ") and fragment in lines[0]
    from attnlab.train.options import check_train_options
    with pytest.raises(ValueError, match=r"opts.json: option 'noise_density' = 1.5 must be in \(0, 1\)"):
        check_train_options({"noise_density": 1.5}, "opts.json")


def test_span_pretraining_learns_and_loads_as_a_gap_filler(sentences, tmp_path, capsys):
    import attnlab
    from attnlab.config import TransformerConfig
    from attnlab.model import build_model
    out = tmp_path / "t5"
    assert main(["train", "--task", "span", "--train", str(sentences), "--out", str(out), "--vocab-size", "500",
                 "--max-len", "32", "--max-steps", "200", "--lr", "3e-3", "--warmup", "20", "--schedule", "cosine",
                 "--max-tokens", "2000", "--batch-size", "64", "--eval-every", "200", "--save-every", "0",
                 *QUIET, *TINY_T5]) == 0
    info = json.loads((out / "task.json").read_text())
    assert info == {"task": "span", "max_len": 32, "noise_density": 0.15, "mean_span_length": 3.0, "sentinels": 2}
    dev = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if "dev_span_loss" in l][-1]
    # The loss of the same (seeded) dev targets before any update, and the best context-free guess:
    # the entropy of the dev targets' own token frequencies (sentinels and </s> included).
    task = _task(sentences, out, reuse_tokenizer=True)
    torch.manual_seed(1)
    initial = task.evaluate(build_model(TransformerConfig.from_json(out / "config.json")), torch.device("cpu"), False)
    labels = Counter(t for _, tgt in task.dev_pairs for t in tgt[1:])
    total = sum(labels.values())
    unigram = -sum(c / total * math.log(c / total) for c in labels.values())
    assert dev["dev_span_loss"] < 0.6 * initial["dev_span_loss"], (dev, initial)
    assert dev["dev_span_loss"] < unigram - 0.2, (dev, unigram)
    # The directory loads as an encoder-decoder that writes spans after their sentinels.
    m = attnlab.load(out)
    assert m.kind == "translation" and m.task["task"] == "span"
    filled = m.translate(["I think <extra_id_0> will rain tomorrow."])[0]
    assert filled.startswith("<extra_id_0>"), filled
    capsys.readouterr()
    assert main(["translate", "--model", str(out), "--text", "Tom <extra_id_0> to school."]) == 0
    assert capsys.readouterr().out.startswith("<extra_id_0>")
    # attnlab evaluate scores lines the same way (fixed gaps): learned, far below the untrained loss.
    assert main(["evaluate", "--task", "span", "--model", str(out), "--data", str(sentences), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["tokens"] > 1000 and scores["dev_span_loss"] < 0.6 * initial["dev_span_loss"], scores
    assert 0 < scores["dev_span_accuracy"] < 1


# -- translation: --source-prefix -------------------------------------------------------------------------


PREFIX = "translate English to Chinese: "


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("prefix")
    lines = (corpus_dir() / "dev.tsv").read_text(encoding="utf-8").splitlines()[:300]
    (d / "train.tsv").write_text("\n".join(lines[:250]) + "\n", encoding="utf-8")
    (d / "dev.tsv").write_text("\n".join(lines[250:]) + "\n", encoding="utf-8")
    return d


def test_source_prefix_reaches_training_and_dev_bleu(pairs, tmp_path):
    from attnlab.train.tasks import TranslationTask
    task = TranslationTask()
    task.prepare(TrainArgs(train=str(pairs / "train.tsv"), dev=str(pairs / "dev.tsv"), vocab_size=300,
                           source_prefix=PREFIX), tmp_path, lambda *a: None)
    raw = [l.split("\t")[0] for l in (pairs / "train.tsv").read_text(encoding="utf-8").splitlines()]
    assert task.train_src[0] == task.src_tok.encode(PREFIX + raw[0], eos=True)
    assert all(s.startswith(PREFIX) and s.count(PREFIX) == 1 for s in task.dev_src_text)  # what dev BLEU reads
    assert task.artifacts()["task"] == {"task": "translation", "source_prefix": PREFIX}


def test_source_prefix_is_kept_and_applied_once_at_inference(pairs, tmp_path, monkeypatch, capsys):
    import attnlab
    import attnlab.generate.translate as gen
    out, plain = tmp_path / "prefixed", tmp_path / "plain"
    for d, extra in ((out, ["--source-prefix", PREFIX]), (plain, [])):
        assert main(["train", "--train", str(pairs / "train.tsv"), "--out", str(d), "--vocab-size", "300",
                     "--max-steps", "2", "--eval-every", "0", "--save-every", "0", *QUIET, *TINY_T5, *extra]) == 0
    assert json.loads((out / "task.json").read_text()) == {"task": "translation", "source_prefix": PREFIX}
    assert json.loads((plain / "task.json").read_text()) == {"task": "translation"}
    m = attnlab.load(out)
    texts = ["I love coding.", "How are you?"]
    real = gen.translate(m.module, m.tokenizer, m.tgt_tokenizer, [PREFIX + t for t in texts])
    assert m.translate(texts) == real  # the same ids as translating prefixed text directly

    seen = []

    def recorder(model, src_tok, tgt_tok, sentences, *a, **kw):
        seen.append(list(sentences))
        return ["x"] * len(sentences)
    monkeypatch.setattr(gen, "translate", recorder)
    m.translate(texts)
    attnlab.load(plain).translate(texts)
    assert seen == [[PREFIX + t for t in texts], texts]
    # the CLI goes through the API: attnlab translate and attnlab evaluate add it exactly once too
    (tmp_path / "src.txt").write_text("\n".join(texts) + "\n")
    assert main(["translate", "--model", str(out), "--input", str(tmp_path / "src.txt")]) == 0
    assert main(["evaluate", "--model", str(out), "--src", str(tmp_path / "src.txt"),
                 "--ref", str(tmp_path / "src.txt")]) == 0
    assert seen[2:] == [[PREFIX + t for t in texts]] * 2
    capsys.readouterr()
