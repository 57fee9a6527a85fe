"""The lengths a symbolic attention's compile plans it at beside the sizes Dynamo saw (`other_lengths`): one of
each kind the kernels compile apart, shorter than the one seen."""
import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fusepass.attention.other_lengths import KINDS, AtLengths, kind, other_lengths, size_at


def _symbolic(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)


@pytest.mark.parametrize("seen, expected", [
    # a multiple of the longest tile: one that is no multiple of 16, and of 64, 32 and 16 but no larger tile
    (1536, [1535, 1472, 1504, 1520]),
    (1500, [1408, 1344, 1376, 1392]),  # no multiple of 16: the four kinds of multiples
    (1040, [1024, 1039, 960, 992]),  # a multiple of 16 no tile divides: the others
    (3008, [2944, 3007, 2912, 2928]),  # a multiple of 64, not of 128
    (200, []),  # no longer than two of the longest tiles: a batch or a head count as likely
])
def test_one_length_of_each_other_kind(seen, expected):
    env = ShapeEnv()
    length, window = _symbolic(env, "T", seen), _symbolic(env, "W", 1024)
    with FakeTensorMode(shape_env=env):
        q = torch.empty(2, 4, length, 64)
    lengths = other_lengths([q])
    assert [size_at(length, at) for at in lengths] == expected
    if expected:  # every kind once, the one seen among them
        assert sorted(map(kind, [seen, *expected]), key=str) == sorted((k for k, _ in KINDS), key=str)
    # A symbolic int read beside the tensors (a window size) keeps the value seen; strides follow the length.
    assert all(size_at(window, at) == 1024 for at in lengths)
    assert [AtLengths(q, at).stride() for at in lengths] == [(4 * n * 64, n * 64, 64, 1) for n in expected]
