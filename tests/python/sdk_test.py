"""The Python SDK (client/python, stubs generated from proto/ at install time) against a running
coordinator with 2 CPU workers: submit / watch / cancel, spec loading, refusal of a bad spec.

Expected values come from the spec and hand computation, not from the code under test: tokens =
steps * global_batch * seq_len; the first loss of a fresh byte-level model is close to uniform,
ln 256 = 5.545 nats; defaults are the ones documented in proto/fsdp8/v1/spec.proto."""
import math
import os
import sys
import time
import unittest

import grpc

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

import fsdp8  # noqa: E402  (installed from client/python by the python_sdk_install test)
from fsdp8.v1 import jobs_pb2  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "../..")
STEPS, BATCH, SEQ = 20, 4, 64


def tiny_spec(train, val, steps=STEPS, **extra):
    spec = {
        "name": "sdk-test", "backend": "cpu",
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 192, "vocab_size": 256,
                  "seq_len": SEQ},
        "data": {"train_path": train, "val_path": val},
        "training": {"steps": steps, "global_batch": BATCH, "seed": 3, "eval_every": 0},
        "sharding": {"min_workers": 2, "max_workers": 2},
        "precision": {"linears": "fp8", "fp8": {"recipe": "delayed", "amax_algorithm": "max"}},
    }
    spec.update(extra)
    return spec


class SdkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(workers=2)
        try:
            cls.train, cls.val = cls.cluster.prepare_corpus()
            cls.cluster.start()
            cls.client = fsdp8.Client(cls.cluster.address, timeout=20)
            t0 = time.monotonic()
            while len(cls.client.workers()) < 2:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("workers did not register\n" + cls.cluster.dump_logs())
                time.sleep(0.1)
        except Exception:
            cls.cluster.cleanup(keep=True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        failed = getattr(cls, "_failed", False)
        if failed:
            print(cls.cluster.dump_logs(), file=sys.stderr)
        cls.cluster.cleanup(keep=failed)

    def run(self, result=None):
        r = super().run(result)
        if result is not None and (result.failures or result.errors):
            type(self)._failed = True
        return r

    def test_submit_watch_to_success(self):
        spec = tiny_spec(self.train, self.val)
        job = self.client.submit(spec, request_id="sdk-ok-1")
        self.assertTrue(job.job_id)
        self.assertIn(job.state, (jobs_pb2.JOB_STATE_PENDING, jobs_pb2.JOB_STATE_STARTING,
                                  jobs_pb2.JOB_STATE_RUNNING))
        # Defaults applied by the coordinator, as documented in spec.proto.
        self.assertAlmostEqual(job.spec.optimizer.beta1, 0.9)
        self.assertAlmostEqual(job.spec.optimizer.beta2, 0.95)
        self.assertEqual(job.spec.precision.fp8.amax_history_len, 16)
        self.assertEqual(job.total_steps, STEPS)
        # Same request id and spec: the same job (idempotent submit).
        again = self.client.submit(spec, request_id="sdk-ok-1")
        self.assertEqual(again.job_id, job.job_id)

        events = list(self.client.watch(job.job_id, timeout=240))
        seqs = [e.seq for e in events]
        self.assertEqual(seqs, list(range(1, len(events) + 1)))
        self.assertEqual(events[-1].state, jobs_pb2.JOB_STATE_SUCCEEDED, events[-1].message)
        losses = {e.step: e.loss for e in events if e.step > 0 and e.loss > 0}
        self.assertEqual(sorted(losses), list(range(1, STEPS + 1)))
        self.assertLess(abs(losses[1] - math.log(256)), 0.5)
        self.assertLess(losses[STEPS], losses[1] - 0.5)

        final = self.client.get(job.job_id)
        self.assertEqual(final.state, jobs_pb2.JOB_STATE_SUCCEEDED)
        self.assertEqual(final.step, STEPS)
        self.assertEqual(final.world_size, 2)
        self.assertEqual(len(final.worker_ids), 2)
        self.assertEqual(final.tokens, STEPS * BATCH * SEQ)
        self.assertIn(job.job_id, [j.job_id for j in self.client.list()])

        # Resuming a watch after seq k replays only what follows k.
        k = len(events) // 2
        tail = list(self.client.watch(job.job_id, after_seq=k, timeout=30))
        self.assertEqual([e.seq for e in tail], seqs[k:])
        self.assertEqual(self.client.wait(job.job_id, timeout=30).state,
                         jobs_pb2.JOB_STATE_SUCCEEDED)
        # An ended job cannot be cancelled, and stays SUCCEEDED.
        with self.assertRaises(grpc.RpcError) as e:
            self.client.cancel(job.job_id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(self.client.get(job.job_id).state, jobs_pb2.JOB_STATE_SUCCEEDED)

    def test_cancel_running_job(self):
        job = self.client.submit(tiny_spec(self.train, self.val, steps=100000))
        stream = self.client.watch(job.job_id, timeout=240)
        for ev in stream:
            if ev.step >= 2:
                break
        else:
            self.fail("the job ended before step 2")
        stream.close()
        cancelled = self.client.cancel(job.job_id)
        self.assertEqual(cancelled.state, jobs_pb2.JOB_STATE_CANCELLED)
        final = self.client.wait(job.job_id, timeout=60)
        self.assertEqual(final.state, jobs_pb2.JOB_STATE_CANCELLED)
        self.assertGreaterEqual(final.step, 2)
        self.assertLess(final.step, 100000)
        self.assertEqual(fsdp8.state_name(final.state), "CANCELLED")

    def test_cancel_saves_then_resume_continues_the_same_job(self):
        ckpt = os.path.join(self.cluster.data, "ckpt-sdk-resume")
        steps = 1000
        job = self.client.submit(tiny_spec(self.train, self.val, steps=steps,
                                           checkpoint={"dir": ckpt}))
        stream = self.client.watch(job.job_id, timeout=240)
        for ev in stream:
            if ev.step >= 2 and not ev.message:
                break
        else:
            self.fail("the job ended before step 2")
        stream.close()
        # The default cancel saves after the step in progress and returns the ended job.
        cancelled = self.client.cancel(job.job_id)
        self.assertEqual(cancelled.state, jobs_pb2.JOB_STATE_CANCELLED, cancelled.reason)
        k = cancelled.step
        self.assertGreaterEqual(k, 2)
        self.assertLess(k, steps)
        self.assertIn(f"checkpoint step-{k} committed", cancelled.reason)
        self.assertTrue(os.path.isfile(os.path.join(ckpt, f"step-{k}", "MANIFEST")))

        resumed = self.client.resume(job.job_id)
        self.assertEqual(resumed.job_id, job.job_id)
        self.assertEqual(resumed.state, jobs_pb2.JOB_STATE_PENDING)
        self.assertEqual(resumed.step, k)
        self.assertEqual(resumed.resumes, 1)
        events = list(self.client.watch(job.job_id, timeout=240))
        self.assertEqual([e.seq for e in events], list(range(1, len(events) + 1)))
        seen = [e.step for e in events if e.step > 0 and not e.message]
        self.assertEqual(seen, list(range(1, steps + 1)))  # no gap, no step twice
        final = self.client.get(job.job_id)
        self.assertEqual(final.state, jobs_pb2.JOB_STATE_SUCCEEDED, final.reason)
        self.assertEqual(final.tokens, steps * BATCH * SEQ)
        # A job that SUCCEEDED is not resumed.
        with self.assertRaises(grpc.RpcError) as e:
            self.client.resume(job.job_id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("SUCCEEDED", e.exception.details())

    def test_bad_spec_refused_and_nothing_lost(self):
        before = [(j.job_id, j.state) for j in self.client.list()]
        spec = tiny_spec(self.train, self.val)
        spec["model"]["d_model"] = 130  # 130 % 4 heads != 0
        with self.assertRaises(grpc.RpcError) as e:
            self.client.submit(spec)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("model.d_model", e.exception.details())
        after = [(j.job_id, j.state) for j in self.client.list()]
        self.assertEqual([j for j, _ in after], [j for j, _ in before])
        with self.assertRaises(grpc.RpcError) as e:
            self.client.get("no-such-job")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_load_spec_from_the_default_file(self):
        s = fsdp8.load_spec(os.path.join(REPO, "data/default-job.yaml"))
        # Values as written in data/default-job.yaml.
        self.assertEqual(s.model.d_model, 128)
        self.assertEqual(s.training.steps, 600)
        self.assertEqual(s.precision.linears, fsdp8.client.spec_pb2.PRECISION_FP8)
        self.assertEqual(s.precision.embedding, fsdp8.client.spec_pb2.PRECISION_BF16)
        self.assertEqual(s.precision.fp8.recipe, fsdp8.client.spec_pb2.SCALING_RECIPE_DELAYED)
        self.assertEqual(s.precision.fp8.format, fsdp8.client.spec_pb2.FP8_FORMAT_HYBRID)
        self.assertFalse(s.model.HasField("rope_theta"))  # unset stays unset (defaults: server)
        with self.assertRaisesRegex(ValueError, r"model\.dmodel: unknown field"):
            fsdp8.load_spec("model:\n  dmodel: 3\n")
        with self.assertRaisesRegex(ValueError, r"precision\.linears: unknown value 'fp9'"):
            fsdp8.load_spec({"precision": {"linears": "fp9"}})
        o = fsdp8.load_spec({"precision": {"overrides": [{"layer": 1, "linears": "BF16"}]}})
        self.assertEqual(o.precision.overrides[0].layer, 1)
        self.assertEqual(o.precision.overrides[0].linears, fsdp8.client.spec_pb2.PRECISION_BF16)

    def test_oversized_spec_file_refused_unread(self):
        # 64 KiB is the coordinator's limit on a spec (common/spec.h); a 50 MB (sparse) file is
        # refused from its size: the process grows by far less than the file.
        import resource
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            big = os.path.join(d, "big.yaml")
            with open(big, "wb") as f:
                f.truncate(50 * 1000 * 1000)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
            with self.assertRaisesRegex(ValueError, r"big\.yaml: 50000000 bytes exceeds the limit "
                                                    r"of 65536 bytes on a job spec"):
                fsdp8.load_spec(big)
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            self.assertLess(grown, 10 * 1024, "the file was read into memory")
            ok = os.path.join(d, "ok.yaml")
            with open(ok, "w") as f:
                f.write("model:\n  d_model: 64\n" + "#" * (65536 - 21 - 1) + "\n")
            self.assertEqual(os.path.getsize(ok), 65536)
            self.assertEqual(fsdp8.load_spec(ok).model.d_model, 64)  # exactly the limit is taken


if __name__ == "__main__":
    unittest.main(verbosity=2)
