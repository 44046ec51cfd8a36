"""Workspace-wide pytest set-up: hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) loads a derandomized profile: every property test draws the same
examples on every run, so a CI result can be reproduced exactly. Without it (a developer's ``uv run pytest``),
hypothesis draws fresh examples each run and keeps exploring.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
