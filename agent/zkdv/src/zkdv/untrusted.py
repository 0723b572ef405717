"""Programs from a lab, made safe to load: the one gate before Torch or JAX sees their bytes.

The platform replays programs a lab committed. Torch's own loader is not safe on such
bytes (security round 3, issue 59): ``torch.export.load`` unpickles any weight or
constant its archive marks ``use_pickle`` (and custom objects), falls back to an
unrestricted ``torch.load`` when the example inputs are not plain tensors, and passes
every symbolic shape expression (``expr_str``) to ``sympy.sympify``, which calls
``eval``. A deserialized graph may also name any callable under ``torch``, ``math`` or
``operator`` as a node's target, and calls it when the program runs. An AOT Inductor
package is a shared object: native code. So nothing a lab uploaded reaches those
loaders until this module has parsed it with code the platform owns:

* :func:`safe_export_archive` reads a ``torch.export`` archive (a zip of JSON and raw
  tensor files) and returns a *rebuilt* archive that holds only what a program needs:
  the format markers, ``models/model.json`` with every node's metadata cleared, the
  weight and constant tables, their raw tensor files, and empty example inputs. It
  refuses (:class:`ProgramUnsafeError`) any pickled payload (``use_pickle``, a custom or
  opaque object, a ``.pt``/``.pkl`` member other than the example inputs, which are
  dropped unread), any member it does not know (an AOT Inductor directory, extra files,
  the legacy format), a compressed member, a node target outside the allow-list
  (:func:`check_target`), and any symbolic expression outside a strict grammar
  (:func:`check_expression`: symbols ``s<digits>``/``u<digits>`` as ``Symbol('s77',
  positive=True, integer=True)`` or bare, integers, ``+ - * // %``, comparisons, and
  the calls Torch's printer writes: ``Add``, ``Mul``, ``Mod``, ``FloorDiv``, ``Min``,
  ``Max``, ``Eq``, ...); a tokenizer and a recursive-descent parser, no ``eval``.
* A compiled package (AOT Inductor) is refused like any archive that is not a
  ``torch.export`` program: its shared object is a member outside a program.
* :func:`check_custom_calls` allow-lists the ``stablehlo.custom_call`` targets a
  deserialized ``jax.export`` program may name (:data:`JAX_CUSTOM_CALLS`).

Every refusal is a :class:`ProgramUnsafeError` whose ``reason`` is ``program_unsafe``;
the platform reports it as the replay's or the slice's reason. This module needs
neither framework; it is the only place that decides what is safe, and every loader of
a lab's program calls it (``zkdv.torch._artifact.load``, ``zkdv.sliced.load_program``,
``zkdv.jax.replay.load_artifact``).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Iterator
from typing import Any

__all__ = [
    "JAX_CUSTOM_CALLS",
    "PROGRAM_UNSAFE",
    "ProgramUnsafeError",
    "check_custom_calls",
    "check_expression",
    "check_target",
    "safe_export_archive",
]

#: The reason code of every refusal (a slice's or a replay's ``reason``).
PROGRAM_UNSAFE = "program_unsafe"


class ProgramUnsafeError(ValueError):
    """A lab's program that the platform will not load; the message says which part."""

    reason = PROGRAM_UNSAFE


# --- symbolic expressions -------------------------------------------------------------

