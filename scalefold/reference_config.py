"""Entry point for the MLPerf HPC OpenFold reference's configuration format.

```python
from scalefold.reference_config import from_reference_config
g = torch.load("golden_small.pt", weights_only=True)
model, loss_fn = from_reference_config(g["config"])   # any config the reference accepts
model.load_state_dict(g["state_dict"])                 # reference parameter names, strict
outputs = model(batch)                                 # batch with the trailing recycling dim
loss, terms = loss_fn(outputs, batch)                  # reads batch[..., -1] like the reference
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from scalefold.losses import AlphaFoldLoss
from scalefold.model.alphafold import AlphaFold
from scalefold.model.config import AlphaFoldConfig


def from_reference_config(
    config: Union[AlphaFoldConfig, Mapping[str, Any]],
    **model_kwargs: Any,
) -> tuple[AlphaFold, AlphaFoldLoss]:
    """Build ScaleFold's model and loss for a reference ``AlphaFoldConfig`` (as its plain dict).

    The dict is validated strictly (unknown keys or wrong types raise ``ValueError``); missing
    keys take the reference defaults. ``model_kwargs`` go to :class:`AlphaFold` (e.g.
    ``activation_checkpointing=False``). The loss expects the batch with its recycling dimension.
    """
    cfg = config if isinstance(config, AlphaFoldConfig) else AlphaFoldConfig.from_dict(dict(config))
    model = AlphaFold(cfg, **model_kwargs)
    loss_fn = AlphaFoldLoss(cfg.to_dict()["loss_config"])
    return model, loss_fn


__all__ = ["from_reference_config"]
