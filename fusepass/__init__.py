"""fusepass: a torch.compile backend that fuses hand-written attention and elementwise chains.

    torch.compile(model, backend="fusepass")
    print(fusepass.last_report())
"""
from importlib.metadata import entry_points

from fusepass.compare import Comparison, compare
from fusepass.options import Options
from fusepass.pipeline import Backend, backend, fusepass_backend
from fusepass.profiling import Profile, profile
from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.report import Report, last_report, reports, reset
from fusepass.report.roofline import Ceilings, measure_ceilings, set_ceilings
from fusepass.report.summary import summarize
from fusepass.runtime.launch import start_triton_in_background

__all__ = ["Backend", "Ceilings", "Comparison", "Hotspot", "Options", "Report", "Rewrite", "backend", "compare",
           "last_report", "measure_ceilings", "Profile", "profile", "reports", "reset", "set_ceilings", "summarize"]


def _register() -> None:
    # An installed fusepass reaches Dynamo through its entry point; registering again would clash.
    # From a checkout (PYTHONPATH=.) there is no entry point, so register here.
    if entry_points(group="torch_dynamo_backends", name="fusepass"):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "fusepass" not in _COMPILER_FNS:
        register_backend(fusepass_backend, name="fusepass")


_register()
# Triton's start hashes its own files, which crawls on a compile thread beside a busy caller: begun now, it is
# usually done by the first compiled call (fusepass.runtime.launch).
start_triton_in_background()
