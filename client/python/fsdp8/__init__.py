"""Python client of an fsdp8 coordinator: submit, watch and cancel training jobs.

    import fsdp8
    with fsdp8.Client("coordinator:50051") as c:
        job = c.submit("job.yaml")            # a path, YAML/JSON text, a dict or a JobSpec
        for ev in c.watch(job.job_id, tensorboard="runs"):   # typed events until the job ends
            if isinstance(ev, fsdp8.StepEvent):              # ValidationEvent is one too
                print(ev.step, ev.loss, ev.tokens_per_s)
            else:                                            # StateEvent
                print(ev.state, ev.message)
        c.cancel(job.job_id)

Events (fsdp8.events): StepEvent, ValidationEvent (a StepEvent with val_loss), StateEvent; State is
the job state enum. TensorBoardWriter (fsdp8.tensorboard) writes steps as TensorBoard scalars.
Messages are the generated protobuf classes of package fsdp8.v1 (fsdp8.v1.jobs_pb2, spec_pb2,
admin_pb2): `import fsdp8` is enough to use fsdp8.v1. RPC errors surface as grpc.RpcError (e.g.
INVALID_ARGUMENT naming the spec field).

fsdp8.prepare is the `fsdp8-prepare` command (text -> token shards through a real tokenizer); it
needs neither grpc nor the generated modules, so every name here is imported on first use.
"""
import importlib

_CLIENT = ["Client", "TERMINAL_STATES", "load_spec", "state_name"]
_EVENTS = ["Event", "StepEvent", "ValidationEvent", "StateEvent", "State"]
_TENSORBOARD = ["TensorBoardWriter"]
_MODULES = ["v1", "client", "events", "tensorboard", "prepare"]
__all__ = _CLIENT + _EVENTS + _TENSORBOARD + ["v1"]


def __getattr__(name):
    if name in _CLIENT:
        return getattr(importlib.import_module("fsdp8.client"), name)
    if name in _EVENTS:
        return getattr(importlib.import_module("fsdp8.events"), name)
    if name in _TENSORBOARD:
        return getattr(importlib.import_module("fsdp8.tensorboard"), name)
    if name in _MODULES:
        return importlib.import_module("fsdp8." + name)
    raise AttributeError(f"module 'fsdp8' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_MODULES))
