"""Digests and random tokens: SHA-256, HMAC-SHA256, constant-time equality, tokens.

Coffer hashes what it fingerprints (definitions, catalogues, exposed names) and signs what it hands out
(requestState) with SHA-256.  hashlib, hmac and secrets load OpenSSL's libcrypto into every process that imports
them, which is most of what a long-running service holds beyond Python itself; CPython also builds SHA-256 in
(the _sha2 module, _sha256 before 3.12), and that is what is used here.  HMAC is RFC 2104 over that SHA-256,
checked against the standard library's hmac (and RFC 4231's vectors) by tests/test_digests.py.
"""

from __future__ import annotations

import base64
import functools
import importlib
import os


@functools.cache
def _sha256_constructor():
    """CPython's own SHA-256 (3.12+ names its module _sha2, 3.10 and 3.11 _sha256); hashlib's, from OpenSSL, only
    for a build without the built-in hashes."""
    for module in ("_sha2", "_sha256"):
        try:
            return importlib.import_module(module).sha256
        except ImportError:
            continue
    return importlib.import_module("hashlib").sha256


@functools.cache
def _constant_time_equal():
    """The comparison the standard library's hmac.compare_digest is (CPython's _operator); hmac's own elsewhere."""
    try:
        return importlib.import_module("_operator")._compare_digest
    except (ImportError, AttributeError):
        return importlib.import_module("hmac").compare_digest


_BLOCK = 64  # SHA-256's block size in bytes (RFC 2104's B)
_INNER = bytes(x ^ 0x36 for x in range(256))
_OUTER = bytes(x ^ 0x5C for x in range(256))


def sha256(data: bytes = b""):
    """A SHA-256 hash object (update, digest, hexdigest), as hashlib.sha256 gives."""
    return _sha256_constructor()(data)


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``key`` (RFC 2104)."""
    if len(key) > _BLOCK:
        key = sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    inner = sha256(key.translate(_INNER))
    inner.update(message)
    outer = sha256(key.translate(_OUTER))
    outer.update(inner.digest())
    return outer.digest()


def same_secret(a: bytes, b: bytes) -> bool:
    """Whether two byte strings are equal, in a time that does not depend on where they differ (a token or a MAC
    compared with what an attacker sent)."""
    return _constant_time_equal()(a, b)


def token_urlsafe(nbytes: int = 32) -> str:
    """A random URL-safe text token of ``nbytes`` random bytes, as secrets.token_urlsafe makes."""
    return base64.urlsafe_b64encode(os.urandom(nbytes)).rstrip(b"=").decode("ascii")


def token_hex(nbytes: int = 32) -> str:
    """A random hexadecimal token of ``nbytes`` random bytes."""
    return os.urandom(nbytes).hex()
