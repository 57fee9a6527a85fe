"""On the GPU: the first call of a compiled attention launches the flash kernels it started compiling ahead
(`fusepass.kernels.flash_ahead`): the forward's and, where a gradient flows, the backward's two, each launch
finding its kernel compiled instead of compiling it."""
import pytest
import torch

import fusepass
from fusepass.kernels.launch import BoundLaunch
from tests.support import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernels compile on the GPU machine only")


def _attention(q, k, v):
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * 0.0917  # a scale of its own: kernels no other test compiled
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("backward", [False, True])
def test_the_first_call_launches_the_flash_kernels_compiled_ahead(monkeypatch, backward):
    compiled_ahead = {}
    original = BoundLaunch._compiled_ahead

    def recording(self, key):
        compiled = original(self, key)
        compiled_ahead[self.kernel.fn.__name__] = compiled is not None
        return compiled

    monkeypatch.setattr(BoundLaunch, "_compiled_ahead", recording)
    q, k, v = (torch.randn(1, 2, 300 + backward, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))
    reference = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
    out = torch.compile(_attention, backend=fusepass.backend(strict=True))(q, k, v)
    expected = _attention(*reference)
    assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    kernels = ["_flash_forward_kernel"]
    if backward:
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad.double())
        for x, r in zip((q, k, v), reference):
            assert_close(x.grad.double(), r.grad, atol=5e-2, rtol=5e-2)
        kernels += ["_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"]
    flash = {name: hit for name, hit in compiled_ahead.items() if name.startswith("_flash")}
    assert flash == dict.fromkeys(kernels, True)
