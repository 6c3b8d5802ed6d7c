"""native/wire.c against independent references: BLAKE2b and keyed BLAKE2b
against hashlib, CRC-32C against a bitwise Python implementation, and the
datagram checks against hand-made bad datagrams."""
import hashlib
import os

import numpy as np
import pytest

from native._native import ffi, lib
from native.fp9 import Fp9Tensor

LENGTHS = [0, 1, 3, 17, 63, 64, 127, 128, 129, 255, 256, 1000, 4097, 100_003]


def crc32c_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def wire_key(key):
    """A wire_key of the fleet key's bytes; a wire_key already (Fleet.link_key: with a link) as it is."""
    if isinstance(key, ffi.CData):
        return key
    k = ffi.new("wire_key *")
    k.bytes[0:len(key)] = key
    k.len = len(key)
    return k


def c_digest(data: bytes) -> bytes:
    out = ffi.new("uint8_t[16]")
    lib.wire_digest(data, len(data), out)
    return bytes(out)


@pytest.mark.parametrize("n", LENGTHS)
def test_digest_is_blake2b_128(n):
    data = os.urandom(n)
    assert c_digest(data) == hashlib.blake2b(data, digest_size=16).digest()


def test_digest_is_the_fp9_tensor_digest():
    t = Fp9Tensor.from_float(np.random.default_rng(1).standard_normal((6, 130)).astype(np.float32))
    assert c_digest(t.to_bytes()).hex() == t.digest()


@pytest.mark.parametrize("keylen", [16, 32, 33, 64])
@pytest.mark.parametrize("n", [0, 1, 96, 127, 1400, 9000])
def test_mac_is_keyed_blake2b_128(keylen, n):
    key, header, payload = os.urandom(keylen), os.urandom(32), os.urandom(n)
    out = ffi.new("uint8_t[16]")
    lib.wire_mac(wire_key(key), header, payload, n, out)
    assert bytes(out) == hashlib.blake2b(header + payload, key=key, digest_size=16).digest()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 33, 1000, 1535, 1536, 1537, 3072, 4615, 20001])
def test_crc32c(n):
    """Short inputs take one chain of crc32; from 1536 bytes on, three chains joined by shift tables."""
    data = os.urandom(n)
    assert lib.wire_crc32c(0, data, n) == crc32c_reference(data)
    assert lib.wire_crc32c(0, b"123456789", 9) == 0xE3069283   # the standard check value
    half = n // 2                                              # continued from a running value
    assert lib.wire_crc32c(lib.wire_crc32c(0, data[:half], half), data[half:], n - half) == crc32c_reference(data)


def test_header_layout_matches_the_constants():
    assert ffi.sizeof("wire_header") == lib.WIRE_HEADER_BYTES == 32
    assert ffi.offsetof("wire_header", "checksum") == 28
    assert ffi.sizeof("wire_hello_reply") == 144 and ffi.sizeof("wire_stats") == 192


def seal(payload: bytes, key, mtype=None, flags=0, frag_index=0, frag_count=1, total=None,
         session=7, sequence=42) -> bytes:
    h = ffi.new("wire_header *")
    h.type = lib.WIRE_T_PING if mtype is None else mtype
    h.flags, h.session, h.sequence = flags, session, sequence
    h.frag_index, h.frag_count = frag_index, frag_count
    h.total_len = len(payload) if total is None else total
    out = ffi.new("uint8_t[]", len(payload) + 64)
    n = lib.wire_seal(h, payload, len(payload), wire_key(key) if key else ffi.NULL, int(key is not None), out)
    return bytes(out[0:n])


def check(dgram: bytes, key: bytes | None, require_mac=False) -> int:
    h = ffi.new("wire_header *")
    p = ffi.new("const uint8_t **")
    return lib.wire_check(dgram, len(dgram), wire_key(key) if key else ffi.NULL, int(require_mac), h, p)


