"""Makes creating Prefect's database slow in every Python process started with this folder on
PYTHONPATH, as a loaded machine does: the first table a process creates waits
PRECAST_TEST_TABLES_DELAY seconds. Only a database being created waits (a migrated one creates no
table), so a first run is as slow as asked, deterministically, and a later start is not."""

import os
import sys
import time

from alembic.operations import Operations

_create_table = Operations.create_table
_waited = []


def create_table(self, *args, **kwargs):
    if not _waited:
        _waited.append(True)
        delay = float(os.environ["PRECAST_TEST_TABLES_DELAY"])
        print(f"slow-database: process {os.getpid()} creates Prefect's tables {delay:g} s late", file=sys.stderr,
              flush=True)
        time.sleep(delay)
    return _create_table(self, *args, **kwargs)


Operations.create_table = create_table
