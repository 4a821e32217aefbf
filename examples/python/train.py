#!/usr/bin/python3
"""train.py: the Python reference elastic trainer -- PyTorch DistributedDataParallel (gloo) with
elastrun's exactly-once semantics: a failure, a restart or another world size changes nothing in
the result.

    elastrun --nnodes=1:4 --nproc-per-node=2 examples/python/train.py --steps 200 --ckpt-dir ckpt/
    /usr/bin/python3 examples/python/train.py --steps 50 --ckpt-dir ckpt/     # one process, world 1

What it shows (docs/python.md walks through it):
  - the process group from the launcher's environment alone (RANK, WORLD_SIZE, MASTER_ADDR/PORT);
  - exactly-once data: a constant global batch B whatever the world size; step s consumes the
    global sample positions [s*B, (s+1)*B) (elastrun.data.ElasticSampler: reshuffled per epoch
    from (seed, epoch) alone, rank r of W takes a contiguous share); sample i is generated from
    (seed, i) alone. The loss is the sum over the rank's samples times W / B, so DDP's average over
    the ranks is the global mean: every world size computes the same update (only the float
    summation order differs);
  - everything a resume needs in one state_dict: model, Adam, the LR scheduler, the RNG states
    (torch, numpy, random), saved every --ckpt-every steps by elastrun.checkpoint.AsyncSaver
    (training goes on while it is written) with the step and the next sample position as metadata;
    loaded in place at start, at whatever world size the job has now;
  - with --memory-every N under `elastrun --memory-checkpoints`, every N steps the same state goes
    into the node agent's memory (elastrun.checkpoint.save(..., tier="memory")): a crashed worker's
    replacement, or the survivors of a lost node, resume from the newest step every node holds
    there (load() picks it when it is not older than the newest file checkpoint) -- a failure
    costs no step instead of everything since the last file checkpoint;
  - the agent's control channel (elastrun.control): on checkpoint-and-stop (Slurm's time-limit
    signal, preemption) every rank saves and exits 85, and the agent requeues the job;
  - with $ELASTRUN_EVENTS_FILE, the same events as the C++ trainer (resumed, step,
    checkpoint_saved, train_done) for tools/elastrun-timeline and the fault suite.
Exit codes: 0 done, 85 checkpointed and stopped, 1 error (and --fail-at-step), 2 bad flags.
"""

import argparse
import json
import math
import os
import random
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import elastrun.checkpoint as checkpoint
import elastrun.control as control
import elastrun.events
from elastrun.data import ElasticSampler

FEATURES = 16
DATASET_SIZE = 4096  # an epoch is 4096 samples: long runs cross epochs (reshuffled per epoch)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=100, help="train until this many optimizer steps")
    p.add_argument("--ckpt-dir", default=os.environ.get(control.CHECKPOINT_DIR_ENV, ""),
                   help="checkpoint directory (default $ELASTRUN_CHECKPOINT_DIR; empty: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=10, help="save every N steps (0: only at the end)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep (0: all)")
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="start at step 0 when every checkpoint is damaged (default: an error, never silently)")
    p.add_argument("--memory-every", type=int, default=0,
                   help="also snapshot into the node agent's memory every N steps (elastrun --memory-checkpoints; "
                        "0: never)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks")
    p.add_argument("--seed", type=int, default=1, help="seed of the data, the model and the RNGs")
    p.add_argument("--hidden", type=int, default=32, help="hidden units")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (halved every 50 steps)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--step-ms", type=int, default=0, help="sleep this long per step (tests: a slower job)")
    p.add_argument("--fail-at-step", default="", metavar="STEP[:RANK]",
                   help="rank RANK (default 1) exits 1 before step STEP, once per job (a marker file in the "
                        "checkpoint directory): the fault tests")
    args = p.parse_args(argv)
    args.fail_step, args.fail_rank = -1, 1
    if args.fail_at_step:
        step, _, rank = args.fail_at_step.partition(":")
        if not step.isdigit() or (rank and not rank.isdigit()):
            p.error(f"--fail-at-step {args.fail_at_step!r}: expected STEP or STEP:RANK")
        args.fail_step, args.fail_rank = int(step), int(rank or 1)
    if args.steps < 0 or args.global_batch < 1 or args.ckpt_every < 0 or args.keep_last < 0 or args.memory_every < 0:
        p.error("--steps, --ckpt-every, --keep-last and --memory-every must not be negative, --global-batch must be "
                "positive")
    if args.memory_every and not args.ckpt_dir:
        p.error("--memory-every needs --ckpt-dir: a requeued job (new agents, their memory gone) resumes from the file tier")
    return args


