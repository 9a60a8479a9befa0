"""attnlab generate: continue prompts with a decoder-only model (greedy, sampling, beam; streamed)."""

from __future__ import annotations

from .common import add_device, add_generation, add_model, add_quantize, generation_config, load, read_lines

HELP = "generate text with a decoder-only model (smollm2, a .gguf, or a trained LM)"
EXAMPLES = """attnlab generate --model smollm2 --chat --prompt "What is attention?" --stream
  attnlab generate --model runs/lm --prompt "ROMEO:" --sample --top-k 50 --temperature 0.8
  echo "Once upon a time" | attnlab generate --model model.gguf --prompt - --beam 4"""


def arguments(p) -> None:
    add_model(p, "smollm2, a .gguf file, an HF folder, or a model directory")
    p.add_argument("--prompt", default="-", help='prompt text, or "-" for one prompt per stdin line')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--bf16", action="store_true",
                   help="run the model in bfloat16 where it is native (fp32 on CPUs that would emulate it)")
    add_device(p)
    add_quantize(p)
    add_generation(p, sampling=True)


def run(args) -> int:
    prompts = [args.prompt] if args.prompt not in (None, "-") else read_lines("-", "prompts")
    model = load(args, bf16=args.bf16)
    cfg = generation_config(args)
    for n, prompt in enumerate(prompts, 1):
        where = "--prompt" if args.prompt not in (None, "-") else f"stdin line {n}"
        shown = "" if args.chat else prompt
        try:
            if args.stream and cfg.num_beams == 1:
                print(shown, end="", flush=True)
                for piece in model.stream(prompt, cfg, chat=args.chat, system=args.system):
                    print(piece, end="", flush=True)
                print()
            else:
                print(shown + model.generate([prompt], cfg, chat=args.chat, system=args.system)[0])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return 0
