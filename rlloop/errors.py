"""What an actor's death or an unplaceable plan raises, apart from the cluster that raises it, so that code which must
tell a recoverable death from a failed write (`rlloop/checkpoint.py`) need not import the cluster and its workers;
what bad data raises, wherever it is read; and what a reward function that cannot run at all raises."""


class ClusterError(RuntimeError):
    """The cluster cannot host the plan, or an actor died; the message says which and what to do."""


class ActorDied(ClusterError):
    """An actor died or hung, past what the run heals: it can go on from its last checkpoint."""


class TrainerDied(ActorDied):
    """A trainer rank's actor died: the loop rebuilds the cluster from the last checkpoint (run.max_restarts)."""


class DataError(ValueError):
    """Bad or unusable data; the message names the source and the problem."""


class RewardError(RuntimeError):
    """The reward function cannot be run at all (its worker processes die as they start); the message says why."""
