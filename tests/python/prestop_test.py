"""The workers' preStop hook of deploy/k8s (prestop-drain.sh, taken from the rendered ConfigMap as
Kubernetes would mount it) against a running coordinator and 2 CPU workers: run while a worker
serves a job with a checkpoint dir, it must return only once a checkpoint taken after it started
is committed (a MANIFEST on disk), well inside the pod's grace period; run for a worker that is
not registered it must return at once."""
import json
import os
import subprocess
import sys
import time
import unittest

import yaml

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

BASE = os.path.join(os.path.dirname(__file__), "../../deploy/k8s/base/config.yaml")


def prestop_script():
    with open(BASE) as f:
        for doc in yaml.safe_load_all(f):
            if doc and doc["kind"] == "ConfigMap":
                return doc["data"]["prestop-drain.sh"]
    raise AssertionError("no ConfigMap in " + BASE)


class PreStopTest(unittest.TestCase):
    def test_prestop_checkpoints_the_job(self):
        c = cluster.Cluster(workers=2)
        self.addCleanup(c.cleanup)
        train, val = c.prepare_corpus()
        addr = c.start()
        cli = [os.path.join(cluster.BIN, "fsdp8"), "--coordinator", addr]
        ckpt = os.path.join(c.data, "ckpt")
        spec = os.path.join(c.root, "job.yaml")
        with open(spec, "w") as f:
            f.write(f"""name: prestop
model: {{d_model: 64, n_layers: 2, n_heads: 4, ffn_dim: 192, seq_len: 64}}
data: {{train_path: {train}, val_path: {val}}}
training: {{steps: 100000, global_batch: 4, eval_every: 0}}
sharding: {{min_workers: 2, max_workers: 2}}
checkpoint: {{dir: {ckpt}}}
""")
        job = subprocess.run(cli + ["submit", spec, "--no-watch"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()[0]
        t0 = time.monotonic()
        while True:
            st = subprocess.run(cli + ["status", job, "--json"], capture_output=True, text=True,
                                timeout=30)
            j = json.loads(st.stdout or "{}")
            if j.get("state") == "JOB_STATE_RUNNING" and int(j.get("step", 0)) >= 2:
                break
            self.assertLess(time.monotonic() - t0, 120, st.stdout + st.stderr + c.dump_logs())
            time.sleep(0.2)

        env = dict(os.environ, FSDP8_COORDINATOR=addr, POD_IP="127.0.0.1",
                   PATH=cluster.BIN + os.pathsep + os.environ["PATH"])
        script = prestop_script()
        t0 = time.monotonic()
        r = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                           timeout=120)
        took = time.monotonic() - t0
        self.assertEqual(r.returncode, 0, r.stderr)
        steps = [int(d.split("-")[1]) for d in os.listdir(ckpt)
                 if os.path.isfile(os.path.join(ckpt, d, "MANIFEST"))]
        self.assertTrue(steps, "no committed checkpoint after the preStop hook")
        self.assertGreaterEqual(max(steps), 3)
        self.assertLess(took, 60)

        # Not registered (another pod IP): nothing to do.
        env["POD_IP"] = "10.255.255.1"
        t0 = time.monotonic()
        r = subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=30)
        self.assertEqual(r.returncode, 0)
        self.assertLess(time.monotonic() - t0, 10)
        subprocess.run(cli + ["cancel", job], capture_output=True, timeout=30)


if __name__ == "__main__":
    unittest.main(verbosity=2)
