"""Hypothesis profiles: `ci` (small, derandomized: CI is never flaky) and `dev` (larger).

`HYPOTHESIS_PROFILE` picks one explicitly; otherwise `ci` when the CI environment variable is
set, else `dev`.
"""

from __future__ import annotations

import os


def register_profiles() -> str:
    from hypothesis import HealthCheck, settings

    common = dict(
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("ci", max_examples=12, derandomize=True, database=None,
                              print_blob=True, **common)
    settings.register_profile("dev", max_examples=60, **common)
    name = os.environ.get("HYPOTHESIS_PROFILE") or (
        "ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev"
    )
    settings.load_profile(name)
    return name
