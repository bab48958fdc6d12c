"""`chaos.workload.replica` with its heal broken on purpose, per replica group: the proof must fail.

``BAD_HEAL`` lists ``replica:bug`` pairs (``1:stale,2:skip``); other groups heal correctly.

- ``stale``: the heal is logged as usual, but the group keeps its own (stale) state instead
  of the peer's;
- ``skip``: the group takes the peer's state, then commits its first step after the heal
  without applying that step's update (a skipped step).
"""

import os
import sys

from chaos.workload import replica

BUGS = dict(item.split(":") for item in os.environ.get("BAD_HEAL", "").split(",") if item)
_correct_load = replica.ReplicaTrainer._load


def _broken_load(self: replica.ReplicaTrainer, state: dict) -> None:
    bug = BUGS.get(str(self.args.replica))
    if bug == "stale":
        state = replica.heal_state(self.model, self.optimizer)
    _correct_load(self, state)
    if bug == "skip":
        applies = self.optimizer.step

        def skipped(*args: object, **kwargs: object) -> None:
            self.optimizer.step = applies  # only the first step after the heal

        self.optimizer.step = skipped


replica.ReplicaTrainer._load = _broken_load

if __name__ == "__main__":
    code = replica.main()
    sys.stdout.flush()
    os._exit(code)
