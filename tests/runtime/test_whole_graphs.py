"""Whole-graph replays (`graphs=True`, runtime/whole_graphs.py) on this machine: the option and the mode that turn
them on, and each reason a graph runs as compiled instead (`refusal`), on graphs of fake CUDA tensors and on the
graphs the pipeline compiles. The replays themselves need a CUDA device: test_whole_graphs_cuda.py."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, assert_close, random_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fusepass
from fusepass.attention.call import call_named
from fusepass.runtime import whole_graphs
from fusepass.attention.known_contents import ContentsChanged
from fusepass.runtime.whole_graphs import guarded_arguments, refusal


def chain(x, b):
    return torch.tanh(x + b) * 2


def test_reduce_overhead_mode_and_graphs_run_as_compiled_off_cuda_and_say_nothing():
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    for compiled in (torch.compile(chain, backend="fusepass", mode="reduce-overhead"),
                     torch.compile(chain, backend=fusepass.backend(graphs=True))):
        fusepass.reset()
        torch._dynamo.reset()
        assert_close(compiled(x, b), chain(x, b))
        if DEVICE == "cpu":  # replays are CUDA's: elsewhere the graphs run as compiled, and nothing is said
            assert not fusepass.last_report().notices


def _fake_cuda_graph(fn, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    """`fn` traced over fake CUDA tensors of `shapes` (no device needed)."""
    with FakeTensorMode():
        inputs = [torch.empty(shape, device="cuda") for shape in shapes]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_an_in_place_write_to_an_argument_that_may_move_is_refused():
    def writes_b(x, b):
        b.add_(1)
        return (x * 2 + b,)

    graph = _fake_cuda_graph(writes_b, (4, 8), (4, 8))
    assert refusal(graph, static=[0]) == "it writes its argument b_1 in place, which may move"
    assert refusal(graph, static=[1]) is None  # a parameter or buffer stays where it is


def test_a_tensor_on_the_cpu_is_refused_an_empty_one_not():
    def reads_host(x):
        return (x * torch.ones(3).to(x.device).sum(),)

    assert refusal(_fake_cuda_graph(reads_host, (4,)), static=[]) == \
        "ones is a tensor on the CPU, which a CUDA graph does not hold"

    def empty_host(x):
        torch.empty(0, dtype=torch.int64)
        return (x * 2,)

    assert refusal(_fake_cuda_graph(empty_host, (4,)), static=[]) is None


def _forward_graph(model, *inputs, **options) -> torch.fx.GraphModule:
    """The forward graph the pipeline compiled for `model`, after one training step."""
    fusepass.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fusepass.backend(strict=True, **options))
    compiled(*inputs).float().pow(2).sum().backward()
    return fusepass.last_report().graphs["forward"]


def dropout_attention(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return F.dropout(torch.softmax(s, dim=-1), p=0.25, training=True) @ v


def _qkv(n: int = 37) -> list[torch.Tensor]:
    return [random_tensor((2, 3, n, 16), torch.float32).requires_grad_() for _ in range(3)]


def test_random_numbers_drawn_on_the_host_are_refused():
    def host_noise(x):
        return (x + torch.rand(4).to(x.device),)

    reason = refusal(_fake_cuda_graph(host_noise, (4,)), static=[])
    assert reason is not None and "draws random numbers on the host: a replay would keep them" in reason


def test_attention_dropout_draws_its_seed_where_the_attention_computes():
    """On the device, a seed the kernels read: a replay draws it anew (the CUDA generator's offset advances with
    each replay), so attention dropout does not keep a graph from replaying."""
    graph = _forward_graph(dropout_attention, *_qkv())
    attention, = graph.graph.find_nodes(op="call_function", target=torch.ops.fusepass.attention.default)
    seed = attention.args[4]
    assert seed.target is torch.ops.aten.randint.low and seed.kwargs["device"].type == torch.device(DEVICE).type


def test_a_buffer_read_as_known_contents_is_checked_before_each_replay():
    from attention.test_known_contents import BufferAttention

    torch.manual_seed(0)
    model = BufferAttention().to(DEVICE)
    graph = _forward_graph(model, torch.randn(2, 37, 32, device=DEVICE))
    (position, guard), = guarded_arguments(graph)
    assert guard.name == "L['self']._buffers['bias']"
    assert graph.graph.find_nodes(op="placeholder")[position].meta["val"].shape == model.bias.shape
    guard.check_tensor(model.bias)  # as it holds what the kernels compute
    with torch.no_grad():
        model.bias[0, 0, 3, 7] = 1.0
    with pytest.raises(ContentsChanged, match="no longer holds what it held when compiled"):
        guard.check_tensor(model.bias)


def plain_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def test_attention_planned_per_call_is_refused():
    fusepass.reset()
    torch._dynamo.reset()
    compiled = torch.compile(plain_attention, backend=fusepass.backend(strict=True), dynamic=True)
    compiled(*_qkv(37)).sum().backward()
    reason = refusal(fusepass.last_report().graphs["forward"], static=[])
    assert reason is not None and "plans its attention per call (symbolic sizes) in Python" in reason


def test_a_plain_attention_graph_is_replayed_and_runs_without_the_sdpa_floor():
    graph = _forward_graph(plain_attention, *_qkv(), graphs=True)
    ops = [n for n in graph.graph.nodes if n.target is torch.ops.fusepass.attention.default]
    assert len(ops) == 1
    # the graph's tensors are on the CPU here; the attention itself gives no reason
    assert refusal(graph, static=[]) in (None, f"{graph.graph.find_nodes(op='placeholder')[0].name} is a tensor on "
                                               "the CPU, which a CUDA graph does not hold")
    assert not call_named(ops[0].args[-1]).spec.sdpa


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs"])
def test_other_modes_are_still_refused(mode):
    with pytest.raises(Exception, match=f"fusepass has no mode '{mode}'"):
        torch.compile(chain, backend="fusepass", mode=mode)(random_tensor((6, 5), torch.float32),
                                                             random_tensor((5,), torch.float32))


def test_a_replayed_graph_hands_out_copies_and_stops_replaying_at_a_changed_buffer(monkeypatch):
    """`replayed`'s wiring with torch's trees stood in for (they need CUDA): what the graph hands out is copied, the
    buffer's guard is checked before each replay, and a changed buffer sends this call and every later one to the
    compiled graph, with a notice."""
    from attention.test_known_contents import BufferAttention
    from torch._inductor import cudagraph_trees

    torch.manual_seed(0)
    model = BufferAttention().to(DEVICE)
    graph = _forward_graph(model, torch.randn(2, 37, 32, device=DEVICE))
    (position, _), = guarded_arguments(graph)
    replays = []

    def trees(model_fn, inputs, static, **kwargs):
        def replay(args):
            replays.append(len(args))
            return model_fn(args)
        return replay

    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", trees)
    monkeypatch.setattr(whole_graphs, "refusal", lambda module, static: None)  # the CPU tensors of this graph
    monkeypatch.setattr(whole_graphs, "handed_out", lambda module: {0})  # AOTAutograd's, at its compile
    handed = torch.ones(3)
    compiled_calls = []

    def compiled(args):
        compiled_calls.append(len(args))
        return [handed]

    arguments = [None] * len(graph.graph.find_nodes(op="placeholder"))
    arguments[position] = model.bias
    notices = []
    one = whole_graphs.GraphsOfOneCompile(0)
    run = whole_graphs.replayed(compiled, graph, arguments, "forward", True, one, notices.append)
    for _ in range(2):
        out, = run(list(arguments))
        assert out is not handed and torch.equal(out, handed)
    assert len(replays) == 2 and len(compiled_calls) == 2 and not notices
    with torch.no_grad():
        model.bias[0, 0, 3, 7] = 1.0
    for _ in range(2):
        assert run(list(arguments))[0] is handed  # run as compiled: nothing of a pool to copy out of
    assert len(replays) == 2 and len(compiled_calls) == 4 and one.given_up
    assert len(notices) == 1 and notices[0].startswith("from this call on: L['self']._buffers['bias'] no longer holds")


def _replayed_by(monkeypatch, trees, graph, compiled=lambda args: [], inputs=(None, None), why_not=None):
    """`compiled` (of `graph`, a forward) through `whole_graphs.replayed`, `trees` standing in for the trees'
    `cudagraphify_impl`, nothing refused and nothing copied out; the reasons told go to `why_not`'s list."""
    from torch._inductor import cudagraph_trees

    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", trees)
    monkeypatch.setattr(whole_graphs, "refusal", lambda module, static: None)
    monkeypatch.setattr(whole_graphs, "handed_out", lambda module: set())
    told = [] if why_not is None else why_not
    return whole_graphs.replayed(compiled, graph, list(inputs), "forward", False, whole_graphs.GraphsOfOneCompile(0),
                                 told.append)


