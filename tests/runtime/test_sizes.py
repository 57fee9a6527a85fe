"""The host's launch arithmetic computes what Triton's constexpr functions do."""
import triton

from fusepass.runtime.sizes import cdiv, next_power_of_2


def test_as_triton_computes_them():
    for a in range(0, 300):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
