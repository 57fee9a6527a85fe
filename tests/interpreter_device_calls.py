"""Triton's interpreter (3.9) patches triton.language's modules for a launch, then again at every call of a
@triton.jit function from inside the kernel (a score or mask function per tile; tl.sum and tl.max, which are jit
functions of triton.language.standard): each time it walks the modules' members (`inspect.getmembers`), ~1.4 ms a
call, a third of the time of a test training attention layers. Those patches are never undone before the launch's
end, so `patch_language_once_per_launch()` skips a device function's patch where the launch has already patched
every language module the function sees; a function that sees one more (triton.language.core, where the kernel
sees triton.language alone) is patched as Triton does, once per launch. Interpreted launches run one at a time
(fusepass.runtime.launch holds a lock around them), so one record of the running launch serves."""
from __future__ import annotations


def patch_language_once_per_launch() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_LangPatchScope"):  # a Triton whose patches this does not know: left as it is
        return
    patch, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    if getattr(patch, "once_per_launch", False):
        return
    # The language modules the running launch has patched (none yet before its own patch), or None outside a launch.
    launch: dict[str, frozenset | None] = {"patched": None}

    def language_modules(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_once(fn):
        seen, patched = language_modules(fn), launch["patched"]
        if patched and seen <= patched:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        if patched is not None:
            launch["patched"] = patched | seen
        return patch(fn)

    def run_grid_patching_once(self, *args, **kwargs):
        launch["patched"] = frozenset()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch["patched"] = None

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = run_grid_patching_once
