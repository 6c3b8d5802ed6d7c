"""Prints the table of a `duckctl bench e2e --synthetic --json` result file."""
import json
import sys
from pathlib import Path

from bench.e2e_synthetic import _table

for path in sys.argv[1:]:
    print(_table(json.loads(Path(path).read_text())))
