"""Print the project's runtime dependencies from pyproject.toml, one per line (a requirements file).

The image installs them in a layer of their own, before the source is copied, so a change to the
code rebuilds only the last layer (``pip install --no-deps .``) and never reinstalls torch & co.
"""

import sys
from pathlib import Path

import tomllib

path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
with path.open("rb") as file:
    print("\n".join(tomllib.load(file)["project"]["dependencies"]))
