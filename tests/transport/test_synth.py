"""Synthetic weights made by the ducks (wire SYNTH, benchmarks only), with real
duckfw processes on loopback: a synthesized layer's forward equals the local
fp9 reference on the same tensors made here; SYNTH is idempotent, counted
against the capacity, kept in RAM only; malformed or forged requests are
refused by name (or dropped) and the ASan/UBSan duck serves on."""
import re
import socket

import numpy as np
import pytest

from native._native import ffi, lib
from native.kernels import ExpertSlice
from native.transport import DuckError, split_experts, synth_experts
from tests.firmware.test_wire import seal
from tests.transport.ducks import Ducks, sanitizer_binary, sanitizer_report
from tests.transport.test_forward import SUMMATION_ORDER_RTOL, assert_close, flat, local_reference, make_layer, routing


def materialized(per_duck):
    return [[ExpertSlice(e.gate_up.materialize(), e.down.materialize()) for e in slices] for slices in per_duck]


def test_synthesized_layer_matches_the_local_reference(tmp_path):
    """inter 200 over tp 3: S = 128, duck 1 has 72 live units, duck 2 only padding."""
    rng = np.random.default_rng(17)
    hidden, inter, tp, n_experts = 320, 200, 3, 4
    synth = synth_experts(n_experts, hidden, inter, tp, seed=5, name="bench")
    real = split_experts(make_layer(rng, 2, inter, hidden), tp=tp)    # uploaded beside them
    assert all(e.gate_up.shape == real[d][0].gate_up.shape and e.down.shape == real[d][0].down.shape
               for d in range(tp) for e in synth[d])
    assert synth[1][0].down.desc.live_cols == 72 and synth[2][0].gate_up.desc.live_rows == 0
    local = materialized(synth)
    assert not local[2][0].gate_up.to_float().any() and not local[1][0].down.to_float()[:, 72:].any()
    with Ducks(tp, tmp_path, retransmit_ms=50, deadline_ms=5000) as ducks:
        held = [{t.digest(): t for t in a + b} for a, b in zip(flat(synth), flat(real))]
        real_unique = [{t.digest(): t for t in ts} for ts in flat(real)]   # duck 2's padding slices repeat
        done = ducks.fleet.upload([a + b for a, b in zip(flat(synth), flat(real))])
        assert done["synthesized"] == tp * n_experts * 2 and done["uploaded"] == sum(map(len, real_unique))
        assert done["synth_bytes"] == sum(t.nbytes for ts in flat(synth) for t in ts)
        stats = ducks.fleet.stats()
        assert [s["upload_bytes"] for s in stats] == [sum(t.nbytes for t in u.values()) for u in real_unique]
        session = ducks.fleet.open_session({0: synth, 1: real}, hidden)
        for ntok in (1, 9):
            x = (rng.standard_normal((ntok, hidden)) * 0.5).astype(np.float32)
            ids, w = routing(rng, ntok, 2, n_experts)
            y = session.forward(0, x, ids, w)
            assert np.isfinite(y).all()
            assert_close(y, local_reference(local, hidden, x, ids, w), SUMMATION_ORDER_RTOL, f"synth ntok {ntok}")
        again = ducks.fleet.upload(flat(synth))                       # idempotent: all held
        assert again["synthesized"] == 0 and again["skipped"] == n_experts * 2 * tp
        infos = ducks.fleet.hello()
        assert [i.cache_bytes for i in infos] == [sum(t.nbytes for t in h.values()) for h in held]
        session.close()


def test_synthetic_entries_live_in_ram_only(tmp_path):
    per_duck = synth_experts(2, 256, 128, 1, seed=9)
    tensors = flat(per_duck)[0]
    with Ducks(1, tmp_path) as ducks:
        assert ducks.fleet.upload([tensors])["synthesized"] == 4
        assert ducks.fleet.cache_query([[t.digest() for t in tensors]]) == [{t.digest() for t in tensors}]
        assert not list(ducks[0].cache_dir.iterdir())                # nothing written to disk
        assert ducks.fleet.invalidate(tensors[0].digest()) == [1]
        assert ducks.fleet.upload([tensors])["synthesized"] == 1
        ducks[0].kill9()
        ducks[0].start()
        assert ducks.fleet.hello()[0].cache_entries == 0              # gone with the process
        assert ducks.fleet.upload([tensors])["synthesized"] == 4     # and made again


# 400 tensors of 9280 and 4672 bytes: 86 fit 600 kB (5 requests); 256 entries at most (2 requests)
@pytest.mark.parametrize("batch_bytes,requests", [(600_000, 5), (None, 2)])
def test_many_tensors_go_in_bounded_batches(tmp_path, monkeypatch, batch_bytes, requests):
    from native.transport import upload as transport_upload

    tensors = flat(synth_experts(200, 64, 64, 1))[0]
    assert [t.nbytes for t in tensors[:2]] == [9280, 4672]
    if batch_bytes:
        monkeypatch.setattr(transport_upload, "SYNTH_BATCH_BYTES", batch_bytes)
    with Ducks(1, tmp_path) as ducks:
        ducks.fleet.hello()   # the run opened first (hello, RUN_OPEN): not counted below
        before = ducks.fleet.stats()[0]["requests"]
        assert ducks.fleet.upload([tensors])["synthesized"] == 400
        # the cache query, the SYNTH requests, this stats request
        assert ducks.fleet.stats()[0]["requests"] - before == 1 + requests + 1
        assert ducks.fleet.hello()[0].cache_entries == 400


