"""``python -m lmq_reclaim`` and ``spark-submit …/lmq_reclaim/__main__.py`` both land here.

Run as a file (spark-submit), Python puts this package's own folder first on ``sys.path``, where module
names like ``session`` or ``report`` could shadow others; drop it before importing the job.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    from lmq_reclaim import job  # noqa: PLC0415  (after the sys.path fix below)

    sys.exit(job.main())


if __name__ == "__main__":
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    main()
