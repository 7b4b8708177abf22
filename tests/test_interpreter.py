"""The test processes' Triton interpreter maps triton.language once per launch (tests/interpreter.py): kernels give the
same values, and the mapping's cost no longer grows with the nested @triton.jit calls a kernel makes."""

import pytest
import torch
import triton
import triton.language as tl

from tests.devices import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter runs CPU tensors only")


@triton.jit
def _double(x):
    return x * 2 + tl.zeros(x.shape, x.dtype)  # tl.zeros: triton.language.standard, mapped through tl.core


@triton.jit
def _nested_calls_kernel(X, OUT, CALLS: tl.constexpr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(X + offs)
    for _ in tl.static_range(CALLS):
        x = _double(x)
    tl.store(OUT + offs, x)


NO_LANGUAGE = """
import triton


@triton.jit
def _identity(x):
    return x
"""


@triton.jit
def _calls_a_helper_without_language(X):
    tl.store(X, no_language_helper._identity(tl.load(X)))  # noqa: F821 - the test puts the module here


def _mappings(monkeypatch, calls: int) -> tuple[torch.Tensor, int]:
    """The kernel's output with ``calls`` nested calls per program, and how many builtin namespaces the interpreter
    mapped during its launch."""
    from triton.runtime import interpreter

    mapped = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: mapped.append(1) or patch_builtin(*args))
    x = torch.arange(24, dtype=torch.float32)
    out = torch.empty_like(x)
    _nested_calls_kernel[(3,)](x, out, CALLS=calls, N=8)
    monkeypatch.setattr(interpreter, "_patch_builtin", patch_builtin)
    return out, len(mapped)


def test_the_language_is_mapped_once_per_launch(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_per_launch", False), (
        f"tests/interpreter.py did not apply to triton {triton.__version__}: interpreted kernels run ~1.5x slower"
    )
    _mappings(monkeypatch, 1)  # the interpreter's first run of a function rewrites it (and adds to its globals)
    one, few = _mappings(monkeypatch, 1)
    eight, many = _mappings(monkeypatch, 8)
    x = torch.arange(24, dtype=torch.float32)
    assert torch.equal(one, x * 2) and torch.equal(eight, x * 256)
    assert few == many > 0  # the launch's mapping and the first of tl.core's, however many nested calls follow


