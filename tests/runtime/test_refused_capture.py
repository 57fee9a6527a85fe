"""On a GPU: a launch sequence that cannot be captured (it waits on the device) runs launched on every call, and
its failed capture leaves the allocator as it found it: no capture underway, so freeing cached memory works and
later captures replay."""
import pytest
import torch

from fusepass.runtime.replay import LaunchReplays

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need the GPU")


def test_a_refused_capture_leaves_no_capture_underway():
    replays = LaunchReplays(capacity=4)
    x = torch.arange(1000.0, device="cuda")
    out = torch.empty_like(x)

    def waits():
        torch.mul(x, 2, out=out)
        out.sum().item()  # a wait on the device: not capturable

    for _ in range(3):  # launched, then a capture tried and refused, then launched
        out.zero_()
        replays.run((x,), ("waits",), waits, (out,))
        assert torch.equal(out, x * 2)
    torch.cuda.empty_cache()  # asserts that no capture is underway
    doubled = torch.empty_like(x)
    for _ in range(3):  # a capturable sequence still captures and replays
        doubled.zero_()
        replays.run((x,), ("doubles",), lambda: torch.mul(x, 2, out=doubled), (doubled,))
        assert torch.equal(doubled, x * 2)
    assert replays.replayed == 1
