"""Synthetic fp9 tensors (benchmarks only): the C generator against an
independent NumPy reading of docs/fp9.md section 8, byte for byte; the same
bytes whatever the thread count; stable digests in their own namespace;
weights shaped like an nn.Linear init; descriptors out of range refused."""
import hashlib

import numpy as np
import pytest

from native._native import lib
from native.fp9 import Fp9Error, Fp9Tensor, SynthTensor
from native.kernels import Pool
from tests.native import fp9_spec

# (rows, cols, live_rows, live_cols): odd rows, a partial group, two panels
# (2100 columns = 33 groups), and live regions cutting rows, groups and blocks
SHAPES = [(1, 1, 1, 1), (3, 17, 3, 17), (17, 33, 17, 20), (4, 2100, 3, 2100), (9, 2100, 9, 2049), (6, 130, 0, 130),
          (128, 64, 70, 64)]


@pytest.mark.parametrize("rows,cols,live_rows,live_cols", SHAPES)
def test_generator_matches_the_spec(rows, cols, live_rows, live_cols):
    seed = 0xDEADBEEF12345678 ^ rows * 1000003 ^ cols
    t = SynthTensor(rows, cols, seed, live_rows=live_rows, live_cols=live_cols)
    prescale_log2 = lib.fp9_synth_default_prescale_log2(cols)
    assert t.materialize().to_bytes() == fp9_spec.synth(rows, cols, seed, live_rows, live_cols, prescale_log2)
    assert t.descriptor() == fp9_spec.synth_descriptor(rows, cols, seed, live_rows, live_cols, prescale_log2)


def test_same_bytes_whatever_the_thread_count():
    t = SynthTensor(301, 4100, 7, live_rows=300, live_cols=4000)
    one = t.materialize().to_bytes()
    for threads in (1, 2, 3, 5):
        assert t.materialize(Pool(threads, pin=False)).to_bytes() == one, f"{threads} threads"


def test_digest_is_stable_and_in_its_own_namespace():
    t = SynthTensor(128, 7168, 42)
    want = hashlib.blake2b(fp9_spec.SYNTH_TAG + t.descriptor(), digest_size=16).hexdigest()
    assert t.digest() == want
    # golden values: a change of the recipe or of the descriptor is a new version, not an accident
    assert t.digest() == "59dba0b340b95ce0c022dc3e1ecb32cd"
    assert hashlib.blake2b(SynthTensor(4, 130, 9).materialize().to_bytes(),
                           digest_size=16).hexdigest() == "43833922aa3f8ef9d0f70c0ece835219"
    real = t.materialize()
    assert real.digest() != t.digest()                      # the bytes' own hash is another key
    assert Fp9Tensor.from_bytes(real.to_bytes()).digest() == real.digest()
    assert not (fp9_spec.SYNTH_TAG + t.descriptor()).startswith(fp9_spec.struct.pack("<I", fp9_spec.MAGIC))
    others = [SynthTensor(128, 7168, 43), SynthTensor(128, 7168, 42, live_rows=127), SynthTensor(128, 7168, 42,
              prescale_log2=-20), SynthTensor(7168, 128, 42)]
    assert len({t.digest()} | {o.digest() for o in others}) == 5


def test_weights_look_like_a_linear_init():
    rows, cols = 512, 2048
    w = SynthTensor(rows, cols, 3).materialize().to_float()
    bound = 1 / np.sqrt(cols)
    assert np.isfinite(w).all() and (w != 0).all()
    assert 0.9 * bound <= np.abs(w).max() <= 1.875 * bound
    assert abs(w.mean()) < 0.01 * w.std() and 0.4 * bound < w.std() < 0.9 * bound
    assert abs((w < 0).mean() - 0.5) < 0.01
    y = w @ np.random.default_rng(0).standard_normal(cols)     # an output of the order of the input
    assert 0.3 < y.std() < 1.0


def test_padding_is_zero_with_sign_zero():
    t = SynthTensor(5, 100, 11, live_rows=3, live_cols=70).materialize()
    w = t.to_float()
    assert (w[3:] == 0).all() and (w[:, 70:] == 0).all() and (w[:3, :70] != 0).all()
    assert not np.signbit(w[3:]).any() and not np.signbit(w[:, 70:]).any()


@pytest.mark.parametrize("kwargs,message", [
    (dict(rows=0, cols=64), r"shape 0x64: rows and cols must be 1\.\.16777216"),
    (dict(rows=64, cols=(1 << 24) + 1), r"shape 64x16777217: rows and cols must be"),
    (dict(rows=1 << 24, cols=1 << 24), r"shape 16777216x16777216 is \d+ bytes of fp9, over the 4294967296-byte"),
    (dict(rows=-1, cols=64), r"rows -1 does not fit its uint32_t field"),
    (dict(rows=64, cols=64, live_rows=65), r"live region 65x64 exceeds the shape 64x64"),
    (dict(rows=64, cols=64, prescale_log2=17), r"prescale_log2 17 outside -64\.\.16"),
    (dict(rows=64, cols=64, seed=1 << 64), r"seed 18446744073709551616 does not fit"),
])
def test_bad_descriptors_are_refused_by_name(kwargs, message):
    kwargs.setdefault("seed", 1)
    with pytest.raises(Fp9Error, match=r"synthetic tensor 'bad': " + message):
        SynthTensor(name="bad", **kwargs)
