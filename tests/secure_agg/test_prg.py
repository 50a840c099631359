"""Mask expansion with AES-256-CTR: vectors, chunking, in-place masks."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.errors import ConfigError, RingError
from secure_agg.prg import CHUNK_BYTES, FUSED_CHUNK_BYTES, add_mask, add_masks, expand

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
PRG = json.loads((VECTORS / "prg.json").read_text())


@pytest.mark.parametrize("case", PRG["cases"], ids=[c["id"] for c in PRG["cases"]])
def test_prg_vectors(case: dict[str, Any]) -> None:
    words = expand(bytes.fromhex(case["seed"]), 16, case["bits"])
    assert [f"{int(w):0{case['bits'] // 4}x}" for w in words] == case["words"]


def test_keystream_is_aes256_ctr_from_zero_counter() -> None:
    seed = hashlib.sha256(b"independent").digest()
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(64))
    assert expand(seed, 16, 32).tobytes() == stream
    assert expand(seed, 8, 64).tobytes() == stream


def test_expansion_spans_chunks_without_seams() -> None:
    seed = bytes(range(32))
    length = CHUNK_BYTES // 4 * 2 + 13
    long = expand(seed, length, 32)
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    assert long.tobytes() == encryptor.update(bytes(4 * length))
    np.testing.assert_array_equal(long[:200].view(np.uint64), expand(seed, 100, 64))


def test_different_seeds_differ_and_empty_is_empty() -> None:
    assert not np.array_equal(expand(bytes(32), 8, 64), expand(b"\x01" + bytes(31), 8, 64))
    assert expand(bytes(32), 0, 32).shape == (0,)


@pytest.mark.parametrize(
    ("seed", "length", "bits"),
    [(bytes(16), 4, 32), (b"x" * 33, 4, 32), (bytes(32), -1, 32), (bytes(32), 4, 8)],
    ids=["short-seed", "long-seed", "negative-length", "bad-bits"],
)
def test_expand_rejects_bad_arguments(seed: bytes, length: int, bits: int) -> None:
    with pytest.raises(ConfigError):
        expand(seed, length, bits)


@pytest.mark.parametrize("bits", [32, 64], ids=["b32", "b64"])
def test_add_mask_matches_expand_across_chunks(bits: int) -> None:
    dtype = np.uint32 if bits == 32 else np.uint64
    length = CHUNK_BYTES // (bits // 8) * 2 + 7
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**bits, size=length, dtype=dtype)
    seed = hashlib.sha256(b"mask").digest()
    target = base.copy()
    add_mask(target, seed)
    np.testing.assert_array_equal(target, base + expand(seed, length, bits))
    add_mask(target, seed, sign=-1)
    np.testing.assert_array_equal(target, base)


@settings(max_examples=30, deadline=None)
@given(
    seeds=st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4),
    length=st.integers(0, 300),
    bits=st.sampled_from([32, 64]),
)
def test_pairwise_masks_cancel(seeds: list[bytes], length: int, bits: int) -> None:
    dtype = np.uint32 if bits == 32 else np.uint64
    x = np.arange(length, dtype=dtype)
    y = x.copy()
    for seed in seeds:
        add_mask(y, seed, 1)
    for seed in reversed(seeds):
        add_mask(y, seed, -1)
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bits", [32, 64], ids=["b32", "b64"])
def test_fused_masks_equal_one_mask_at_a_time(bits: int) -> None:
    dtype = np.uint32 if bits == 32 else np.uint64
    length = FUSED_CHUNK_BYTES // (bits // 8) * 3 + 11
    base = np.random.default_rng(5).integers(0, 2**bits, size=length, dtype=dtype)
    masks = [(hashlib.sha256(bytes([i])).digest(), 1 if i % 2 else -1) for i in range(5)]
    fused = base.copy()
    add_masks(fused, masks)
    one_by_one = base.copy()
    for seed, sign in masks:
        mask = expand(seed, length, bits)
        one_by_one = one_by_one + mask if sign == 1 else one_by_one - mask
    np.testing.assert_array_equal(fused, one_by_one)
    assert not np.array_equal(fused, base)
    add_masks(fused, [(seed, -sign) for seed, sign in masks])
    np.testing.assert_array_equal(fused, base)
    into = np.full_like(base, 7)
    add_masks(into, masks, base=base)
    np.testing.assert_array_equal(into, one_by_one)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    length=st.integers(0, 3 * 4096 + 37),
    data=st.data(),
)
def test_masks_from_an_offset_are_that_slice_of_the_whole(
    bits: int, length: int, data: st.DataObject
) -> None:
    # a ring member unmasks only its chunk of the sum: the keystream must seek to any
    # element, including one in the middle of a 16-byte counter block
    dtype = np.uint32 if bits == 32 else np.uint64
    lo = data.draw(st.integers(0, length), label="lo")
    hi = data.draw(st.integers(lo, length), label="hi")
    base = np.random.default_rng(length).integers(0, 2**bits, size=length, dtype=dtype)
    masks = [(hashlib.sha256(bytes([i, bits])).digest(), 1 if i % 2 else -1) for i in range(3)]
    whole = base.copy()
    add_masks(whole, masks)
    part = np.empty(hi - lo, dtype=dtype)
    add_masks(part, masks, base=base[lo:hi], offset=lo)
    np.testing.assert_array_equal(part, whole[lo:hi])
    in_place = base[lo:hi].copy()
    add_masks(in_place, masks, offset=lo)
    np.testing.assert_array_equal(in_place, whole[lo:hi])


def test_masks_refuse_a_bad_offset() -> None:
    target = np.arange(10, dtype=np.uint32)
    for offset in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="offset"):
            add_masks(target, [(bytes(32), 1)], offset=offset)  # type: ignore[arg-type]
    np.testing.assert_array_equal(target, np.arange(10, dtype=np.uint32))


def test_fused_masks_reject_a_bad_sign_before_touching_the_target() -> None:
    target = np.arange(10, dtype=np.uint32)
    with pytest.raises(ConfigError):
        add_masks(target, [(bytes(32), 1), (bytes(32), 2)])
    np.testing.assert_array_equal(target, np.arange(10, dtype=np.uint32))


def test_add_mask_rejects_bad_targets() -> None:
    with pytest.raises(RingError):
        add_mask(np.zeros(4, np.int64), bytes(32))
    with pytest.raises(RingError, match="contiguous"):
        add_mask(np.zeros(8, np.uint32)[::2], bytes(32))
    frozen = np.zeros(4, np.uint32)
    frozen.flags.writeable = False
    with pytest.raises(RingError, match="writeable"):
        add_mask(frozen, bytes(32))
    with pytest.raises(ConfigError, match="sign"):
        add_mask(np.zeros(4, np.uint32), bytes(32), sign=2)


def test_vector_files_are_current() -> None:
    spec = importlib.util.spec_from_file_location("vectors_generate", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0


def test_16_bit_masks_cancel_and_read_the_same_keystream() -> None:
    seed = bytes(range(32))
    words = expand(seed, 10, 16)
    assert words.dtype == np.uint16
    np.testing.assert_array_equal(words.view(np.uint32), expand(seed, 5, 32))
    target = np.arange(10, dtype=np.uint16)
    add_masks(target, [(seed, 1), (bytes(32), 1), (seed, -1), (bytes(32), -1)])
    np.testing.assert_array_equal(target, np.arange(10, dtype=np.uint16))
