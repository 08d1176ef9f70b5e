import os

import torch
from hypothesis import HealthCheck, settings

# Triton kernels run through Triton's interpreter where there is no GPU. The switch must be set
# before triton is first imported anywhere in the run, hence here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A small, deterministic profile: CI has 2 cores and a 90-minute budget for everything.
settings.register_profile(
    "moet", max_examples=int(os.environ.get("MOET_HYPOTHESIS_EXAMPLES", "40")), deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("moet")
