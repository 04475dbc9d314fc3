from __future__ import annotations

import logging

logger = logging.getLogger("loom.platform_dummy")
