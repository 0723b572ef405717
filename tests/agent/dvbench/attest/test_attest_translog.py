"""The transparency log: RFC 9162 roots, inclusion and consistency proofs for every tree
size up to a few hundred, altered proofs, and signed checkpoints."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvbench.attest import (
    EMPTY_ROOT,
    Checkpoint,
    InvalidProofError,
    InvalidSignatureError,
    KeyNotValidError,
    MalformedInputError,
    MerkleTree,
    SigningKey,
    TrustRoot,
    UnknownKeyError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_hash,
    sign_checkpoint,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)

MAX_SIZE = 300
LEAVES = [leaf_hash(b"entry %d" % number) for number in range(MAX_SIZE)]


def reference_root(leaves: Sequence[bytes]) -> bytes:
    """RFC 9162 section 2.1.1, written as literally as possible."""
    n = len(leaves)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return leaves[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return hashlib.sha256(
        b"\x01" + reference_root(leaves[:k]) + reference_root(leaves[k:])
    ).digest()


@pytest.fixture(scope="module")
def tree() -> MerkleTree:
    return MerkleTree(LEAVES)


def test_hashing_is_domain_separated_as_rfc_9162_says() -> None:
    assert leaf_hash(b"") == hashlib.sha256(b"\x00").digest()
    assert (
        node_hash(b"a" * 32, b"b" * 32) == hashlib.sha256(b"\x01" + b"a" * 32 + b"b" * 32).digest()
    )
    assert EMPTY_ROOT == root_hash([]) == hashlib.sha256(b"").digest()


def test_roots_match_the_literal_definition_for_every_size(tree: MerkleTree) -> None:
    growing = MerkleTree()
    for size in range(MAX_SIZE + 1):
        expected = reference_root(LEAVES[:size])
        assert tree.root(size) == expected
        assert growing.root() == expected
        if size < MAX_SIZE:
            assert growing.append(LEAVES[size]) == size


def test_known_root_of_a_small_tree() -> None:
    # The 7-leaf tree of RFC 9162 section 2.1.5: ((a b)(c d))((e f) g).
    a, b, c, d, e, f, g = LEAVES[:7]
    expected = node_hash(node_hash(node_hash(a, b), node_hash(c, d)), node_hash(node_hash(e, f), g))
    assert root_hash(LEAVES[:7]) == expected
    # Section 2.1.5's examples: the path of b is [a, h(c,d), h(h(e,f),g)].
    assert inclusion_proof(LEAVES[:7], 1) == [a, node_hash(c, d), node_hash(node_hash(e, f), g)]
    # ... and the consistency proof from size 3 to 7 is [c, d, h(a,b), h(h(e,f),g)].
    assert consistency_proof(LEAVES[:7], 3) == [
        c,
        d,
        node_hash(a, b),
        node_hash(node_hash(e, f), g),
    ]


def test_inclusion_proofs_verify_for_every_size_and_index(tree: MerkleTree) -> None:
    for size in range(1, MAX_SIZE + 1):
        root = tree.root(size)
        for index in range(size):
            verify_inclusion(LEAVES[index], index, size, tree.inclusion_proof(index, size), root)


def test_consistency_proofs_verify_for_every_pair_of_sizes(tree: MerkleTree) -> None:
    roots = [tree.root(size) for size in range(MAX_SIZE + 1)]
    for new in range(MAX_SIZE + 1):
        for old in range(new + 1):
            verify_consistency(old, new, roots[old], roots[new], tree.consistency_proof(old, new))


def _alterations(proof: list[bytes]) -> list[list[bytes]]:
    altered: list[list[bytes]] = []
    for position in range(len(proof)):
        for bit in (0, 7 * 8 + 3, 255):
            value = bytearray(proof[position])
            value[bit // 8] ^= 1 << (bit % 8)
            altered.append([*proof[:position], bytes(value), *proof[position + 1 :]])
        altered.append(proof[:position] + proof[position + 1 :])  # dropped
        altered.append([*proof[:position], proof[position], *proof[position:]])  # duplicated
    altered.append([*proof, LEAVES[0]])  # extended
    if len(proof) > 1:
        altered.append(proof[::-1])  # reordered
    return [candidate for candidate in altered if candidate != proof]


def test_altered_inclusion_proofs_fail(tree: MerkleTree) -> None:
    for size in (*range(1, 40), 64, 65, 127, 200, 255, 256, 257, MAX_SIZE):
        root = tree.root(size)
        for index in sorted({0, 1, size // 2, size - 2, size - 1} & set(range(size))):
            proof = tree.inclusion_proof(index, size)
            for altered in _alterations(proof):
                with pytest.raises(InvalidProofError):
                    verify_inclusion(LEAVES[index], index, size, altered, root)
            other = (index + 1) % size
            if other != index:
                with pytest.raises(InvalidProofError):
                    verify_inclusion(LEAVES[index], other, size, proof, root)
                with pytest.raises(InvalidProofError):
                    verify_inclusion(LEAVES[other], index, size, proof, root)
            # (The same path can fit a neighbouring tree size; that is why a checkpoint
            # signs the size together with the root.)
            with pytest.raises(InvalidProofError):
                verify_inclusion(LEAVES[index], size, size, proof, root)
            with pytest.raises(InvalidProofError):
                verify_inclusion(LEAVES[index], index, size, proof, tree.root(size - 1))


def test_altered_consistency_proofs_fail(tree: MerkleTree) -> None:
    for new in (*range(2, 34), 64, 65, 100, 128, 129, 255, 256, MAX_SIZE):
        for old in sorted({1, 2, 3, new // 2, new - 1} & set(range(1, new))):
            old_root, new_root = tree.root(old), tree.root(new)
            proof = tree.consistency_proof(old, new)
            for altered in _alterations(proof):
                with pytest.raises(InvalidProofError):
                    verify_consistency(old, new, old_root, new_root, altered)
            with pytest.raises(InvalidProofError):
                verify_consistency(old, new, tree.root(old - 1), new_root, proof)
            with pytest.raises(InvalidProofError):
                verify_consistency(old, new, old_root, tree.root(new - 1), proof)
            with pytest.raises(InvalidProofError):
                verify_consistency(new, old, new_root, old_root, proof)


def test_consistency_edge_cases() -> None:
    root = root_hash(LEAVES[:5])
    verify_consistency(0, 5, EMPTY_ROOT, root, [])
    verify_consistency(5, 5, root, root, [])
    with pytest.raises(InvalidProofError, match="different roots"):
        verify_consistency(5, 5, root, EMPTY_ROOT, [])
    with pytest.raises(InvalidProofError, match="must be empty"):
        verify_consistency(5, 5, root, root, [root])
    with pytest.raises(InvalidProofError, match="is empty"):
        verify_consistency(2, 5, root_hash(LEAVES[:2]), root, [])


def test_bad_arguments_are_named(tree: MerkleTree) -> None:
    with pytest.raises(ValueError, match="leaf index 5 is outside a tree of size 5"):
        tree.inclusion_proof(5, 5)
    with pytest.raises(ValueError, match="tree size 301 is outside"):
        tree.root(MAX_SIZE + 1)
    with pytest.raises(ValueError, match="old tree size 6 is outside"):
        tree.consistency_proof(6, 5)
    with pytest.raises(ValueError, match="a leaf hash is 32 bytes"):
        MerkleTree().append(b"short")
    with pytest.raises(InvalidProofError, match="is 3 bytes"):
        verify_inclusion(LEAVES[0], 0, 2, [b"abc"], tree.root(2))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_sizes_of_larger_trees(tree: MerkleTree, data: st.DataObject) -> None:
    new = data.draw(st.integers(1, MAX_SIZE))
    old = data.draw(st.integers(0, new))
    index = data.draw(st.integers(0, new - 1))
    assert inclusion_proof(LEAVES, index, new) == tree.inclusion_proof(index, new)
    assert consistency_proof(LEAVES, old, new) == tree.consistency_proof(old, new)


def test_tens_of_thousands_of_entries() -> None:
    # Scale, not speed (speed belongs to bench/): proofs across a 50,000-entry log verify
    # (the verifiers raise on a bad proof).
    leaves = [hashlib.sha256(number.to_bytes(4, "big")).digest() for number in range(50_000)]
    big = MerkleTree(leaves)
    root = big.root()
    for index in range(0, 50_000, 997):
        verify_inclusion(leaves[index], index, big.size, big.inclusion_proof(index), root)
        old = index + 1
        verify_consistency(old, big.size, big.root(old), root, big.consistency_proof(old))


# --- checkpoints ---------------------------------------------------------------------

ORIGIN = "dvbench.example/log"
AT = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _note(key: SigningKey, *, size: int = 7, at: datetime = AT) -> str:
    return sign_checkpoint(Checkpoint(ORIGIN, size, root_hash(LEAVES[:size]), at), key)


def test_checkpoint_note_format(key_2026a: SigningKey, trust_root_v1: TrustRoot) -> None:
    note = _note(key_2026a)
    body, signatures = note.split("\n\n")
    assert body.split("\n") == [
        ORIGIN,
        "7",
        __import__("base64").b64encode(root_hash(LEAVES[:7])).decode(),
        "timestamp 2026-03-01T12:00:00Z",
    ]
    assert signatures.startswith(f"\u2014 {ORIGIN} ") and signatures.endswith("\n")
    checkpoint = verify_checkpoint(note, trust_root_v1)
    assert checkpoint == Checkpoint(ORIGIN, 7, root_hash(LEAVES[:7]), AT)


def test_checkpoint_key_hash_follows_signed_note(key_2026a: SigningKey) -> None:
    import base64

    from cryptography.hazmat.primitives import serialization

    raw = key_2026a.public_key.public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    expected = hashlib.sha256(ORIGIN.encode() + b"\n\x01" + raw).digest()[:4]
    line = _note(key_2026a).split("\n\n")[1].rstrip("\n")
    assert base64.b64decode(line.split(" ")[2])[:4] == expected


def test_altered_checkpoints_fail(key_2026a: SigningKey, trust_root_v1: TrustRoot) -> None:
    note = _note(key_2026a)
    for old, new in [
        ("\n7\n", "\n8\n"),
        ("12:00:00Z", "12:00:01Z"),
        (ORIGIN + "\n", "other.example/log\n"),
    ]:
        with pytest.raises((InvalidSignatureError, UnknownKeyError)):
            verify_checkpoint(note.replace(old, new, 1), trust_root_v1)
    with pytest.raises(MalformedInputError, match="decimal"):
        verify_checkpoint(note.replace("\n7\n", "\n07\n", 1), trust_root_v1)
    with pytest.raises(MalformedInputError, match="blank line"):
        verify_checkpoint(note.replace("\n\n", "\n", 1), trust_root_v1)
    with pytest.raises(MalformedInputError, match="em dash"):
        verify_checkpoint(note.replace("\u2014", "-", 1), trust_root_v1)


def test_checkpoints_by_untrusted_or_expired_keys_fail(
    key_2026a: SigningKey, outsider_key: SigningKey, trust_root_v2: TrustRoot
) -> None:
    with pytest.raises(UnknownKeyError, match="no signature by a key of the trust root"):
        verify_checkpoint(_note(outsider_key), trust_root_v2)
    # key_2026a retired on 2026-07-01: a checkpoint it signs afterwards is refused.
    late = AT + timedelta(days=200)
    with pytest.raises(KeyNotValidError, match="checkpoint signature"):
        verify_checkpoint(_note(key_2026a, at=late), trust_root_v2)
    assert verify_checkpoint(_note(key_2026a), trust_root_v2).tree_size == 7


def test_cosignatures_by_other_keys_are_ignored(
    key_2026a: SigningKey, outsider_key: SigningKey, trust_root_v1: TrustRoot
) -> None:
    witness = _note(outsider_key).split("\n\n")[1]
    assert verify_checkpoint(_note(key_2026a) + witness, trust_root_v1).tree_size == 7
    assert (
        verify_checkpoint(
            _note(key_2026a).replace("\n\n", "\n\n" + witness, 1), trust_root_v1
        ).tree_size
        == 7
    )
