"""Scale out from the notebook: run training in several processes through torch.distributed.

Example:
    >>> from mpnb.distributed import launch
    >>> launch(lambda: __import__("torch.distributed").distributed.get_world_size(), nproc=2).results
    [2, 2]
"""

from mpnb.distributed.launch import Launched, LaunchError, default_backend, launch
from mpnb.distributed.rank_rows import RankRows, RanksView

__all__ = ["Launched", "LaunchError", "RankRows", "RanksView", "default_backend", "launch"]
