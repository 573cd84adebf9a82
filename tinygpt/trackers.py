"""A run watched where runs are watched (--log_to): each record train.py appends to log.jsonl goes, as it is
written, to TensorBoard (event files in OUT_DIR/tensorboard/: `tensorboard --logdir out` shows every run) and
to Weights & Biases (offline too: WANDB_MODE=offline, then `wandb sync`), the step as the x axis and the run's
settings as decided as the hyperparameters. log.jsonl stays the record of truth: a tracker that fails (a full
disk, the network gone) is dropped with one warning line, and the run goes on.
"""

import contextlib
import dataclasses
import importlib
import sys
from pathlib import Path

from tqdm import tqdm

from config import UserError

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}  # what each tracker imports


def check(log_to):
    """--log_to's trackers (comma-separated), once each, if their packages import; else a UserError, said
    before anything is written or trained."""
    names = list(dict.fromkeys(name.strip() for name in log_to.split(",") if name.strip()))
    for name in names:
        if name not in MODULES:  # a misspelt name first: it needs no package
            raise UserError(f"--log_to must be tensorboard, wandb or tensorboard,wandb, got {name!r}")
    for name in names:
        try:
            importlib.import_module(MODULES[name])
        except ImportError:
            raise UserError(f"--log_to={name} needs the {name} package: pip install {name}") from None
    return ",".join(names)


def opened(run):
    """The trackers of run (a train.Run) from its step run.it, rank 0's alone, to be closed however the loop
    ends (a context manager); none without --log_to."""
    return Trackers(run.cfg, run.it, run.wandb_id) if run.procs.master and run.cfg.log_to else contextlib.nullcontext()


class Trackers:
    """The trackers cfg.log_to names, opened at step start_iter with cfg's settings; wandb_id: the W&B run to go
    on in (a resumed run's), then the one it logs to. Each record goes to each; one that raises is dropped."""

    def __init__(self, cfg, start_iter, wandb_id=None):
        self.open, self.wandb_id = {}, wandb_id
        for name in filter(None, check(cfg.log_to).split(",")):
            self.guard(name, self.start, name, cfg, start_iter)

    def start(self, name, cfg, start_iter):
        self.open[name] = {"tensorboard": TensorBoard, "wandb": WandB}[name](cfg, start_iter, self)

    def log(self, record):
        for name, tracker in list(self.open.items()):
            self.guard(name, tracker.log, record)

    def guard(self, name, call, *args):
        try:
            call(*args)
        except Exception as e:  # whatever a tracker raises costs the run that tracker, and nothing else
            self.open.pop(name, None)
            tqdm.write(f"warning: --log_to={name} failed ({type(e).__name__}: {e}); it gets no more records, "
                       "log.jsonl keeps them all", file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        for name, tracker in list(self.open.items()):
            self.guard(name, tracker.close, 0 if exc_type is None else 1)  # 1: W&B marks the run failed
        self.open = {}


class TensorBoard:
    """Event files in OUT_DIR/tensorboard/: a scalar per key of each record, in float64 as log.jsonl holds it, and
    the settings in the HPARAMS tab. A resumed run hides the steps after its checkpoint that the run before wrote,
    as files.start_log cuts them from log.jsonl: no step shows twice."""

    def __init__(self, cfg, start_iter, trackers):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: what was written at that step or later is hidden (for a new run, all of it)
        self.writer = SummaryWriter(Path(cfg.out_dir) / "tensorboard", purge_step=start_iter + 1 if start_iter else 0)
        for summary in hparams(dataclasses.asdict(cfg), {"val_loss": None, "val_bpc": None}):
            self.writer.file_writer.add_summary(summary)

    def log(self, record):
        for key, value in record.items():
            if key != "iter":
                self.writer.add_scalar(key, value, record["iter"], new_style=True, double_precision=True)
        self.writer.flush()  # on disk now: a run killed later has lost nothing that log.jsonl holds

    def close(self, exit_code):
        self.writer.close()


class WandB:
    """A Weights & Biases run in OUT_DIR/wandb/: the settings as its config, a row per record with iter its
    x axis. A resumed run goes on in the W&B run its checkpoint names."""

    def __init__(self, cfg, start_iter, trackers):
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or Path(cfg.out_dir).name,
                              id=trackers.wandb_id, resume="allow", dir=cfg.out_dir, config=dataclasses.asdict(cfg),
                              settings=wandb.Settings(console="off", quiet=True))  # the run's output stays ours
        self.run.define_metric("iter")
        self.run.define_metric("*", step_metric="iter")
        trackers.wandb_id = self.run.id

    def log(self, record):
        self.run.log(record)

    def close(self, exit_code):
        import wandb

        self.run.finish(exit_code=exit_code)
        # Its service done with the run's files: scripts end with os._exit, past wandb's own atexit, and a run
        # resumed at once in the same process (as in the tests) found the last one's file still empty.
        wandb.teardown()
