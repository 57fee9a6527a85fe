"""`LaunchReplays`: a key seen once launches, seen twice is captured and replayed, later replayed only; a
capture that fails launches and is not tried again; the most recently replayed keys are kept. The capture is
replaced by a recorder here, so this runs on any machine; tests/attention/test_replay.py replays on the GPU."""
import pytest
import torch

from fusepass.runtime import replay as replay_module
from fusepass.runtime.replay import LaunchReplays

# what a graph's ops do call by call, which a whole-graph replay does not run
pytestmark = pytest.mark.usefixtures("graphs_off")


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class _Replays(LaunchReplays):
    """Captures by calling nothing: a graph that counts its replays, or a failure for the keys in `fails`."""

    def __init__(self, capacity=128, fails=()):
        super().__init__(capacity)
        self.captures = 0
        self.fails = fails

    def _launch(self, launches):  # no launch pool without a GPU
        launches()

    def _capture(self, launches, named):
        self.captures += 1
        return None if self.captures in self.fails else replay_module._Replay(_Graph(), [])


@pytest.fixture(autouse=True)
def not_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _counting():
    calls = []
    return calls, lambda: calls.append(1)


def test_a_key_is_captured_on_its_second_call_and_replayed_after():
    replays, (calls, launches) = _Replays(), _counting()
    replays.run((), "a", launches)
    assert (len(calls), replays.captures) == (1, 0)
    replays.run((), "a", launches)
    graph = replays._replays[("a", 0)].graph
    assert (len(calls), replays.captures, graph.replays) == (1, 1, 1)  # the capture's results come from a replay
    for _ in range(3):
        replays.run((), "a", launches)
    assert (len(calls), replays.captures, graph.replays) == (1, 1, 4)


def test_keys_alternating_are_each_captured():
    replays, (calls, launches) = _Replays(), _counting()
    for key in "ababab":
        replays.run((), key, launches)
    assert (len(calls), replays.captures) == (2, 2)
    assert [replays._replays[(k, 0)].graph.replays for k in "ab"] == [2, 2]


def test_a_failed_capture_launches_and_is_not_tried_again():
    replays, (calls, launches) = _Replays(fails=(1,)), _counting()
    for _ in range(5):
        replays.run((), "a", launches)
    assert (len(calls), replays.captures, replays.captured) == (5, 1, 0)  # tried once, none counted as captured


def test_the_most_recently_replayed_keys_are_kept():
    replays, (_, launches) = _Replays(capacity=2), _counting()
    for key in "aabbacc":  # a replayed after b was captured: b is the oldest when c comes
        replays.run((), key, launches)
    assert [key for key, _ in replays._replays] == ["a", "c"]


def test_while_the_caller_captures_its_own_graph_the_launches_are_made(monkeypatch):
    replays, (calls, launches) = _Replays(), _counting()
    replays.run((), "a", launches)
    replays.run((), "a", launches)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    replays.run((), "a", launches)
    assert (len(calls), replays._replays[("a", 0)].graph.replays) == (2, 1)


def test_a_replay_holds_its_kernels_and_what_the_caller_does_not_name():
    from triton.tools.tensor_descriptor import TensorDescriptor

    named, cached, table = torch.randn(4, 8), torch.randn(3), torch.randn(16, 16)
    view = named[1:]  # the caller's memory, seen through a view
    descriptor = TensorDescriptor(table, [16, 16], [16, 1], [8, 8])
    held = replay_module.held_by_replay([("kernel a", (view, (cached, 3), None)), ("kernel b", (descriptor, 1.5))],
                                        [named])
    assert held[:2] == ["kernel a", "kernel b"]
    assert [t is cached or t is table for t in held[2:]] == [True, True]


def test_when_repeating_keys_outnumber_the_capacity_the_kept_graphs_replay_and_others_launch():
    replays, (calls, launches) = _Replays(capacity=2), _counting()
    for _ in range(6):
        for key in "abc":
            replays.run((), key, launches)
    # round 2 captures a, b and c (c's capture drops a), round 4 captures a again (dropping b): two graphs
    # dropped, as many as are kept, so b launches from then on while a and c replay
    assert (replays.captures, replays.captured, replays.dropped) == (4, 4, 2)
    assert [key for key, _ in replays._replays] == ["a", "c"]
    assert len(calls) == 3 + 1 + 3  # round 1; a in round 3; b in rounds 4 to 6


