"""``models.llama.train`` under msrun with the faults tests/test_llama_train_faults.py asks for in
$FAULTS (comma-separated): ``slow-save`` (rank 0 sleeps 2 s before each save, so the other rank
reaches the end of the run first), ``sigterm-rank-1-at-3`` (rank 1 alone sends itself SIGTERM as
its step 3 ends)."""
import os
import signal
import sys
import time

from models.llama import train
from models.llama.training.trainer import Trainer

FAULTS = os.environ.get("FAULTS", "").split(",")
real_save, real_step = Trainer.save, Trainer.train_step


def slow_save(self, *args):
    if self.mesh.world_rank == 0:
        time.sleep(2)
    return real_save(self, *args)


def step_then_sigterm(self, micro_batches):
    loss = real_step(self, micro_batches)
    if self.mesh.world_rank == 1 and self.step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return loss


if "slow-save" in FAULTS:
    Trainer.save = slow_save
if "sigterm-rank-1-at-3" in FAULTS:
    Trainer.train_step = step_then_sigterm
train.main(sys.argv[1:])
