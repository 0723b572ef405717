"""zkdv.untrusted: the gate a lab's program passes before Torch or JAX loads it (issue 59).

The payloads are the security round's, built from real exported programs
(``tests/untrusted_programs.py``). Each is first shown to work against plain
``torch.export.load`` in a child process (the marker appears), then refused by the gate
with ``program_unsafe``, and the marker never appears.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from tests import untrusted_programs as payloads  # noqa: E402
from tests.sources import AGENT_PYTHONPATH  # noqa: E402
from zkdv import sliced, untrusted  # noqa: E402
from zkdv.torch import _artifact  # noqa: E402
from zkdv.untrusted import ProgramUnsafeError, check_expression, safe_export_archive  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture(scope="module")
def block_program() -> bytes:
    """A sliced block program, as ``zkdv.sliced.export_program`` writes it."""
    return sliced.export_program(Block(), (torch.zeros(2, 3, 4),))


@pytest.fixture(scope="module")
def step_program() -> bytes:
    """A program with weights and a dynamic batch size (its sizes are expressions)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    exported = torch.export.export(
        model, (torch.zeros(3, 4),), dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return buffer.getvalue()


def _plain_load(archive: bytes, tmp_path: Path) -> None:
    """``torch.export.load`` on the archive, in a child process (the control)."""
    path = tmp_path / "program.pt2"
    path.write_bytes(archive)
    code = "import sys, torch; torch.export.load(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env={"PYTHONPATH": AGENT_PYTHONPATH, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "payload", [payloads.pickled_weight, payloads.evaluated_expression], ids=["pickle", "expr_str"]
)
def test_the_payload_runs_under_torch_and_is_refused_here(
    payload: object, block_program: bytes, tmp_path: Path
) -> None:
    control, marker = tmp_path / "control", tmp_path / "marker"
    _plain_load(payload(block_program, control), tmp_path)  # type: ignore[operator]
    assert control.exists(), "the payload does not run under plain torch.export.load"
    archive = payload(block_program, marker)  # type: ignore[operator]
    with pytest.raises(ProgramUnsafeError) as refused:
        sliced.load_program(archive)
    assert refused.value.reason == "program_unsafe"
    with pytest.raises(ProgramUnsafeError):
        _artifact.load(archive, _artifact.TORCH_EXPORT)
    assert not marker.exists()


def test_a_pickled_weight_is_named(block_program: bytes, tmp_path: Path) -> None:
    archive = payloads.pickled_weight(block_program, tmp_path / "marker")
    with pytest.raises(ProgramUnsafeError, match=r"'planted' is pickled \(use_pickle True\)"):
        safe_export_archive(archive)


def test_an_expression_with_code_is_named(block_program: bytes, tmp_path: Path) -> None:
    archive = payloads.evaluated_expression(block_program, tmp_path / "marker")
    with pytest.raises(ProgramUnsafeError, match=r"__import__.*outside the shape grammar"):
        safe_export_archive(archive)


def test_a_node_calling_a_python_function_is_refused(block_program: bytes) -> None:
    with pytest.raises(ProgramUnsafeError, match=r"node target 'torch\.save'"):
        safe_export_archive(payloads.foreign_target(block_program))


@pytest.mark.parametrize(
    "member",
    [
        "archive/extra/notes.txt",
        "archive/data/constants/custom_obj_0",
        "archive/payload.pkl",
        "archive/models/other.json",
    ],
)
def test_any_member_outside_the_program_is_refused(block_program: bytes, member: str) -> None:
    archive = payloads._edit(block_program, {member: b"\x80\x04N."})
    with pytest.raises(ProgramUnsafeError, match=r"is not part of a torch\.export program"):
        safe_export_archive(archive)


def test_honest_programs_rebuild_and_compute_the_same(
    block_program: bytes, step_program: bytes
) -> None:
    rebuilt = safe_export_archive(block_program)
    with zipfile_names(rebuilt) as names:
        assert "archive/data/sample_inputs/model.pt" in names
    module = sliced.load_program(block_program)
    weights = {
        name: torch.randn(p.shape, dtype=torch.float64) for name, p in Block().named_parameters()
    }
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out = torch.func.functional_call(module, weights, (x,))
    reference = torch.func.functional_call(
        torch.export.load(io.BytesIO(block_program)).module(), weights, (x,)
    )
    assert torch.equal(out, reference)
    # A dynamic batch: its sizes are Symbol('s77', ...) expressions, which pass.
    loaded = torch.export.load(io.BytesIO(safe_export_archive(step_program))).module()
    assert loaded(torch.randn(5, 4)).shape == (5, 4)


