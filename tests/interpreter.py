"""The Triton interpreter, for the test processes: triton.language patched once per launch, not once per call, and no
integer overflow sanitizer whose findings are thrown away.

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
