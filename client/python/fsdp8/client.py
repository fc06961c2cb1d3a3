"""The fsdp8 Python SDK: a thin layer over the generated JobService / AdminService stubs."""
import os
import pathlib
import uuid
from typing import Iterator, List, Optional, Union

import grpc
import yaml
from google.protobuf import descriptor, json_format

from fsdp8 import events
from fsdp8.v1 import admin_pb2, admin_pb2_grpc, jobs_pb2, jobs_pb2_grpc, spec_pb2

JobState = jobs_pb2.JobState
TERMINAL_STATES = frozenset(
    [jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED])

SpecLike = Union[spec_pb2.JobSpec, dict, str, os.PathLike]


def state_name(state: int) -> str:
    """JOB_STATE_RUNNING -> "RUNNING"."""
    return jobs_pb2.JobState.Name(state).replace("JOB_STATE_", "")


def _enum_value(enum: descriptor.EnumDescriptor, text: str, path: str) -> str:
    # Like the CLI: full value names, case-insensitive, or the name without the enum's prefix
    # (PRECISION_FP8 <- fp8, AMAX_ALGORITHM_MOST_RECENT <- most_recent).
    names = [v.name for v in enum.values]
    zero = enum.values_by_number[0].name  # PRECISION_UNSPECIFIED
    prefix = zero[: -len("UNSPECIFIED")] if zero.endswith("_UNSPECIFIED") else ""
    want = text.upper()
    for n in names:
        if want == n or (prefix and prefix + want == n):
            return n
    short = [n[len(prefix):].lower() for n in names if not n.endswith("_UNSPECIFIED")]
    raise ValueError(f"{path}: unknown value {text!r} (one of {', '.join(short)})")


def _is_repeated(f: descriptor.FieldDescriptor) -> bool:
    if hasattr(f, "is_repeated"):  # protobuf >= 5.28; FieldDescriptor.label is gone in 7
        return f.is_repeated
    return f.label == descriptor.FieldDescriptor.LABEL_REPEATED