#: The longest ``expr_str`` accepted; Torch writes a few dozen characters per symbol.
MAX_EXPRESSION = 4096
#: The deepest nesting accepted (each level is a Python frame of the parser).
MAX_DEPTH = 64
#: Symbol names as Torch's shape environment makes them: backed (``s``) and unbacked
#: (``u``) integer symbols.
SYMBOL = re.compile(r"[su][0-9]{1,9}")
#: The assumptions ``sympy.srepr`` writes inside ``Symbol(...)``.
ASSUMPTIONS = frozenset({"integer", "positive", "nonnegative", "negative", "real", "finite"})
#: Calls as ``sympy.srepr`` writes Torch's shape arithmetic (``torch.utils._sympy``).
FUNCTIONS = frozenset(
    {
        "Add",
        "Mul",
        "Mod",
        "PythonMod",
        "FloorDiv",
        "CleanDiv",
        "CeilDiv",
        "Min",
        "Max",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "StrictLessThan",
        "LessThan",
        "StrictGreaterThan",
        "GreaterThan",
        "Equality",
        "Unequality",
    }
)
_CONSTANTS = frozenset({"True", "False", "true", "false"})
_TOKEN = re.compile(
    r"\s*(?:(?P<int>[0-9]{1,30})|(?P<name>[A-Za-z][A-Za-z0-9]{0,31})"
    r"|(?P<string>'[A-Za-z0-9]{1,32}')|(?P<op>//|==|!=|<=|>=|[-+*%<>(),=]))"
)
_COMPARISONS = frozenset({"==", "!=", "<", "<=", ">", ">="})


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    position = 0
    end = len(text.rstrip())
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise ProgramUnsafeError(
                f"symbolic expression {text[:80]!r}: character {position} "
                f"({text[position : position + 10]!r}) is outside the shape grammar"
            )
        kind = match.lastgroup
        assert kind is not None
        out.append((kind, match.group(kind)))
        position = match.end()
    return out


