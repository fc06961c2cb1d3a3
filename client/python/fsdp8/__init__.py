"""Python client of an fsdp8 coordinator: submit, watch and cancel training jobs.

    import fsdp8
    with fsdp8.Client("coordinator:50051") as c:
        job = c.submit("job.yaml")            # a path, YAML/JSON text, a dict or a JobSpec
        for ev in c.watch(job.job_id):          # JobEvent messages until the job ends
            print(ev.step, ev.loss)
        c.cancel(job.job_id)

Messages are the generated protobuf classes of package fsdp8.v1 (fsdp8.v1.jobs_pb2, spec_pb2,
admin_pb2). RPC errors surface as grpc.RpcError (e.g. INVALID_ARGUMENT naming the spec field).

fsdp8.prepare is the `fsdp8-prepare` command (text -> token shards through a real tokenizer); it
needs neither grpc nor the generated modules, so the client's names are imported on first use.
"""
__all__ = ["Client", "TERMINAL_STATES", "load_spec", "state_name"]


def __getattr__(name):
    if name in __all__:
        from fsdp8 import client
        return getattr(client, name)
    raise AttributeError(f"module 'fsdp8' has no attribute {name!r}")
