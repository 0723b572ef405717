"""The sliced wire format is read in bounded work: counts and sizes are checked first.

``RunFile.from_bytes`` and ``opening_from_bytes`` read the lab's bytes inside a request or
a worker. Each limit is refused from the CBOR headers, before the document is decoded,
with the field, the limit and what was found; membership checks are linear.
"""

from __future__ import annotations

import struct
import time

import cbor2
import pytest

from zkdv import sliced
from zkdv.sliced import _wire
from zkdv.sliced._bounded import Field, skip

DIGEST = b"\x11" * 32
HP = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999}


def run_file(names: tuple[str, ...] = ("blocks.0.w", "blocks.1.w"), steps: int = 2) -> bytes:
    """A well-formed run file of two one-parameter blocks (no framework needed)."""
    blocks = sliced.BlockLayout(tuple((n.rsplit(".", 1)[0], (n,)) for n in names))
    commitments = tuple(
        sliced.StepCommitment(
            i, (DIGEST, DIGEST), (DIGEST, DIGEST), DIGEST, DIGEST, DIGEST, (1, 3, 2), HP
        )
        for i in range(steps)
    )
    return sliced.RunFile(
        blocks, names, 1024, (), ("ab" * 32,) * len(names), "", commitments
    ).to_bytes()


def refused(data: bytes) -> sliced.SlicedFormatError:
    with pytest.raises(sliced.SlicedFormatError) as caught:
        sliced.RunFile.from_bytes(data)
    return caught.value


def replace(data: bytes, key: str, value: bytes) -> bytes:
    """``data`` with ``key``'s encoded value replaced by raw CBOR bytes (maybe truncated)."""
    body = cbor2.loads(data)
    marker = object()
    body[key] = marker
    # Encode with a placeholder, then swap its bytes for the raw value.
    encoded = cbor2.dumps({k: (b"PLACEHOLDER" if v is marker else v) for k, v in body.items()})
    placeholder = cbor2.dumps(b"PLACEHOLDER")
    return encoded.replace(placeholder, value)


def test_a_well_formed_run_file_still_reads() -> None:
    data = run_file()
    assert sliced.RunFile.from_bytes(data).to_bytes() == data


def test_a_list_over_its_limit_is_refused_from_its_header() -> None:
    # A names list that claims 2**21 items; nothing after the header needs to exist.
    error = refused(replace(run_file(), "names", b"\x9a" + struct.pack(">I", 1 << 21)))
    assert error.field == "names"
    assert (error.limit, error.got) == (_wire.MAX_NAMES, 1 << 21)
    assert f"a list of {1 << 21} items is over the {_wire.MAX_NAMES}" in str(error)
    # 2**64 - 1 steps: the header's word, refused before any step is read.
    error = refused(replace(run_file(), "steps", b"\x9b" + b"\xff" * 8))
    assert (error.field, error.limit, error.got) == ("steps", _wire.MAX_STEPS, 2**64 - 1)


def test_an_element_over_its_item_budget_is_refused_before_it_is_decoded() -> None:
    # A step padded with 100,000 empty arrays: 40 items is the most a step may have.
    step = cbor2.loads(run_file())["steps"][0]
    step["pad"] = [[] for _ in range(100_000)]
    error = refused(replace(run_file(), "steps", b"\x81" + cbor2.dumps(step)))
    assert error.field == "steps[0]" and error.limit == 40
    assert "more than 40 CBOR data items" in str(error)


def test_empty_arrays_do_not_inflate_into_memory() -> None:
    # The reported shape: 2 MB of empty arrays in a names list (137 MiB once decoded).
    # Each element is walked and decoded on its own: the first is refused at once.
    flood = b"\x9a" + struct.pack(">I", 1 << 20) + b"\x80" * (1 << 20)
    error = refused(replace(run_file(), "names", flood))
    assert error.field == "names[0]"
    assert "non-empty string" in str(error)


