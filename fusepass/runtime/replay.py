"""Launch sequences replayed as CUDA graphs.

A kernel launch's host time (the Python that computes its arguments, Triton's launcher, the driver) exceeds what
a small attention's kernels take on the device: a small sliding window's forward+backward spent longer on the
host per call than in its kernels. A launch is a function of its arguments alone (the kernel, the grid, the
values, pointers among them), so a sequence of launches made with the same arguments as an earlier call's can
replay a CUDA graph captured from that call: one driver call, none of the Python.

`LaunchReplays.run(tensors, values, launches, allocated)` runs `launches` (a function making launches, nothing else)
or replays it. Its key is the pointers, shapes, strides and dtypes of `tensors`, the host `values`, and the pointers
alone of `allocated`, tensors the caller allocated for the call whose shapes, strides and dtypes follow from the
rest of the key (its outputs): together they must determine every argument of every launch. The key is built on
every replayed call and is a noticeable part of its host instructions, so the tensors whose layouts the rest
determines enter it by pointer alone. What a sequence returns or leaves for later is allocated by the caller,
outside it: tensors allocated inside live in the graph's memory pool, and every replay writes them again. A key
seen a second time is captured (a first call compiles kernels and builds cached block maps: work that cannot be
captured); the calls after it replay. The tensors a captured launch reads without the key naming them (a cached
block map, which its cache may drop) are held alive by the graph, as are the compiled kernels; the caller's are
not (their memory must come back to the next call for its key to be the same). A sequence that cannot be captured
(it waits on the device) is launched as it is, and not tried again.

A key captured on its second sighting, `period` calls of its site (its `values`) after the first, should come back
within about as many; where the caller's allocations wander (a tensor it keeps a call or two longer, another
allocator's timing) keys may recur once and never again, and every capture is lost. A site that has lost
`MISSES_TO_STOP` captures, more than it has replayed, captures no more: it launches, and its graphs replay.

A key repeats only if the caller's allocations land where the last call's did, and a launched sequence's
temporaries (a block map's scratch, the backward's flags) would otherwise come from the caller's pool and move
them: a document mask's calls, launched, captured and replayed by turns, seldom met their keys again. Launched
sequences allocate from a pool of their own, as captured ones do, so launched, captured and replayed calls leave
the caller's pool alike.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusepass.runtime import launch


def tensor_key(t: torch.Tensor) -> tuple:
    """What a launch reading or writing `t` takes from it."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a launch argument: itself, in tuples, or a TMA descriptor's base."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(getattr(value, "base", None), torch.Tensor):
        yield value.base


def held_by_replay(launches: list[tuple[Any, tuple]], named: Sequence[torch.Tensor]) -> list:
    """What a replay of `launches` ((compiled kernel, arguments) each) holds alive: the compiled kernels and the
    tensors of the arguments but those sharing memory with the `named` ones."""
    callers = {t.untyped_storage().data_ptr() for t in named}
    tensors = [t for _, args in launches for t in _tensors_in(args) if t.untyped_storage().data_ptr() not in callers]
    return [compiled for compiled, _ in launches] + tensors


@dataclass
class _Fate:
    """How a captured graph fares, judged by its site (apart from the graph, which its site must not hold)."""
    due: int  # the site's call count by which its key should have come back
    replays: int = 0


@dataclass
class _Replay:
    graph: Any  # torch.cuda.CUDAGraph
    held: list  # its launches' compiled kernels, and the tensors they read that its key does not name
    fate: _Fate | None = None  # set once captured


# Captures a site may lose (keys not back within twice the period they were captured at) before it stops capturing,
# where it has replayed fewer graphs than that.
MISSES_TO_STOP = 4


@dataclass
class _Site:
    """One caller's sequence (the `values` of its keys): its calls, and how its captures have fared."""
    calls: int = 0
    hits: int = 0  # graphs replayed at least once
    misses: int = 0  # graphs whose key did not come back in time
    pending: list[_Fate] = field(default_factory=list)  # of graphs not yet replayed or judged
    stopped: bool = False  # captures no more


