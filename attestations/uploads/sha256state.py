"""A SHA-256 whose state can be saved between requests and taken up again.

A multipart upload's parts arrive in separate requests, often to separate web workers,
and the whole file's digest must still be computed once per byte: while each part is
written, not again when the parts are joined. ``hashlib`` cannot hand its state from one
request to the next, so this module drives the same OpenSSL that ``hashlib`` uses
through its SHA-256 primitives (``SHA256_Init``, ``SHA256_Update``, ``SHA256_Final``),
whose context is a plain structure that OpenSSL documents in ``<openssl/sha.h>``:
eight chaining words, the message length in bits, and up to 63 bytes not yet hashed.

The saved state is written in a fixed, architecture-independent form (version byte,
eight big-endian words, the 64-bit bit count, the pending bytes), so a state saved by
one worker is taken up by any other. Where Python's OpenSSL cannot be found (a build
without it, a platform without ``/proc``), :func:`available` is false and callers hash
the whole file at the end as they would without this module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import struct
from typing import Any

__all__ = ["ResumableSHA256", "available", "initial_state"]

_VERSION = 1
_HEADER = struct.Struct(">B8IQ")  # version, h0..h7, message length in bits
_BLOCK = 64


class _Context(ctypes.Structure):
    """``SHA256_CTX`` as ``<openssl/sha.h>`` declares it (``SHA_LONG`` is 32 bits)."""

    _fields_ = [
        ("h", ctypes.c_uint32 * 8),
        ("Nl", ctypes.c_uint32),
        ("Nh", ctypes.c_uint32),
        ("data", ctypes.c_ubyte * _BLOCK),
        ("num", ctypes.c_uint32),
        ("md_len", ctypes.c_uint32),
    ]


def _libcrypto() -> str | None:
    """The libcrypto that ``hashlib`` loaded, by the name the dynamic linker resolved for it.

    ``find_library`` answers the soname (``libcrypto.so.3``), which resolves to the library
    already in this process; a private copy that a wheel maps under a hashed name
    (``psycopg_binary.libs/libcrypto-<hash>.so.3``) is used only when nothing else is found.
    """
    import _hashlib  # noqa: F401  (loads libcrypto into this process)

    found = ctypes.util.find_library("crypto")
    if found is not None:
        return found
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if path.rsplit("/", 1)[-1].startswith("libcrypto"):
                    return path
    except OSError:
        pass
    return None


@functools.cache
def _library() -> Any | None:
    path = _libcrypto()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        functions = (library.SHA256_Init, library.SHA256_Update, library.SHA256_Final)
    except (OSError, AttributeError):
        return None
    pointer = ctypes.POINTER(_Context)
    for function in functions:
        function.restype = ctypes.c_int
    functions[0].argtypes = [pointer]
    functions[1].argtypes = [pointer, ctypes.c_void_p, ctypes.c_size_t]
    functions[2].argtypes = [ctypes.c_char_p, pointer]
    if not _agrees_with_hashlib(library):
        return None
    return library


def _agrees_with_hashlib(library: Any) -> bool:
    """Refuse a libcrypto whose context is not the documented one (checked once)."""
    import hashlib

    message = bytes(range(256)) * 3 + b"dvbench"
    context = _Context()
    library.SHA256_Init(ctypes.byref(context))
    library.SHA256_Update(ctypes.byref(context), message, len(message))
    bits = len(message) * 8
    if (context.Nh << 32 | context.Nl) != bits or context.num != len(message) % _BLOCK:
        return False
    out = ctypes.create_string_buffer(32)
    library.SHA256_Final(out, ctypes.byref(context))
    return out.raw == hashlib.sha256(message).digest()


def available() -> bool:
    """Whether states can be saved here (Python's OpenSSL found and checked)."""
    return _library() is not None


def initial_state() -> bytes:
    """The saved state of a SHA-256 that has hashed nothing."""
    return ResumableSHA256().state()


class ResumableSHA256:
    """SHA-256 that starts from a saved :meth:`state` (or from nothing).

    ``update`` releases the GIL for the hashing, as ``hashlib``'s does, so another thread
    can hash the same bytes into a second digest meanwhile.
    """

    def __init__(self, state: bytes | None = None) -> None:
        library = _library()
        if library is None:
            raise RuntimeError("resumable SHA-256 needs Python's OpenSSL (libcrypto)")
        self._update = library.SHA256_Update
        self._final = library.SHA256_Final
        self._context = _Context()
        library.SHA256_Init(ctypes.byref(self._context))
        if state is not None:
            self._restore(state)

    def _restore(self, state: bytes) -> None:
        if len(state) < _HEADER.size or state[0] != _VERSION:
            raise ValueError("not a saved SHA-256 state of this version")
        _version, *words, bits = _HEADER.unpack_from(state)
        pending = state[_HEADER.size :]
        if bits % 8 or len(pending) != (bits // 8) % _BLOCK:
            raise ValueError(
                f"saved SHA-256 state: {len(pending)} pending bytes do not match a "
                f"message of {bits // 8} bytes"
            )
        context = self._context
        context.h[:] = words
        context.Nl, context.Nh = bits & 0xFFFFFFFF, bits >> 32
        context.data[: len(pending)] = pending
        context.num = len(pending)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if isinstance(data, bytes):
            self._update(ctypes.byref(self._context), data, len(data))
            return
        view = memoryview(data).cast("B")
        if view.readonly:
            self._update(ctypes.byref(self._context), bytes(view), len(view))
            return
        buffer = (ctypes.c_char * len(view)).from_buffer(view)
        self._update(ctypes.byref(self._context), buffer, len(view))

    @property
    def length(self) -> int:
        """Bytes hashed so far."""
        context = self._context
        return int(context.Nh << 32 | context.Nl) // 8

    def state(self) -> bytes:
        """The state to save; ``ResumableSHA256(state)`` takes up exactly here."""
        context = self._context
        bits = context.Nh << 32 | context.Nl
        pending = bytes(context.data[: context.num])
        return _HEADER.pack(_VERSION, *context.h, bits) + pending

    def hexdigest(self) -> str:
        """The digest of everything hashed; the state itself is left as it was."""
        copy = _Context.from_buffer_copy(self._context)
        out = ctypes.create_string_buffer(32)
        self._final(out, ctypes.byref(copy))
        return out.raw.hex()
