"""The lengths a symbolic attention's compile plans it at beside the sizes Dynamo saw (`other_lengths`): one of
each kind the kernels compile apart, shorter than the one seen."""
import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fusepass.attention.other_lengths import AtLengths, other_lengths, size_at


def _symbolic(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)


@pytest.mark.parametrize("seen, expected", [
    (1536, [1535]),  # a multiple of the tiles: one that is no multiple of 16
    (1500, [1408]),  # neither: a multiple of the tiles
    (1040, [1024, 1039]),  # a multiple of 16 the tiles do not divide: both
    (200, []),  # no longer than two of the longest tiles: a batch or a head count as likely
])
def test_one_length_of_each_other_kind(seen, expected):
    env = ShapeEnv()
    length, window = _symbolic(env, "T", seen), _symbolic(env, "W", 1024)
    with FakeTensorMode(shape_env=env):
        q = torch.empty(2, 4, length, 64)
    kinds = other_lengths([q])
    assert [size_at(length, kind) for kind in kinds] == expected
    # A symbolic int read beside the tensors (a window size) keeps the value seen; strides follow the length.
    assert all(size_at(window, kind) == 1024 for kind in kinds)
    assert [AtLengths(q, kind).stride() for kind in kinds] == [(4 * n * 64, n * 64, 64, 1) for n in expected]
