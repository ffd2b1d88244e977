"""What every benchmark of ``python -m bench`` stands on: the shape suites and the cases they expand to
(``suites``: ``configs/bench/*.yaml``, and the names of the ops, dtypes, formats and backends), rank launching
(``launch``: own ranks or torchrun), timing across ranks (``timing``) and the reports (``report``: metadata,
table, JSON, CSV, PNG). It imports no other part of ``bench``.
"""
