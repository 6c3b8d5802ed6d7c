"""engine: the host side of inference. Models (torch), checkpoint loading,
tokenizer + chat template, generation, and the FFN backends (torch reference,
local fp9, the duck fleet). Imports nothing of duckd/ or console/.

    from engine.loader import load_model
    from engine.generate import SamplingParams, generate
    lm = load_model("default", backend="fp9")
    r = generate(lm.model, lm.tokenizer, lm.tokenizer.encode_chat(msgs), SamplingParams(max_tokens=64))
    print(r.text); print(r.stats)
"""
