"""The weight cache of a real duck: persisted across restarts (no re-upload),
verified on load (a corrupt entry is discarded and counted), bounded by its
capacity with a clear refusal, invalidated on request, resumable uploads."""
import numpy as np
import pytest

from native._native import ffi, lib
from native.fp9 import Fp9Tensor
from native.transport import DuckError
from native.transport.upload import _upload_payload
from tests.transport.ducks import Ducks


def tensors(n, rows=128, cols=1024, seed=0):
    rng = np.random.default_rng(seed)
    return [Fp9Tensor.from_float(rng.standard_normal((rows, cols)).astype(np.float32), f"t{i}") for i in range(n)]


def test_restarted_duck_finds_its_cache(tmp_path):
    ts = tensors(3)
    with Ducks(1, tmp_path) as ducks:
        assert ducks.fleet.upload([ts])["uploaded"] == 3
        ducks[0].kill9()
        ducks[0].start()
        info = ducks.fleet.hello()[0]
        assert info.cache_entries == 3 and info.cache_bytes == sum(t.nbytes for t in ts)
        again = ducks.fleet.upload([ts])
        assert again["uploaded"] == 0 and again["skipped"] == 3
        assert ducks.fleet.stats()[0]["upload_bytes"] == 0      # nothing sent to the new process


def test_memory_cache_serves_uploads_and_writes_no_file(tmp_path):
    """--memory-cache (a disk-less duck): uploads are held and verified as usual, nothing is written,
    and a restarted duck has to get them again."""
    ts = tensors(2)
    with Ducks(1, tmp_path, args=["--memory-cache"]) as ducks:
        assert ducks.fleet.upload([ts])["uploaded"] == 2
        assert ducks.fleet.hello()[0].cache_entries == 2
        assert ducks.fleet.invalidate(ts[0].digest()) == [1]
        assert not ducks[0].cache_dir.exists() and "in memory only" in ducks[0].log()
        ducks[0].kill9()
        ducks[0].start()
        assert ducks.fleet.hello()[0].cache_entries == 0
        assert ducks.fleet.upload([ts])["uploaded"] == 2


def test_corrupt_entry_is_discarded_and_reported(tmp_path):
    ts = tensors(2)
    with Ducks(1, tmp_path) as ducks:
        ducks.fleet.upload([ts])
        ducks[0].stop()
        victim = ducks[0].cache_dir / f"{ts[0].digest()}.fp9"
        data = bytearray(victim.read_bytes())
        data[500] ^= 0x10
        victim.write_bytes(bytes(data))
        ducks[0].start()
        assert ducks.fleet.stats()[0]["cache_corrupt"] == 1
        assert "corrupt entry" in ducks[0].log()
        assert not victim.exists()
        assert ducks.fleet.upload([ts]) ["uploaded"] == 1


def test_capacity_is_a_clear_refusal(tmp_path):
    ts = tensors(3)          # ~147 KB each
    with Ducks(1, tmp_path, args=["--cache-capacity", "300K"]) as ducks:
        with pytest.raises(DuckError, match="cache full") as e:
            ducks.fleet.upload([ts])
        assert e.value.status == lib.WIRE_E_CACHE_FULL and e.value.duck == 0
        assert "--cache-capacity" in str(e.value)
        assert ducks.fleet.hello()[0].cache_entries == 2
        assert ducks.fleet.invalidate(ts[0].digest()) == [1]
        assert ducks.fleet.upload([ts[2:]])["uploaded"] == 1
        assert ducks.fleet.invalidate() == [2]
        assert ducks.fleet.hello()[0].cache_entries == 0


def test_upload_resumes_and_verifies_the_hash(tmp_path):
    t = tensors(1, rows=512, cols=4096)[0]            # 1.2 MB: two parts
    data = memoryview(t.buf).cast("B")
    digest = bytes.fromhex(t.digest())
    with Ducks(1, tmp_path) as ducks:
        fleet = ducks.fleet
        cap = ffi.sizeof("wire_upload_reply")
        # the first part only, then a "new host" resumes from what the duck reports
        (_, body), = fleet.call([(0, lib.WIRE_T_UPLOAD, _upload_payload(digest, data, 0, 1 << 20), cap)])
        assert ffi.cast("wire_upload_reply *", ffi.from_buffer(body)).have == 1 << 20
        (_, body), = fleet.call([(0, lib.WIRE_T_UPLOAD, _upload_payload(digest, data, 0, 0), cap)])
        rep = ffi.cast("wire_upload_reply *", ffi.from_buffer(body))
        assert rep.have == 1 << 20 and not rep.complete
        assert fleet.upload([[t]])["uploaded"] == 1
        assert fleet.stats()[0]["upload_bytes"] == t.nbytes    # each byte sent once
        # content that does not hash to its name is refused
        other = tensors(1, seed=9)[0]
        bad = _upload_payload(bytes(16), memoryview(other.buf).cast("B"), 0, other.nbytes)
        with pytest.raises(DuckError, match="content hashes to") as e:
            fleet.call([(0, lib.WIRE_T_UPLOAD, bad, cap)])
        assert e.value.status == lib.WIRE_E_HASH_MISMATCH


def test_weights_memory_is_reused_after_invalidation(tmp_path):
    """The duck's tensors live in huge-page chunks (firmware/cache.c): invalidated
    ones return their memory, tensors made after them land in it, and one larger
    than half a chunk (37 MiB) gets a mapping of its own; forwards stay exact."""
    from native.kernels import ExpertSlice
    from native.transport import synth_experts
    from tests.transport.test_forward import SUMMATION_ORDER_RTOL, assert_close, flat, local_reference, routing

    rng = np.random.default_rng(41)
    hidden = 4096
    small = synth_experts(6, hidden, 256, 1, seed=3, name="small")
    big = synth_experts(1, hidden, 4096, 1, seed=4, name="big")          # gate_up [8192, 4096]
    assert big[0][0].gate_up.nbytes > 32 << 20
    with Ducks(1, tmp_path, deadline_ms=10000) as ducks:
        for layers in ([small], [small, big], [big, small]):
            for per_duck in layers:
                ducks.fleet.upload(flat(per_duck))
            session = ducks.fleet.open_session(dict(enumerate(layers)), hidden)
            for i, per_duck in enumerate(layers):
                local = [[ExpertSlice(e.gate_up.materialize(), e.down.materialize()) for e in per_duck[0]]]
                x = rng.standard_normal((2, hidden)).astype(np.float32)
                ids, w = routing(rng, 2, 1, len(per_duck[0]))
                assert_close(session.forward(i, x, ids, w), local_reference(local, hidden, x, ids, w),
                             SUMMATION_ORDER_RTOL, f"layer {i}")
            session.close()
            assert ducks.fleet.invalidate() == [sum(len(flat(p)[0]) for p in layers)]