def test_a_failed_recording_says_which_graph_and_the_way_out(monkeypatch):
    """A capture that fails (GPT-2's did, reading the device while its stream captured) raises CUDA's error, which
    names neither the graph nor `graphs=False`: a note on it does. The error itself goes on, its type and message as
    raised (a strict compile's kernel failure inside a warm-up is caught by them)."""
    def trees(model_fn, inputs, static, **kwargs):
        def replay(args):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return replay

    told, compiled_calls = [], []
    run = _replayed_by(monkeypatch, trees, _fake_cuda_graph(chain, (6, 5), (5,)), why_not=told,
                       compiled=lambda args: compiled_calls.append(args) or [])
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing") as raised:
        run([None, None])
    note, = raised.value.__notes__
    assert "the compiled forward graph failed while warmed up, recorded or replayed as a CUDA graph" in note
    assert "fusepass.backend(graphs=False) runs the graphs as compiled" in note
    # The next call fails, or not, as the compiled graph does (not in the trees' state of the failed call).
    run([None, None])
    assert len(compiled_calls) == 1
    assert told == ["from this call on: it failed while replayed (RuntimeError)"]


def test_a_call_from_another_thread_than_the_recordings_runs_as_compiled(monkeypatch):
    """torch's CUDA graph trees keep their recordings in a thread's state (torch 2.11's serve no thread that Python
    started): a call from a thread other than the one that first replayed runs the graph as compiled, and says so."""
    import threading

    replays, compiled_calls, told = [], [], []

    def trees(model_fn, inputs, static, **kwargs):
        return lambda args: replays.append(args) or []

    run = _replayed_by(monkeypatch, trees, _fake_cuda_graph(chain, (6, 5), (5,)), why_not=told,
                       compiled=lambda args: compiled_calls.append(args) or [])
    run([None, None])
    other = threading.Thread(target=run, args=([None, None],))
    other.start()
    other.join()
    run([None, None])
    assert (len(replays), len(compiled_calls)) == (2, 1)
    assert told == ["a call from another thread than the one that holds its recordings runs as compiled"]


