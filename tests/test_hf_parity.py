"""Parity with Hugging Face transformers on tiny random models: weights copied by from_hf, logits
compared; and to_hf(from_hf(m)) reproduces m."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.interop.hf import from_hf, to_hf  # noqa: E402

TOL = 1e-4


def perturb(model):
    """Random-init HF models have LayerNorm = (1, 0) and zero biases; perturb every parameter so a
    mapping mistake cannot hide behind a constant."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:  # fixed tables, e.g. Marian's sinusoids
                continue
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.normal_(generator=g)
    return model.eval()


def batch(vocab, B=3, T=7, pad_right=True):
    ids = torch.randint(5, vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        mask[b, T - 2 * b:] = 0
    if not pad_right:
        mask = mask.flip(1)
    return ids, mask


def assert_same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def seq2seq(hf_cls, cfg_cls, **extra):
    cfg = cfg_cls(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **extra)
    hf = perturb(hf_cls(cfg))
    ours = from_hf(hf).eval()
    src, src_mask = batch(99)
    tgt, _ = batch(99, T=6)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
        got = ours(src, tgt, src_mask.bool())
    assert (got - ref).abs().max().item() <= TOL
    back = to_hf(ours)
    with torch.no_grad():
        again = back(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
    assert (again - ref).abs().max().item() <= TOL
    assert_same_params(from_hf(back), ours)
    return ours


def test_bart():
    ours = seq2seq(transformers.BartForConditionalGeneration, transformers.BartConfig, scale_embedding=True)
    assert ours.config.positions == "learned" and ours.config.embedding_norm


def test_marian():
    ours = seq2seq(transformers.MarianMTModel, transformers.MarianConfig, scale_embedding=True,
                   activation_function="swish")
    assert ours.config.positions == "sinusoidal" and ours.config.sinusoidal_layout == "split"


def test_gpt2():
    cfg = transformers.GPT2Config(vocab_size=99, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=98, eos_token_id=98)
    hf = perturb(transformers.GPT2LMHeadModel(cfg))
    ours = from_hf(hf).eval()
    ids, mask = batch(99)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask.bool())
    real = mask.bool()
    assert (got - ref)[real].abs().max().item() <= TOL
    assert_same_params(from_hf(to_hf(ours)), ours)


@pytest.mark.parametrize("head", ["base", "classifier"])
def test_bert(head):
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=3)
    hf = perturb(transformers.BertModel(cfg) if head == "base" else
                 transformers.BertForSequenceClassification(cfg))
    ours = from_hf(hf).eval()
    ids, mask = batch(99)
    types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        if head == "base":
            out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
            hidden = ours(ids, mask.bool(), types)
            real = mask.bool()
            assert (hidden - out.last_hidden_state)[real].abs().max().item() <= TOL
            assert (ours.pool(hidden) - out.pooler_output).abs().max().item() <= TOL
        else:
            ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
            assert (ours.classify(ids, mask.bool(), types) - ref).abs().max().item() <= TOL
    assert_same_params(from_hf(to_hf(ours)), ours)


@pytest.mark.parametrize("tied", [True, False])
def test_llama_rope_rmsnorm_swiglu_gqa(tied):
    cfg = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, rms_norm_eps=1e-5, pad_token_id=0)
    hf = perturb(transformers.LlamaForCausalLM(cfg))
    ours = from_hf(hf).eval()
    assert ours.config.kv_heads == 2 and ours.config.norm == "rmsnorm" and ours.config.activation == "swiglu"
    ids, _ = batch(99, B=2, T=9)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - ref).abs().max().item() <= TOL
    back = to_hf(ours)
    with torch.no_grad():
        assert (back(input_ids=ids).logits - ref).abs().max().item() <= TOL
    assert_same_params(from_hf(back), ours)


def test_unsupported_architecture_is_named():
    cfg = transformers.OPTConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="unsupported architecture 'opt'"):
        from_hf(transformers.OPTModel(cfg))
