"""Whole compiled graphs replayed as CUDA graphs (``fusepass.backend(graphs=True)``, the default on CUDA devices),
through torch's CUDA graph trees, as Inductor's reduce-overhead mode replays its own graphs.

A model of many small layers spends longer on the host between kernels (ATen's matmul calls, views,
allocations, the Python of each fused op) than the kernels take on the device. Replaying a graph's recorded
kernels costs one driver call. The trees record each compiled graph (forward, backward, inference) once per set
of sizes after a warm-up call, keep what the graphs allocate in one memory pool shared by a forward and its
backward, copy the arguments that may move (all but parameters and buffers, and the saved values a backward reads)
into the recording's buffers, and record again where a parameter moves.

A replay runs none of the graph's Python, so a graph whose calls do host work a replay would skip runs as compiled,
and the report says why (`refusal`): it draws random numbers on the host (the recording would keep one draw;
attention dropout draws its seed on the device, which a replay draws anew), it holds a tensor on the CPU (a replay
would keep the values it was recorded with; `host_scalars` makes the graph's own 0-d constants on the device first),
it writes an argument that may move in place, it plans its attention per call (symbolic sizes: the plan and what the
forward keeps for the backward live in Python), or its attention computes a buffer's contents in place of reading it
where the buffer reaches it through other ops. Where the buffer is the graph's argument, its guard (the buffer's
version counter) is checked before each replay, and a changed buffer ends the replays of the graph: the attention's
call, run as compiled, sees the change and runs the replaced ops. The SDPA floor is off for graphs replayed whole:
SDPA keeps its autograd graph in Python for the backward.

What a graph hands its caller may be kept past the next step, as what eager gives may (Inductor's mode leaves it in
the pool, where the next replay overwrites it): a forward's outputs are copied out of the pool after each replay, and
a backward's gradients too, or lent out of it and given memory of their own before the pool is next written where the
caller still holds them (`lent_outputs`). What a forward saves for its backward stays in the pool.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fusepass.attention.known_contents import ContentGuard, ContentsChanged, checked_by_caller
from fusepass.runtime import launch, lent_outputs


# A warm-up routes the calling thread's allocations to the trees' pool, and a recording captures the stream: CUDA
# states of the process that another thread's warm-up, recording or replay meanwhile breaks (two threads running
# replayed graphs at once failed on the GPU: bench/NOTES.md). One runs at a time, from whichever thread calls.
_one_thread_at_a_time = threading.RLock()

# Sets of sizes a compile's graphs are recorded at, each holding memory of its own (Inductor's trees warn at 8): a
# forward at one more runs as compiled, as its backward, from then on, with a warning.
SIZES_RECORDED = 8


def refusal(module: torch.fx.GraphModule, static: Sequence[int]) -> str | None:
    """Why `module` (a forward, backward or inference graph as AOTAutograd hands it over) cannot be replayed whole,
    or None. `static`: the indices of the arguments that stay where they are between calls (parameters, buffers, the
    saved values of a backward)."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graph = module.graph
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) \
                and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return f"{node.name} draws random numbers on the host: a replay would keep them"
        if node.target is torch.ops.fusepass.attention_dynamic.default:
            return (f"{node.name} plans its attention per call (symbolic sizes) in Python, which a replay skips; "
                    "torch.compile(..., dynamic=False) compiles each size static (up to Dynamo's recompile limit), "
                    "and static graphs replay")
    for node in graph.nodes:
        value = node.meta.get("val")
        # (an empty tensor holds nothing to copy or compute: the attention op's seed where it draws none)
        if node.op in ("call_function", "placeholder") and isinstance(value, torch.Tensor) \
                and value.device.type == "cpu" and value.numel():
            return f"{node.name} is a tensor on the CPU, which a CUDA graph does not hold"
    try:
        mutated = _mutated_inputs(graph) - set(static)
    except KeyError as missing:  # an op's argument without the fake value that tells its storage
        return f"which arguments it writes in place could not be told ({missing} missing)"
    if mutated:
        names = [n.name for n in graph.find_nodes(op="placeholder")]
        return f"it writes its argument {', '.join(names[i] for i in sorted(mutated))} in place, which may move"
    node = get_first_incompatible_cudagraph_node(module)
    if node is not None:
        return f"{node.name} cannot be recorded in a CUDA graph (torch's rule: {node.target})"
    return None


