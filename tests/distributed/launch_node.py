"""One node of a two-node launch on this machine (run as a script by test_security.py).

Usage: python launch_node.py NODE_RANK ENDPOINT STEPS OUT.json   (the secret comes from MPNB_LAUNCH_SECRET)
"""

from __future__ import annotations

import json
import sys
import warnings

from mpnb.distributed import RankRows, RanksView, launch
from mpnb.errors import MpnbError
from tests.distributed.test_security import train_rank


class Final(RanksView):
    rows: RankRows | None = None

    def update(self, rows: RankRows) -> None:
        pass

    def close(self, rows: RankRows) -> None:
        self.rows = rows


def main(node_rank: int, endpoint: str, steps: int, out: str) -> None:
    view = Final()
    try:
        _launch(node_rank, endpoint, steps, out, view)
    except MpnbError as error:
        with open(out, "w") as file:
            json.dump({"error": str(error)}, file)


def _launch(node_rank: int, endpoint: str, steps: int, out: str, view: Final) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launched = launch(
            train_rank,
            steps,
            nproc=1,
            nnodes=2,
            node_rank=node_rank,
            rdzv_endpoint=endpoint,
            dashboard=view,
            timeout=240,
        )
    with open(out, "w") as file:
        json.dump(
            {
                "results": launched.results,
                "streamed_ranks": view.rows.ranks,
                "streamed_losses": [view.rows.histories[rank][0].loss for rank in view.rows.ranks],
                "losses": [histories[0].loss for histories in launched.histories],
                "warnings": [str(warning.message) for warning in caught],
            },
            file,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
