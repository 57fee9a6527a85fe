"""`fusepass.compare` with fusepass's options: the backend it times is the one they configure."""
import torch
import torch.nn.functional as F

import fusepass


def chain(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def test_compare_times_fusepass_with_the_options_given():
    x, b = torch.randn(6, 5), torch.randn(5)
    fused = fusepass.compare(chain, x, b, backends=("eager", "fusepass"), warmup_ms=1, rep_ms=1)
    unfused = fusepass.compare(chain, x, b, backends=("eager", "fusepass"), warmup_ms=1, rep_ms=1,
                               options={"elementwise": False})
    assert [len(r.rewrites) for r in fused.reports] == [1]
    assert [len(r.rewrites) for r in unfused.reports] == [0]
    assert unfused.result("fusepass").output_error == 0


def test_compare_checks_a_later_call_too():
    """A call after the first (after the timed ones on a GPU, where replays run) is checked against eager's."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.LayerNorm(7))
    result = fusepass.compare(model, torch.randn(6, 5), loss=lambda out: out.sum(), backends=("eager", "fusepass"))
    fused = result.result("fusepass")
    assert (fused.later_output_error, fused.later_gradient_error) == (fused.output_error, fused.gradient_error)
    assert result.result("eager").later_output_error is None
    assert "later call: output" in str(result)
