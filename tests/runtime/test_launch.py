"""`launch`: the first call of an argument signature goes through Triton's ``kernel[grid]``, later calls
straight to the compiled kernel it returned, with every parameter's value in order. Triton's own launch is
replaced by a recorder, so this runs on any machine; the GPU suite runs the real launcher."""
import functools
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from fusepass.runtime import launch as launch_module
from fusepass.runtime.launch import BoundLaunch, compile_ahead, launch


def _kernel_source(X, n, seed, scale, pair, SCALE_FN: tl.constexpr, BLOCK: tl.constexpr = 64):
    pass


class _Recorder:
    """Stands in for Triton: records bound launches (Triton's path) and direct ones (the compiled kernel's)."""

    def __init__(self):
        self.bound: list = []
        self.direct: list = []

    def run(self, kernel, *args, grid, warmup, **keywords):
        self.bound.append((grid, args, keywords))
        recorder = self

        class Compiled:
            def __init__(self):
                self.handles_on = None  # the thread that built its launcher and loaded it (Triton: on first launch)

            def _init_handles(self):
                self.handles_on = threading.get_ident()

            def __getitem__(self, grid):
                return lambda *values: recorder.direct.append((grid, values))

        return Compiled()


@pytest.fixture
def recorder(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: recorder.run(self, *a, **k))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_make_cuda_context_current", lambda: None)
    monkeypatch.setattr(launch_module, "_bound", launch_module.OrderedDict())
    return recorder


@pytest.fixture
def kernel():
    return JITFunction(_kernel_source, do_not_specialize=["seed"])


def _identity(x):
    return x


def _other(x):
    return x


def _call(kernel, x, n=100, seed=7, scale=0.5, pair=(3, 16), fn=_identity, **keywords):
    launch(kernel, (4,), x, n, seed, scale, pair, SCALE_FN=fn, num_warps=4, **keywords)


def test_second_call_launches_the_compiled_kernel_with_every_value_in_order(recorder, kernel):
    x = torch.randn(40)
    _call(kernel, x)
    _call(kernel, x, seed=123, scale=2.0)
    assert len(recorder.bound) == 1 and recorder.bound[0][2] == {"SCALE_FN": _identity, "num_warps": 4}
    (grid, values), = recorder.direct
    assert grid == (4, 1, 1)
    assert values[0] is x and values[1:] == (100, 123, 2.0, (3, 16), _identity, 64)


@pytest.mark.parametrize("change", [
    dict(x="misaligned"), dict(x="float64"), dict(n=101), dict(pair=(3, 17)), dict(fn=_other), dict(BLOCK=32),
    dict(seed=2**31), dict(seed=-1), dict(num_warps=8)])
def test_a_new_signature_goes_through_triton(recorder, kernel, change):
    x = torch.randn(40)
    _call(kernel, x)
    if change.get("x") == "misaligned":
        change["x"] = x[1:]  # 4 bytes past a 16-byte aligned base
    elif change.get("x") == "float64":
        change["x"] = x.double()
    if "num_warps" in change:
        launch(kernel, (4,), x, 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=8)
    else:
        _call(kernel, **{"x": x, **change})
    assert len(recorder.bound) == 2 and not recorder.direct


def test_values_triton_does_not_specialize_on_keep_the_compiled_kernel(recorder, kernel):
    x = torch.randn(40)
    for seed, scale in [(7, 0.5), (8, 0.25), (2**31 - 1, -3.0)]:
        _call(kernel, torch.randn(40), seed=seed, scale=scale)
    _call(kernel, x, seed=0)
    assert len(recorder.bound) == 1 and len(recorder.direct) == 3


def test_interpreted_kernels_are_launched_by_triton():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **keywords: calls.append((grid, args, keywords))

    launch(Interpreted(), (2, 3), 1, 2, BLOCK=16)
    launch(Interpreted(), (2, 3), 1, 2, BLOCK=16)
    assert calls == [((2, 3), (1, 2), {"BLOCK": 16})] * 2