def test_seal_then_check_round_trip():
    key = os.urandom(32)
    d = seal(b"x" * 8, key)
    assert len(d) == 32 + 8 + 16
    assert check(d, key, require_mac=True) == lib.WIRE_CHECK_OK
    # the checksum is CRC-32C over the datagram with the checksum field zeroed
    zeroed = d[:28] + b"\0\0\0\0" + d[32:]
    assert int.from_bytes(d[28:32], "little") == crc32c_reference(zeroed)


def test_check_refuses_each_defect():
    key = os.urandom(32)
    good = seal(b"p" * 8, key)
    assert check(good[:20], key) == lib.WIRE_CHECK_SHORT
    assert check(b"XXXX" + good[4:], key) == lib.WIRE_CHECK_MAGIC
    assert check(good[:-1], key) == lib.WIRE_CHECK_LENGTH
    flipped = bytearray(good)
    flipped[40] ^= 1
    assert check(bytes(flipped), key) == lib.WIRE_CHECK_CHECKSUM
    assert check(good, os.urandom(32)) == lib.WIRE_CHECK_MAC                 # forged: other key
    assert check(seal(b"p" * 8, None), key, require_mac=True) == lib.WIRE_CHECK_MAC
    assert check(seal(b"p" * 8, key, frag_index=2, frag_count=2), key) == lib.WIRE_CHECK_FRAGMENT
    assert check(seal(b"p" * 8, key, frag_count=3, total=24 + 1), key) == lib.WIRE_CHECK_FRAGMENT
    assert check(seal(b"p" * 8, key, mtype=99), key) == lib.WIRE_CHECK_TYPE
    assert check(seal(b"p" * 8, key, flags=0x40), key) == lib.WIRE_CHECK_TYPE
    assert check(seal(b"p" * 8, key, frag_index=1, frag_count=3, total=24), key) == lib.WIRE_CHECK_OK


def test_fragment_rule():
    """count = ceil(total / max_payload); all but the last carry ceil(total / count)."""
    mtu_payload = 1500 - lib.WIRE_IP_UDP_BYTES - lib.WIRE_HEADER_BYTES - lib.WIRE_MAC_BYTES
    assert mtu_payload == 1424
    total = 28_672            # one token of hidden 7168 in fp32
    count = -(-total // mtu_payload)
    size = -(-total // count)
    assert count == 21 and size * (count - 1) < total <= size * count


def test_the_type_table_is_the_specs():
    """wire_types (native/wire/wire.c), the one table the host's transport and the duck read: each
    type's name and MAC kind as docs/wire.md's table of message types has them, which requests
    must carry their MAC, and the fixed reply sizes of the handlers."""
    import re
    from pathlib import Path

    rows = re.findall(r"^\| (\d+) \| ([A-Z_]+) \| ([^|]+) \|", (Path(__file__).parents[2] / "docs" / "wire.md")
                      .read_text(), re.M)
    assert [int(n) for n, _, _ in rows] == list(range(1, lib.WIRE_T_COUNT))
    need = {lib.WIRE_MAC_NONE: "none", lib.WIRE_MAC_OPTIONAL: "optional", lib.WIRE_MAC_REQUIRED: "required",
            lib.WIRE_MAC_DATA: "data"}
    for n, name, mac in rows:
        t = lib.wire_types[int(n)]
        assert ffi.string(t.name).decode() == name.lower() == ffi.string(lib.wire_type_str(int(n))).decode()
        assert t.mac_kind == lib.wire_mac_kind(int(n)) == (lib.WIRE_MAC_LINK if mac.startswith("link")
                                                          else lib.WIRE_MAC_FLEET), name
        want = ("none" if mac.strip() == "–" or name == "NACK" else "optional" if "not required" in mac
                else "data" if "no-data-mac" in mac else "required")
        assert need[t.mac_need] == need[lib.wire_mac_need(int(n))] == want, name
    sizes = {name: lib.wire_types[int(n)].reply_size for n, name, _ in rows}
    assert sizes["HELLO"] == 144 and sizes["STATS"] == 192 and sizes["CACHE_INVALIDATE"] == 4
    assert sizes["SYNTH"] == 16 and sizes["FORWARD"] == 0 and ffi.string(lib.wire_type_str(99)) == b"unknown"
