"""Launching Triton kernels without re-binding their arguments on every call.

``kernel[grid](*args)`` binds and specializes every argument and builds a cache key string before it reaches the
driver, at more host time per launch than some of the kernels take on the device. A `BoundLaunch` (a kernel with
its keywords fixed, as a launch plan fixes them) does that once per signature of its positional arguments and
then launches the compiled kernel Triton returned for it (``CompiledKernel[grid](*values)``, every parameter's
value in order). `launch` keeps a `BoundLaunch` per kernel and keywords.

The signature (`fusepass.runtime.signature`) is finer than Triton's specialization, so a compiled kernel is
never reused where Triton would have compiled another; keywords enter it by value, positional arguments as
their parameters are specialized.

`compile_ahead` starts compiling what a launch will need on a background thread, so that a caller can go on
(building a block map, compiling another kernel) meanwhile: Triton's compiler passes and ptxas leave Python's
lock to other threads, so compiles on threads overlap. The launch then waits for that compile instead of starting
its own.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import torch
from triton.runtime import driver
from triton.runtime.cache import triton_key
from triton.runtime.jit import JITFunction

from fusepass.runtime.signature import CONSTANT, SPECIALIZED, UNSPECIALIZED, SignatureOf


class BoundLaunch:
    """`kernel` with its keywords (constexprs, launch options), the number of the positional arguments a call
    passes and the values of the positional parameters after them (`bound_args`: sizes and strides a launch
    plan fixes) fixed: a call looks up the signature of the arguments it passes alone. Kernels other than
    plain ``triton.jit`` functions (the interpreter's) are launched by Triton on every call."""

    def __init__(self, kernel: Any, n_args: int, *, bound_args: tuple = (), **keywords: Any) -> None:
        self.kernel = kernel
        self.bound_args = bound_args
        self.keywords = keywords  # held: constexpr functions keep their identity
        self.direct = type(kernel) is JITFunction
        if self.direct:
            params = kernel.params
            self.signature_of = SignatureOf([UNSPECIALIZED if p.do_not_specialize else SPECIALIZED
                                             for p in params[:n_args]])
            # The values of the other parameters, in order (the launcher skips the constexprs among them).
            self.keyword_values = [*bound_args, *(keywords.get(p.name, p.default)
                                                  for p in params[n_args + len(bound_args):])]
        self._compiled: dict[tuple, Any] = {}  # signature -> (compiled kernel, what it holds alive)
        self._ahead: dict[tuple, Future] = {}  # signature -> its compile on a background thread
        # Compiles ahead of one kernel and keywords run one at a time: signatures that differ where Triton does
        # not specialize (sizes other than 1 and multiples of 16) are one compiled kernel, which the second then
        # finds in Triton's cache (run at once, the maps' lists kernel at two maps' sizes was compiled twice).
        self._compiling_one = threading.Lock()

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        if not self.direct:
            if _held is not None:
                _held.append((self.kernel, args))
            with _interpreting_one:
                self.kernel[grid](*args, *self.bound_args, **self.keywords)
            return
        if not getattr(_thread, "has_cuda_context", False):
            _make_cuda_context_current()
        key = (torch.cuda.current_device(), self.signature_of.key(args))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self._compiled_ahead(key)
            if compiled is None:  # Triton compiles and launches it
                self._finish_compiles_ahead()
                try:
                    compiled = self.kernel[grid](*args, *self.bound_args, **self.keywords)
                except TypeError as error:
                    if not _raised_by_triton_hook(error):
                        raise
                    # Triton serializes a kernel's constexprs for its post-compile hook, which the attention's score
                    # functions fail, after it has cached the kernel and before it launches it: launched again, the
                    # kernel is found in Triton's cache and the hook not called.
                    compiled = self.kernel[grid](*args, *self.bound_args, **self.keywords)
                if compiled is not None:  # None: not compiled on this thread yet (Triton's asynchronous mode)
                    self._compiled[key] = compiled, self.signature_of.held(args)
                if _held is not None:
                    _held.append((compiled, args))
                return
            entry = self._compiled[key] = compiled, self.signature_of.held(args)
        if _held is not None:
            _held.append((entry[0], args))
        entry[0][(*grid, 1, 1)[:3]](*args, *self.keyword_values)

    def compile_ahead(self, *args: Any) -> None:
        """Compile, on a background thread, the kernel a call with these positional arguments will launch (only
        their signature matters: tensors may be meta tensors)."""
        if not self.direct:
            return
        key = (torch.cuda.current_device(), self.signature_of.key(args))
        if key in self._compiled or key in self._ahead:
            return

        _settle_cache_keys(self.kernel, self.keywords)
        _start_triton()

        def compile() -> Any:
            torch.cuda.set_device(key[0])  # a thread starts on the first device
            with self._compiling_one:
                compiled = self.kernel.run(*args, *self.bound_args, grid=(1,), warmup=True, **self.keywords)
            if compiled is not None:
                # Triton builds a kernel's launcher (C, compiled by the system's compiler; cached on disk) and
                # loads its binary at its first launch, on the caller's thread: here instead. A kernel that does
                # not fit raises here, and the launch raises it again (`flash_config.launch_fitting`).
                compiled._init_handles()
            return compiled

        self._ahead[key] = future = _compiling.submit(compile)
        _pending.add(future)
        future.add_done_callback(_pending.discard)

    def _finish_compiles_ahead(self) -> None:
        """Wait for the compiles ahead of this kernel at other signatures, and forget them. The signature keys
        ints by value where Triton tells them only as multiples of 16 or not: one of those compiles may be the
        kernel Triton is about to look up in its cache (a symbolic attention compiles ahead at a length of each
        kind, `attention.other_lengths`), which it would otherwise compile again beside it."""
        for key in list(self._ahead):
            ahead = self._ahead.pop(key, None)
            if ahead is not None:
                wait([ahead])

    def _compiled_ahead(self, key: tuple) -> Any:
        """The kernel compiled ahead for this signature, once compiled, or None where none was or it failed (the
        launch then compiles it again, and raises what Triton raises)."""
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            return None
        try:
            return ahead.result()
        except Exception:
            return None


def _raised_by_triton_hook(error: BaseException) -> bool:
    """Whether `error` was raised calling one of Triton's JIT hooks (`knobs.runtime.jit_cache_hook`, before a
    compile, or `jit_post_compile_hook`, after it)."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_call_hook" and code.co_filename.endswith(os.path.join("runtime", "jit.py")):
            return True
        tb = tb.tb_next
    return False


_thread = threading.local()
# Triton's interpreter keeps a launch's grid and program ids in globals: two threads' launches at once compute
# wrong values, or never end. Interpreted launches run one at a time.
_interpreting_one = threading.RLock()


def _make_cuda_context_current() -> None:
    """Make the device's context current on this thread, once per thread.

    A thread other than the one that started CUDA (autograd's backward thread) holds no current context until
    some CUDA runtime call makes one current. Triton encodes a launch's TMA descriptors (the driver's
    ``cuTensorMapEncodeTiled``) before its launcher makes the context current, so where that thread's first
    CUDA work was such a launch (every block it allocated already in torch's cache), the encoding failed with
    "invalid device context". Querying the current stream is a runtime call: it makes the context current and
    waits for nothing."""
    torch.cuda.current_stream().query()
    _thread.has_cuda_context = True


def _settle_cache_keys(kernel: JITFunction, keywords: dict) -> None:
    """Compute the cache keys of `kernel` and of the jit functions among its constexprs on this thread.

    Triton folds a dependency's constexpr globals into a kernel's key only where the dependency's own key was
    computed before (triton 3.6 `DependenciesFinder._update_hash` reads them first), so a key depends on the
    order in which keys were computed. Computed on compile threads, that order was whichever the threads ran
    in: a process repeating the same first call found none of its flash kernels in the warm disk cache and
    compiled them again. On the caller's thread, keys follow the program's order, the same in every run."""
    for function in (kernel, *(value for value in keywords.values() if isinstance(value, JITFunction))):
        function.cache_key  # a property: computed on first reading, then kept


_starting = threading.Lock()


def _start_triton() -> None:
    """Triton's start in a process: the hash of its own library (`triton_key`, computed once and kept) and its
    driver, on the thread that asks for the first compile ahead, before any compile thread runs.

    On a compile thread, while the caller's thread went on tracing (AOTAutograd's joint graph and partition), the
    hash crawled: it reads Triton's files one at a time, and each read gives up Python's lock, which a thread
    gets back only once the busy thread lets go of it (at Python's switch interval). Beside a busy Python loop it
    took many times as long as alone, so a forward+backward's first call, whose tracing keeps the caller's thread
    busy longer, started its compiles well after a forward's did. The hash may have been computed already
    (`start_triton_in_background`); every caller waits for the one that computes it."""
    with _starting:
        triton_key()
        driver.active.get_current_target()


def _hash_triton() -> None:
    with _starting:
        triton_key()


def start_triton_in_background() -> None:
    """Compute Triton's hash (see `_start_triton`) on a thread of its own where torch is built for CUDA: a
    program that imports fusepass usually spends the time before its first compiled call where Python's lock
    is free often (loading data, starting CUDA). Nothing of CUDA is touched here (asking whether a device is
    there would start CUDA's driver before a fork). Not in processes that `multiprocessing` started (data
    loader workers import the program's modules too, and compile nothing). A child forked meanwhile gets a
    lock of its own."""
    if torch.version.cuda is not None and multiprocessing.parent_process() is None:
        threading.Thread(target=_hash_triton, name="fusepass-triton-start", daemon=True).start()


def _new_start_lock() -> None:
    global _starting
    _starting = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_new_start_lock)


# The compiled kernels and arguments of the launches made inside `holding()`, or None outside it.
_held: list | None = None


@contextmanager
def holding() -> Iterator[list]:
    """Collect the compiled kernel and the arguments of every launch made inside (`fusepass.runtime.replay`
    keeps what a captured graph reads alive with them)."""
    global _held
    outer, _held = _held, []
    try:
        yield _held
    finally:
        _held = outer


# Threads for `compile_ahead`: a rewrite starts up to three flash kernels' compiles and its block maps' (a
# tile-kind kernel and a lists kernel per tile shape).
_compiling = ThreadPoolExecutor(max_workers=8, thread_name_prefix="fusepass-compile")
_pending: set[Future] = set()


def finish_compiles_ahead() -> None:
    """Wait for every compile `compile_ahead` started. Python's warning filters are the process's, and Triton
    may change them while it compiles: a warning the caller's thread gives meanwhile can be lost to a
    ``warnings.catch_warnings`` (a test of warnings waits first)."""
    wait(list(_pending))


# Bound launches keep their kernels and constexpr functions alive (generated kernels come and go with
# models): the oldest go first. Kernels are keyed by identity (hashing a JITFunction hashes its source).
_CACHE_SIZE = 512
_bound: OrderedDict[tuple, BoundLaunch] = OrderedDict()


# The signatures of keyword values, by the keywords' names (the values' structures are few per name set).
_keyword_signatures: dict[tuple[str, ...], SignatureOf] = {}


def _bound_launch(kernel: Any, args: tuple, keywords: dict) -> BoundLaunch:
    names = tuple(keywords)
    signature_of = _keyword_signatures.get(names)
    if signature_of is None:
        signature_of = _keyword_signatures[names] = SignatureOf([CONSTANT] * len(names))
    key = (id(kernel), len(args), names, signature_of.key(tuple(keywords.values())))
    bound = _bound.get(key)
    if bound is None:
        bound = _bound[key] = BoundLaunch(kernel, len(args), **keywords)
        if len(_bound) > _CACHE_SIZE:
            _bound.popitem(last=False)
    return bound


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **keywords: Any) -> None:
    """``kernel[grid](*args, **keywords)`` (``num_warps`` and ``num_stages`` among the keywords), through the
    `BoundLaunch` of the kernel with these keywords."""
    if type(kernel) is not JITFunction:
        if _held is not None:
            _held.append((kernel, args))
        with _interpreting_one:
            kernel[grid](*args, **keywords)
        return
    _bound_launch(kernel, args, keywords)(grid, *args)


def compile_ahead(kernel: Any, *args: Any, **keywords: Any) -> None:
    """Start compiling, on a background thread, what ``launch(kernel, grid, *args, **keywords)`` will launch
    (interpreted kernels compile nothing)."""
    if type(kernel) is JITFunction:
        _bound_launch(kernel, args, keywords).compile_ahead(*args)