def test_a_bound_launch_looks_at_its_positional_arguments_only(recorder, kernel):
    bound = BoundLaunch(kernel, 5, SCALE_FN=_identity, num_warps=4)
    x = torch.randn(40)
    bound((3,), x, 100, 7, 0.5, (3, 16))
    bound((5, 2), x, 100, 8, 0.25, (3, 16))
    bound((5, 2), x[1:], 100, 8, 0.25, (3, 16))
    assert [call[2] for call in recorder.bound] == [{"SCALE_FN": _identity, "num_warps": 4}] * 2
    assert recorder.direct == [((5, 2, 1), (x, 100, 8, 0.25, (3, 16), _identity, 64))]


@pytest.fixture
def compiling(recorder, monkeypatch):
    """`compile_ahead` on the recorder's device, Triton already started (its driver needs a GPU)."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(launch_module, "_start_triton", lambda: None)
    return recorder


@pytest.fixture
def ahead(compiling, monkeypatch):
    """`compile_ahead` on this thread (the pool's thread runs the same function)."""

    class Now:
        def submit(self, fn):
            future = launch_module.Future()
            try:
                future.set_result(fn())
            except Exception as error:
                future.set_exception(error)
            return future

    monkeypatch.setattr(launch_module, "_compiling", Now())
    return compiling


def test_a_launch_compiled_ahead_goes_straight_to_the_compiled_kernel(ahead, kernel):
    x = torch.randn(40)
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    compile_ahead(kernel, x, 100, 8, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)  # the same signature
    (grid, args, keywords), = ahead.bound
    assert grid == (1,) and keywords == {"SCALE_FN": _identity, "num_warps": 4}
    _call(kernel, x)
    assert len(ahead.bound) == 1 and ahead.direct == [((4, 1, 1), (x, 100, 7, 0.5, (3, 16), _identity, 64))]


def test_a_launch_of_another_signature_than_compiled_ahead_goes_through_triton(ahead, kernel):
    compile_ahead(kernel, torch.empty(0, device="meta", dtype=torch.float64), 100, 7, 0.5, (3, 16),
                  SCALE_FN=_identity, num_warps=4)
    _call(kernel, torch.randn(40))
    assert len(ahead.bound) == 2 and not ahead.direct


def test_a_launch_of_another_signature_waits_for_its_kernels_compiles_ahead(compiling, kernel, monkeypatch):
    """Triton tells an int only as a multiple of 16 or not: a compile ahead at another value may be the kernel
    Triton looks up for the launch, which waits for it rather than have Triton compile it again."""
    order, release = [], threading.Event()

    def run(self, *args, grid, warmup, **keywords):
        if warmup:
            release.wait(10)
        order.append("compiled ahead" if warmup else "launched through Triton")
        return compiling.run(self, *args, grid=grid, warmup=warmup, **keywords)

    monkeypatch.setattr(JITFunction, "run", run)
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    threading.Timer(0.2, release.set).start()
    _call(kernel, torch.randn(40), n=116)
    assert order == ["compiled ahead", "launched through Triton"]


def test_a_compile_ahead_that_failed_leaves_the_launch_to_triton(ahead, kernel, monkeypatch):
    def failing(*args, warmup, **keywords):
        if warmup:
            raise RuntimeError("compile failed")
        return ahead.run(kernel, *args, warmup=warmup, **keywords)

    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: failing(*a, **k))
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    _call(kernel, torch.randn(40))
    assert len(ahead.bound) == 1 and not ahead.direct  # the launch's own compile, through Triton


def test_cache_keys_are_computed_before_the_compile_thread_starts(ahead, kernel, monkeypatch):
    """A kernel's Triton cache key depends on which of its dependencies' keys were computed before it: computed
    on compile threads, keys would follow the threads' order and differ between runs of one program (a warm
    disk cache then misses). `compile_ahead` computes the kernel's and its constexpr functions' first."""
    scale_fn = JITFunction(_identity)
    computed_first = []
    pool = launch_module._compiling

    class Checking:
        def submit(self, fn):
            computed_first.append((kernel.hash is not None, scale_fn.hash is not None))
            return pool.submit(fn)

    monkeypatch.setattr(launch_module, "_compiling", Checking())
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=scale_fn, num_warps=4)
    assert computed_first == [(True, True)]


