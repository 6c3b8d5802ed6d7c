"""engine: the host side of inference. Models (torch), checkpoint loading,
tokenizer + chat template, generation, and the FFN backends (torch reference,
local fp9, the duck fleet). Imports nothing of duckd/ or console/.

    from engine.loader import load_model
    from engine.generate import generate
    from engine.tokens import SamplingParams
    lm = load_model("default", backend="fp9")
    r = generate(lm.model, lm.tokenizer, lm.tokenizer.encode_chat(msgs), SamplingParams(max_tokens=64))
    print(r.text); print(r.stats)
"""
import os
import sys

# torch's OpenMP runtime (libgomp) keeps each worker spinning for milliseconds after a
# parallel op, waiting for the next one. On a CPU host whose cores the native decoder's
# threads and local ducks share, that spin holds a core the next step needs: a script
# batching 32 sequences on the 2-core VM (engine.batch on its main thread, local ducks)
# waited 2.8 ms for a duck's wake-up after each step's torch argmax, and its steps took
# 79-82 ms against 72-73 with PASSIVE workers, which sleep at once. libgomp reads this once,
# when torch loads it, so only before torch's first import; a value already set is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

