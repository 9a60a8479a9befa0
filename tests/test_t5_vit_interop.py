"""T5 (original and v1.1, T5EncoderModel) and ViT ⇄ Hugging Face on tiny random models: the bucket
function, logits both ways, greedy and beam search token for token, config.json + safetensors
folders, and a clear error for a config attnlab cannot express."""
import json
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.config import PRESETS, TransformerConfig  # noqa: E402
from attnlab.generate import GenerationConfig, generate  # noqa: E402
from attnlab.interop.hf import from_hf, load_hf_folder, to_hf  # noqa: E402
from attnlab.model import build_model, relative_position_bucket  # noqa: E402

TOL = 1e-4
VOCAB = 61
# 2 encoder + 3 decoder layers catch a mix-up of the two counts; 8 buckets up to distance 20 put
# most of a 12-token sentence's distances in the log-spaced buckets.
T5_SIZES = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=3,
                relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Matrices of 32 columns: a second thread only adds hand-off costs (16 ms a matmul on a busy
    machine instead of 10 µs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturb(model):
    """Random-init HF models have norms = 1 and zero biases; perturb every parameter so a mapping
    mistake cannot hide behind a constant."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def assert_same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def untie_lm_head(hf):
    """transformers 5 ties T5's lm_head to the shared embedding even with tie_word_embeddings=False
    (a T5 v1.1 checkpoint, holding both, unties them when loaded): untie it as loading would."""
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())
    hf.all_tied_weights_keys.pop("lm_head.weight", None)


def t5(ffn="relu", tied=True, **extra):
    cfg = transformers.T5Config(**{**T5_SIZES, **extra}, feed_forward_proj=ffn, tie_word_embeddings=tied)
    hf = transformers.T5ForConditionalGeneration(cfg)
    if not tied:
        untie_lm_head(hf)
    return perturb(hf)


def sources(B=4, S=12):
    """T5 batches: real tokens, EOS (1), then pad (0); the last row is padded on the left (relative
    positions make either side work)."""
    ids = torch.randint(3, VOCAB, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(1, B):
        mask[b, S - 3 * b:] = 0
    mask[-1] = mask[-1].flip(0)
    for b in range(B):
        real = mask[b].nonzero().squeeze(1)
        ids[b, real[-1]] = 1
    return ids.masked_fill(mask == 0, 0), mask


def t5_cache():
    """transformers 5 sizes generate()'s cache by the encoder's layer count; a growing cache lets a
    decoder with more layers generate."""
    return transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())


# -- T5 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20)])
def test_relative_position_bucket_matches_t5(bidirectional, buckets, max_distance):
    rel = torch.arange(-300, 301)
    ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance)
    assert torch.equal(relative_position_bucket(rel, bidirectional, buckets, max_distance), ref)


@pytest.mark.parametrize("ffn,tied,activation", [("relu", True, "relu"), ("gated-gelu", False, "geglu_tanh"),
                                                 ("gated-silu", True, "swiglu")])
def test_t5_logits_both_ways(ffn, tied, activation):
    hf = t5(ffn, tied)
    ours = from_hf(hf).eval()
    c = ours.config
    assert (c.positions, c.activation, c.n_encoder_layers, c.n_decoder_layers) == ("t5", activation, 2, 3)
    assert c.tie_output == tied and c.tied_output_scale == tied and not c.attention_scale
    src, mask = sources()
    tgt = torch.randint(0, VOCAB, (4, 9))
    tgt[:, 0] = 0  # the decoder start token
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        assert (ours(src, tgt, mask.bool()) - ref).abs().max().item() <= TOL
        back = to_hf(ours)
        assert (back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits - ref).abs().max().item() <= TOL
    assert (back.lm_head.weight is back.shared.weight) == tied
    assert_same_params(from_hf(back), ours)


def test_t5_encoder_model_hidden_states():
    hf = perturb(transformers.T5EncoderModel(transformers.T5Config(**T5_SIZES, feed_forward_proj="gated-gelu")))
    ours = from_hf(hf).eval()
    assert ours.config.family == "encoder-only" and ours.config.n_classes == 0
    src, mask = sources()
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask).last_hidden_state
        real = mask.bool()
        assert (ours(src, real) - ref)[real].abs().max().item() <= TOL
        back = to_hf(ours)
        assert isinstance(back, transformers.T5EncoderModel)
        assert (back(input_ids=src, attention_mask=mask).last_hidden_state - ref)[real].abs().max().item() <= TOL
    assert_same_params(from_hf(back), ours)


def lively(hf):
    """A random T5's sublayers barely move its std-1 embeddings, so greedy search repeats one token
    forever. Sharper attention and larger sublayer outputs make varied sequences: a harder test."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((".q.weight", ".o.weight", ".wo.weight")):
                p.mul_(10)
    return hf


def emitted_eos(hf, src, mask):
    """A random model hardly ever emits T5's EOS (1). Make EOS the token it emits most often, but never
    first, on both sides, so that searches end by EOS after a few tokens as well as by the length limit."""
    out = hf.generate(src, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=t5_cache())
    counts = Counter(out[:, 2:].flatten().tolist())
    eos = max(set(counts) - set(out[:, 1].tolist()), key=counts.get)
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    return eos


def hf_tokens(row: torch.Tensor, eos: int) -> list[int]:
    """An HF output row without the decoder start token, cut before EOS (pads follow it)."""
    toks = row[1:].tolist()
    return toks[: toks.index(eos)] if eos in toks else toks


@pytest.mark.parametrize("ffn,tied", [("relu", True), ("gated-gelu", False)])
def test_t5_greedy_and_beam_match_hf_generate(ffn, tied):
    hf = lively(t5(ffn, tied))
    src, mask = sources()
    eos = emitted_eos(hf, src, mask)
    ours = from_hf(hf).eval()
    assert ours.config.eos_id == eos and ours.config.bos_id == 0
    n = 12
    with torch.no_grad():
        ref = hf.generate(src, attention_mask=mask, max_new_tokens=n, do_sample=False, cache=t5_cache())
    got = generate(ours, src, mask.bool(), GenerationConfig(max_new_tokens=n)).sequences
    assert got == [hf_tokens(r, eos) for r in ref]
    assert any(len(s) < n for s in got)  # some ended by EOS
    # Beam search. Length penalties differ: attnlab divides by GNMT's ((5 + |Y|) / 6)^α, HF by |Y|^α;
    # they agree at α = 0 (plain sums of log-probabilities). Both then finish candidates ranked in the
    # top K that end in EOS (or reach the length limit), and early_stopping=True ends an input's search
    # once K hypotheses are finished; early_stopping=False continues while the best alive beam can
    # still beat the worst finished one, with α = 0 the same test on both sides.
    K = 4
    for early in (True, False):
        with torch.no_grad():
            ref = hf.generate(src, attention_mask=mask, max_new_tokens=n, do_sample=False, num_beams=K,
                              num_return_sequences=K, length_penalty=0.0, early_stopping=early, cache=t5_cache())
        cfg = GenerationConfig(max_new_tokens=n, num_beams=K, num_return_sequences=K, length_penalty=0.0,
                               early_stopping=early)
        nbest = generate(ours, src, mask.bool(), cfg).nbest
        assert [[h.tokens for h in hyps] for hyps in nbest] == [
            [hf_tokens(r, eos) for r in ref[b * K:(b + 1) * K]] for b in range(len(src))]


def test_t5_folders_load_without_transformers(tmp_path):
    src, mask = sources()
    tgt = torch.randint(0, VOCAB, (4, 7))
    for name, hf in (("t5", t5("relu", True)), ("t5-v1_1", t5("gated-gelu", False))):
        hf.save_pretrained(tmp_path / name)
        ours = load_hf_folder(tmp_path / name).eval()
        with torch.no_grad():
            ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
            assert (ours(src, tgt, mask.bool()) - ref).abs().max().item() <= TOL
        assert_same_params(ours, from_hf(hf))


@pytest.mark.parametrize("field,value,message", [
    ("feed_forward_proj", "swishy", "feed_forward_proj 'swishy'"),
    ("feed_forward_proj", "gated-relu", "feed_forward_proj 'gated-relu'"),
    ("d_kv", 16, "d_kv"),
])
def test_t5_config_attnlab_cannot_express_is_named(tmp_path, field, value, message):
    t5().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_hf_folder(tmp_path)


def test_t5_config_json_defaults():
    """A config.json of the first T5 releases: no feed_forward_proj, relative_attention_max_distance,
    num_decoder_layers nor tie_word_embeddings; HF's defaults fill them."""
    from attnlab.interop.hf import _ConfigDict
    from attnlab.interop.hf_rules import _t5_config
    c = _ConfigDict(dict(model_type="t5", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4))
    cfg = _t5_config(c, encoder_only=False, own_head=False)
    assert (cfg.activation, cfg.rel_max_distance, cfg.n_decoder_layers) == ("relu", 128, 2)
    assert cfg.tied_output_scale and (cfg.pad_id, cfg.eos_id, cfg.bos_id) == (0, 1, 0)


# -- ViT ----------------------------------------------------------------------------------------------


def vit_config(image, channels, **extra):
    return transformers.ViTConfig(image_size=image, patch_size=4, num_channels=channels, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                  num_labels=5, **extra)


@pytest.mark.parametrize("image,channels", [(16, 3), (28, 1)])
def test_vit_classifier_logits_both_ways(image, channels, tmp_path):
    hf = perturb(transformers.ViTForImageClassification(vit_config(image, channels)))
    ours = from_hf(hf).eval()
    c = ours.config
    assert (c.image_size, c.patch_size, c.n_channels, c.n_classes) == (image, 4, channels, 5)
    pixels = torch.randn(3, channels, image, image)
    with torch.no_grad():
        ref = hf(pixel_values=pixels).logits
        assert (ours.classify(pixels) - ref).abs().max().item() <= TOL
        back = to_hf(ours)
        assert (back(pixel_values=pixels).logits - ref).abs().max().item() <= TOL
    assert_same_params(from_hf(back), ours)
    hf.save_pretrained(tmp_path)  # the file keeps ViT's checkpoint names (encoder.layer.N.attention...)
    folder = load_hf_folder(tmp_path).eval()
    with torch.no_grad():
        assert (folder.classify(pixels) - ref).abs().max().item() <= TOL
    assert_same_params(folder, ours)


def test_vit_model_with_pooler():
    hf = perturb(transformers.ViTModel(vit_config(16, 3), add_pooling_layer=True))
    ours = from_hf(hf).eval()
    assert ours.config.n_classes == 0 and ours.config.pooler_activation
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = hf(pixel_values=pixels)
        hidden = ours(pixels)
        assert (hidden - out.last_hidden_state).abs().max().item() <= TOL
        assert (ours.pool(hidden) - out.pooler_output).abs().max().item() <= TOL
    assert_same_params(from_hf(to_hf(ours)), ours)


# -- attnlab's own presets ------------------------------------------------------------------------------


def small_preset(name, **changes):
    return build_model(TransformerConfig(**{**PRESETS[name], "n_encoder_layers": 2, "n_decoder_layers": 2,
                                            **changes})).eval()


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("storage", ["preset", "t5"])
def test_t5_preset_to_hf(untied, storage):
    """An attnlab-trained T5 (T5 init, positions='t5') is written as T5ForConditionalGeneration, whether
    its embedding is stored T5's way (std 1, tied output × d^-0.5) or √d-scaled (embed_scale)."""
    own = dict(embed_scale=False, tied_output_scale=not untied, attention_scale=False) if storage == "t5" else {}
    untie = dict(tie_output=False, tied_output_scale=False) if untied else {}
    ours = small_preset("t5-mini", vocab_size=VOCAB, **{**own, **untie})
    with torch.no_grad():  # every weight away from its init, the embedding included
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf = to_hf(ours)
    assert isinstance(hf, transformers.T5ForConditionalGeneration)
    assert hf.config.feed_forward_proj == "gated-gelu" and (hf.lm_head.weight is hf.shared.weight) != untied
    src, mask = sources()
    tgt = torch.randint(0, VOCAB, (4, 6))
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        assert (ours(src, tgt, mask.bool()) - ref).abs().max().item() <= TOL


def test_vit_preset_to_hf():
    ours = small_preset("vit-mnist", pooling="cls")  # HF's ViT classifies from [CLS]
    hf = to_hf(ours)
    assert isinstance(hf, transformers.ViTForImageClassification)
    pixels = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert (ours.classify(pixels) - hf(pixel_values=pixels).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name,change,message", [("t5-mini", dict(norm="layernorm"), "norm='rmsnorm'"),
                                                 ("t5-mini", dict(bias=True), "bias=False"),
                                                 ("vit-mnist", dict(norm_placement="post"), "norm_placement='pre'")])
def test_to_hf_refuses_what_hf_cannot_compute(name, change, message):
    with pytest.raises(ValueError, match=message):
        to_hf(small_preset(name, **change))
