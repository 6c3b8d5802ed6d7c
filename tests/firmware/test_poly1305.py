"""The data path's MAC: Poly1305 (native/wire/poly1305.c) against the vectors of
RFC 8439 (§2.5.2 and appendix A.3) and a Python big-integer reference; the link
key and the one-time keys against hashlib."""
import hashlib
import random

import pytest

from native._native import ffi, lib

IETF = (b"Any submission to the IETF intended by the Contributor for publication as all or part of an IETF "
        b"Internet-Draft or RFC and any statement made within the context of an IETF activity is considered an "
        b"\"IETF Contribution\". Such statements include oral statements in IETF sessions, as well as written and "
        b"electronic communications made at any time or place, which are addressed to")

# (key = r || s, message, tag), RFC 8439 §2.5.2 and A.3
VECTORS = [
    ("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b", b"Cryptographic Forum Research Group",
     "a8061dc1305136c6c22b8baf0c0127a9"),
    ("00" * 32, bytes(64), "00" * 16),
    ("00" * 16 + "36e5f6b5c5e06070f0efca96227a863e", IETF, "36e5f6b5c5e06070f0efca96227a863e"),
    ("36e5f6b5c5e06070f0efca96227a863e" + "00" * 16, IETF, "f3477e7cd95417af89a6b8794c310cf0"),
    ("02" + "00" * 31, b"\xff" * 16, "03" + "00" * 15),
    ("02" + "00" * 15 + "ff" * 16, b"\x02" + bytes(15), "03" + "00" * 15),
    ("01" + "00" * 31, b"\xff" * 16 + b"\xf0" + b"\xff" * 15 + b"\x11" + bytes(15), "05" + "00" * 15),
    ("01" + "00" * 31, b"\xff" * 16 + b"\xfb" + b"\xfe" * 15 + b"\x01" * 16, "00" * 16),
    ("02" + "00" * 31, b"\xfd" + b"\xff" * 15, "faffffffffffffffffffffffffffffff"),
]


def poly1305(key: bytes, msg: bytes, split: int | None = None) -> bytes:
    out = ffi.new("uint8_t[16]")
    split = len(msg) if split is None else split
    a, b = msg[:split], msg[split:]
    lib.wire_poly1305(key, a, len(a), b, len(b), out)
    return bytes(out)


def poly1305_ref(key: bytes, msg: bytes) -> bytes:
    """RFC 8439 §2.5.1, in Python integers."""
    r = int.from_bytes(key[:16], "little") & 0x0FFFFFFC0FFFFFFC0FFFFFFC0FFFFFFF
    s = int.from_bytes(key[16:], "little")
    p = (1 << 130) - 5
    acc = 0
    for i in range(0, len(msg), 16):
        block = msg[i:i + 16] + b"\x01"
        acc = (acc + int.from_bytes(block, "little")) * r % p
    return ((acc + s) % (1 << 128)).to_bytes(16, "little")


def test_ietf_text_is_the_rfcs():
    assert len(IETF) == 375


@pytest.mark.parametrize("key,msg,tag", VECTORS)
def test_rfc8439_vectors(key, msg, tag):
    assert poly1305(bytes.fromhex(key), msg).hex() == tag
    assert poly1305_ref(bytes.fromhex(key), msg).hex() == tag


def test_against_the_reference_at_odd_lengths_and_splits():
    rng = random.Random(8439)
    for n in [0, 1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 1000, 4099]:
        for _ in range(4):
            key = bytes(rng.getrandbits(8) for _ in range(32))
            if rng.random() < 0.3:   # r and s at their extremes: the final reduction's edge
                key = b"\xff" * 32
            msg = bytes(rng.getrandbits(8) for _ in range(n))
            want = poly1305_ref(key, msg)
            assert poly1305(key, msg) == want, n
            assert poly1305(key, msg, rng.randint(0, n)) == want, n


def test_link_key_and_mac_follow_the_spec():
    """link = BLAKE2b-256(fleet key, "duck-link-v1" || run || challenge); each datagram's
    one-time key BLAKE2b-256(link, header); the MAC Poly1305 of header || payload."""
    fleet, run, chal = b"k" * 32, bytes(range(16)), bytes(range(100, 116))
    key = ffi.new("wire_key *")
    key.bytes[0:32] = list(fleet)
    key.len = 32
    lib.wire_link_set(key, run, chal)
    assert key.has_link and bytes(key.run) == run
    link = hashlib.blake2b(b"duck-link-v1" + run + chal, key=fleet, digest_size=32).digest()
    hdr, payload = bytes(range(32)), b"payload bytes" * 50
    out = ffi.new("uint8_t[16]")
    lib.wire_link_mac(key, hdr, payload, len(payload), out)
    otk = hashlib.blake2b(hdr, key=link, digest_size=32).digest()
    assert bytes(out) == poly1305_ref(otk, hdr + payload)


def test_avx2_lanes_match_the_portable_reference():
    """wire_poly1305 takes runs of 64 blocks and more in four AVX2 lanes (where the CPU has
    them); wire_poly1305_ref is the portable loop alone. Same tags for every length around
    the lane boundaries, split points, and keys with r and s at their extremes."""
    rng = random.Random(20261201)
    lengths = [0, 15, 16, 255, 1023, 1024, 1025, 1039, 1040, 1087, 1088, 1089, 1400, 4097, 28672, 65459]
    keys = [b"\xff" * 32, bytes(32), b"\x01" + bytes(31)] + [bytes(rng.getrandbits(8) for _ in range(32))
                                                             for _ in range(6)]
    for n in lengths:
        msg = bytes(rng.getrandbits(8) for _ in range(n)) if n % 2 else b"\xff" * n   # all-ones: every carry
        for key in keys:
            for split in {0, 32, min(n, 17), n}:
                a, b = msg[:split], msg[split:]
                ref, fast = ffi.new("uint8_t[16]"), ffi.new("uint8_t[16]")
                lib.wire_poly1305_ref(key, a, len(a), b, len(b), ref)
                lib.wire_poly1305(key, a, len(a), b, len(b), fast)
                assert bytes(fast) == bytes(ref), (n, key.hex(), split)
            if n <= 4097:
                assert bytes(ref) == poly1305_ref(key, msg), (n, key.hex())
