"""fivefold.train: the training loop, runtime, checkpoints and metrics (and `train.data`).

    from fivefold.train.entry import load_run        # recipe + overrides -> RunConfig
    from fivefold.train.start import train           # RunConfig -> TrainSummary
    from fivefold.train.runtime import Runtime, LocalRuntime, StepResult, make_runtime

Importing this package does not import torch; its modules do.
"""