def guarded_arguments(module: torch.fx.GraphModule) -> list[tuple[int, ContentGuard]] | str:
    """The guards of the buffers `module`'s attention computes rather than reads (`known_contents`), each with the
    position of the graph argument it checks: a replay checks them first, as the attention's call would. A reason
    where a guarded buffer reaches the attention other than as an argument."""
    from fusepass.attention.call import call_named

    placeholders = module.graph.find_nodes(op="placeholder")
    guarded = []
    for node in module.graph.find_nodes(op="call_function", target=torch.ops.fusepass.attention.default):
        aux = node.args[3]
        for guard in call_named(node.args[-1]).guards:
            if aux[guard.index] not in placeholders:
                return f"{node.name} computes what {guard.name} holds, which reaches it through ops a replay skips"
            guarded.append((placeholders.index(aux[guard.index]), guard))
    return guarded


def _mutated_inputs(graph: torch.fx.Graph) -> set[int]:
    """The indices of the arguments `graph` writes in place (by the ops' schemas; generated kernels write none)."""
    from torch._dynamo.backends.cudagraphs import find_input_mutations
    return find_input_mutations(graph)


@dataclass
class GraphsOfOneCompile:
    """Whether the forward of one AOTAutograd compile is replayed whole (its backward must then run in the trees'
    bookkeeping even where it is not), and on which device."""
    device_index: int
    forward_replayed: bool = False
    given_up: bool = False  # a guarded buffer changed, or a replay failed: both phases run as compiled from then on
    trees: Any = None  # the trees (of the thread) that hold this compile's recordings, once a call replayed
    # The forward's parameters by position, as its last replayed call had them: the gradient at a position of the
    # backward's outputs is theirs (AOTAutograd's backward gives one per argument of the forward).
    leaves: dict[int, Any] = field(default_factory=dict)

    def on_the_trees_thread(self) -> bool:
        """Whether this call runs where this compile's recordings are: torch's CUDA graph trees live in the state of
        a thread (which autograd's threads share with the caller of ``backward``), and torch 2.11's serve no thread
        that Python started; the first call that can replay takes the trees of its thread for the compile."""
        from torch._inductor import cudagraph_trees

        name = "tree_manager_containers"
        if not (hasattr(cudagraph_trees.local, name) or torch._C._is_key_in_tls(name)
                or hasattr(cudagraph_trees, "_initialize_tls")):  # (later releases make them for any thread)
            return False
        trees = cudagraph_trees.get_obj(cudagraph_trees.local, name)
        if self.trees is None:
            self.trees = trees
        return trees is self.trees

    def backward_ran(self) -> None:
        """Tell the trees that a backward of this compile's forward ran outside them."""
        from torch._inductor import cudagraph_trees

        cudagraph_trees.get_manager(self.device_index, create_if_none_exists=False).set_to_running_backward()


def _forward_metadata() -> Any:
    """AOTAutograd's metadata of the forward it compiles now (`ViewAndMutationMeta`), or None."""
    context = torch._guards.TracingContext.try_get()
    return None if context is None else context.fw_metadata


def forward_static_inputs(count: int) -> list[int]:
    """The forward's arguments that stay where they are between calls: parameters and buffers, as AOTAutograd's
    metadata marks them (Inductor's choice too)."""
    meta = _forward_metadata()
    return [] if meta is None else [i for i in meta.static_input_indices if i < count]


def backward_static_inputs(graph: torch.fx.GraphModule) -> list[int]:
    """The backward's arguments but its incoming gradients: what the forward saved, which stays in the pool."""
    from torch._inductor.utils import count_tangents
    return list(range(count_tangents(graph)))


