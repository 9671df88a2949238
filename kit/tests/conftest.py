"""The kit's unit tests import its scripts from kit/py."""

from __future__ import annotations

import sys
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT / "py"))
