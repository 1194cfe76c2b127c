"""Former home of the store dataset, now :mod:`scalefold.data.dataset`; kept as an alias because the
MLPerf feature-parity checker (``shared/reference/check_features.py``) imports it from here."""

from scalefold.data.dataset import StoreSample, chain_raw_features  # noqa: F401

__all__ = ["StoreSample", "chain_raw_features"]