def test_symbolic_sizes_record_once_per_set_of_sizes(monkeypatch):
    """The trees record one function per value of a graph's integer arguments, made from the arguments it is given
    first: fake ones at compile time, and a graph's tensors' sizes need not follow from its integers. So each set of
    the symbolic arguments' sizes gets its own, made at its first call from real arguments (a second size had been
    copied into the first's recorded buffers: 'The size of tensor a (9) must match the size of tensor b (17)')."""
    made = []

    def trees(model_fn, inputs, static, **kwargs):
        made.append([tuple(a.shape) for a in inputs])
        return lambda args: model_fn(args)

    graph = make_fx(chain, tracing_mode="symbolic")(torch.empty(9, 5), torch.empty(5))
    fake = [node.meta["val"] for node in graph.graph.find_nodes(op="placeholder")]
    assert whole_graphs.symbolic_arguments(graph) == [0, 1]
    assert whole_graphs.symbolic_arguments(_fake_cuda_graph(chain, (6, 5), (5,))) == []
    told = []
    run = _replayed_by(monkeypatch, trees, graph, lambda args: [args[0].shape], fake, why_not=told)
    assert made == []  # nothing recorded from the fake arguments
    for rows in (9, 17, 9):
        assert run([torch.empty(rows, 5), torch.empty(5)]) == [(rows, 5)]
    assert made == [[(9, 5), (5,)], [(17, 5), (5,)]]
    assert not told


