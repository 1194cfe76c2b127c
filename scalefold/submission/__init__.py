"""The MLPerf HPC submission of the OpenFold benchmark: finished runs packed into the official layout
(:mod:`.pack`, :mod:`.runs`, :mod:`.system`) and judged by the installed ``mlperf-logging``'s own package
checker and result summarizer (:mod:`.check`). ``scalefold submission pack`` / ``check``."""