def test_nesting_strings_tags_and_unknown_keys_are_refused() -> None:
    deep = b"\x81" * 10 + b"\x80"  # [[[[...]]]]
    error = refused(replace(run_file(), "blocks", b"\x81" + deep))
    assert error.field == "blocks[0]" and error.limit == 2
    assert "nested deeper than the 2 levels" in str(error)

    long_name = b"\x81" + cbor2.dumps("x" * 5000)
    error = refused(replace(run_file(), "names", long_name))
    assert error.field == "names[0]"
    assert (error.limit, error.got) == (4096, 5000)
    assert "a string of 5000 bytes is over the 4096" in str(error)

    error = refused(replace(run_file(), "embed", cbor2.dumps(cbor2.CBORTag(258, [1]))))
    assert error.field == "embed" and "CBOR tag" in str(error)

    body = cbor2.loads(run_file())
    error = refused(cbor2.dumps({**body, "extra": 1}))
    assert error.field == "run file" and "a map of 10 keys" in str(error)
    del body["embed"]
    error = refused(cbor2.dumps({**body, "other": ""}))
    assert error.field == "run file" and "'other' is not a key of a run file" in str(error)
    error = refused(run_file() + b"\x00")
    assert "1 bytes after the end of the document" in str(error)
    error = refused(run_file()[:-5])
    assert "the document ends inside it" in str(error)


def test_indefinite_lengths_are_refused() -> None:
    error = refused(replace(run_file(), "names", b"\x9f" + cbor2.dumps("blocks.0.w") + b"\xff"))
    assert error.field == "names" and "indefinite length" in str(error)
    with pytest.raises(sliced.SlicedFormatError, match="indefinite length"):
        skip(b"\x5f\x41a\xff", 0, "x", Field(items=10))


def test_membership_is_linear_in_the_names() -> None:
    # 100,000 names in one block: a tuple's membership made 25,000 take 6 s.
    names = tuple(f"blocks.0.p{i}" for i in range(100_000))
    blocks = sliced.BlockLayout((("blocks.0", names),))
    step = sliced.StepCommitment(
        0, (DIGEST, DIGEST), (DIGEST, DIGEST), DIGEST, DIGEST, DIGEST, (1, 2, 2), HP
    )
    data = sliced.RunFile(blocks, names, 1024, names, ("ab" * 32,), "cd" * 32, (step,)).to_bytes()
    start = time.perf_counter()
    assert len(sliced.RunFile.from_bytes(data).names) == 100_000
    # Linear: about 0.2 s here; quadratic would be minutes.
    assert time.perf_counter() - start < 10


def test_openings_are_read_element_by_element_within_limits() -> None:
    opening = cbor2.dumps(
        {
            "v": sliced.SLICED_VERSION,
            "kind": _wire.OPENING_KIND,
            "params": [],
            "opt_state": [],
            "grad": [],
            "post_params": [],
            "post_opt_state": [],
            "rows": [],
            "inputs": [],
            "batch_rows": [],
        },
        canonical=True,
    )
    assert sliced.opening_from_bytes(opening).params == ()
    flood = opening.replace(
        cbor2.dumps("rows") + b"\x80",
        cbor2.dumps("rows") + b"\x9a" + struct.pack(">I", 1 << 17),
    )
    with pytest.raises(sliced.SlicedFormatError) as caught:
        sliced.opening_from_bytes(flood)
    assert (caught.value.field, caught.value.limit) == ("rows", _wire.MAX_OPENED_ROWS)
    padded = opening.replace(
        cbor2.dumps("grad") + b"\x80",
        cbor2.dumps("grad") + b"\x81" + cbor2.dumps({"pad": [[]] * 200}),
    )
    with pytest.raises(sliced.SlicedFormatError) as caught:
        sliced.opening_from_bytes(padded)
    assert caught.value.field == "grad[0]" and caught.value.limit == 128
