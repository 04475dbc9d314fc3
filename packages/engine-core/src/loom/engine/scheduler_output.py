"""The step types live in the plugin contract (``loom_plugin_api.step``): workers take and return them."""

from __future__ import annotations

from loom_plugin_api.step import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SampledLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)

__all__ = [
    "ModelRunnerOutput", "NewRequestData", "PromptLogprobs", "SampledLogprobs", "ScheduledRequest", "SchedulerOutput",
]
