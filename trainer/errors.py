"""The trainer's errors, torch-free: the driver catches them without loading the trainer (rlloop/run.py)."""


class NonFiniteTraining(RuntimeError):
    """`train.max_bad_steps` optimizer steps in a row had a non-finite loss or gradient."""