class LaunchReplays:
    """Captured launch sequences by key, the `capacity` most recently replayed. Once as many have been dropped
    as are kept, the keys that repeat outnumber the capacity (more layers or shapes than it): a new capture
    would only drop a graph before it replays again, capturing every call. Then the graphs kept replay and the
    other keys launch."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._replays: OrderedDict[Hashable, _Replay] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()  # keys run once, not captured yet: their site's call
        self._sites: OrderedDict[Hashable, _Site] = OrderedDict()  # by the values of their keys
        self._refused: OrderedDict[Hashable, None] = OrderedDict()  # keys whose capture failed
        # Per (device, thread): a pool allocated to by two threads at once refuses the second, and two threads'
        # captures on one side stream would be one capture.
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._launch_pools: dict[tuple[int, int], Any] = {}  # torch.cuda.MemPools of launched sequences
        self.replayed = 0  # calls replayed
        self.captured = 0  # sequences captured (each capture costs the call far more host time than a launch)
        self.dropped = 0  # graphs dropped for newer ones
        self.missed = 0  # graphs whose key did not come back in time

    @staticmethod
    def can_replay(t: torch.Tensor) -> bool:
        """Whether launches on `t`'s device can be replayed."""
        return t.is_cuda

    @staticmethod
    def key(tensors: Sequence[torch.Tensor], values: tuple, allocated: Sequence[torch.Tensor]) -> tuple:
        return (values, torch.cuda.current_device(), *(tensor_key(t) for t in tensors),
                *(t.data_ptr() for t in allocated))

    def run(self, tensors: Sequence[torch.Tensor], values: tuple, launches: Callable[[], None],
            allocated: Sequence[torch.Tensor] = ()) -> None:
        """`launches`, or its replay where `tensors` and `allocated` (every tensor it reads or writes that the
        caller holds; `allocated`: those whose layouts follow from the others' and `values`) and `values` (every
        host value it depends on) are as in an earlier call's."""
        if torch.cuda.is_current_stream_capturing():
            launches()  # a caller capturing a graph of its own captures these launches into it
            return
        key = self.key(tensors, values, allocated)
        site = self._sites.get(values)
        if site is None:
            site = _Site()
            _remember(self._sites, values, 4 * self.capacity, site)
        site.calls += 1
        replay = self._replays.get(key)
        if replay is not None:
            self._replays.move_to_end(key)
            replay.graph.replay()
            self.replayed += 1
            if not replay.fate.replays:
                site.hits += 1
            replay.fate.replays += 1
            return
        if key in self._refused or self.dropped >= self.capacity or self._stopped(site):
            self._launch(launches)
            return
        if key not in self._seen:
            _remember(self._seen, key, 4 * self.capacity, site.calls)
            self._launch(launches)
            return
        period = site.calls - self._seen.pop(key)
        replay = self._capture(launches, (*tensors, *allocated))
        if replay is None:
            _remember(self._refused, key, 4 * self.capacity)
            self._launch(launches)
            return
        replay.fate = _Fate(due=site.calls + 2 * period)
        site.pending.append(replay.fate)
        self.captured += 1
        self._replays[key] = replay
        if len(self._replays) > self.capacity:
            self._replays.popitem(last=False)
            self.dropped += 1
        replay.graph.replay()

    def _stopped(self, site: _Site) -> bool:
        """Whether `site` captures no more: its graphs judged so far (`_Site.pending` whose keys are overdue are
        misses) lost `MISSES_TO_STOP` captures, more than replayed."""
        if not site.stopped:
            waiting = []
            for fate in site.pending:
                if fate.replays:
                    continue
                if site.calls > fate.due:
                    site.misses += 1
                    self.missed += 1
                else:
                    waiting.append(fate)
            site.pending = waiting
            site.stopped = site.misses >= MISSES_TO_STOP and site.misses > site.hits
        return site.stopped

    def _launch(self, launches: Callable[[], None]) -> None:
        """`launches` launched, their temporaries allocated from the launch pool of the current device."""
        where = (torch.cuda.current_device(), threading.get_ident())
        pool = self._launch_pools.get(where)
        if pool is None:
            pool = self._launch_pools[where] = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            launches()

    def _capture(self, launches: Callable[[], None], named: Sequence[torch.Tensor]) -> _Replay | None:
        """`launches` captured on a side stream (a capture cannot use the default stream), or None where they
        cannot be captured. Compiles started ahead on threads finish first: loading a module is not allowed
        while a stream captures. The replay holds the compiled kernels and the tensors of the launches'
        arguments but the `named` ones (the caller's: held, their memory could not come back to the next
        call, whose key would then differ)."""
        launch.finish_compiles_ahead()
        where = (torch.cuda.current_device(), threading.get_ident())
        stream = self._streams.get(where)
        if stream is None:
            stream = self._streams[where] = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(stream), launch.holding() as held:
                # thread_local: another thread's CUDA calls meanwhile do not invalidate the capture
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    launches()
                finally:
                    graph.capture_end()
        except Exception:  # whatever a capture meets (a wait on the device, above all) refuses it
            _end_refused_capture(pool)
            return None
        torch.cuda.current_stream().wait_stream(stream)
        return _Replay(graph, held_by_replay(held, named))

    def clear(self) -> None:
        self._replays.clear()
        self._seen.clear()
        self._refused.clear()
        self._sites.clear()
        self._launch_pools.clear()
        self.dropped = 0


def _end_refused_capture(pool: tuple[int, int]) -> None:
    """The allocator told that a refused capture into `pool` has ended. `capture_end` raises on an invalidated
    capture before it tells the allocator, which would go on treating `pool` as a capture underway: every later
    free deferred, and `torch.cuda.empty_cache()` (or a memory pool's end) failing its assert that none is."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # capture_end told it: the graph releases the pool
        return
    torch._C._cuda_releasePool(device, pool)  # what the capture allocated, freed (the graph never owned it)


def _remember(keys: OrderedDict, key: Hashable, capacity: int, value: Any = None) -> None:
    keys[key] = value
    if len(keys) > capacity:
        keys.popitem(last=False)


# The attention op's sequences (fusepass/attention/op.py) and the pointwise groups' launches
# (fusepass/elementwise/kernel.py); `clear()` drops their graphs and memory.
attention_replays = LaunchReplays()
pointwise_replays = LaunchReplays(capacity=1024)  # one kernel each, no memory of their own: many fit
