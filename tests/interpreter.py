"""The Triton interpreter, for the test processes: triton.language patched once per launch, not once per call, no
integer overflow sanitizer whose findings are thrown away, and types built once per shape, not once per operation.

The interpreter maps ``triton.language``'s builtins onto numpy when a launch starts, and maps them again at every
call of a nested ``@triton.jit`` function, though the launch's mapping is still in force (the nested mapping is
never undone either). Those repeats — ``inspect.getmembers`` of four modules, about half a millisecond each — are
a third of an attention kernel's interpreted time. :func:`patch_language_once_per_launch` keeps the first mapping
of each language module (``triton.language``, ``triton.language.core``) per launch and skips the repeats: the
kernels run the same numpy operations, in the same order, on the same values.

A function that sees no language module is still passed to the interpreter's own mapping, which refuses it as it
would. The bookkeeping is per thread; the mapping itself, as in the interpreter, is global (kernels launched from
two threads at once race there either way).

Every 32-bit integer add, sub and mul a kernel makes is also recomputed in 64 bits and compared with the 32-bit range
(``sanitize_overflow``) — half of an attention kernel's interpreted time — for a ``device_assert`` that does nothing
unless the options' ``debug`` is on, which in the interpreter it never is. :func:`skip_discarded_overflow_checks`
turns that recomputation off where ``debug`` is off: the same values, and the same (no) assertions.

Every operation also rebuilds its result's type bookkeeping from scratch: a ``block_type`` re-validates its shape, a
``tensor`` turns that shape into a fresh tuple of constexprs (a tuple type per dim), ``_get_np_dtype`` builds a table
of 19 dtypes to look one up, and two blocks of one shape go through triton-tuple comparisons to learn that they need
no broadcast — together about 40% of an attention kernel's interpreted time. :func:`reuse_interpreted_types` keeps
what the first type of each shape computed (its shape tuple, numel and name, which nothing changes afterwards) and
shares it with the later ones, and returns blocks of one shape unbroadcast at once, as the interpreter's broadcast
returns them: the same types, the same numpy operations on the same values. A shape seen first (or one the
interpreter would refuse) still goes through the interpreter's own construction and checks. Two tensor operands of one
arithmetic dtype also skip the type promotion (a dozen dtype predicates, then two casts that return them as they
are) and go straight to the broadcast: what the interpreter's checks return for them.

Test processes only: hfaccel itself never changes Triton. Where the interpreter's internals differ from what this
expects (another Triton release), nothing is changed and kernels run at the interpreter's own speed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading

_NOT_STARTED = frozenset({-1})  # a launch begun whose own mapping has not been made yet


def patch_language_once_per_launch() -> bool:
    """Make the interpreter skip repeated mappings of a language module within one launch; False where its internals
    are not the expected ones (nothing is changed then)."""
    import triton.language as tl
    from triton.runtime import interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    original = getattr(interpreter, "_patch_lang", None)
    if executor is None or original is None or getattr(original, "once_per_launch", False):
        return False
    if list(inspect.signature(original).parameters) != ["fn"] or not hasattr(interpreter, "_LangPatchScope"):
        return False
    state = threading.local()
    launch = executor.__call__

    def language_modules(fn) -> frozenset:
        return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)

    @functools.wraps(original)
    def patch_lang(fn):
        done = getattr(state, "done", None)
        if done is None:  # outside a launch: as the interpreter does
            return original(fn)
        modules = language_modules(fn)
        if modules and done is not _NOT_STARTED and modules <= done:
            return interpreter._LangPatchScope()  # nothing to undo: the launch's mapping stands
        state.done = modules if done is _NOT_STARTED else done | modules
        return original(fn)

    @functools.wraps(launch)
    def run_launch(self, *args, **kwargs):
        state.done = _NOT_STARTED
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.done = None

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = run_launch
    return True


def skip_discarded_overflow_checks() -> bool:
    """Make the interpreter's builders skip ``sanitize_overflow`` while their ``debug`` is off (module docstring);
    False where the interpreter's internals are not the expected ones, or it was done already (nothing is changed
    then)."""
    from triton.runtime import interpreter

    builder_class = getattr(interpreter, "InterpreterBuilder", None)
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if builder_class is None or not dataclasses.is_dataclass(options):
        return False
    if not {"debug", "sanitize_overflow"} <= {f.name for f in dataclasses.fields(options)}:
        return False
    init = builder_class.__init__
    if getattr(init, "skips_discarded_checks", False):
        return False

    def unchecked(options):
        return options if options.debug else dataclasses.replace(options, sanitize_overflow=False)

    @functools.wraps(init)
    def build(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.options = unchecked(self.options)

    build.skips_discarded_checks = True
    builder_class.__init__ = build
    builder.options = unchecked(builder.options)
    return True


def reuse_interpreted_types() -> bool:
    """Make the interpreter's per-operation type bookkeeping reuse what an earlier operation of the same shape built
    (module docstring); False where its internals are not the expected ones, or it was done already (nothing is
    changed then)."""
    import triton.language as tl
    from triton.language import core, semantic
    from triton.runtime import interpreter

    semantics = getattr(semantic, "TritonSemantic", None)
    if semantics is None or not hasattr(interpreter, "_get_np_dtype"):
        return False
    if getattr(core.tensor.__init__, "reuses_types", False):
        return False
    probe_type = core.block_type(tl.float32, [2, 4])
    probe = core.tensor(None, probe_type)
    if (
        type(probe_type.shape) is not core.tuple
        or set(vars(probe_type)) != {"element_ty", "shape", "numel", "name"}
        or probe_type.name != f"<{probe_type.shape}, {tl.float32}>"
        or set(vars(probe)) != {"handle", "type", "dtype", "numel", "shape"}
    ):
        return False
    block_type, scalar_type = core.block_type, core.dtype

    np_dtype_of = interpreter._get_np_dtype
    np_dtypes: dict[str, object] = {}

    @functools.wraps(np_dtype_of)
    def np_dtype(tt_dtype):  # the interpreter's builds a table of 19 dtypes per call
        if type(tt_dtype) is block_type:
            tt_dtype = tt_dtype.element_ty
        if type(tt_dtype) is not scalar_type:  # pointers (and anything else): as the interpreter does
            return np_dtype_of(tt_dtype)
        found = np_dtypes.get(tt_dtype.name)  # dtypes are equal (and hash) by name
        if found is None:
            found = np_dtypes[tt_dtype.name] = np_dtype_of(tt_dtype)
        return found

    block_init = block_type.__init__
    blocks: dict[tuple[int, ...], tuple] = {}  # shape -> (its triton tuple, numel, str)

    def shape_key(shape) -> tuple[int, ...] | None:
        """The dims of a list or triton tuple of ints or constexpr ints (what block_type accepts), else None."""
        if type(shape) is core.tuple:
            shape = shape.values
        elif type(shape) is not list:
            return None
        key = []
        for dim in shape:
            if type(dim) is core.constexpr:
                dim = dim.value
            if type(dim) is not int:
                return None
            key.append(dim)
        return tuple(key)

    @functools.wraps(block_init)
    def init_block_type(self, element_ty, shape):
        key = shape_key(shape)
        found = blocks.get(key) if key is not None else None
        if found is None:  # first of its shape (or an argument to refuse): checked as the interpreter does
            block_init(self, element_ty, shape)
            if key is not None:
                blocks[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, shape_name = found
        self.name = f"<{shape_name}, {element_ty}>"

    tensor_init = core.tensor.__init__
    tensor_shapes: dict[tuple[int, ...], tuple] = {}  # block shape -> (numel, shape as a triton tuple of constexpr)

    @functools.wraps(tensor_init)
    def init_tensor(self, handle, type):
        shape = type.shape if type.is_block() else ()
        found = tensor_shapes.get(shape)
        if found is None:
            tensor_init(self, handle, type)
            tensor_shapes[shape] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = found

    broadcast = semantics.broadcast_impl_value

    @functools.wraps(broadcast)
    def broadcast_values(self, lhs, rhs):
        lhs_type, rhs_type = lhs.type, rhs.type
        if (
            type(lhs_type) is block_type
            and type(rhs_type) is block_type
            and lhs_type.shape.values == rhs_type.shape.values
        ):
            return lhs, rhs  # what the interpreter's returns for blocks of one shape, without comparing them thrice
        return broadcast(self, lhs, rhs)

    check_operands = semantics.binary_op_type_checking_impl
    tensor_class = core.tensor

    @functools.wraps(check_operands)
    def operands_of_one_type(self, lhs, rhs, *args, **kwargs):
        if type(lhs) is tensor_class and type(rhs) is tensor_class and _one_arithmetic_dtype(lhs.dtype, rhs.dtype):
            div_or_mod = kwargs.get("div_or_mod", args[3] if len(args) > 3 else False)
            narrow_division = div_or_mod and lhs.dtype.is_floating() and lhs.dtype.name not in ("fp32", "fp64")
            if not narrow_division:  # promoted to their own dtype (/ and % of fewer bits: to fp32), no casts
                return self.broadcast_impl_value(lhs, rhs)
        return check_operands(self, lhs, rhs, *args, **kwargs)

    def _one_arithmetic_dtype(a, b) -> bool:
        """One non-pointer int or float dtype (of tensors, scalar or block; Python numbers take the promotion rules)."""
        return (
            type(a) is scalar_type and type(b) is scalar_type and a.name == b.name and (a.is_floating() or a.is_int())
        )

    init_tensor.reuses_types = True
    interpreter._get_np_dtype = np_dtype
    block_type.__init__ = init_block_type
    core.tensor.__init__ = init_tensor
    semantics.broadcast_impl_value = broadcast_values
    semantics.binary_op_type_checking_impl = operands_of_one_type
    return True