def test_a_function_that_cannot_see_the_language_is_still_refused(tmp_path, monkeypatch):
    """As the interpreter does: a nested @triton.jit function whose module imports no triton.language fails."""
    import importlib

    from triton.runtime.errors import InterpreterError

    (tmp_path / "no_language_helper.py").write_text(NO_LANGUAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(globals(), "no_language_helper", importlib.import_module("no_language_helper"))
    with pytest.raises(InterpreterError, match="triton.language must be visible"):
        _calls_a_helper_without_language[(1,)](torch.zeros(1))


@triton.jit
def _affine_int32_kernel(X, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, tl.load(X + offs) * 3 + 7 - offs)


def test_overflow_checks_whose_findings_are_dropped_are_skipped():
    """The interpreter's builders skip ``sanitize_overflow`` (it only feeds a ``device_assert`` their ``debug`` option
    turns off), and 32-bit integers still wrap as compiled kernels wrap them."""
    from triton.runtime import interpreter

    for builder in (interpreter.interpreter_builder, interpreter.InterpreterBuilder()):
        assert not builder.options.debug, "with debug on the sanitizer's findings count: they must be kept"
        assert not builder.options.sanitize_overflow, (
            f"tests/interpreter.py did not apply to triton {triton.__version__}: interpreted kernels run ~1.5x slower"
        )
    x = torch.tensor([1, -5, 2**30, 2**31 - 1, -(2**31), 12345, 0, 7], dtype=torch.int32)
    got = torch.empty_like(x)
    _affine_int32_kernel[(1,)](x, got, N=8)
    wrapped = (x.long() * 3 + 7 - torch.arange(8)).to(torch.int32)  # int64 math, then two's complement wrap
    assert torch.equal(got, wrapped)


def test_types_are_built_once_per_shape():
    """A block type or tensor of a shape seen before reuses what the first one built: the same attributes as the
    interpreter's own construction gives, and numpy dtypes as its table gives them."""
    from triton.language import core
    from triton.runtime import interpreter

    assert getattr(core.tensor.__init__, "reuses_types", False), (
        f"tests/interpreter.py did not apply to triton {triton.__version__}: interpreted kernels run ~1.6x slower"
    )
    for element, shape in [(tl.float16, [4, 8]), (tl.int32, [tl.constexpr(4), 8]), (tl.pointer_type(tl.int8), [16])]:
        for _ in range(2):  # the first builds, the second reuses
            fast = core.block_type(element, shape)
            own = core.block_type.__new__(core.block_type)
            core.block_type.__init__.__wrapped__(own, element, shape)
            assert fast == own and fast.name == own.name and fast.numel == own.numel
            tensor, own_tensor = core.tensor(None, fast), core.tensor.__new__(core.tensor)
            core.tensor.__init__.__wrapped__(own_tensor, None, own)
            assert tensor.shape == own_tensor.shape and tensor.numel == own_tensor.numel
            assert interpreter._get_np_dtype(fast) == interpreter._get_np_dtype.__wrapped__(own)
    with pytest.raises(ValueError, match="power of 2"):
        core.block_type(tl.float32, [3])


@triton.jit
def _broadcasts_kernel(X, Y, OUT, N: tl.constexpr):
    rows = tl.arange(0, N)
    x = tl.load(X + rows)  # int32
    y = tl.load(Y + rows)  # float32
    grid = x[:, None] * 2 + y[None, :]  # [N, 1] and [1, N]: broadcast both ways, int32 to float32
    grid = grid - x[:, None] + 0.5  # [N, N] and [N, 1], then a scalar
    grid = grid * (grid > 1.0) + tl.zeros([N, N], tl.float32)  # blocks of one shape
    tl.store(OUT + rows[:, None] * N + rows[None, :], grid)


def test_broadcasts_give_the_values_torch_gives():
    x = torch.tensor([1, -2, 3, 0], dtype=torch.int32)
    y = torch.tensor([0.25, 1.5, -3.0, 2.0])
    out = torch.empty(4, 4)
    _broadcasts_kernel[(1,)](x, y, out, N=4)
    grid = x[:, None] * 2 + y[None, :] - x[:, None] + 0.5
    assert torch.equal(out, grid * (grid > 1.0))


@triton.jit
def _one_type_kernel(X, Y, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    x, y = tl.load(X + offs), tl.load(Y + offs)  # float16 blocks of one shape
    tl.static_assert((x * y).dtype == tl.float16)
    tl.static_assert((x / y).dtype == tl.float32)  # / and % of 16-bit floats: in float32, as compiled
    i = offs * 3 - offs // 2 + (tl.program_id(0) + 3)  # int32 blocks of one shape, then an int32 scalar broadcast
    tl.store(OUT + offs, (x / y + x * y) * (i % 5).to(tl.float32))


def test_operands_of_one_type_keep_it_and_16_bit_division_is_promoted():
    """Tensors of one arithmetic dtype skip the promotion rules, which would return them as they are, and are broadcast
    as before; a 16-bit division still runs in float32, as the interpreter's rules (and compiled kernels) make it."""
    from triton.language import semantic

    assert hasattr(semantic.TritonSemantic.binary_op_type_checking_impl, "__wrapped__"), (
        f"tests/interpreter.py did not apply to triton {triton.__version__}"
    )
    x = torch.tensor([1.0, -2.5, 3.0, 0.5, 7.0, -1.0, 2.0, 9.0], dtype=torch.float16)
    y = torch.tensor([3.0, 0.5, -7.0, 2.0, 3.0, 6.0, -0.25, 1.5], dtype=torch.float16)
    out = torch.empty(8)
    _one_type_kernel[(1,)](x, y, out, N=8)
    i = torch.arange(8, dtype=torch.int32)
    expected = (x.float() / y.float() + (x * y).float()) * ((i * 3 - i // 2 + 3) % 5).float()
    assert torch.equal(out, expected)
