"""TensorBoard event files of a job's progress, written by the `tensorboard` package's own writer
(tensorboard.summary.writer.event_file_writer, the one PyTorch's SummaryWriter uses).

    w = fsdp8.TensorBoardWriter("runs/" + job_id)
    for ev in client.watch(job_id):
        w.write(ev)
    w.close()

or `client.watch(job_id, tensorboard="runs")` (the run directory runs/JOB), or the command
`fsdp8-tensorboard --logdir runs --job JOB` reading the JSON lines of `fsdp8 watch --json` on its
standard input (what `fsdp8 watch JOB --tensorboard runs` runs). `tensorboard --logdir runs` then
shows each job as a run.

Scalars per step (the step number as TensorBoard's step, the coordinator's event time as its
wall time, values as float32): TAG_LOSS (train loss, nats per token), TAG_VAL_LOSS (steps that
validated), TAG_LR, TAG_TOKENS_PER_S and TAG_GRAD_NORM (before clipping). Before its first step
and before a step that does not follow the last one it wrote (a generation restarted from a
checkpoint replays the steps after it), a writer marks a restart (TensorBoard's SessionLog START
event at that step): TensorBoard's event reader (EventAccumulator) then drops what the run held
from that step on, so a second watch of the same job, or the replayed steps, replace the older
values instead of doubling them."""
import argparse
import json
import math
import os
import sys
from typing import Optional

TAG_LOSS = "train/loss"
TAG_VAL_LOSS = "val/loss"
TAG_LR = "train/lr"
TAG_TOKENS_PER_S = "train/tokens_per_s"
TAG_GRAD_NORM = "train/grad_norm"

_INSTALL = ("the tensorboard package is not installed: python3 -m pip install tensorboard "
            "(or './client/python[tensorboard]' from the fsdp8 source tree)")


def _writer_classes():
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise ImportError(f"fsdp8.TensorBoardWriter: {_INSTALL} ({e})") from None
    return EventFileWriter, event_pb2, summary_pb2


class TensorBoardWriter:
    """Writes step events as TensorBoard scalars into `logdir` (created if missing), one event
    file per writer. Not thread-safe. ImportError (saying what to install) without tensorboard.

    flush_secs: seconds between flushes to disk; close() flushes the rest."""

    def __init__(self, logdir: str, *, flush_secs: float = 5.0):
        writer_cls, self._event_pb2, self._summary_pb2 = _writer_classes()
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self._writer = writer_cls(logdir, flush_secs=flush_secs)
        self.steps_written = 0
        self._last_step = None

    def write(self, event) -> bool:
        """Writes a StepEvent / ValidationEvent (or a JobEvent message of a step); returns whether
        it was a step. State events and notices write nothing."""
        from fsdp8.events import StepEvent, ValidationEvent, from_proto
        ev = from_proto(event)
        if not isinstance(ev, StepEvent):
            return False
        values = [(TAG_LOSS, ev.loss), (TAG_LR, ev.lr), (TAG_TOKENS_PER_S, ev.tokens_per_s),
                  (TAG_GRAD_NORM, ev.grad_norm)]
        if isinstance(ev, ValidationEvent):
            values.append((TAG_VAL_LOSS, ev.val_loss))
        summary = self._summary_pb2.Summary(value=[
            self._summary_pb2.Summary.Value(tag=tag, simple_value=v)
            for tag, v in values if not math.isnan(v)])
        if self._last_step is None or ev.step <= self._last_step:
            self._writer.add_event(self._event_pb2.Event(
                wall_time=ev.time, step=ev.step,
                session_log=self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)))
        self._last_step = ev.step
        self._writer.add_event(self._event_pb2.Event(
            wall_time=ev.time, step=ev.step, summary=summary))
        self.steps_written += 1
        return True

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_dir(logdir: str, job_id: str) -> str:
    """The run directory of a job under a TensorBoard log directory: logdir/job_id."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} cannot name a run directory")
    return os.path.join(logdir, job_id)


def main(argv: Optional[list] = None) -> int:
    """fsdp8-tensorboard --logdir DIR --job JOB: JobEvent JSON lines on standard input (as
    `fsdp8 watch --json` prints them) -> TensorBoard scalars in DIR/JOB. Prints one line once it
    can write, and a last line saying what it wrote; exit 2 when it cannot start (no tensorboard
    package, DIR/JOB not writable), 1 on a line it cannot read."""
    p = argparse.ArgumentParser(prog="fsdp8-tensorboard", description=main.__doc__)
    p.add_argument("--logdir", required=True, help="TensorBoard log directory")
    p.add_argument("--job", required=True, help="job id: the run directory under --logdir")
    args = p.parse_args(argv)
    try:
        from google.protobuf import json_format
        from fsdp8.v1 import jobs_pb2
        out = run_dir(args.logdir, args.job)
        writer = TensorBoardWriter(out)
    except (ImportError, OSError, ValueError) as e:
        print(f"fsdp8-tensorboard: {e}", file=sys.stderr)
        return 2
    print(f"fsdp8-tensorboard: writing {out}", flush=True)
    rc = 0
    with writer:
        for n, line in enumerate(sys.stdin, 1):
            if not line.strip():
                continue
            try:
                ev = json_format.Parse(line, jobs_pb2.JobEvent(), ignore_unknown_fields=True)
            except (json_format.ParseError, json.JSONDecodeError) as e:
                print(f"fsdp8-tensorboard: standard input line {n}: not a JobEvent: {e}",
                      file=sys.stderr)
                rc = 1
                break
            writer.write(ev)
    print(f"tensorboard: {writer.steps_written} steps written to {out} "
          f"(tensorboard --logdir {args.logdir})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