def test_triton_starts_on_the_callers_thread_before_the_compile_thread(ahead, kernel, monkeypatch):
    """On a compile thread, Triton's start (hashing its files) crawled while the caller's thread traced on:
    `compile_ahead` starts it on the caller's thread, before it submits the compile."""
    events = []
    monkeypatch.setattr(launch_module, "_start_triton", lambda: events.append(("start", threading.get_ident())))
    pool = launch_module._compiling

    class Checking:
        def submit(self, fn):
            events.append(("submit", threading.get_ident()))
            return pool.submit(fn)

    monkeypatch.setattr(launch_module, "_compiling", Checking())
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    assert events == [("start", threading.get_ident()), ("submit", threading.get_ident())]


def test_compiles_ahead_of_one_kernel_and_keywords_run_one_at_a_time(compiling, kernel, monkeypatch):
    """Two signatures that Triton specializes alike are one compiled kernel: compiled at once, it was compiled
    twice; one after the other, the second finds it in Triton's cache."""
    running, overlapped = [], []

    def slow(self, *args, **keywords):
        overlapped.append(bool(running))
        running.append(1)
        time.sleep(0.05)
        running.pop()
        return compiling.run(self, *args, **keywords)

    monkeypatch.setattr(JITFunction, "run", slow)
    for n in (100, 200):  # the same bound launch, two signatures
        compile_ahead(kernel, torch.empty(0, device="meta"), n, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    launch_module.finish_compiles_ahead()
    assert overlapped == [False, False]


def test_a_compile_ahead_builds_the_launcher_on_the_compile_thread(compiling, kernel, monkeypatch):
    """Triton builds a kernel's launcher (a C module, compiled) and loads its binary on its first launch; a
    kernel compiled ahead has them built on the compile thread, off the caller's."""
    compiled = []
    run = compiling.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: compiled.append(run(self, *a, **k)) or compiled[-1])
    compile_ahead(kernel, torch.empty(0, device="meta"), 100, 7, 0.5, (3, 16), SCALE_FN=_identity, num_warps=4)
    launch_module.finish_compiles_ahead()
    assert compiled[0].handles_on not in (None, threading.get_ident())


def test_triton_is_not_hashed_in_processes_multiprocessing_started(monkeypatch):
    started = []
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(launch_module.threading, "Thread",
                        lambda **kwargs: started.append(kwargs) or SimpleNamespace(start=lambda: None))
    monkeypatch.setattr(launch_module.multiprocessing, "parent_process", lambda: object())
    launch_module.start_triton_in_background()
    assert not started


def _slow_triton_key(hashed: list):
    @functools.lru_cache  # as Triton keeps its key: computed by every caller that asks before the first has it
    def slow_key():
        hashed.append(threading.get_ident())
        time.sleep(0.05)
        return "key"

    return slow_key


def test_triton_hashed_in_the_background_is_hashed_once(monkeypatch):
    """Where torch is built for CUDA, importing fusepass starts hashing Triton on a thread of its own; a compile
    ahead asking meanwhile waits for it instead of hashing again."""
    hashed = []
    monkeypatch.setattr(launch_module, "triton_key", _slow_triton_key(hashed))
    monkeypatch.setattr(launch_module, "driver", SimpleNamespace(active=SimpleNamespace(get_current_target=tuple)))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    launch_module.start_triton_in_background()
    deadline = time.monotonic() + 10
    while not launch_module._starting.locked() and not hashed and time.monotonic() < deadline:
        time.sleep(0.001)  # until the background thread holds the lock
    launch_module._start_triton()
    assert len(hashed) == 1 and hashed[0] != threading.get_ident()


def test_bound_arguments_follow_the_passed_ones_and_stay_out_of_the_signature(recorder, kernel):
    bound = BoundLaunch(kernel, 3, bound_args=(0.5, (3, 16)), SCALE_FN=_identity, num_warps=4)
    x = torch.randn(40)
    bound((3,), x, 100, 7)
    bound((3,), x, 100, 8)
    (grid, args, keywords), = recorder.bound
    assert args == (x, 100, 7, 0.5, (3, 16)) and keywords == {"SCALE_FN": _identity, "num_warps": 4}
    assert recorder.direct == [((3, 1, 1), (x, 100, 8, 0.5, (3, 16), _identity, 64))]


def test_holding_collects_each_launch_with_its_compiled_kernel(recorder, kernel):
    x = torch.randn(40)
    _call(kernel, x)  # Triton's path
    with launch_module.holding() as held:
        _call(kernel, x, seed=1)  # the compiled kernel's
        with launch_module.holding() as inner:
            _call(kernel, x, seed=2)
        _call(kernel, x, seed=3)
    _call(kernel, x, seed=4)
    assert [args[2] for _, args in held] == [1, 3] and [args[2] for _, args in inner] == [2]
    assert all(args[0] is x for _, args in held + inner)
    assert launch_module._held is None


