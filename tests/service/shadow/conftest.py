from __future__ import annotations

import sys
from pathlib import Path

# The shadow tests share helpers (shadow_traffic) that live beside them.
sys.path.insert(0, str(Path(__file__).parent))
