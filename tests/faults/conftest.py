"""Fault-injection suite: real simulator processes and the router on loopback.

Every test is bounded in time (pytest-timeout) and in requests; synchronisation is by polling
state with deadlines (``until``), never by fixed sleeps.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
