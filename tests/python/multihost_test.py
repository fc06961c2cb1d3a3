"""Multi-host: the coordinator, two workers and the CLI each in their own network namespace, joined
by veth pairs to a bridge in a fifth one, loopback down everywhere. A job trains across them, so
nothing may assume one host or loopback: workers dial the coordinator's address on the bridge,
advertise their own (--host) for the Gloo mesh, and the collectives cross the veths.

Addresses: 198.18.0.0/24 (RFC 2544 benchmarking range), only inside namespaces this test creates;
no namespace has a route out and the root namespace is not joined. Every namespace is deleted on
the way out, failed or not, and stale ones of an earlier killed run (named f8mh<pid>-*, pid gone)
are deleted first. The whole test is bounded by an alarm below ctest's timeout.

Expected values, by hand: with Gloo's ring reduce-scatter each of W ranks receives (W-1)/W of
every FP32 gradient buffer per step, so each worker's veth carries at least
steps * (W-1)/W * 4 bytes * 139584 parameters (d 64, 2 layers, ffn 192, vocab 256)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

PREFIX = f"f8mh{os.getpid()}-"
NET = "198.18.0."
NODES = {"c": NET + "1", "w0": NET + "10", "w1": NET + "11", "cli": NET + "100"}
STEPS, PARAMS = 8, 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) + 64 + 256 * 64
LIMIT_S = 240


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def delete_stale():
    for line in ip("netns", "list").stdout.splitlines():
        m = re.match(r"(f8mh(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            ip("netns", "del", m.group(1), check=False)


def ns(name):
    return PREFIX + name


def exec_in(name):
    return ["ip", "netns", "exec", ns(name)]


def create_topology():
    sw = ns("sw")
    ip("netns", "add", sw)
    ip("-n", sw, "link", "add", "br0", "type", "bridge")
    ip("-n", sw, "link", "set", "br0", "up")
    for node, addr in NODES.items():
        ip("netns", "add", ns(node))
        ip("-n", sw, "link", "add", "v" + node, "type", "veth", "peer", "name", "eth0",
           "netns", ns(node))
        ip("-n", sw, "link", "set", "v" + node, "master", "br0", "up")
        ip("-n", ns(node), "addr", "add", addr + "/24", "dev", "eth0")
        ip("-n", ns(node), "link", "set", "eth0", "up")
        # lo stays down: a 127.0.0.1 anywhere in the path fails to connect.


def delete_topology():
    for node in list(NODES) + ["sw"]:
        ip("netns", "del", ns(node), check=False)


def rx_bytes(node):
    out = ip("-n", ns("sw"), "-s", "-j", "link", "show", "v" + node).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


class MultiHostTest(unittest.TestCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("needs root for ip netns")
        signal.signal(signal.SIGALRM, self._timeout)
        signal.alarm(LIMIT_S)
        delete_stale()
        self.addCleanup(delete_topology)
        self.addCleanup(signal.alarm, 0)
        create_topology()
        self.cluster = cluster.Cluster(
            workers=2, coordinator_prefix=exec_in("c"),
            worker_prefixes=[exec_in("w0"), exec_in("w1")],
            coordinator_listen="0.0.0.0:0", coordinator_dial=NODES["c"],
            worker_hosts=[NODES["w0"], NODES["w1"]])
        self.addCleanup(self.cluster.cleanup)

    @staticmethod
    def _timeout(*_):
        raise TimeoutError(f"multi-host test over {LIMIT_S} s")

    def cli(self, *args, timeout=60, check=True):
        r = subprocess.run(exec_in("cli") + [os.path.join(cluster.BIN, "fsdp8"), "--coordinator",
                                             self.cluster.address, *args],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            self.fail(f"fsdp8 {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}\n"
                      + self.cluster.dump_logs())
        return r

    def test_job_trains_across_namespaces(self):
        # Nothing answers on loopback in the coordinator's namespace.
        probe = subprocess.run(exec_in("c") + ["ip", "-br", "link", "show", "lo"],
                               capture_output=True, text=True, timeout=10)
        self.assertIn("DOWN", probe.stdout)
        train, val = self.cluster.prepare_corpus()
        self.cluster.start()
        t0 = time.monotonic()
        while True:
            out = self.cli("workers", check=False).stdout
            hosts = sorted(re.findall(r"\b198\.18\.0\.\d+\b", out))
            if hosts == [NODES["w0"], NODES["w1"]]:
                break
            self.assertLess(time.monotonic() - t0, 60, "workers did not register:\n" + out
                            + self.cluster.dump_logs())
            time.sleep(0.2)
        before = {w: rx_bytes(w) for w in ("w0", "w1")}

        spec = os.path.join(self.cluster.root, "job.yaml")
        with open(spec, "w") as f:
            f.write(f"""name: multihost
backend: cpu
model: {{d_model: 64, n_layers: 2, n_heads: 4, ffn_dim: 192, vocab_size: 256, seq_len: 64}}
data: {{train_path: {train}, val_path: {val}}}
training: {{steps: {STEPS}, global_batch: 4, eval_every: 0}}
sharding: {{min_workers: 2, max_workers: 2}}
precision: {{linears: fp8}}
""")
        job_id = self.cli("submit", spec, "--no-watch").stdout.split()[0]
        self.cli("watch", job_id, timeout=180)  # exits 0 only when SUCCEEDED
        job = json.loads(self.cli("status", job_id, "--json").stdout)
        self.assertEqual(job["state"], "JOB_STATE_SUCCEEDED")
        self.assertEqual(int(job["step"]), STEPS)
        self.assertEqual(job["world_size"], 2)
        self.assertEqual(int(job["tokens"]), STEPS * 4 * 64)

        floor = STEPS * PARAMS * 4 // 2  # (W-1)/W of the FP32 gradients, W = 2
        for w in ("w0", "w1"):
            rx, tx = rx_bytes(w)
            # The bridge port's rx is what the worker sent, tx what it received.
            self.assertGreater(tx - before[w][1], floor, f"{w} received")
            self.assertGreater(rx - before[w][0], floor, f"{w} sent")


if __name__ == "__main__":
    unittest.main(verbosity=2)