class _Parser:
    """Recursive descent over the tokens; accepts or raises, and builds nothing."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.position = 0

    def fail(self, what: str) -> ProgramUnsafeError:
        return ProgramUnsafeError(
            f"symbolic expression {self.text[:80]!r}: {what} at token {self.position}; "
            "only symbols, integers, + - * // %, comparisons and Torch's shape functions "
            "are accepted"
        )

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.position] if self.position < len(self.tokens) else ("", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        token_kind, token = self.peek()
        if (
            not token_kind
            or (value is not None and token != value)
            or (kind is not None and token_kind != kind)
        ):
            raise self.fail(f"expected {value or kind}, found {token or 'the end'!r}")
        self.position += 1
        return token

    def whole(self) -> None:
        self.expression(0)
        if self.position != len(self.tokens):
            raise self.fail(f"unexpected {self.peek()[1]!r}")

    def expression(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise self.fail("nesting too deep")
        self.arithmetic(depth)
        if self.peek()[1] in _COMPARISONS:
            self.position += 1
            self.arithmetic(depth)

    def arithmetic(self, depth: int) -> None:
        self.term(depth)
        while self.peek()[1] in ("+", "-"):
            self.position += 1
            self.term(depth)

    def term(self, depth: int) -> None:
        self.unary(depth)
        while self.peek()[1] in ("*", "//", "%"):
            self.position += 1
            self.unary(depth)

    def unary(self, depth: int) -> None:
        if self.peek()[1] == "-":
            self.position += 1
            return self.unary(depth + 1)
        return self.primary(depth)

    def primary(self, depth: int) -> None:
        kind, token = self.peek()
        if kind == "int":
            self.position += 1
        elif token == "(":  # noqa: S105 - a grammar word, not a secret
            self.position += 1
            self.expression(depth + 1)
            self.take(")")
        elif kind == "name":
            self.position += 1
            if self.peek()[1] != "(":
                if not (SYMBOL.fullmatch(token) or token in _CONSTANTS):
                    raise self.fail(f"unknown name {token!r}")
            elif token == "Symbol":  # noqa: S105 - a grammar word, not a secret
                self.symbol()
            elif token == "Integer":  # noqa: S105 - a grammar word, not a secret
                self.take("(")
                if self.peek()[1] == "-":
                    self.position += 1
                self.take(kind="int")
                self.take(")")
            elif token in FUNCTIONS:
                self.take("(")
                self.expression(depth + 1)
                while self.peek()[1] == ",":
                    self.position += 1
                    self.expression(depth + 1)
                self.take(")")
            else:
                raise self.fail(f"call of {token!r}")
        else:
            raise self.fail(f"unexpected {token or 'end'!r}")

    def symbol(self) -> None:
        self.take("(")
        name = self.take(kind="string")[1:-1]
        if not SYMBOL.fullmatch(name):
            raise self.fail(f"symbol name {name!r}")
        while self.peek()[1] == ",":
            self.position += 1
            assumption = self.take(kind="name")
            if assumption not in ASSUMPTIONS:
                raise self.fail(f"symbol assumption {assumption!r}")
            self.take("=")
            if self.take(kind="name") not in ("True", "False"):
                raise self.fail("an assumption that is not True or False")
        self.take(")")


def check_expression(text: Any) -> None:
    """Accept a symbolic shape expression of the grammar above, or raise.

    Raises:
        ProgramUnsafeError: not a string, too long, or outside the grammar.
    """
    if not isinstance(text, str):
        raise ProgramUnsafeError(f"symbolic expression {text!r} is not a string")
    if len(text) > MAX_EXPRESSION:
        raise ProgramUnsafeError(
            f"a symbolic expression of {len(text)} characters (at most {MAX_EXPRESSION})"
        )
    _Parser(text).whole()


# --- node targets ---------------------------------------------------------------------

#: ATen operators that reach outside the program's tensors: files, printing, the global
#: generators, storage swaps. A replay never needs them.
DENIED_ATEN = frozenset(
    {
        "from_file",
        "save",
        "_print",
        "warn",
        "set_",
        "manual_seed",
        "seed",
        "initial_seed",
        "record_stream",
        "to_here",
        "_set_item",
    }
)
#: Symbolic-shape arithmetic as the format names it (Torch's ``_SYM_OPS``).
SYMBOLIC_TARGETS = frozenset(
    {
        *(
            f"_operator.{name}"
            for name in [
                "eq",
                "ne",
                "le",
                "ge",
                "lt",
                "gt",
                "neg",
                "pos",
                "mul",
                "add",
                "sub",
                "floordiv",
                "mod",
                "pow",
                "truediv",
                "and_",
                "or_",
                "lshift",
                "rshift",
            ]
        ),
        *(
            f"torch.{name}"
            for name in [
                "sym_not",
                "sym_int",
                "sym_float",
                "sym_ite",
                "sym_max",
                "sym_min",
                "_sym_sqrt",
            ]
        ),
        "math.trunc",
    }
)
_ATEN = re.compile(
    r"torch\.ops\.aten\.(?P<op>[A-Za-z_][A-Za-z0-9_]{0,99})\.[A-Za-z_][A-Za-z0-9_]{0,63}"
)


def check_target(target: Any) -> None:
    """Accept a node's target: an ATen operator overload or shape arithmetic.

    ``torch.export``'s deserializer resolves a target by walking attributes of
    ``torch``, ``math`` or ``operator`` and calls whatever callable it finds when the
    program runs (``torch.hub.load`` would do), so only these names pass.

    Raises:
        ProgramUnsafeError: any other target.
    """
    if isinstance(target, str):
        if target in SYMBOLIC_TARGETS:
            return
        match = _ATEN.fullmatch(target)
        if match is not None and match.group("op") not in DENIED_ATEN:
            return
    raise ProgramUnsafeError(
        f"node target {str(target)[:120]!r} is not an ATen operator or shape arithmetic "
        "the platform runs"
    )


# --- torch.export archives -------------------------------------------------------------

#: The one model an archive may hold, under this folder (``torch.export.save``'s names).
PREFIX = "archive/"
MODEL = "models/model.json"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"
#: Small members with the values Torch writes (``byteorder``: the platform is
#: little-endian; the archive's raw tensors must be too).
MARKERS = {
    "archive_format": (b"pt2",),
    "archive_version": (b"0",),
    "byteorder": (b"little",),
}
#: Members kept as they are after a format check (:func:`_check_marker`).
VERSIONS = ("archive_version", ".data/version", ".data/serialization_id")
_PAYLOAD = {
    "data/weights/": re.compile(r"weight_[0-9]{1,9}"),
    "data/constants/": re.compile(r"tensor_constant[0-9]{1,9}|tensor_[0-9]{1,9}"),
}
#: The most members and JSON bytes an archive may have (a program's structure is small).
MAX_MEMBERS = 100_000
MAX_JSON = 64 * 1024**2


def _members(data: bytes) -> dict[str, bytes]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(bytes(data)))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as error:
        raise ProgramUnsafeError(f"the program is not a torch.export archive: {error}") from None
    if len(infos) > MAX_MEMBERS:
        raise ProgramUnsafeError(f"the archive has {len(infos)} members (at most {MAX_MEMBERS})")
    members: dict[str, bytes] = {}
    for info in infos:
        name = info.filename
        if "/aotinductor/" in f"/{name}" or name.endswith((".so", ".dll", ".dylib")):
            raise ProgramUnsafeError(
                f"archive member {name!r} is compiled code (an AOT Inductor package), native "
                "code the platform never loads; commit the torch.export program, which the "
                "platform compiles itself (what ZKDV_TORCH_PROGRAM=aot-inductor seals)"
            )
        if not name.startswith(PREFIX):
            raise ProgramUnsafeError(f"archive member {name!r} is outside {PREFIX!r}")
        name = name[len(PREFIX) :]
        if name in members:
            raise ProgramUnsafeError(f"archive member {name!r} appears twice")
        # Stored only, so no member inflates past the bytes the platform holds.
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
            raise ProgramUnsafeError(f"archive member {name!r} is compressed")
        try:
            members[name] = archive.read(info)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as error:
            raise ProgramUnsafeError(f"archive member {name!r} cannot be read: {error}") from None
    return members


def _json(members: dict[str, bytes], name: str) -> Any:
    body = members.get(name)
    if body is None:
        raise ProgramUnsafeError(f"the archive has no {name}")
    if len(body) > MAX_JSON:
        raise ProgramUnsafeError(f"{name} is {len(body)} bytes (at most {MAX_JSON})")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise ProgramUnsafeError(f"{name} is not JSON: {error}") from None


def _payloads(members: dict[str, bytes], name: str, folder: str) -> set[str]:
    """Check a weight or constant table; the raw tensor files it names."""
    table = _json(members, name)
    config = table.get("config") if isinstance(table, dict) else None
    if not isinstance(config, dict) or set(table) != {"config"}:
        raise ProgramUnsafeError(f"{name} is not a payload table")
    files = set()
    for fqn, entry in config.items():
        where = f"{name}: {fqn!r}"
        if not isinstance(entry, dict):
            raise ProgramUnsafeError(f"{where} is not an entry")
        if entry.get("use_pickle") is not False:
            raise ProgramUnsafeError(
                f"{where} is pickled (use_pickle {entry.get('use_pickle')!r}); the platform "
                "never unpickles a lab's bytes"
            )
        path = entry.get("path_name")
        if not isinstance(path, str) or not _PAYLOAD[folder].fullmatch(path):
            raise ProgramUnsafeError(
                f"{where} names payload {path!r}, not a raw tensor file "
                "(custom and opaque objects are pickles)"
            )
        if not isinstance(entry.get("tensor_meta"), dict):
            raise ProgramUnsafeError(f"{where} has no tensor_meta")
        if folder + path not in members:
            raise ProgramUnsafeError(f"{where} names {folder + path}, which is not in the archive")
        files.add(folder + path)
    return files


def _walk(value: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    if depth > 2 * MAX_DEPTH + 200:
        raise ProgramUnsafeError("models/model.json nests too deep")
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _walk(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item, depth + 1)


def _check_model(model: Any) -> Any:
    """Check every expression and node target; the model with node metadata cleared."""
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise ProgramUnsafeError(f"{MODEL} is not an exported program")
    nodes = 0
    for entry in _walk(model):
        if "expr_str" in entry:
            check_expression(entry["expr_str"])
        # A graph's nodes (the top graph's, and every subgraph's) are the one list the
        # format calls "nodes"; each is a Node, whose target the loader resolves.
        listed = entry.get("nodes")
        if isinstance(listed, list):
            for node in listed:
                if not isinstance(node, dict):
                    raise ProgramUnsafeError(f"{MODEL}: a node that is not an object")
                check_target(node.get("target"))
                # Metadata is provenance (stack traces, module paths, custom JSON) that a
                # replay does not need: the loader resolves names in it, so it goes.
                node["metadata"] = {}
                nodes += 1
    if not nodes:
        raise ProgramUnsafeError(f"{MODEL} has no node")
    return model


def _check_marker(members: dict[str, bytes], name: str) -> None:
    body = members.get(name)
    if body is None:
        raise ProgramUnsafeError(f"the archive has no {name}")
    expected = MARKERS.get(name)
    if expected is not None and body not in expected:
        raise ProgramUnsafeError(f"{name} is {body[:40]!r}, not {expected[0]!r}")
    if expected is None and not re.fullmatch(rb"[0-9A-Za-z.\-\n]{1,64}", body):
        raise ProgramUnsafeError(f"{name} is {body[:40]!r}, not a version")


def safe_export_archive(data: bytes | bytearray | memoryview) -> bytes:
    """Check a lab's ``torch.export`` archive; the archive Torch may load instead.

    The returned archive holds only the members checked here, rebuilt from their bytes:
    the format markers, the model with node metadata cleared, the weight and constant
    tables (no pickle), their raw tensor files, and empty example inputs (the archive's
    are a pickle, which Torch's loader unpickles without restriction when the
    restricted load fails). A program is only its structure and these tensors.

    Raises:
        ProgramUnsafeError: anything else in the archive, any pickled payload, a node
            target outside :func:`check_target`, an expression outside
            :func:`check_expression`.
    """
    members = _members(bytes(data))
    for name in (*MARKERS, *VERSIONS):
        _check_marker(members, name)
    model = _check_model(_json(members, MODEL))
    payloads = _payloads(members, WEIGHTS_CONFIG, "data/weights/") | _payloads(
        members, CONSTANTS_CONFIG, "data/constants/"
    )
    known = {*MARKERS, *VERSIONS, MODEL, WEIGHTS_CONFIG, CONSTANTS_CONFIG, SAMPLE_INPUTS}
    unknown = sorted(set(members) - known - payloads)
    if unknown:
        raise ProgramUnsafeError(
            f"archive member {unknown[0]!r} is not part of a torch.export program the "
            "platform loads (pickles, AOT Inductor code, extra files and other models are "
            "refused)"
        )
    rebuilt = {name: members[name] for name in (*MARKERS, *VERSIONS)}
    rebuilt[MODEL] = json.dumps(model).encode()
    for name in (WEIGHTS_CONFIG, CONSTANTS_CONFIG, *sorted(payloads)):
        rebuilt[name] = members[name]
    rebuilt[SAMPLE_INPUTS] = b""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for name, body in rebuilt.items():
            target.writestr(zipfile.ZipInfo(PREFIX + name, date_time=(1980, 1, 1, 0, 0, 0)), body)
    return out.getvalue()


# --- jax.export programs ---------------------------------------------------------------

#: Custom-call targets a deserialized ``jax.export`` program may name: what the
#: project's programs emit on CPU and TPU for the operations they use (sharding
#: annotations and the host/device placement marker; no LAPACK, no FFI, no callbacks).
JAX_CUSTOM_CALLS = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "shape_assertion",
    }
)
#: Every place a custom call can be named; each must read as one of the forms below.
_CUSTOM_CALL_SITE = re.compile(r"custom_call|call_target_name")
_CUSTOM_CALL_FORMS = (
    re.compile(r"custom_call\s*@([A-Za-z0-9_.$\-]+)\s*\("),
    re.compile(r"custom_call_target\s*=\s*\"([A-Za-z0-9_.$\-]*)\""),
    re.compile(r"call_target_name\s*=\s*\"([A-Za-z0-9_.$\-]*)\""),
)


def check_custom_calls(module_text: str, *, where: str = "the program") -> None:
    """Refuse a JAX program whose StableHLO names a custom call outside the allow-list.

    Args:
        module_text: ``exported.mlir_module()``, the program's StableHLO as text.
        where: what to call the program in the message.

    Raises:
        ProgramUnsafeError: a custom call to any other target (a host callback, an FFI
            handler, a LAPACK routine, ...).
    """
    for site in _CUSTOM_CALL_SITE.finditer(module_text):
        found = [form.match(module_text, site.start()) for form in _CUSTOM_CALL_FORMS]
        target = next((m.group(1) for m in found if m is not None), None)
        if target is None:
            # A quoted or otherwise unusual name (or the words in a location string):
            # nothing the platform can read with certainty, so nothing it runs.
            excerpt = module_text[site.start() : site.start() + 80]
            raise ProgramUnsafeError(
                f"{where} names a custom call the platform cannot read: {excerpt!r}"
            )
        if target not in JAX_CUSTOM_CALLS:
            raise ProgramUnsafeError(
                f"{where} calls custom call target {target!r}; the platform runs only "
                f"{sorted(JAX_CUSTOM_CALLS)}"
            )