def replayed(compiled: Callable[[list], Any], graph: torch.fx.GraphModule, inputs: Sequence[Any], phase: str,
             inference: bool, one: GraphsOfOneCompile, why_not: Callable[[str], None]) -> Callable[[list], Any]:
    """`compiled` (a boxed function of `graph`, which AOTAutograd compiled for `phase`) replayed whole by torch's
    CUDA graph trees, or `compiled` itself where `refusal` gives a reason (told to `why_not`)."""
    from torch._dynamo.backends.cudagraphs import get_stack_traces
    from torch._inductor import cudagraph_trees
    from torch._inductor.cudagraph_utils import get_placeholder_info

    backward = phase == "backward"
    if backward and not one.forward_replayed:
        return compiled  # the forward's reason was told
    static = backward_static_inputs(graph) if backward else forward_static_inputs(len(inputs))
    guarded = [] if backward else guarded_arguments(graph)
    owned = set() if backward else handed_out(graph)  # (a backward's gradients: `lent_outputs`)
    if isinstance(guarded, str):
        reason = guarded
    elif owned is None:
        reason = "AOTAutograd's metadata does not say which of its outputs the caller takes"
    else:
        reason = refusal(graph, static)
    if reason is not None:
        why_not(reason)
        if backward:
            def run_backward(args: list) -> Any:
                if one.on_the_trees_thread():
                    one.backward_ran()  # the trees' step bookkeeping: this forward's backward ran
                return compiled(args)

            run_backward._boxed_call = True
            return run_backward
        return compiled
    mutated = _mutated_inputs(graph.graph)
    sized = symbolic_arguments(graph)
    trees: dict[tuple, Callable[[list], Any]] = {}

    def sizes(args: list) -> tuple:
        """What the trees' recordings of this graph hang on: the symbolic arguments' sizes and values."""
        return tuple(args[i].shape if isinstance(args[i], torch.Tensor) else args[i] for i in sized)

    def tree(args: list) -> Any:
        """The trees' function for the sizes of `args`, made from the first call's arguments at those sizes: the
        trees record once per value of a graph's integer arguments, which under symbolic sizes need not tell a
        tensor's sizes (the arguments given at compile time are fake)."""
        key = sizes(args)
        function = trees.get(key)
        if function is None:
            function = trees[key] = cudagraph_trees.cudagraphify_impl(
                _consuming(compiled), list(args), static, device_index=one.device_index, is_backward=backward,
                is_inference=inference, stack_traces=get_stack_traces(graph),
                placeholders=get_placeholder_info(graph.graph), mutated_input_idxs=mutated)
        return function(args)

    if not backward:
        one.forward_replayed = not inference

    def give_up(reason: str) -> None:
        """Run both phases as compiled from this call on, and say why."""
        one.given_up = True
        why_not(f"from this call on: {reason}")

    def run(args: list) -> Any:
        if not one.on_the_trees_thread():
            why_not("a call from another thread than the one that holds its recordings runs as compiled")
            return compiled(args)
        if not backward and not one.given_up and len(trees) == SIZES_RECORDED and sizes(args) not in trees:
            # (a backward is recorded at its forward's sizes only: it never has more)
            give_up(f"recorded at {SIZES_RECORDED} sets of sizes already")
            warnings.warn(
                f"fusepass: the compiled {'inference' if inference else phase} graph has been recorded as a CUDA "
                f"graph at {SIZES_RECORDED} sets of sizes, each holding memory of its own, and runs as compiled from "
                "now on; fewer distinct sizes (padded inputs) replay", RuntimeWarning, stacklevel=2)
        if one.given_up:
            if backward:
                one.backward_ran()
            return compiled(args)
        try:
            for position, guard in guarded:
                guard.check_tensor(args[position])
        except ContentsChanged as error:
            # The attention's call sees the change too and runs the replaced ops from now on: the recorded kernels
            # would not.
            give_up(str(error))
            return compiled(args)
        # Kernels compiled ahead on threads are loaded before a recording: no module loads while a stream captures.
        launch.finish_compiles_ahead()
        if lent_outputs.LEND_GRADIENTS and not backward and not inference:
            one.leaves = {i: weakref.ref(args[i]) for i in static}  # (the trees take the arguments over)
        with _one_thread_at_a_time:  # its copies out of the pool too, before another thread's replay
            try:
                lent_outputs.reclaim(one.device_index)  # what earlier replays lent, where the caller still holds it
                with checked_by_caller():  # the guards above: a recording's attention sees the recording's copies
                    handed = tree(args)
            except Exception as error:
                # CUDA's own message names neither the graph nor the way out; the error itself goes on as raised (a
                # strict compile's kernel failure is the caller's to catch by its type and message). The graph runs
                # as compiled from then on, so that a later call fails, or not, as the compiled graph does, not in
                # the trees' bookkeeping of the failed call.
                _forget_failed_warmup(one.device_index)
                give_up(f"it failed while replayed ({type(error).__name__})")
                error.add_note(
                    f"fusepass: the compiled {'inference' if inference else phase} graph failed while warmed up, "
                    "recorded or replayed as a CUDA graph, and runs as compiled from now on; a capture that fails "
                    "can leave this process's later captures failing too. fusepass.backend(graphs=False) runs the "
                    "graphs as compiled")
                raise
            if backward:
                return lent_outputs.lend(handed, one.leaves, one.device_index)
            return _owned(handed, owned)

    run._boxed_call = True
    return run