def test_a_map_built_while_capturing_is_not_cached(monkeypatch):
    """It is written only when the graph replays (not at all if the capture fails): a later call must build
    its own."""
    from types import SimpleNamespace

    from fusepass.flash import blockmap

    monkeypatch.setattr(blockmap, "_cache", blockmap.OrderedDict())
    monkeypatch.setattr(blockmap, "build_block_map", lambda *args, **kwargs: object())
    mod = SimpleNamespace(mask_functions=(object(),), keep_reads_aux=False, keep_uses_batch=False, keep_uses_head=True)
    shape = ((), 2, 3, 40, 40, 16, 16, "cpu")
    monkeypatch.setattr(blockmap, "capturing", lambda device: True)
    during = blockmap.block_map_for(mod, *shape)
    monkeypatch.setattr(blockmap, "capturing", lambda device: False)
    after = blockmap.block_map_for(mod, *shape)
    assert after is not during and blockmap.block_map_for(mod, *shape) is after


def test_a_pointwise_replay_key_names_every_tensor_of_the_launch(monkeypatch):
    """The tensors the kernel reads (a zero-dim one on the kernel's device among them, read by pointer) and
    the outputs it writes, by pointer alone (the plan, its serial among the values, fixes their layouts);
    scalars from another device (read by value on the GPU) enter the key by repr."""
    from support import random_tensor

    import fusepass
    from fusepass.elementwise import kernel as pointwise

    keys = []

    class Recording(LaunchReplays):
        @staticmethod
        def can_replay(t):
            return True

        def run(self, tensors, values, launches, allocated=()):
            keys.append((tensors, values, allocated))
            launches()

    monkeypatch.setattr(pointwise, "pointwise_replays", Recording())
    x = random_tensor((5, 7), torch.float32)
    scale = torch.tensor(-0.5, device=x.device)
    out = torch.compile(lambda x, s: torch.relu(x * s) + x, backend=fusepass.backend(strict=True))(x, scale)
    (named, values, allocated), = keys
    assert [t is expected for t, expected in zip((*named, *allocated), (x, scale, out))] == [True, True, True]
    assert (len(named), len(allocated), len(values)) == (0, 3, 1)  # every tensor by its pointer; the plan's serial


def test_clear_drops_every_graph_and_starts_over():
    replays, (calls, launches) = _Replays(capacity=1), _counting()
    for key in "aabb":  # b's capture drops a
        replays.run((), key, launches)
    replays.clear()
    assert (len(replays._replays), replays.dropped) == (0, 0)
    replays.run((), "a", launches)  # seen anew: launched, not replayed
    assert (len(calls), replays.captures) == (3, 2)


class _At:
    """An allocated tensor as a key sees it: its pointer."""

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def _keys_each_back_once(count):
    """Pointers each seen twice, two calls apart, then never again: 0 1 0 2 1 3 2 4 ..."""
    return [0, 1] + [p for i in range(2, count) for p in (i - 2, i)]


def test_a_site_whose_keys_do_not_come_back_stops_capturing():
    """Each capture is judged lost twice its period (three calls) after it: once four are lost, none replayed, the
    site launches (having captured a few more meanwhile)."""
    replays, (calls, launches) = _Replays(), _counting()
    pointers = _keys_each_back_once(40)
    for ptr in pointers:
        replays.run((), "site", launches, [_At(ptr)])
    assert replays._sites["site"].stopped and replays.missed == replay_module.MISSES_TO_STOP
    assert replays.captures < 2 * replay_module.MISSES_TO_STOP
    assert (replays.replayed, len(calls)) == (0, len(pointers) - replays.captures)


def test_keys_that_do_not_come_back_are_judged_by_site():
    """The same calls under sites of their own (other values): none is judged, each captures."""
    replays, (_, launches) = _Replays(), _counting()
    for ptr in _keys_each_back_once(40):
        replays.run((), ("site", ptr), launches)
    assert (replays.captures, replays.missed) == (38, 0)


def test_a_site_of_many_keys_captured_in_one_round_replays_them_all():
    """Twelve layers sharing a site: twelve captures in the second round, replayed from the third on."""
    replays, (calls, launches) = _Replays(), _counting()
    for _ in range(6):
        for layer in range(12):
            replays.run((), "site", launches, [_At(layer)])
    assert (replays.captures, replays.missed, replays.replayed, len(calls)) == (12, 0, 48, 12)


def test_a_site_keeps_replaying_after_it_stops_capturing():
    replays, (calls, launches) = _Replays(), _counting()
    for _ in range(3):  # a key that settles: captured, then replayed
        replays.run((), "site", launches, [_At(-1)])
    for ptr in _keys_each_back_once(30):
        replays.run((), "site", launches, [_At(ptr)])
    replays.run((), "site", launches, [_At(-1)])
    assert replays._sites["site"].stopped and replays._replays[("site", 0, -1)].fate.replays == 2
