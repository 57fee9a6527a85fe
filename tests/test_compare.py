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