def _forget_failed_warmup(device_index: int) -> None:
    """Take a warm-up that raised off the trees' current path: its node never got its outputs, and the trees' next
    call (any graph's) would fail on it. The path goes on from the node before it, as the trees' state was then."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    node = None if manager is None else manager.current_node
    if isinstance(node, cudagraph_trees.CUDAWarmupNode) and len(node.tensor_weakrefs) != len(node.stack_traces):
        manager.current_node = node.parent


def symbolic_arguments(graph: torch.fx.GraphModule) -> list[int]:
    """The positions of the graph's arguments whose values or sizes are symbolic: what a recording's sizes hang on."""
    positions = []
    for i, node in enumerate(graph.graph.find_nodes(op="placeholder")):
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(n, torch.SymInt) for n in sizes):
            positions.append(i)
    return positions


def handed_out(graph: torch.fx.GraphModule) -> set[int] | None:
    """The positions of a forward's outputs that reach the caller as they are, to copy out of the pool: those that
    alias nothing and the intermediates the caller's views are made from (AOTAutograd makes those views, and those of
    the inputs, after the call, from its metadata: a copy must not stand in for a view). A training forward's saved
    values stay in the pool for its backward. None where AOTAutograd's metadata is not at hand."""
    from torch._functorch._aot_autograd.schemas import OutputType

    meta = _forward_metadata()
    if meta is None or meta.tokens:  # (effect tokens lead the outputs)
        return None
    first = meta.num_mutated_inp_runtime_indices  # the inputs' new values, which AOTAutograd copies into them
    owned = {first + i for i, info in enumerate(meta.output_info)
             if info.output_type in (OutputType.non_alias, OutputType.unsafe_view_alias,
                                     OutputType.custom_function_view)}
    bases = first + meta.num_outputs
    return owned | set(range(bases, bases + meta.num_intermediate_bases))


def _owned(outputs: Sequence[Any], owned: set[int]) -> list:
    """`outputs` with those at the `owned` positions copied out of the pool. (A forward's outputs are not lent: alive
    across the backward's replay, as a loss keeps its logits, they would have to be copied then, and the backward's
    recording may have put its temporaries where they lie.)"""
    return [o.clone() if i in owned and isinstance(o, torch.Tensor) else o for i, o in enumerate(outputs)]


def _consuming(compiled: Callable[[list], Any]) -> Callable[[list], Any]:
    """`compiled` taking its argument list over, as the trees ask (they free arguments as the graph runs)."""
    def run(args: list) -> Any:
        taken = list(args)
        args.clear()
        return compiled(taken)

    return run
