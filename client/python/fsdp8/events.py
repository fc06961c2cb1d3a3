"""Typed job events: what `Client.watch` yields, one per JobEvent of the coordinator's stream.

    StepEvent        a step's results: step, total_steps, loss, lr, grad_norm, tokens_per_s, ...
    ValidationEvent  a StepEvent whose step also ran a validation: val_loss, eval_seconds
    StateEvent       a state change or a notice: state, message (and the steps done so far)

Every event has seq (1, 2, ... per job), job_id, state (a State, equal to the jobs_pb2 numbers)
and time (seconds since the Unix epoch, the coordinator's clock); `raw` is the JobEvent message.
The message's fields stay readable on every event as before (ev.tokens_per_second, ev.val_loss:
NaN unless validated, ev.message: "" on steps), so code written against the raw messages keeps
working. Losses are in nats per token. Needs protobuf only (no grpc)."""
import dataclasses
import enum
import math
from typing import Any, Union

from fsdp8.v1 import jobs_pb2


class State(enum.IntEnum):
    """A job's state; equal to the jobs_pb2.JOB_STATE_* numbers (State.RUNNING == 3)."""
    UNSPECIFIED = jobs_pb2.JOB_STATE_UNSPECIFIED
    PENDING = jobs_pb2.JOB_STATE_PENDING
    STARTING = jobs_pb2.JOB_STATE_STARTING
    RUNNING = jobs_pb2.JOB_STATE_RUNNING
    RECOVERING = jobs_pb2.JOB_STATE_RECOVERING
    SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
    FAILED = jobs_pb2.JOB_STATE_FAILED
    CANCELLED = jobs_pb2.JOB_STATE_CANCELLED

    def __str__(self) -> str:
        return self.name

    @property
    def terminal(self) -> bool:
        """SUCCEEDED, FAILED or CANCELLED: the job has ended."""
        return self in (State.SUCCEEDED, State.FAILED, State.CANCELLED)


@dataclasses.dataclass(frozen=True)
class Event:
    """Fields every event has."""
    seq: int
    job_id: str
    state: State
    time: float
    raw: Any = dataclasses.field(repr=False, compare=False)

    def __getattr__(self, name):
        # Called only for names the dataclass lacks: the JobEvent's own fields, as the SDK
        # yielded raw messages before.
        raw = self.__dict__.get("raw")
        if raw is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(raw, name)


@dataclasses.dataclass(frozen=True)
class StepEvent(Event):
    """The results of one optimizer step (steps count from 1).

    loss: train loss of the step (mean over the global batch); lr: the step's learning rate;
    grad_norm: before clipping; tokens_per_s: training tokens per second of the step's training
    (validation time left out); tokens: cumulative; step_seconds: wall seconds since the previous
    step's results; epoch: epochs of the training data done (0 when not reported)."""
    step: int
    total_steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    tokens: int
    step_seconds: float
    epoch: float


@dataclasses.dataclass(frozen=True)
class ValidationEvent(StepEvent):
    """A step that also ran a validation: val_loss (nats per token) and eval_seconds, the
    validation's seconds."""
    val_loss: float
    eval_seconds: float


@dataclasses.dataclass(frozen=True)
class StateEvent(Event):
    """A state change (PENDING, STARTING, RUNNING, RECOVERING, the final state) or a notice, with
    its human-readable message; step / total_steps: the job's steps done so far and in all."""
    message: str
    step: int
    total_steps: int


JobEventLike = Union[jobs_pb2.JobEvent, Event]


def is_step(ev: jobs_pb2.JobEvent) -> bool:
    """Whether a JobEvent message reports a step (as the CLI decides): no message, step > 0."""
    return not ev.message and ev.step > 0


def _state(number: int):
    try:
        return State(number)
    except ValueError:  # a state a newer coordinator added
        return number


def from_proto(ev: jobs_pb2.JobEvent) -> Event:
    """The typed event of one JobEvent message (an Event passes through unchanged)."""
    if isinstance(ev, Event):
        return ev
    common = dict(seq=ev.seq, job_id=ev.job_id, state=_state(ev.state), time=ev.time, raw=ev)
    if not is_step(ev):
        return StateEvent(**common, message=ev.message, step=ev.step, total_steps=ev.total_steps)
    step = dict(step=ev.step, total_steps=ev.total_steps, loss=ev.loss, lr=ev.lr,
                grad_norm=ev.grad_norm, tokens_per_s=ev.tokens_per_second, tokens=ev.tokens,
                step_seconds=ev.step_seconds, epoch=ev.epoch)
    if math.isnan(ev.val_loss):
        return StepEvent(**common, **step)
    return ValidationEvent(**common, **step, val_loss=ev.val_loss, eval_seconds=ev.eval_seconds)
