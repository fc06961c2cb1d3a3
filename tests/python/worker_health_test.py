"""The worker's health port (--health_port), what Kubernetes' native gRPC probes call.

grpc.health.v1.Health/Check is called with requests and responses encoded by hand from the
protobuf wire format (HealthCheckRequest: field 1 `service`, string; HealthCheckResponse: field 1
`status`, enum, SERVING = 1, NOT_SERVING = 2, SERVICE_UNKNOWN = 3), so no stub of ours is involved.
Expected: service "" is SERVING while the process runs; service "ready" is NOT_SERVING until the
worker has registered with a coordinator, SERVING while registered, NOT_SERVING again when the
coordinator goes away."""
import os
import random
import socket
import subprocess
import sys
import time
import unittest

import grpc

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

SERVING, NOT_SERVING = 1, 2


def free_port(avoid=()):
    """A free port below Linux's ephemeral range (32768-60999): the worker dials the coordinator's
    port before anything listens there, and a port the kernel also hands out as a source port can
    end up taken by that very connection attempt (a TCP self-connect)."""
    rng = random.Random(os.getpid() ^ int(time.time() * 1000))
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def check(channel, service):
    req = b"" if not service else b"\x0a" + bytes([len(service)]) + service.encode()
    rpc = channel.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
    resp = rpc(req, timeout=5, wait_for_ready=True)
    if resp == b"":
        return 0  # status UNKNOWN (0) is the empty message
    assert resp[0] == 0x08, resp  # field 1, varint
    return resp[1]


class WorkerHealthTest(unittest.TestCase):
    def test_ready_follows_registration(self):
        coord_port = free_port()
        health_port = free_port(avoid=(coord_port,))
        c = cluster.Cluster(workers=0)
        self.addCleanup(c.cleanup)
        worker, _ = c._spawn([os.path.join(cluster.BIN, "fsdp8-worker"),
                              f"--coordinator=127.0.0.1:{coord_port}",
                              f"--health_port={health_port}", "--connect_timeout_s=60"],
                             "worker")
        ch = grpc.insecure_channel(f"127.0.0.1:{health_port}")
        self.addCleanup(ch.close)

        def wait_for(service, want, limit=20):
            t0 = time.monotonic()
            while True:
                got = check(ch, service)
                if got == want:
                    return
                self.assertLess(time.monotonic() - t0, limit,
                                f"{service!r}: {got} != {want}\n{c.dump_logs()}")
                time.sleep(0.1)

        self.assertEqual(check(ch, ""), SERVING)
        self.assertEqual(check(ch, "ready"), NOT_SERVING)  # no coordinator yet
        with self.assertRaises(grpc.RpcError) as e:
            check(ch, "no-such-service")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

        coord, _ = c._spawn([os.path.join(cluster.BIN, "fsdp8-coordinator"),
                             f"--listen=127.0.0.1:{coord_port}", "--state_db=:memory:"],
                            "coordinator")
        wait_for("ready", SERVING)
        self.assertEqual(check(ch, ""), SERVING)

        coord.terminate()
        coord.wait(timeout=10)
        wait_for("ready", NOT_SERVING)
        self.assertIsNone(worker.poll())  # the worker keeps trying to register

        worker.terminate()
        self.assertEqual(worker.wait(timeout=10), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
