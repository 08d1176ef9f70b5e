import os

from hypothesis import HealthCheck, settings

# A small, deterministic profile: CI has 2 cores and a 90-minute budget for everything.
settings.register_profile(
    "moet", max_examples=int(os.environ.get("MOET_HYPOTHESIS_EXAMPLES", "40")), deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("moet")
