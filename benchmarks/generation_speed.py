"""attnlab generation vs Hugging Face MarianMTModel.generate, side by side, same weights.

Both run in fp32, then both in bf16 (weights cast). A random-init Marian model (d_model 256, 4 heads, 3+3 layers, d_ff 1024, vocab 8000) is built with
transformers and copied into attnlab with from_hf, so both decode the *same* model. 64 sources of
length 20; exactly 24 new tokens (min = max = 24); greedy and beam 4; sentences/s, best of N runs
(the two sides take turns, so a change in the machine's load does not bias the ratio).

    python benchmarks/generation_speed.py [--repeats 3] [--threads 2] [--compile] [--as-avx2]

--compile adds attnlab's compiled decoding step (``GenerationConfig(compile=True)``: inductor, frozen
weights, oneDNN's packed products kept; ``accel.compiled_step``) as a third side in the same turns; the
compilation itself is the warm-up, reported as ``compile_s``.

--as-avx2 caps PyTorch, oneDNN and MKL at AVX2 (``accel.AVX2_ENVIRONMENT``; no native bf16, so the
bf16 rows are left out): the stand-in for an AVX2-only CPU.
"""

import argparse
import json
import time

import torch

from attnlab.generate import GenerationConfig, generate
from attnlab.interop.hf import from_hf


def best_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_times(fns, repeats):
    """Best of ``repeats`` for each function, the functions taking turns (A B A B ...), so that a change in
    the machine's load during the run reaches every side alike instead of biasing the ratio."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--compile", action="store_true", help="also time attnlab's compiled decoding step")
    ap.add_argument("--as-avx2", action="store_true", help="cap PyTorch, oneDNN and MKL at AVX2 (and no native bf16)")
    args = ap.parse_args()
    from attnlab import accel
    if args.as_avx2:
        accel.restart_capped_at_avx2()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MarianConfig(vocab_size=8000, d_model=256, encoder_layers=3, decoder_layers=3,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
                                    decoder_ffn_dim=1024, max_position_embeddings=512, pad_token_id=0,
                                    eos_token_id=2, decoder_start_token_id=1, bos_token_id=1, scale_embedding=True)
    hf = transformers.MarianMTModel(cfg).eval()
    hf.generation_config.forced_eos_token_id = None  # Marian forces token 0 at max length; not a model property
    ours = from_hf(hf).eval()
    ours.config.bos_id = cfg.decoder_start_token_id
    src = torch.randint(4, 8000, (args.batch, args.src_len))
    mask = torch.ones_like(src)
    n = args.new_tokens
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
               "batch": args.batch, "src_len": args.src_len, "new_tokens": n}
    modes = [(torch.float32, 1), (torch.float32, 4)]
    if accel.bf16_native("cpu"):  # emulated bf16 is several times slower than fp32 on both sides: not a row
        modes += [(torch.bfloat16, 1), (torch.bfloat16, 4)]
    for dtype, beams in modes:
        hf.to(dtype)
        ours.to(dtype)
        with torch.no_grad():
            def run_hf():
                return hf.generate(input_ids=src, attention_mask=mask, num_beams=beams, do_sample=False,
                                   min_new_tokens=n, max_new_tokens=n, use_cache=True, early_stopping=True)

            def run_ours(compile=False):
                return generate(ours, src, mask.bool(), GenerationConfig(num_beams=beams, min_new_tokens=n,
                                                                          max_new_tokens=n, compile=compile))
            out_hf, out_ours = run_hf(), run_ours()
            same = [list(r[1:]) for r in out_hf.tolist()] == [s for s in out_ours.sequences]
            sides = [run_hf, run_ours]
            if args.compile:
                t0 = time.perf_counter()
                out_compiled = run_ours(True)  # the first call compiles
                compile_s = time.perf_counter() - t0
                sides.append(lambda: run_ours(True))
            t_hf, t_ours, *t_compiled = best_times(sides, args.repeats)
        name = ("greedy" if beams == 1 else f"beam{beams}") + ("_bf16" if dtype == torch.bfloat16 else "_fp32")
        results[name] = {"hf_sent_per_s": round(args.batch / t_hf, 1), "attnlab_sent_per_s": round(args.batch / t_ours, 1),
                         "speedup": round(t_hf / t_ours, 2), "identical_outputs": same}
        if args.compile:
            results[name].update({"compiled_sent_per_s": round(args.batch / t_compiled[0], 1),
                                  "compiled_speedup": round(t_hf / t_compiled[0], 2), "compile_s": round(compile_s, 1),
                                  "compiled_identical_to_eager": out_compiled.sequences == out_ours.sequences})
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
