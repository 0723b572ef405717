"""The transparency log's mathematics: RFC 9162 Merkle trees, proofs and checkpoints.

Storage-agnostic: everything works over a sequence of *leaf hashes* (RFC 9162 section
2.1.1, ``SHA-256(0x00 || leaf)``), which the platform keeps in a table. A
:class:`MerkleTree` caches the hash of every complete, aligned power-of-two subtree as
leaves arrive, so a root, an inclusion proof or a consistency proof costs
O(log^2 n) hashes after an O(n) build; tens of thousands of entries are cheap.

Checkpoints follow the C2SP ``tlog-checkpoint`` and ``signed-note`` formats
(https://c2sp.org/tlog-checkpoint, https://c2sp.org/signed-note)::

    dvbench.example/log            <- origin
    42                             <- tree size, ASCII decimal
    qINS1GRFhWHwdkUeqLEoP4yEMkTBBzxBkGwGQlVlVcs=   <- root hash, base64
    timestamp 2026-11-29T12:00:00Z <- extension line: when the checkpoint was signed
                                   <- blank line ends the body
    — dvbench.example/log Az3grlgt...   <- em dash, key name, base64(key hash || signature)

The signature is Ed25519 over the body (the four lines, each ending in a newline). The
4-byte key hash is ``SHA-256(key name || 0x0A || 0x01 || raw public key)[:4]`` as in
signed-note for Ed25519; the key name must equal the origin, and the trust root spells
each key as a signed-note verifier key (``dvbench.attest._note``).

Why the ``timestamp`` extension line stays: keys rotate with validity windows, and a
checkpoint's signature is judged at the time it was signed, which must therefore be
signed too; it also bounds a certificate's ``issuedOn`` from above (the checkpoint that
includes it cannot precede it). C2SP tlog-checkpoint allows extension lines after the
root hash and tells clients to treat unknown ones as opaque, so note and checkpoint
tools (Go's ``sumdb/note`` and ``sumdb/tlog``, sigstore-python) accept it unchanged.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dvbench.attest._encoding import b64decode, b64encode, format_time, parse_time, to_seconds
from dvbench.attest._errors import (
    AttestationError,
    InvalidProofError,
    InvalidSignatureError,
    KeyNotValidError,
    MalformedInputError,
    UnknownKeyError,
)
from dvbench.attest._keys import Signer, TrustRoot
from dvbench.attest._note import note_key_id

__all__ = [
    "EMPTY_ROOT",
    "Checkpoint",
    "MerkleTree",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "node_hash",
    "root_hash",
    "sign_checkpoint",
    "verify_checkpoint",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE: Final = 32
# RFC 9162 section 2.1.1: the hash of an empty list is the hash of an empty string.
EMPTY_ROOT: Final = hashlib.sha256(b"").digest()
_NOTE_DASH: Final = "\u2014 "
_ORIGIN = re.compile(r"[^\s\u2014]+")
# Up to 2**64 - 1, as C2SP tlog-checkpoint bounds the tree size.
_SIZE = re.compile(r"0|[1-9][0-9]{0,19}")


def leaf_hash(leaf: bytes) -> bytes:
    """RFC 9162 section 2.1.1: ``MTH({d(0)}) = SHA-256(0x00 || d(0))``."""
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 section 2.1.1: ``SHA-256(0x01 || MTH(left) || MTH(right))``."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _largest_power_of_two_below(n: int) -> int:
    # RFC 9162 section 2.1.1: "k be the largest power of two smaller than n (k < n <= 2k)".
    return 1 << ((n - 1).bit_length() - 1)


class MerkleTree:
    """An append-only Merkle tree over leaf hashes, with cached complete subtrees.

    ``self._levels[h][i]`` is the hash of leaves ``[i * 2**h, (i + 1) * 2**h)``. The
    recursive splits of RFC 9162 only ever ask for a complete subtree that starts at a
    multiple of its own size (the left part of every split), so each one is a lookup
    and only the ragged right edge is hashed on demand.

    Args:
        leaf_hashes: the initial leaf hashes, in log order.
    """

    def __init__(self, leaf_hashes: Iterable[bytes] = ()) -> None:
        self._levels: list[list[bytes]] = [[]]
        for value in leaf_hashes:
            self.append(value)

    def __len__(self) -> int:
        return len(self._levels[0])

    @property
    def size(self) -> int:
        """The number of leaves."""
        return len(self._levels[0])

    def append(self, leaf_hash_: bytes) -> int:
        """Add a leaf hash; return its index.

        Raises:
            ValueError: the value is not a 32-byte hash.
        """
        if len(leaf_hash_) != HASH_SIZE:
            raise ValueError(f"a leaf hash is {HASH_SIZE} bytes, got {len(leaf_hash_)}")
        index = len(self._levels[0])
        self._levels[0].append(bytes(leaf_hash_))
        level, position = 0, index
        # Completing a right child completes its parent: carry upwards as a binary counter.
        while position & 1:
            below = self._levels[level]
            if len(self._levels) == level + 1:
                self._levels.append([])
            self._levels[level + 1].append(node_hash(below[position - 1], below[position]))
            level, position = level + 1, position >> 1
        return index

    def leaf(self, index: int) -> bytes:
        """The leaf hash at ``index``."""
        return self._levels[0][index]

    def _size(self, size: int | None) -> int:
        if size is None:
            return self.size
        if not 0 <= size <= self.size:
            raise ValueError(f"tree size {size} is outside [0, {self.size}]")
        return size

    def _mth(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) (RFC 9162 section 2.1.1) for ``end > start``."""
        n = end - start
        if (n & (n - 1)) == 0 and start % n == 0:
            return self._levels[n.bit_length() - 1][start // n]
        k = _largest_power_of_two_below(n)
        return node_hash(self._mth(start, start + k), self._mth(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        """The root hash of the first ``size`` leaves (all of them by default).

        Raises:
            ValueError: ``size`` exceeds the tree.
        """
        n = self._size(size)
        return EMPTY_ROOT if n == 0 else self._mth(0, n)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """The audit path of leaf ``index`` in the tree of ``size`` leaves.

        RFC 9162 section 2.1.3.1: ``PATH(m, D[n])`` is empty for ``n = 1``; otherwise,
        with ``k`` the largest power of two below ``n``, ``PATH(m, D[0:k]) : MTH(D[k:n])``
        when ``m < k``, else ``PATH(m - k, D[k:n]) : MTH(D[0:k])``.

        Raises:
            ValueError: ``index`` is not below ``size``, or ``size`` exceeds the tree.
        """
        n = self._size(size)
        if not 0 <= index < n:
            raise ValueError(f"leaf index {index} is outside a tree of size {n}")
        path: list[bytes] = []
        start, end, m = 0, n, index
        # Walk down from the root; siblings are collected top-down, so reverse at the end
        # to list them leaf-to-root as the recursion's ":" concatenation does.
        while end - start > 1:
            k = _largest_power_of_two_below(end - start)
            if m < k:
                path.append(self._mth(start + k, end))
                end = start + k
            else:
                path.append(self._mth(start, start + k))
                start, m = start + k, m - k
        path.reverse()
        return path

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """The proof that the tree of ``old_size`` leaves is a prefix of ``new_size``.

        RFC 9162 section 2.1.4.1: ``PROOF(m, D[n]) = SUBPROOF(m, D[n], true)``, where
        ``SUBPROOF(m, D[m], true)`` is empty, ``SUBPROOF(m, D[m], false) = {MTH(D[m])}``,
        and for ``m < n`` with ``k`` the largest power of two below ``n``:
        ``SUBPROOF(m, D[0:k], b) : MTH(D[k:n])`` if ``m <= k``, else
        ``SUBPROOF(m - k, D[k:n], false) : MTH(D[0:k])``. Empty when ``old_size`` is 0 or
        equals ``new_size``.

        Raises:
            ValueError: ``old_size`` exceeds ``new_size`` or the tree.
        """
        n = self._size(new_size)
        if not 0 <= old_size <= n:
            raise ValueError(f"old tree size {old_size} is outside [0, {n}]")
        if old_size in (0, n):
            return []
        proof: list[bytes] = []
        start, end, m, complete = 0, n, old_size, True
        while m != end - start:
            k = _largest_power_of_two_below(end - start)
            if m <= k:
                proof.append(self._mth(start + k, end))
                end = start + k
            else:
                proof.append(self._mth(start, start + k))
                start, m, complete = start + k, m - k, False
        if not complete:
            proof.append(self._mth(start, end))
        proof.reverse()
        return proof


def root_hash(leaf_hashes: Sequence[bytes]) -> bytes:
    """The RFC 9162 root hash of a list of leaf hashes (O(n))."""
    return MerkleTree(leaf_hashes).root()


def inclusion_proof(
    leaf_hashes: Sequence[bytes], index: int, size: int | None = None
) -> list[bytes]:
    """:meth:`MerkleTree.inclusion_proof` over a list; build a tree to ask several."""
    n = len(leaf_hashes) if size is None else size
    return MerkleTree(leaf_hashes[:n]).inclusion_proof(index, n)


def consistency_proof(
    leaf_hashes: Sequence[bytes], old_size: int, new_size: int | None = None
) -> list[bytes]:
    """:meth:`MerkleTree.consistency_proof` over a list; build a tree to ask several."""
    n = len(leaf_hashes) if new_size is None else new_size
    return MerkleTree(leaf_hashes[:n]).consistency_proof(old_size, n)


def _check_hashes(values: Sequence[bytes], what: str) -> None:
    for position, value in enumerate(values):
        if len(value) != HASH_SIZE:
            raise InvalidProofError(f"{what}[{position}] is {len(value)} bytes, not {HASH_SIZE}")


def verify_inclusion(
    leaf_hash_: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes
) -> None:
    """Check that ``leaf_hash_`` is leaf ``index`` of the tree with ``root``.

    RFC 9162 section 2.1.3.2, step for step.

    Raises:
        InvalidProofError: the proof does not lead from the leaf to ``root``.
    """
    _check_hashes(proof, "inclusion proof")
    # Step 1.
    if not 0 <= index < tree_size:
        raise InvalidProofError(f"leaf index {index} is not below the tree size {tree_size}")
    # Steps 2 and 3.
    fn, sn, r = index, tree_size - 1, leaf_hash_
    # Step 4.
    for p in proof:
        if sn == 0:
            raise InvalidProofError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    # Step 5.
    if sn != 0:
        raise InvalidProofError("inclusion proof is shorter than the tree is deep")
    if r != root:
        raise InvalidProofError(
            f"inclusion proof for leaf {index} does not lead to the root of the tree of size {tree_size}"
        )


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """Check that the tree ``(old_size, old_root)`` is a prefix of ``(new_size, new_root)``.

    RFC 9162 section 2.1.4.2, step for step, for ``0 < old_size < new_size``; an empty
    old tree is a prefix of every tree, and equal sizes need equal roots, both with an
    empty proof.

    Raises:
        InvalidProofError: the proof does not verify.
    """
    _check_hashes(proof, "consistency proof")
    if not 0 <= old_size <= new_size:
        raise InvalidProofError(f"old size {old_size} is not within [0, new size {new_size}]")
    if old_size == 0 or old_size == new_size:
        if proof:
            raise InvalidProofError(
                f"consistency proof for sizes {old_size} -> {new_size} must be empty"
            )
        if old_size == new_size and old_root != new_root:
            raise InvalidProofError(f"two trees of size {old_size} have different roots")
        return
    # Step 1.
    if not proof:
        raise InvalidProofError("consistency proof is empty")
    path = list(proof)
    # Step 2.
    if (old_size & (old_size - 1)) == 0:
        path.insert(0, old_root)
    # Step 3.
    fn, sn = old_size - 1, new_size - 1
    # Step 4.
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    # Step 5.
    fr = sr = path[0]
    # Step 6.
    for c in path[1:]:
        if sn == 0:
            raise InvalidProofError("consistency proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    # Step 7.
    if sn != 0:
        raise InvalidProofError("consistency proof is shorter than the tree is deep")
    if fr != old_root:
        raise InvalidProofError(f"consistency proof does not reproduce the root of size {old_size}")
    if sr != new_root:
        raise InvalidProofError(f"consistency proof does not reproduce the root of size {new_size}")


# --- checkpoints ---------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A log state: origin, tree size, root hash and the time it was signed.

    Attributes:
        origin: the log's unique name, e.g. ``dvbench.example/log``.
        tree_size: the number of leaves.
        root_hash: the RFC 9162 root of those leaves (32 bytes).
        timestamp: when the checkpoint was signed (whole UTC seconds).
    """

    origin: str
    tree_size: int
    root_hash: bytes
    timestamp: datetime

    def __post_init__(self) -> None:
        if _ORIGIN.fullmatch(self.origin) is None:
            raise ValueError(f"checkpoint origin {self.origin!r} must be non-empty without spaces")
        if self.tree_size < 0:
            raise ValueError(f"checkpoint tree size {self.tree_size} is negative")
        if len(self.root_hash) != HASH_SIZE:
            raise ValueError(
                f"checkpoint root hash is {len(self.root_hash)} bytes, not {HASH_SIZE}"
            )
        object.__setattr__(self, "timestamp", to_seconds(self.timestamp))

    def body(self) -> bytes:
        """The signed note body: origin, size, base64 root, timestamp, each line ending in LF."""
        return (
            f"{self.origin}\n{self.tree_size}\n{b64encode(self.root_hash)}\n"
            f"timestamp {format_time(self.timestamp)}\n"
        ).encode()

    @classmethod
    def parse_body(cls, body: str) -> Checkpoint:
        """Parse a body written by :meth:`body`.

        Raises:
            MalformedInputError: any other text.
        """
        lines = body.split("\n")
        if len(lines) != 5 or lines[4] != "":
            raise MalformedInputError(
                "checkpoint body must be four lines, each ending in a newline"
            )
        origin, size, root, stamp = lines[:4]
        if _ORIGIN.fullmatch(origin) is None:
            raise MalformedInputError(f"checkpoint origin {origin!r:.80} is malformed")
        if _SIZE.fullmatch(size) is None or int(size) >= 1 << 64:
            raise MalformedInputError(
                f"checkpoint tree size {size!r:.80} is not a decimal number below 2**64"
            )
        root_hash = b64decode(root, "checkpoint root hash")
        if len(root_hash) != HASH_SIZE:
            raise MalformedInputError(
                f"checkpoint root hash is {len(root_hash)} bytes, not {HASH_SIZE}"
            )
        if not stamp.startswith("timestamp "):
            raise MalformedInputError("checkpoint line 4 must be 'timestamp <RFC 3339 time>'")
        moment = parse_time(stamp.removeprefix("timestamp "), "checkpoint timestamp")
        return cls(origin=origin, tree_size=int(size), root_hash=root_hash, timestamp=moment)


def _note_key_hash(name: str, public_key: Ed25519PublicKey) -> bytes:
    # C2SP signed-note: key ID = SHA-256(key name || 0x0A || signature type 0x01 || key)[:4].
    return note_key_id(name, public_key)[:4]


def sign_checkpoint(checkpoint: Checkpoint, signer: Signer) -> str:
    """The checkpoint as a signed note, signed under the key name ``checkpoint.origin``."""
    body = checkpoint.body()
    signature = signer.sign(body)
    key_hash = _note_key_hash(checkpoint.origin, signer.public_key)
    line = f"{_NOTE_DASH}{checkpoint.origin} {b64encode(key_hash + signature)}\n"
    return body.decode("utf-8") + "\n" + line


def verify_checkpoint(note: object, trust_root: TrustRoot) -> Checkpoint:
    """Verify a signed checkpoint note and return the checkpoint.

    Signature lines of keys the trust root does not list are ignored (other parties,
    such as witnesses, may cosign), but every line must be well formed and one must be a
    valid signature by a listed key, valid at the checkpoint's own timestamp.

    Args:
        note: the signed note text.
        trust_root: the keys to trust.

    Returns:
        The verified checkpoint.

    Raises:
        MalformedInputError: the note does not parse.
        UnknownKeyError: no signature is by a listed key.
        InvalidSignatureError: no listed key's signature verifies.
        KeyNotValidError: the signing key was outside its window at the timestamp.
    """
    if not isinstance(note, str):
        raise MalformedInputError(
            f"checkpoint must be a signed note string, got {type(note).__name__}"
        )
    body, separator, signatures = note.partition("\n\n")
    if not separator or not signatures.endswith("\n"):
        raise MalformedInputError(
            "checkpoint note must be a body, a blank line and signature lines"
        )
    checkpoint = Checkpoint.parse_body(body + "\n")
    signed = (body + "\n").encode("utf-8")
    failure: AttestationError = UnknownKeyError(
        f"checkpoint carries no signature by a key of the trust root (version {trust_root.version})"
    )
    for number, line in enumerate(signatures[:-1].split("\n")):
        what = f"checkpoint signature line {number + 1}"
        if not line.startswith(_NOTE_DASH):
            raise MalformedInputError(f"{what} must start with an em dash and a space")
        name, space, encoded = line.removeprefix(_NOTE_DASH).partition(" ")
        if not space or not name or " " in encoded:
            raise MalformedInputError(f"{what} must be '\u2014 <name> <base64 signature>'")
        blob = b64decode(encoded, what)
        if len(blob) < 5:
            raise MalformedInputError(f"{what} is too short to hold a key hash and a signature")
        if name != checkpoint.origin:
            continue
        for key in trust_root.keys:
            if _note_key_hash(name, key.public_key) != blob[:4]:
                continue
            try:
                key.verify(blob[4:], signed, "checkpoint signature")
                key.check_valid_at(checkpoint.timestamp, "checkpoint signature")
            except (InvalidSignatureError, KeyNotValidError) as error:
                failure = error
                continue
            return checkpoint
    raise failure
