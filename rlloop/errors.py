"""The errors a run ends with, each the one line `rlloop.run` prints (config errors: rlloop/config_errors.py).

Apart from the code that raises them, so that code which must tell a recoverable death from a failed write
(`rlloop/checkpoint.py`) need not import the cluster and its workers, and the driver imports none of the stacks.
"""


class ClusterError(RuntimeError):
    """The cluster cannot host the plan, or an actor died; the message says which and what to do."""


class ActorDied(ClusterError):
    """An actor died or hung, past what the run heals: it can go on from its last checkpoint."""


class TrainerDied(ActorDied):
    """A trainer rank's actor died: the loop rebuilds the cluster from the last checkpoint (run.max_restarts)."""


class ModelError(ValueError):
    """The model or tokenizer a config names cannot be loaded; the message names the key."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact), no intact one is left to resume from, or the
    run cannot load the one it resumes from (another trainer layout)."""


class RunDirInUse(RuntimeError):
    """Another run holds the run directory."""


class DataError(ValueError):
    """Bad or unusable data; the message names the source and the problem."""


class RewardError(RuntimeError):
    """The reward function cannot be run: its worker processes die as they start, or it failed on a step's worth of
    samples in a row. The message names the function and its last failure."""
