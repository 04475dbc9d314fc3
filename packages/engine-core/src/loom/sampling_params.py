"""SamplingParams lives in the plugin contract: workers receive it in each step's input."""

from __future__ import annotations

from loom_plugin_api.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
