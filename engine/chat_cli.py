"""A plain command-line chat loop for development (the product chat goes
through duckd):  python -m engine.chat_cli --model PATH|default --backend torch|fp9|fleet"""
from __future__ import annotations

import argparse
import logging
import sys

from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.chat_cli", description=__doc__)
    ap.add_argument("--model", default="default", help="checkpoint folder, .gguf file, or 'default' (SmolLM2-135M)")
    ap.add_argument("--backend", default="torch", choices=("torch", "fp9", "fleet"))
    ap.add_argument("--ducks", default=None, help="fleet: host:port,host:port,... of running ducks")
    ap.add_argument("--key-file", default=None, help="fleet: the ducks' shared key file")
    ap.add_argument("--local-ducks", type=int, default=4, help="fleet without --ducks: start this many local ducks")
    ap.add_argument("--multiple-of", type=int, default=64, help="fleet: tensor-parallel slice granularity")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, unless DUCK_GPU=0), cpu or cuda[:n]")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt", default=None, help="answer this one message and exit")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    options = {}
    if args.backend == "fleet":
        options = {"multiple_of": args.multiple_of}
        if args.ducks:
            options["addresses"] = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in args.ducks.split(","))]
            options["key_file"] = args.key_file
        else:
            options["local_ducks"] = args.local_ducks
    lm = load_model(args.model, device=args.device, dtype=args.dtype, backend=args.backend, backend_options=options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"{lm.config.model_type} model, FFN backend {lm.ffn.name}; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if args.prompt is not None:
            line = args.prompt
        else:
            try:
                line = input("> ")
            except EOFError:
                break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = lm.tokenizer.encode_chat(messages)
        result = generate(lm.model, lm.tokenizer, prompt, params, max_model_len=args.max_model_len,
                          on_text=lambda s: print(s, end="", flush=True))
        print()
        print(result.stats, file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
        if args.prompt is not None:
            break
    lm.ffn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