def test_a_graph_recorded_at_as_many_sets_of_sizes_as_allowed_runs_as_compiled_from_then_on(monkeypatch):
    """Each recorded set of sizes holds memory of its own: a forward at one set more runs as compiled, from then on
    at every size (its backward too, which is recorded at its forward's sizes only), with a warning and a notice."""
    made, compiled_calls, told = [], [], []

    def trees(model_fn, inputs, static, **kwargs):
        made.append(inputs[0].shape[0])
        return lambda args: model_fn(args)

    graph = make_fx(chain, tracing_mode="symbolic")(torch.empty(9, 5), torch.empty(5))
    fake = [node.meta["val"] for node in graph.graph.find_nodes(op="placeholder")]
    run = _replayed_by(monkeypatch, trees, graph, lambda args: compiled_calls.append(args[0].shape[0]) or [], fake,
                       why_not=told)
    allowed = range(20, 20 + whole_graphs.SIZES_RECORDED)
    for rows in allowed:
        run([torch.empty(rows, 5), torch.empty(5)])
    assert made == list(allowed) and not told
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run([torch.empty(7, 5), torch.empty(5)])
        run([torch.empty(20, 5), torch.empty(5)])  # a recorded size: as compiled too, from then on
    assert made == list(allowed)
    assert compiled_calls[-2:] == [7, 20]
    assert told == [f"from this call on: recorded at {whole_graphs.SIZES_RECORDED} sets of sizes already"]
    assert [str(w.message) for w in caught] == [
        f"fusepass: the compiled forward graph has been recorded as a CUDA graph at {whole_graphs.SIZES_RECORDED} "
        "sets of sizes, each holding memory of its own, and runs as compiled from now on; fewer distinct sizes "
        "(padded inputs) replay"]