class SyntheticRegression(Dataset):
    """Sample i is a function of (seed, i) alone: a 16-feature input and a linear target + noise."""

    def __init__(self, seed, size):
        self.seed, self.size = seed, size
        self.weights = torch.linspace(-1.0, 1.0, FEATURES)

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        values = torch.randn(FEATURES + 1, generator=g)
        x = values[:FEATURES]
        return x, (x @ self.weights + 0.01 * values[FEATURES]).reshape(1)


def finite(x):
    return x if math.isfinite(x) else None


class Trainer:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1:
            dist.init_process_group("gloo")
        self.events = elastrun.events.Writer.from_environment(self.rank)
        torch.manual_seed(args.seed)  # the same initial model on every rank, whatever the world
        np.random.seed(args.seed)
        random.seed(args.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, args.hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(args.hidden, 1))
        self.ddp = DistributedDataParallel(self.model) if self.world > 1 else self.model
        self.optim = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=50, gamma=0.5)
        self.step = 0
        self.next_sample = 0
        self.saver = checkpoint.AsyncSaver(args.ckpt_dir, keep_last=args.keep_last) if args.ckpt_dir else None
        self.pending = None  # (step, start time, blocked seconds) of the save in flight
        self.memory = bool(args.memory_every) and checkpoint.memory_available()
        if args.memory_every and not self.memory and self.rank == 0:
            self.log(f"--memory-every {args.memory_every}: the agent keeps no memory checkpoints "
                     "(elastrun --memory-checkpoints): file tier only")
        self.memory_warned = False
        self.seen_sequence = 0  # the control channel's last request seen

    def log(self, message):
        print(message, flush=True)  # the agent prefixes "[rank N]"

    def state(self):
        """Everything a resume needs, as one state_dict (the same objects: load fills them in place)."""
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(),
                "sched": self.sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}

    def restore(self):
        if not self.args.ckpt_dir:
            return
        os.makedirs(self.args.ckpt_dir, exist_ok=True)
        state = self.state()
        info = checkpoint.load(state, self.args.ckpt_dir, memory=self.memory,
                               allow_fresh_start=self.args.allow_fresh_start)
        if info is None:
            self.log(f"no checkpoint in {self.args.ckpt_dir}: starting at step 0")
            return
        meta = info.metadata
        if meta.get("seed") != self.args.seed:
            raise SystemExit(f"error: {info.path} was trained with --seed {meta.get('seed')}, not {self.args.seed}: "
                             f"pass --seed {meta.get('seed')} or another --ckpt-dir")
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.step = int(meta["step"])
        self.next_sample = int(meta["next_sample"])
        if meta.get("global_batch") != self.args.global_batch and self.rank == 0:
            self.log(f"warning: the checkpoint used --global-batch {meta.get('global_batch')}, this run "
                     f"{self.args.global_batch}: continuing at sample {self.next_sample}")
        for why in info.skipped:
            self.log(f"skipped a damaged checkpoint: {why}")
        where = {"memory-local": "the agents' memory",
                 "memory-partner": "the agents' memory (partner copies)"}.get(info.source, info.path)
        self.log(f"resumed from {where}: step {self.step}, sample {self.next_sample}, world {self.world} "
                 f"(saved at world {meta.get('world_size')})")
        if self.rank == 0:  # one event per resume, as the C++ trainer writes
            self.events.write("resumed", step=self.step, source=info.source, world_size=self.world,
                              saved_world_size=meta.get("world_size"), next_sample=self.next_sample)

    def metadata(self, loss):
        return {"step": self.step, "next_sample": self.next_sample, "global_batch": self.args.global_batch,
                "seed": self.args.seed, "world_size": self.world, "loss": finite(loss)}

    def save_to_memory(self, loss):
        """Never fatal: a snapshot the agent refuses (its budget) leaves the file tier in charge."""
        started = time.monotonic()
        try:
            info = checkpoint.save(self.state(), self.args.ckpt_dir, self.step, tier="memory",
                                   metadata=self.metadata(loss))
        except checkpoint.CheckpointError as e:
            if not self.memory_warned:
                self.log(f"warning: memory snapshot of step {self.step}: {e}")
            self.memory_warned = True
            return
        blocked = time.monotonic() - started
        if self.rank == 0:
            self.events.write("checkpoint_saved", step=self.step, tier="memory", bytes=info.bytes_written,
                              blocked_s=blocked, durable_s=blocked, world_size=self.world)

    def save(self, loss, wait):
        self.finish_save()
        metadata = self.metadata(loss)
        started = time.monotonic()
        self.saver.save(self.state(), self.step, metadata=metadata)
        self.pending = (self.step, started, time.monotonic() - started)
        if wait:
            self.finish_save()

    def finish_save(self):
        """Waits for the save in flight; logs it and writes its event (its error is raised here)."""
        if self.pending is None:
            return
        step, started, blocked = self.pending
        self.pending = None
        info = self.saver.wait()
        durable = time.monotonic() - started
        if self.rank == 0:
            self.log(f"checkpoint step {step} -> {info.path} (blocked {blocked:.3f} s, durable after {durable:.3f} s)")
        self.events.write("checkpoint_saved", step=step, tier="file", bytes=info.bytes_written, blocked_s=blocked,
                          durable_s=durable, world_size=self.world)

    def maybe_fail(self):
        if self.step != self.args.fail_step or self.rank != self.args.fail_rank or not self.args.ckpt_dir:
            return
        marker = os.path.join(self.args.ckpt_dir, f"train-fail-at-step-{self.step}.rank-{self.rank}.done")
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return  # failed once already in this job
        os.fsync(fd)
        os.close(fd)
        self.log(f"--fail-at-step {self.args.fail_at_step}: failing on purpose at step {self.step}")
        sys.stdout.flush()
        os._exit(1)

    def run(self):
        control.install_signal_handlers()
        self.restore()
        args = self.args
        sampler = ElasticSampler(DATASET_SIZE, args.global_batch, seed=args.seed, start_index=self.next_sample,
                                 num_steps=max(0, args.steps - self.step))
        # Its own generator: a DataLoader iterator otherwise draws its base seed from the global
        # torch RNG, and a resumed job (one more iterator) would continue with another RNG state.
        loader = DataLoader(SyntheticRegression(args.seed, DATASET_SIZE), batch_sampler=sampler,
                            num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed))
        loss_value = float("nan")
        for x, y in loader:
            self.maybe_fail()
            self.optim.zero_grad()
            with control.compute():  # what precedes the step's collectives: the agent finds stragglers by it
                loss = (self.ddp(x) - y).pow(2).sum() * (self.world / args.global_batch)
            loss.backward()  # DDP's gradient all-reduce: it waits for the slowest rank, not compute
            self.optim.step()
            self.sched.step()
            self.step += 1
            self.next_sample += args.global_batch
            loss_value = loss.item()  # this rank's share; the log shows rank 0's
            control.progress(self.step)  # --hang-timeout: this rank completed a step (with compute()'s time)
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            if self.rank == 0:
                if self.step % 10 == 0 or self.step == args.steps:
                    self.log(f"step {self.step}/{args.steps} loss {loss_value:.5f} world {self.world}")
                self.events.write("step", step=self.step, loss=finite(loss_value), world_size=self.world)
            if self.memory and self.step % args.memory_every == 0 and self.step != args.steps:
                self.save_to_memory(loss_value)
            if self.pending is not None and not self.saver.busy:
                self.finish_save()  # durable: log it and write its event now, not at the next save
            status = control.poll_all()  # every rank takes the same decision
            if status.stop:
                if self.saver:
                    self.save(loss_value, wait=True)
                    self.log(f"checkpoint-and-stop: saved step {self.step}; exiting {control.CHECKPOINTED_EXIT_CODE}")
                return control.CHECKPOINTED_EXIT_CODE
            requested = status.checkpoint and status.sequence > self.seen_sequence  # a new request
            self.seen_sequence = max(self.seen_sequence, status.sequence)
            periodic = args.ckpt_every > 0 and self.step % args.ckpt_every == 0
            if self.saver and (periodic or requested or self.step == args.steps):
                self.save(loss_value, wait=self.step == args.steps)
        if self.saver:
            self.finish_save()
            self.saver.close()
        self.log(f"done: {args.steps} steps")
        if self.rank == 0:
            self.events.write("train_done", step=self.step, loss=finite(loss_value), world_size=self.world)
        return 0


def main(argv):
    args = parse_args(argv)
    trainer = Trainer(args)
    code = trainer.run()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
