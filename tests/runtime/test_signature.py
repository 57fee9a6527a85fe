"""`SignatureOf`: its keys tell launches apart exactly as `signature` does, whatever the structures of the values
it meets (its generated functions check a structure, then read the leaves)."""
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.tools.tensor_descriptor import TensorDescriptor

from fusepass.runtime.signature import CONSTANT, SPECIALIZED, UNSPECIALIZED, SignatureOf, signature

_BASE = torch.zeros(64, dtype=torch.float32)
_TENSORS = [_BASE, _BASE[1:], _BASE[4:], _BASE.to(torch.float16), torch.zeros(3, 16, dtype=torch.bfloat16)]


def _identity(x):
    return x


def _other(x):
    return x


@dataclass
class _Pair:
    first: object
    second: object


def _descriptor(rows):
    return TensorDescriptor(torch.zeros(32, 16), [32, 16], [16, 1], [rows, 16])


leaves = st.one_of(
    st.sampled_from([0, 1, 16, 17, -1, 2**31, 2**31 - 1, -2**31 - 1, 2**63]), st.sampled_from([0.5, 1.0, -2.0]),
    st.sampled_from([True, False, None, "zero", "nan", _identity, _other]), st.sampled_from(_TENSORS),
    st.sampled_from([16, 32]).map(_descriptor))
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(tuple), st.lists(inner, max_size=2),
    st.builds(_Pair, inner, inner)), max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(modes=st.lists(st.sampled_from([CONSTANT, SPECIALIZED, UNSPECIALIZED]), min_size=1, max_size=3),
       data=st.data())
def test_keys_are_equal_where_signatures_are(modes, data):
    signature_of = SignatureOf(modes)
    calls = [tuple(data.draw(values) for _ in modes) for _ in range(6)]
    keys = [signature_of.key(call) for call in calls]
    signatures = [signature(call, modes, []) for call in calls]
    for key, sig in zip(keys, signatures):
        for other_key, other_sig in zip(keys, signatures):
            assert (key == other_key) == (sig == other_sig), (key, other_key, sig, other_sig)


def test_values_of_one_structure_share_its_function():
    signature_of = SignatureOf([SPECIALIZED, UNSPECIALIZED, SPECIALIZED])
    first = signature_of.key((_BASE, 7, (3, 16)))
    assert signature_of.key((_BASE[4:], 2**30, (3, 16))) == first  # aligned alike, one width class
    assert signature_of.key((_BASE[1:], 7, (3, 16))) != first
    assert signature_of.key((_BASE, 7, (3, 17))) != first
    assert len(signature_of.structures) == 1
    assert signature_of.key((_BASE, 7, (3, 16, 1))) != first  # another structure: a function of its own
    assert len(signature_of.structures) == 2


def test_objects_keyed_by_identity_are_held():
    signature_of = SignatureOf([CONSTANT, CONSTANT])
    assert signature_of.key((_identity, 1)) != signature_of.key((_other, 1))
    assert signature_of.held((_identity, (_other, 2))) == [_identity, _other]


def test_past_the_last_structure_keys_are_signatures():
    signature_of = SignatureOf([SPECIALIZED])
    for length in range(SignatureOf.MAX_STRUCTURES):
        signature_of.key(((1,) * length,))
    assert signature_of.key(((1,) * 20,)) == (None, signature(((1,) * 20,), [SPECIALIZED], []))