def test_threads_run_replayed_graphs_one_at_a_time(monkeypatch):
    """A warm-up routes the calling thread's allocations to the trees' pool and a recording captures the stream:
    another thread's warm-up, recording or replay meanwhile broke them on the GPU. Replayed graphs called from two
    threads at once run one after the other."""
    import threading
    import time

    inside, most = [0], [0]

    def trees(model_fn, inputs, static, **kwargs):
        def replay(args):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.02)
            inside[0] -= 1
            return []
        return replay

    # (the recordings' thread is not this test's subject: every thread holds them here)
    monkeypatch.setattr(whole_graphs.GraphsOfOneCompile, "on_the_trees_thread", lambda one: True)
    run = _replayed_by(monkeypatch, trees, _fake_cuda_graph(chain, (6, 5), (5,)))
    threads = [threading.Thread(target=lambda: [run([None, None]) for _ in range(5)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_the_outputs_copied_out_of_the_pool_are_those_that_alias_nothing_and_the_bases_of_views():
    """AOTAutograd makes the caller's views of inputs and of intermediates after the call from its metadata and the
    graph's output as a template: a copy must not stand in for such an output (it has no offset into the base), but
    the base of a view of an intermediate is copied, and the view made from the copy. The backward gives one output
    per argument of the forward, where the gradients are lent from: a parameter's gradient at its position."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen = {}

    def backend(gm, example_inputs):
        def forward_compiler(graph, inputs):
            seen["forward"] = whole_graphs.handed_out(graph)
            seen["outputs"] = [n.name for n in graph.graph.find_nodes(op="output")[0].args[0]]
            seen["arguments"] = [n.name for n in graph.graph.find_nodes(op="placeholder")]
            return make_boxed_func(graph.forward)

        def backward_compiler(graph, inputs):
            backward = make_boxed_func(graph.forward)

            def run(args):
                seen["gradients"] = backward(args)
                return seen["gradients"]

            run._boxed_call = True
            return run

        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=backward_compiler)

    def f(x, w):
        y = x * w
        z = torch.tanh(x)
        return y, x[:, 1:], z.view(-1)[2:]  # a new tensor, a view of an input, a view of an intermediate

    x, w = torch.randn(4, 5), torch.randn(4, 5, requires_grad=True)
    outs = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(outs[2], torch.tanh(x).view(-1)[2:])
    # y, and z as the intermediate base of the third output; not x's view, not the saved values
    named = [seen["outputs"][i] for i in sorted(seen["forward"])]
    assert len(named) == 2 and named[0] == "mul", seen
    sum(o.sum() for o in outs).backward()
    assert seen["arguments"] == ["primals_1", "primals_2"]  # x and w, in the order f takes them
    x_slot, w_gradient = seen["gradients"]
    assert x_slot is None and w_gradient.shape == w.shape


def _forward_static_inputs_seen(monkeypatch) -> list[list[int]]:
    """The static arguments of each forward graph fusepass compiles from here on, as AOTAutograd marked them."""
    import fusepass.pipeline as pipeline

    seen = []
    runnable = pipeline.runnable

    def observed(module, annotated):
        if annotated != "backward":
            seen.append(whole_graphs.forward_static_inputs(len(module.graph.find_nodes(op="placeholder"))))
        return runnable(module, annotated)

    monkeypatch.setattr(pipeline, "runnable", observed)
    return seen


def test_parameters_and_buffers_are_the_static_arguments_of_the_graphs_fusepass_compiles(monkeypatch):
    """The trees copy every argument but the static ones into a recording's buffers before each replay. fusepass
    retraces Dynamo's graph: unless its parameters' sources reach AOTAutograd, none counts as static (every
    parameter was copied on each replay). Observed where each graph is compiled, training and inference, and at
    a second shape."""
    seen = _forward_static_inputs_seen(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.BatchNorm1d(7)).to(DEVICE)
    compiled = torch.compile(model, backend=fusepass.backend(graphs=True), dynamic=False)
    held = len(list(model.parameters())) + len(list(model.buffers()))
    for rows in (6, 9):
        compiled(random_tensor((rows, 5), torch.float32)).sum().backward()
        with torch.no_grad():
            compiled(random_tensor((rows, 5), torch.float32))
    assert len(seen) >= 4 and all(len(static) == held for static in seen), seen


class _Normalized(torch.nn.Module):
    """Gemma's embedding scale: a tensor made in the forward, which the retrace bakes into a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 7)

    def forward(self, x):
        return self.linear(x) * torch.tensor(7 ** 0.5, dtype=x.dtype)


def test_a_tensor_the_trace_baked_in_leaves_the_parameters_static(monkeypatch):
    """`torch.tensor(...)` in the forward is a call in Dynamo's graph and a ``_tensor_constant`` buffer of the
    retraced one, which Dynamo gave no source: it gets one of its own, so the parameters (and it) still count as
    static, and the report says nothing of lost sources."""
    import fusepass.pipeline as pipeline

    seen = _forward_static_inputs_seen(monkeypatch)
    model = _Normalized().to(DEVICE)
    compiled = torch.compile(model, backend=fusepass.backend(graphs=True), dynamic=False)
    for rows in (6, 9):
        fusepass.reset()
        x = random_tensor((rows, 5), torch.float32).requires_grad_()
        compiled(x).sum().backward()
        fused_grads = [t.grad for t in (x, model.linear.weight, model.linear.bias)]
        x.grad = model.linear.weight.grad = model.linear.bias.grad = None
        model(x).sum().backward()
        for fused, eager in zip(fused_grads, (x.grad, model.linear.weight.grad, model.linear.bias.grad)):
            assert_close(fused, eager)
        model.linear.weight.grad = model.linear.bias.grad = None
        assert pipeline.SOURCES_LOST not in fusepass.last_report().notices
    assert len(seen) >= 2 and all(len(static) == 3 for static in seen), seen  # weight, bias and the baked scale


def test_sources_are_carried_only_where_the_inputs_match_and_a_loss_is_told(monkeypatch):
    import fusepass.pipeline as pipeline
    from fusepass.capture import carry_input_sources
    from fusepass.runnable import copy_graph

    graphs = []
    torch.compile(lambda x, w: torch.tanh(x * w), backend=lambda gm, inputs: graphs.append(gm) or gm)(
        random_tensor((3, 4), torch.float32), random_tensor((4,), torch.float32))
    (dynamo,) = graphs
    retraced = make_fx(dynamo)(*(torch.empty(3, 4), torch.empty(4)))
    assert carry_input_sources(dynamo, retraced)
    assert [n._dynamo_source for n in retraced.graph.find_nodes(op="placeholder")] == \
        [n._dynamo_source for n in dynamo.graph.find_nodes(op="placeholder")]
    one_more = make_fx(lambda x, w, y: dynamo(x, w))(torch.empty(3, 4), torch.empty(4), torch.empty(1))
    assert not carry_input_sources(dynamo, one_more)
    assert not carry_input_sources(torch.fx.GraphModule(torch.nn.Module(), copy_graph(retraced.graph)), retraced)

    monkeypatch.setattr(pipeline, "carry_input_sources", lambda dynamo, rewritten: False)
    fusepass.reset()
    torch.compile(chain, backend=fusepass.backend(graphs=True))(random_tensor((6, 5), torch.float32),
                                                                random_tensor((5,), torch.float32))
    assert pipeline.SOURCES_LOST in fusepass.last_report().notices


def test_graphs_are_on_unless_an_option_or_the_environment_turns_them_off(monkeypatch):
    from fusepass.options import GRAPHS_ENV, Options

    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert Options().graphs and fusepass.backend().options.graphs
    assert not fusepass.backend(graphs=False).options.graphs
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert not Options().graphs and not fusepass.backend().options.graphs
    assert fusepass.backend(graphs=True).options.graphs
