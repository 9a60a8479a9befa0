"""One full training step (forward, backward, AdamW: attnlab's fused kernel, torch's default for the others) of the same seq2seq architecture, side by side:
attnlab (a copy of the HF model made with ``from_hf``, so the weights are equal), Hugging Face
``MarianMTModel`` and ``torch.nn.Transformer`` (PyTorch's translation-tutorial model: embeddings ×√d,
sinusoidal positions, nn.Transformer, output projection). fp32, and bf16 autocast where the CPU has
native bf16 (``accel.bf16_native``). Two shapes: d256/4 heads/3+3/d_ff 1024, 64 pairs × 24 tokens; and
d512/8 heads/6+6/d_ff 2048, 32 × 32. Prints target tokens/s, ratios, the growth of the process's RSS high-water mark (order-dependent: a
model that needs less than an earlier one shows 0) and the model FLOP utilisation against a matmul
peak measured in the same run.

    python benchmarks/train_speed.py [--steps 10] [--shapes small,large] [--threads 2]
"""

import argparse
import json
import math
import resource
import time

import torch
from torch import nn

from attnlab import accel
from attnlab.interop.hf import from_hf
from attnlab.train.trainer import make_adamw

SHAPES = {"small": dict(d=256, heads=4, layers=3, ff=1024, batch=64, length=24),
          "large": dict(d=512, heads=8, layers=6, ff=2048, batch=32, length=32),
          "tiny": dict(d=32, heads=2, layers=1, ff=64, batch=4, length=8)}  # the smoke test's
VOCAB = 8000


class TorchSeq2Seq(nn.Module):
    """The PyTorch tutorial's model: token embeddings ×√d + sinusoidal positions → nn.Transformer → linear."""

    def __init__(self, s):
        super().__init__()
        d = s["d"]
        self.src_emb, self.tgt_emb = nn.Embedding(VOCAB, d), nn.Embedding(VOCAB, d)
        pos = torch.arange(512)[:, None] * torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        self.register_buffer("pe", torch.cat([pos.sin(), pos.cos()], 1))
        self.tf = nn.Transformer(d, s["heads"], s["layers"], s["layers"], s["ff"], 0.1, batch_first=True)
        self.out = nn.Linear(d, VOCAB)
        self.scale = math.sqrt(d)

    def forward(self, src, tgt):
        T = tgt.shape[1]
        x = self.src_emb(src) * self.scale + self.pe[: src.shape[1]]
        y = self.tgt_emb(tgt) * self.scale + self.pe[:T]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        return self.out(self.tf(x, y, tgt_mask=causal, tgt_is_causal=True))


def matmul_peak(dtype) -> float:
    """FLOP/s of a large square matmul on this machine, now (the roofline the MFU is measured against)."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048 ** 3 / (time.perf_counter() - t0)


def model_flops(s) -> float:
    """Forward+backward FLOPs of one step ≈ 6 · (non-embedding matmul parameters) · tokens, plus attention."""
    d, L, ff = s["d"], s["layers"], s["ff"]
    per_token = L * (4 * d * d + 2 * d * ff) + L * (8 * d * d + 2 * d * ff) + d * VOCAB
    tokens = s["batch"] * s["length"]
    attention = 3 * 2 * 2 * s["batch"] * s["length"] ** 2 * d * L  # self + causal + cross, QK and AV
    return 6 * per_token * tokens + 3 * attention


def time_steps(step, steps: int) -> float:
    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def run_shape(name, s, args, bf16: bool, peak: float) -> dict:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MarianConfig(vocab_size=VOCAB, d_model=s["d"], encoder_layers=s["layers"],
                                    decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                                    decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ff"], decoder_ffn_dim=s["ff"],
                                    max_position_embeddings=512, pad_token_id=0, eos_token_id=2,
                                    decoder_start_token_id=1, scale_embedding=True)
    hf = transformers.MarianMTModel(cfg).train()
    models = {"attnlab": from_hf(hf).train(), "hf_marian": hf, "torch_nn_transformer": TorchSeq2Seq(s).train()}
    src = torch.randint(4, VOCAB, (s["batch"], s["length"]))
    tgt_in, labels = torch.randint(4, VOCAB, (s["batch"], s["length"])), torch.randint(4, VOCAB, (s["batch"], s["length"]))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    forwards = {"attnlab": lambda m: m(src, tgt_in), "torch_nn_transformer": lambda m: m(src, tgt_in),
                "hf_marian": lambda m: m(input_ids=src, decoder_input_ids=tgt_in).logits}
    out = {}
    for key, model in models.items():
        # each side's own optimizer: attnlab's trainer takes the fused AdamW kernel where it exists
        # (train.trainer.make_adamw); HF's Trainer and the PyTorch tutorial use torch's default (foreach)
        opt = (make_adamw if key == "attnlab" else torch.optim.AdamW)(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = forwards[key](model)
            loss_fn(logits.float().reshape(-1, VOCAB), labels.reshape(-1)).backward()
            opt.step()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time_steps(step, args.steps)
        out[key] = {"ms_per_step": round(t * 1e3, 1), "tgt_tokens_per_s": round(s["batch"] * s["length"] / t),
                    "mfu": round(model_flops(s) / t / peak, 3),
                    "rss_high_water_growth_MB": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)}
    out["attnlab_vs_hf"] = round(out["hf_marian"]["ms_per_step"] / out["attnlab"]["ms_per_step"], 2)
    out["attnlab_vs_torch"] = round(out["torch_nn_transformer"]["ms_per_step"] / out["attnlab"]["ms_per_step"], 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shapes", default="small,large", help="comma-separated: small, large")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    dtypes = [False] + ([True] if accel.bf16_native("cpu") else [])
    for bf16 in dtypes:
        peak = matmul_peak(torch.bfloat16 if bf16 else torch.float32)
        results[f"matmul_peak_GFLOPs_{'bf16' if bf16 else 'fp32'}"] = round(peak / 1e9, 1)
        for name in args.shapes.split(","):
            key = f"{name}_{'bf16' if bf16 else 'fp32'}"
            results[key] = run_shape(name, SHAPES[name], args, bf16, peak)
            print(key, json.dumps(results[key]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
