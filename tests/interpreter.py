"""The Triton interpreter, for the test processes: triton.language patched once per launch, not once per call.

The interpreter maps ``triton.language``'s builtins onto numpy when a launch starts, and maps them again at every
call of a nested ``@triton.jit`` function, though the launch's mapping is still in force (the nested mapping is
never undone either). Those repeats — ``inspect.getmembers`` of four modules, about half a millisecond each — are
a third of an attention kernel's interpreted time. :func:`patch_language_once_per_launch` keeps the first mapping
of each language module (``triton.language``, ``triton.language.core``) per launch and skips the repeats: the
kernels run the same numpy operations, in the same order, on the same values.

A function that sees no language module is still passed to the interpreter's own mapping, which refuses it as it
would. The bookkeeping is per thread; the mapping itself, as in the interpreter, is global (kernels launched from
two threads at once race there either way).

Test processes only: hfaccel itself never changes Triton. Where the interpreter's internals differ from what this
expects (another Triton release), nothing is changed and kernels run at the interpreter's own speed.
"""

from __future__ import annotations

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
