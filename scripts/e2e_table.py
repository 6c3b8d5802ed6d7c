"""Prints the table of a `duckctl bench e2e --synthetic --json` result file."""
import json
import sys
from pathlib import Path

from bench.e2e_synthetic_table import format_table

for path in sys.argv[1:]:
    print(format_table(json.loads(Path(path).read_text())))