class zipfile_names:  # noqa: N801 - a small context manager for one test
    def __init__(self, data: bytes) -> None:
        import zipfile

        self.archive = zipfile.ZipFile(io.BytesIO(data))

    def __enter__(self) -> set[str]:
        return set(self.archive.namelist())

    def __exit__(self, *_: object) -> None:
        self.archive.close()


@pytest.mark.parametrize(
    "text",
    [
        "Symbol('s77', positive=True, integer=True)",
        "Symbol('u0', integer=True)",
        "s0 + 2*s1 - 3",
        "Mul(Integer(2), Symbol('s3', positive=True, integer=True))",
        "FloorDiv(s0, 2) >= 1",
        "Eq(Mod(s0, 4), 0)",
        "Max(1, Min(s0, s1))",
        "s0 // 2 % 3 != -1",
    ],
)
def test_shape_expressions_as_torch_writes_them_pass(text: str) -> None:
    check_expression(text)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('id') or Symbol('s77', positive=True, integer=True)",
        "s0.__class__",
        "Symbol('s0', integer=True, foo=True)",
        "Symbol('os', integer=True)",
        "Symbol('s0', integer=exec)",
        "exec('1')",
        "Function('f')(s0)",
        "s0 ** 2",
        "lambda: 1",
        "[s0]",
        "'s0'",
        "(" * 100 + "s0" + ")" * 100,
        "s0 + " * 2000 + "1",
        42,
    ],
)
def test_anything_else_is_refused(text: object) -> None:
    with pytest.raises(ProgramUnsafeError):
        check_expression(text)


@pytest.mark.parametrize(
    "member",
    [
        "program/data/aotinductor/model/c5m2.wrapper.so",
        "program/data/aotinductor/model/c5m2.wrapper.cpp",
        "archive/data/weights/lib.so",
    ],
)
def test_an_aot_inductor_package_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, member: str
) -> None:
    called: list[str] = []
    for name in ("aoti_load_package", "aoti_compile_and_package"):
        monkeypatch.setattr(torch._inductor, name, lambda *a, n=name, **k: called.append(n))
    package = io.BytesIO()
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr(member, b"\x7fELF")
    for kind in (_artifact.AOT_INDUCTOR, _artifact.TORCH_EXPORT):
        with pytest.raises(ProgramUnsafeError, match="native code the platform never loads"):
            _artifact.load(package.getvalue(), kind)
    assert called == []


def test_targets_are_aten_operators_or_shape_arithmetic() -> None:
    from torch._export.serde.serialize import _SYM_OPS

    for op in _SYM_OPS:  # every symbolic operator the format writes passes
        untrusted.check_target(f"{op.__module__}.{op.__name__}")
    untrusted.check_target("torch.ops.aten.linear.default")
    for target in (
        "torch.ops.aten.from_file.default",
        "torch.ops.aten.save.default",
        "torch.hub.load",
        "torch.ops.higher_order.invoke_subgraph",
        "torch.ops.mylib.op.default",
        "_operator.methodcaller",
        "#custom:op",
        None,
    ):
        with pytest.raises(ProgramUnsafeError):
            untrusted.check_target(target)


def test_a_jax_program_with_a_foreign_custom_call_is_refused() -> None:
    pytest.importorskip("jax")
    from jax import export

    program = export.deserialize(payloads.jax_custom_call_program())
    with pytest.raises(ProgramUnsafeError, match="custom call target 'lab_payload'"):
        untrusted.check_custom_calls(program.mlir_module())


@pytest.mark.parametrize(
    "text",
    [
        '%0 = stablehlo.custom_call @"lab payload"(%arg0) : (tensor<4xf32>) -> tensor<4xf32>',
        '%0 = "stablehlo.custom_call"(%arg0) {call_target_name = "lab_payload"} : () -> ()',
        '%0 = mhlo.custom_call(%arg0) {custom_call_target = "lapack_sgetrf_ffi"} : () -> ()',
    ],
)
def test_every_spelling_of_a_custom_call_is_read(text: str) -> None:
    with pytest.raises(ProgramUnsafeError):
        untrusted.check_custom_calls(text)
    untrusted.check_custom_calls("%0 = stablehlo.custom_call @Sharding(%arg0) : () -> ()")


def test_a_pickled_constant_is_refused(block_program: bytes) -> None:
    config = {
        "config": {
            "lifted_tensor_0": {
                "path_name": "tensor_constant0",
                "is_param": False,
                "use_pickle": True,
                "tensor_meta": None,
            }
        }
    }
    archive = payloads._edit(
        block_program,
        {
            "archive/data/constants/model_constants_config.json": json.dumps(config).encode(),
            "archive/data/constants/tensor_constant0": b"\x80\x04N.",
        },
    )
    with pytest.raises(ProgramUnsafeError, match=r"'lifted_tensor_0' is pickled"):
        safe_export_archive(archive)