def _normalise(value, msg: descriptor.Descriptor, path: str):
    """Rewrites short enum spellings in a parsed YAML/JSON dict to protobuf JSON enum names."""
    if not isinstance(value, dict):
        raise ValueError(f"{path or 'spec'}: expected a mapping, got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        f = msg.fields_by_name.get(key) or msg.fields_by_camelcase_name.get(key)
        p = f"{path}.{key}" if path else str(key)
        if f is None:
            raise ValueError(f"{p}: unknown field {key!r}")
        if v is None:  # as the CLI: null leaves the field unset
            continue
        repeated = _is_repeated(f)
        items = v if repeated and isinstance(v, list) else [v]
        conv = []
        for i, item in enumerate(items):
            ip = f"{p}[{i}]" if repeated else p
            if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
                conv.append(_normalise(item, f.message_type, ip))
            elif f.type == descriptor.FieldDescriptor.TYPE_ENUM and isinstance(item, str):
                conv.append(_enum_value(f.enum_type, item, ip))
            else:
                conv.append(item)
        out[key] = conv if repeated and isinstance(v, list) else conv[0]
    return out


# The largest spec the coordinator takes (common/spec.h, kMaxSpecBytes), and so the largest spec
# file read: a larger file is refused from its size, before it is read.
MAX_SPEC_BYTES = 64 * 1024


def _read_spec_file(path: pathlib.Path) -> str:
    """The text of a spec file of at most MAX_SPEC_BYTES; ValueError naming the file otherwise."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{path}: {size} bytes exceeds the limit of {MAX_SPEC_BYTES} bytes "
                             "on a job spec")
        data = f.read(MAX_SPEC_BYTES + 1)  # a file that grew since fstat is still bounded
    if len(data) > MAX_SPEC_BYTES:
        raise ValueError(f"{path}: more than the limit of {MAX_SPEC_BYTES} bytes on a job spec")
    return data.decode("utf-8")


def load_spec(spec: SpecLike) -> spec_pb2.JobSpec:
    """A JobSpec from a JobSpec, a dict, a file path (YAML or JSON) or YAML/JSON text.

    Field names as in proto/fsdp8/v1/spec.proto (or lowerCamel); enums by value name or the short
    spellings the CLI takes (fp8, bf16, fp32, delayed, current, hybrid, e4m3, max, most_recent).
    Raises ValueError naming the field path on an unknown field or value. Defaults are applied and
    rules checked by the coordinator at submit time, not here."""
    if isinstance(spec, spec_pb2.JobSpec):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = str(spec)
        p = pathlib.Path(text)
        if "\n" not in text and p.suffix in (".yaml", ".yml", ".json"):
            text = _read_spec_file(p)
        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"spec: parse error: {e}") from None
    msg = spec_pb2.JobSpec()
    try:
        json_format.ParseDict(_normalise(spec, msg.DESCRIPTOR, ""), msg)
    except json_format.ParseError as e:
        raise ValueError(f"spec: {e}") from None
    return msg


class Client:
    """A connection to one coordinator. Thread-safe (grpc channels and stubs are).

    address: host:port; default $FSDP8_COORDINATOR, else localhost:50051.
    timeout: seconds for each unary call (and for the channel to become ready)."""

    def __init__(self, address: Optional[str] = None, *, timeout: float = 30.0,
                 channel: Optional[grpc.Channel] = None):
        self.address = address or os.environ.get("FSDP8_COORDINATOR") or "localhost:50051"
        self.timeout = timeout
        self._channel = channel or grpc.insecure_channel(self.address)
        self.jobs = jobs_pb2_grpc.JobServiceStub(self._channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, rpc, request):
        # wait_for_ready: a coordinator that is still starting is waited for, up to the timeout.
        return rpc(request, timeout=self.timeout, wait_for_ready=True)

    def submit(self, spec: SpecLike, *, request_id: Optional[str] = None) -> jobs_pb2.Job:
        """Submits a job; returns it as stored (defaults applied, state PENDING or later).

        request_id is the idempotency key (default: a new UUID): the same id with the same spec
        returns the same job. A spec that breaks a rule raises grpc.RpcError INVALID_ARGUMENT
        whose details name the field; an unparsable one raises ValueError before any call."""
        req = jobs_pb2.SubmitJobRequest(spec=load_spec(spec),
                                        request_id=request_id or str(uuid.uuid4()))
        return self._call(self.jobs.SubmitJob, req)

    def get(self, job_id: str) -> jobs_pb2.Job:
        return self._call(self.jobs.GetJob, jobs_pb2.GetJobRequest(job_id=job_id))

    def list(self) -> List[jobs_pb2.Job]:
        """Every job the caller may see (a submitter: its own), oldest first, page by page."""
        out: List[jobs_pb2.Job] = []
        token = ""
        while True:
            page = self._call(self.jobs.ListJobs, jobs_pb2.ListJobsRequest(page_token=token))
            out.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return out

    def delete(self, job_id: str) -> jobs_pb2.Job:
        """Removes an ended job from the job table (its checkpoints stay); returns it as it was.
        grpc.RpcError FAILED_PRECONDITION for a job that has not ended."""
        return self._call(self.jobs.DeleteJob, jobs_pb2.DeleteJobRequest(job_id=job_id))

    def cancel(self, job_id: str, *, save: bool = True,
               timeout: Optional[float] = 600.0) -> jobs_pb2.Job:
        """Cancels a PENDING, STARTING or RUNNING job; returns it as it ended.

        save (default): a RUNNING job with a checkpoint.dir first saves a checkpoint after the
        step in progress, and the call returns once the job has ended: CANCELLED, its reason
        naming the committed checkpoint or why none was saved (SUCCEEDED when that step was its
        last); timeout bounds that wait (seconds; None: no limit). save=False stops it at once.
        grpc.RpcError FAILED_PRECONDITION for a job that already ended, NOT_FOUND for an unknown
        id."""
        req = jobs_pb2.CancelJobRequest(job_id=job_id, no_save=not save)
        return self.jobs.CancelJob(req, timeout=timeout if save else self.timeout,
                                   wait_for_ready=True)

    def resume(self, job_id: str) -> jobs_pb2.Job:
        """Continues an ended job (CANCELLED or FAILED) as the same job id from its own newest
        committed checkpoint; returns it PENDING (follow it with watch / wait: the events go on
        after the ones it had). grpc.RpcError FAILED_PRECONDITION naming the rule for a job that
        has not ended, SUCCEEDED, or has no committed checkpoint of its own; PERMISSION_DENIED
        for another user's job; NOT_FOUND for an unknown id."""
        return self._call(self.jobs.ResumeJob, jobs_pb2.ResumeJobRequest(job_id=job_id))

    def watch(self, job_id: str, *, after_seq: int = 0, timeout: Optional[float] = None,
              tensorboard: Optional[str] = None) -> Iterator[events.Event]:
        """Yields the job's events (seq > after_seq) until the one carrying its final state, typed
        (fsdp8.events): StepEvent, ValidationEvent (a step that validated) or StateEvent (a state
        change or a notice); ev.raw is the JobEvent message, whose fields stay readable on the
        event itself (ev.tokens_per_second, ev.val_loss) as when this yielded the messages.

        timeout: seconds for the whole stream (None: no limit); past it grpc.RpcError
        DEADLINE_EXCEEDED is raised. Resume after a broken stream with after_seq = last seq.
        tensorboard: a TensorBoard log directory: the steps are also written as scalars into its
        run directory of this job, tensorboard/JOB_ID (fsdp8.TensorBoardWriter; needs the
        tensorboard package), flushed when the stream ends or is closed."""
        writer = None
        if tensorboard is not None:
            from fsdp8.tensorboard import TensorBoardWriter, run_dir
            writer = TensorBoardWriter(run_dir(tensorboard, job_id))
        req = jobs_pb2.WatchJobRequest(job_id=job_id, after_seq=after_seq)
        stream = self.jobs.WatchJob(req, timeout=timeout, wait_for_ready=True)
        try:
            for msg in stream:
                ev = events.from_proto(msg)
                if writer is not None:
                    writer.write(ev)
                yield ev
        finally:
            stream.cancel()
            if writer is not None:
                writer.close()

    def wait(self, job_id: str, *, timeout: Optional[float] = None) -> jobs_pb2.Job:
        """Follows the job until it ends; returns the final Job."""
        for _ in self.watch(job_id, timeout=timeout):
            pass
        return self.get(job_id)

    def workers(self) -> List[admin_pb2.WorkerInfo]:
        return list(self._call(self.admin.ListWorkers, admin_pb2.ListWorkersRequest()).workers)
