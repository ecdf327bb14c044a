"""Coffer's SHA-256, HMAC-SHA256 and token helpers (coffer_src.digests) against the standard library's own and
RFC 4231's test vectors: the service signs requestState with them instead of loading OpenSSL."""

import hashlib
import hmac
import os
import re

import pytest

from coffer_src.digests import hmac_sha256, same_secret, sha256, token_hex, token_urlsafe

# RFC 4231, test cases 1, 2, 6 and 7 (key, data, HMAC-SHA-256)
RFC4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. The key "
                    b"needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key, data, expected", RFC4231)
def test_hmac_sha256_matches_rfc_4231(key, data, expected):
    assert hmac_sha256(key, data).hex() == expected


def test_hmac_and_sha256_agree_with_the_standard_library_on_random_input():
    for size in (0, 1, 63, 64, 65, 200, 5000):
        key, data = os.urandom(size % 150), os.urandom(size)
        assert hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest()
        assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
    incremental = sha256(b"ab")
    incremental.update(b"cd")
    assert incremental.digest() == hashlib.sha256(b"abcd").digest()


def test_same_secret_and_tokens():
    assert same_secret(b"abc", b"abc") and not same_secret(b"abc", b"abd") and not same_secret(b"abc", b"ab")
    token = token_urlsafe(32)
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", token) and token != token_urlsafe(32)
    assert re.fullmatch(r"[0-9a-f]{6}", token_hex(3))