def _desc(rows=128, cols=256, version=None, live_rows=None, live_cols=None, prescale_log2=-20, seed=1):
    d = ffi.new("fp9_synth_desc *")
    d.version = lib.FP9_SYNTH_VERSION if version is None else version
    d.rows, d.cols, d.prescale_log2, d.seed = rows, cols, prescale_log2, seed
    d.live_rows = rows if live_rows is None else live_rows
    d.live_cols = cols if live_cols is None else live_cols
    return d


def _entry(d, digest: bytes | None = None) -> bytes:
    if digest is None:
        out = ffi.new("uint8_t[16]")
        lib.wire_synth_digest(d, out)
        digest = bytes(out)
    return bytes(ffi.buffer(d)) + digest


def _synth(fleet, entries: list[bytes], count: int | None = None, reserved: int = 0) -> tuple[int, str]:
    head = (len(entries) if count is None else count).to_bytes(4, "little") + reserved.to_bytes(4, "little")
    [(status, body)] = fleet.call([(0, lib.WIRE_T_SYNTH, head + b"".join(entries), 16)], check=False)
    return status, body.decode(errors="replace") if status else ""


@pytest.fixture(scope="module")
def asan_duck(tmp_path_factory):
    with Ducks(1, tmp_path_factory.mktemp("synth"), binary=sanitizer_binary(), args=["--cache-capacity", "1M"],
               deadline_ms=5000) as ducks:
        yield ducks
    assert not sanitizer_report(ducks[0].log()), ducks[0].log()[-3000:]


@pytest.mark.parametrize("entries,count,status,message", [
    ([_entry(_desc(rows=0))], None, "WIRE_E_RANGE",
     r"synth entry 0 of 1: shape 0x256: rows and cols must be 1\.\.16777216"),
    ([_entry(_desc(rows=1 << 24, cols=1 << 24))], None, "WIRE_E_RANGE",
     r"shape 16777216x16777216 is 316659348799552 bytes of fp9, over the 4294967296-byte limit"),
    ([_entry(_desc(rows=0xFFFFFFFF))], None, "WIRE_E_RANGE", r"shape 4294967295x256"),
    ([_entry(_desc(live_rows=129))], None, "WIRE_E_RANGE", r"live region 129x256 exceeds the shape 128x256"),
    ([_entry(_desc(prescale_log2=-65))], None, "WIRE_E_RANGE", r"prescale_log2 -65 outside -64\.\.16"),
    ([_entry(_desc(version=2))], None, "WIRE_E_UNSUPPORTED", r"unknown synth descriptor version 2"),
    ([_entry(_desc()), _entry(_desc(seed=2), b"\x11" * 16)], None, "WIRE_E_HASH_MISMATCH",
     r"synth entry 1 of 2: digest 1111.* is not the descriptor's [0-9a-f]{32}; host and duck disagree"),
    ([_entry(_desc())], 2, "WIRE_E_MALFORMED", r"synth of 56 bytes is not a 8-byte head and 48-byte entries"),
    ([], 0, "WIRE_E_RANGE", r"synth of 0 entries"),
    ([_entry(_desc(seed=s)) for s in range(257)], None, "WIRE_E_RANGE", r"synth of 257 entries .* 1\.\.256 entries"),
    # 2 x 590 KB does not fit 1 MiB: refused whole, nothing made
    ([_entry(_desc(rows=512, cols=1024, seed=s)) for s in range(2)], None, "WIRE_E_CACHE_FULL",
     r"cache full: 0 of 1048576 bytes used .*2 synthetic tensors need 1179776; .*--cache-capacity"),
])
def test_malformed_synth_is_refused_by_name(asan_duck, entries, count, status, message):
    fleet = asan_duck.fleet
    got, text = _synth(fleet, entries, count)
    assert got == getattr(lib, status), text
    assert text and re.search(message, text), text
    assert fleet.hello()[0].cache_entries == 0                       # nothing was made
    assert _synth(fleet, [_entry(_desc(rows=6, cols=70, seed=99))]) == (0, "")   # and it serves on
    assert fleet.invalidate() == [1]


def test_forged_synth_is_dropped(asan_duck):
    fleet, duck = asan_duck.fleet, asan_duck[0]
    before = fleet.stats()[0]
    payload = (1).to_bytes(4, "little") + bytes(4) + _entry(_desc(seed=123))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(seal(payload, b"w" * 32, mtype=lib.WIRE_T_SYNTH), duck.address)    # another key
        s.sendto(seal(payload, None, mtype=lib.WIRE_T_SYNTH), duck.address)         # no MAC at all
    after = fleet.stats()[0]
    assert after["unauthenticated"] - before["unauthenticated"] == 2
    assert fleet.hello()[0].cache_entries == 0 and duck.proc.poll() is None


def test_synth_through_the_fleet_names_the_duck(tmp_path):
    tensors = flat(synth_experts(1, 1024, 1024, 1))[0]              # 2 x 1.2 MB > 1 MiB
    with Ducks(1, tmp_path, args=["--cache-capacity", "1M"]) as ducks:
        with pytest.raises(DuckError, match=r"duck 0 .* refused synth: cache full") as e:
            ducks.fleet.upload([tensors])
        assert e.value.status == lib.WIRE_E_CACHE_FULL and e.value.duck == 0
        assert ducks.fleet.hello()[0].cache_entries == 0
