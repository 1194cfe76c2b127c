"""Why reading the MLPerf layout's pickles needs the user's opt-in, in words (standard library only:
``scalefold preprocess --help`` shows it without importing numpy)."""

PICKLE_RISK = (
    "the MLPerf 'dicts/' shards are Python pickles, and unpickling can execute arbitrary code; "
    "load them only from a source you trust, by passing allow_pickle=True (CLI: --allow-pickle)"
)
