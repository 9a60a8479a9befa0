"""Property tests: masks, causality and (lack of) permutation equivariance on random inputs."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import TransformerConfig, build_model
from attnlab.model import MultiHeadAttention, causal_mask, padding_mask

SETTINGS = settings(max_examples=25, deadline=None)


@SETTINGS
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4), causal=st.booleans(),
       kv_heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_padded_keys_get_exactly_zero_weight_and_no_nan(lengths, causal, kv_heads, seed):
    torch.manual_seed(seed)
    T = max(max(lengths), 1)
    B = len(lengths)
    attn = MultiHeadAttention(16, 4, kv_heads).eval()
    attn.record_weights = True
    x = torch.randn(B, T, 16)
    is_token = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    mask = padding_mask(is_token)
    if causal:
        mask = mask & causal_mask(T)
    out = attn(x, mask=mask)
    w = attn.last_weights  # (B, h, T, T)
    assert torch.isfinite(out).all()
    assert (w.masked_select(~mask.expand_as(w)) == 0).all()  # exactly zero, not just small
    for b, n in enumerate(lengths):
        if n == 0:  # a fully padded row gives zeros
            assert (attn.last_weights[b] == 0).all()
    # The fast (fused) path gives the same outputs as the explicit one.
    attn.record_weights = False
    assert torch.allclose(attn(x, mask=mask), out, atol=1e-5)


@SETTINGS
@given(t=st.integers(0, 8), positions=st.sampled_from(["sinusoidal", "learned", "rope", "alibi", "none"]),
       seed=st.integers(0, 2**16))
def test_causality_future_tokens_do_not_change_the_past(t, positions, seed):
    torch.manual_seed(seed)
    cfg = TransformerConfig(family="decoder-only", vocab_size=40, d_model=16, n_heads=4, n_decoder_layers=2,
                            d_ff=32, dropout=0.0, positions=positions, max_len=16, norm_placement="pre")
    model = build_model(cfg).eval()
    ids = torch.randint(0, 40, (2, 10))
    changed = ids.clone()
    changed[:, t + 1:] = torch.randint(0, 40, changed[:, t + 1:].shape)
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6)


@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_self_attention_is_permutation_equivariant_only_without_positions(seed):
    torch.manual_seed(seed)
    ids = torch.randint(4, 40, (1, 8))
    perm = torch.randperm(8)
    while (perm == torch.arange(8)).all():
        perm = torch.randperm(8)
    for positions, equivariant in [("none", True), ("sinusoidal", False), ("learned", False),
                                   ("rope", False), ("alibi", False)]:
        cfg = TransformerConfig(family="encoder-only", vocab_size=40, d_model=16, n_heads=4,
                                n_encoder_layers=2, d_ff=32, dropout=0.0, positions=positions)
        model = build_model(cfg).eval()
        with torch.no_grad():
            if positions == "learned":  # learned tables start random; make them clearly non-constant
                model.embed.position.weight.normal_()
            h, hp = model(ids), model(ids[:, perm])
        assert torch.allclose(h[:, perm], hp, atol=1e-5) == equivariant, positions
