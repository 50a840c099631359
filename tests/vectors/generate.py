"""Write the JSON test vectors of ``secure_agg``, or check them with ``--check``.

Usage::

    python tests/vectors/generate.py           # rewrite prg.json, keys.json, shamir.json, codec.json
    python tests/vectors/generate.py --check   # exit 1 if any file differs from what the code gives

Every input is fixed (private keys, seeds, nonces, the bytes behind the Shamir
coefficients, the numpy generator seed of the codec's stochastic rounding), so the
files are byte-exact regression vectors. ``keys.json`` also carries the X25519 test
vector of RFC 7748, Section 6.1, which is independent of this code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from secure_agg.codec import FixedPointCodec
from secure_agg.keys import (
    RoundContext,
    agree,
    encrypt,
    generate_keypair,
    pairwise_mask_seed,
    share_encryption_key,
)
from secure_agg.prg import expand
from secure_agg.shamir import commitment, split

VECTORS_DIR = Path(__file__).resolve().parent

#: RFC 7748, Section 6.1 (Alice and Bob).
RFC7748 = {
    "alice_private": "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
    "alice_public": "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a",
    "bob_private": "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb",
    "bob_public": "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f",
    "shared": "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742",
}


def byte_stream(data: bytes) -> Callable[[int], bytes]:
    """An ``rng(k)`` seam that hands out ``data`` in order and fails when it runs out."""
    position = 0

    def rng(k: int) -> bytes:
        nonlocal position
        if position + k > len(data):
            raise ValueError("fixed rng bytes exhausted")
        chunk = data[position : position + k]
        position += k
        return chunk

    return rng


def _seed(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def prg_vectors() -> dict[str, Any]:
    """First 16 words of ``expand(seed)`` for 32- and 64-bit rings."""
    seeds = {
        "zero-seed": bytes(32),
        "counting-seed": bytes(range(32)),
        "sha256-label-seed": _seed("fedweave prg vector"),
    }
    cases = []
    for name, seed in seeds.items():
        for bits in (32, 64):
            words = expand(seed, 16, bits)
            cases.append(
                {
                    "id": f"{name}-{bits}",
                    "seed": seed.hex(),
                    "bits": bits,
                    "words": [f"{int(w):0{bits // 4}x}" for w in words],
                }
            )
    return {"description": "AES-256-CTR mask expansion, little-endian words", "cases": cases}


def keys_vectors() -> dict[str, Any]:
    """X25519 agreement, HKDF derivations and AES-GCM encryption with fixed inputs."""
    cases = []
    pairs = [
        ("counting-keys", bytes(range(32)), bytes(range(32, 64)), "org-a", "org-b"),
        ("hashed-keys", _seed("alice key"), _seed("bob key"), "hospital-7", "bank-2"),
    ]
    for name, priv_a, priv_b, org_a, org_b in pairs:
        kp_a, kp_b = generate_keypair(priv_a), generate_keypair(priv_b)
        shared = agree(kp_a.private, kp_b.public)
        ctx = RoundContext(federation="fed-1", run="run-2024", round=7)
        enc_key = share_encryption_key(shared, ctx, org_a, org_b)
        nonce = _seed(f"{name} nonce")[:12]
        plaintext = b"share bytes for " + org_b.encode()
        aad = ctx.to_bytes() + org_a.encode() + org_b.encode()
        cases.append(
            {
                "id": name,
                "private_a": priv_a.hex(),
                "private_b": priv_b.hex(),
                "public_a": kp_a.public.hex(),
                "public_b": kp_b.public.hex(),
                "shared": shared.hex(),
                "context": {"federation": ctx.federation, "run": ctx.run, "round": ctx.round},
                "context_bytes": ctx.to_bytes().hex(),
                "a": org_a,
                "b": org_b,
                "mask_seed": pairwise_mask_seed(shared, ctx, org_a, org_b).hex(),
                "share_key": enc_key.hex(),
                "nonce": nonce.hex(),
                "plaintext": plaintext.hex(),
                "aad": aad.hex(),
                "ciphertext": encrypt(enc_key, plaintext, aad, nonce=nonce).hex(),
            }
        )
    return {"description": "X25519 + HKDF-SHA256 + AES-256-GCM", "rfc7748": RFC7748, "cases": cases}


def shamir_vectors() -> dict[str, Any]:
    """Shamir splits whose coefficients come from fixed bytes through the rng seam."""
    cases = []
    for name, secret, t, n in [
        ("2-of-3-short", b"\x01\x02\x03", 2, 3),
        ("3-of-5-seed", _seed("shamir secret"), 3, 5),
        ("4-of-4-64-bytes", _seed("a") + _seed("b"), 4, 4),
        ("1-of-2-leading-zero", b"\x00\x00\x07", 1, 2),
    ]:
        rng_bytes = b"".join(
            hashlib.shake_256(f"{name} coefficient {i}".encode()).digest(66) for i in range(t - 1)
        )
        shares = split(secret, t, n, rng=byte_stream(rng_bytes))
        cases.append(
            {
                "id": name,
                "secret": secret.hex(),
                "t": t,
                "n": n,
                "rng_bytes": rng_bytes.hex(),
                "commitment": commitment(secret).hex(),
                "shares": [share.to_bytes().hex() for share in shares],
            }
        )
    return {"description": "Shamir t-of-n over GF(2^521 - 1)", "cases": cases}


def codec_vectors() -> dict[str, Any]:
    """Fixed-point encoding with a fixed ``np.random.default_rng(seed)``."""
    x = [0.0, 0.5, -0.5, 0.3, -0.3, 1.0, -1.0, 2.5, -7.0, 1e-9, -1e-9, 0.123456789]
    cases = []
    for name, kwargs, dtype in [
        ("b32-clip1-n1-float64", {"bits": 32, "clip": 1.0}, "float64"),
        (
            "b32-clip1-n8-f16-float32",
            {"bits": 32, "clip": 1.0, "max_summands": 8, "frac_bits": 16},
            "float32",
        ),
        (
            "b64-clip2-n100-noise",
            {"bits": 64, "clip": 2.0, "max_summands": 100, "noise_bound": 0.5},
            "float64",
        ),
        ("b32-clip0.25-coarse", {"bits": 32, "clip": 0.25, "frac_bits": 3}, "float64"),
    ]:
        codec = FixedPointCodec(**kwargs)  # type: ignore[arg-type]
        seed = 20240611
        encoded = codec.encode(np.asarray(x, dtype=dtype), np.random.default_rng(seed))
        cases.append(
            {
                "id": name,
                "codec": kwargs,
                "frac_bits": codec.frac_bits,
                "dtype": dtype,
                "seed": seed,
                "x": x,
                "encoded": [f"{int(w):0{codec.bits // 4}x}" for w in encoded],
                "decoded": [float(v) for v in codec.decode(encoded)],
            }
        )
    return {
        "description": "FixedPointCodec.encode with np.random.default_rng(seed)",
        "cases": cases,
    }


BUILDERS: dict[str, Callable[[], dict[str, Any]]] = {
    "prg": prg_vectors,
    "keys": keys_vectors,
    "shamir": shamir_vectors,
    "codec": codec_vectors,
}


def render(name: str) -> str:
    """The exact text of ``NAME.json``."""
    return json.dumps(BUILDERS[name](), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="verify the files, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name in BUILDERS:
        path = VECTORS_DIR / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("stale test vectors: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