def test_triton_starts_once_however_many_threads_compile(monkeypatch):
    hashed = []
    monkeypatch.setattr(launch_module, "triton_key", _slow_triton_key(hashed))
    monkeypatch.setattr(launch_module, "driver", SimpleNamespace(active=SimpleNamespace(get_current_target=tuple)))
    threads = [threading.Thread(target=launch_module._start_triton) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(hashed) == 1


@triton.jit
def _copy_tile(source, target, BLOCK: tl.constexpr):
    target.store([0, 0], source.load([0, 0]))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="TMA descriptors are encoded by the driver of a Hopper GPU")
def test_a_tma_launch_runs_on_a_thread_that_has_done_no_cuda_work():
    # Autograd's backward thread launches kernels compiled on the main thread, with every block it allocates
    # in torch's cache: its first CUDA work can be a launch whose descriptors the driver encodes.
    x = torch.randn(16, 16, device="cuda")
    y = torch.empty_like(x)
    descriptors = TensorDescriptor.from_tensor(x, [16, 16]), TensorDescriptor.from_tensor(y, [16, 16])
    launch(_copy_tile, (1,), *descriptors, BLOCK=16)  # compiled, and its binary loaded, here
    y.zero_()
    errors = []

    def on_a_new_thread():
        try:
            launch(_copy_tile, (1,), *descriptors, BLOCK=16)
        except Exception as error:  # noqa: BLE001 (the assertion below shows it)
            errors.append(error)

    thread = threading.Thread(target=on_a_new_thread)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.testing.assert_close(y, x, rtol=0, atol=0)


def _triton_hook_failing():
    """Raises as Triton's call of a JIT hook raises on a jit function among a kernel's constexprs (from a function of
    that name in Triton's runtime/jit.py, whose signature changes between Triton's versions)."""
    namespace = {}
    exec(compile("def _call_hook():\n    raise TypeError('Object of type JITFunction is not JSON serializable')\n",
                 os.path.join("site-packages", "triton", "runtime", "jit.py"), "exec"), namespace)
    namespace["_call_hook"]()


def test_a_launch_that_triton_s_post_compile_hook_fails_is_made_again(recorder, kernel, monkeypatch):
    """Triton serializes a kernel's constexprs for its post-compile hook, after it has cached the kernel: a score
    function among them (a jit function) fails that. The launch is made again, which finds the cached kernel."""
    run = recorder.run

    def compile_then_hook(self, *args, grid, warmup, **keywords):
        compiled = run(self, *args, grid=grid, warmup=warmup, **keywords)
        if len(recorder.bound) == 1:
            _triton_hook_failing()
        return compiled

    monkeypatch.setattr(JITFunction, "run", compile_then_hook)
    x = torch.randn(40)
    _call(kernel, x)
    _call(kernel, x)
    assert len(recorder.bound) == 2 and len(recorder.direct) == 1  # made again once, then straight to the kernel


def test_other_type_errors_of_a_launch_are_raised(recorder, kernel, monkeypatch):
    def failing(self, *args, **keywords):
        raise TypeError("planted")

    monkeypatch.setattr(JITFunction, "run", failing)
    with pytest.raises(TypeError, match="planted"):
        _call(kernel, torch.randn(40))


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _apply_to_tile(X, Y, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(Y + offsets, FN(tl.load(X + offsets)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton calls its JIT hooks when it compiles for a GPU")
def test_a_kernel_taking_a_jit_function_runs_under_a_real_post_compile_hook(monkeypatch):
    """Triton's own post-compile hook call, which fails to serialize a jit function among the constexprs (as the
    attention kernels' score functions are): the launch still runs the kernel, at its first call and after."""
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kwargs: None)
    monkeypatch.setattr(launch_module, "_bound", launch_module.OrderedDict())
    x = torch.randn(16, device="cuda")
    for _ in range(2):
        y = torch.zeros_like(x)
        launch(_apply_to_tile, (1,), x, y, FN=_doubled, BLOCK=16)
        torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
